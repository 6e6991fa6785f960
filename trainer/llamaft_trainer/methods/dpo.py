"""DPO and IPO on preference pairs: the batch, the sequence log-probabilities, the loss and the
metrics, as TRL's DPOTrainer defines them, in plain torch (no model, no process group), so the
training loop under FSDP and the tests against TRL use the same functions.

Matched against TRL 1.16.0 (bench/peers-requirements.txt), `trl/trainer/dpo_trainer.py`:

* `concatenated_batch`: `DataCollatorForPreference.torch_call`: per pair, prompt + chosen and
  prompt + rejected, each truncated to `max_length` on its own (`keep_start` keeps the first
  tokens, `keep_end` the last), chosen rows first then rejected rows, right-padded with the pad
  id, and a completion mask marking the completion tokens. One forward of the policy over it
  scores both sides of every pair.
* `sequence_logps`: `DPOTrainer._compute_loss` with its fused LM head
  (`trl/trainer/utils.py::add_fused_lm_head`): the log-probability of each next token
  (`log_softmax` in fp32) at the positions whose label is a completion token, summed per row.
* `dpo_losses`: `_compute_loss`'s `reverse_kl` (standard DPO) branch with `loss_type` `sigmoid`,
  `-logsigmoid(beta * (chosen log-ratio - rejected log-ratio))`, or `ipo`, whose log-ratios TRL
  divides by each completion's token count (the unshifted completion mask's sum, at least 1)
  before `(delta - 1 / (2 beta))^2`.
* `DpoMetrics`: the `rewards/*` and `logps/*` values `_compute_loss` logs: rewards are
  `beta * (policy - reference)` log-probabilities, detached, averaged over the pairs (TRL gathers
  them from every rank first, so the sums here are what a loop all-reduces).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from llamaft.api.spec import DpoLoss

from llamaft_trainer.data.preference import PreferenceExample

TRUNCATION_MODES = ("keep_start", "keep_end")
METRIC_NAMES = (
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
)
"""TRL's names, in the order DPOTrainer logs them."""


@dataclass(frozen=True)
class PreferenceBatch:
    """`2 x pairs` rows: the chosen sequences, then the rejected ones (same pair order)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor

    @property
    def pairs(self) -> int:
        return self.input_ids.size(0) // 2


def _pad(rows: list[list[int]], value: int, width: int) -> torch.Tensor:
    return torch.tensor([row + [value] * (width - len(row)) for row in rows], dtype=torch.long)


def concatenated_batch(
    examples: Sequence[PreferenceExample],
    pad_token_id: int,
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
    pad_to_multiple_of: int | None = None,
) -> PreferenceBatch:
    """The pairs as one right-padded batch for one forward (TRL's DataCollatorForPreference)."""
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation_mode must be one of {TRUNCATION_MODES}, not {truncation_mode!r}")
    if not examples:
        raise ValueError("a preference batch needs at least one pair")
    ids = [e.prompt_ids + e.chosen_ids for e in examples] + [e.prompt_ids + e.rejected_ids for e in examples]
    masks = [[0] * len(e.prompt_ids) + [1] * len(e.chosen_ids) for e in examples]
    masks += [[0] * len(e.prompt_ids) + [1] * len(e.rejected_ids) for e in examples]
    if max_length is not None:
        cut = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
        ids = [row[cut] for row in ids]
        masks = [row[cut] for row in masks]
    width = max(len(row) for row in ids)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    return PreferenceBatch(
        input_ids=_pad(ids, pad_token_id, width),
        attention_mask=_pad([[1] * len(row) for row in ids], 0, width),
        completion_mask=_pad(masks, 0, width),
    )


def sequence_logps(
    logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor, chunks: int = 1,
) -> torch.Tensor:
    """Per row, the summed log-probability of its completion tokens given what precedes them.

    `logits` (rows x positions x vocabulary, any dtype) predict the next token: position t's
    logits score token t + 1, counted when token t + 1 is a completion token. log_softmax runs in
    fp32 on `chunks` slices of the positions one at a time, so at most 1/chunks of the fp32
    logits exists at once (the model's own dtype may be bf16)."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, not {chunks}")
    labels = input_ids[:, 1:]
    mask = completion_mask[:, 1:].bool()
    total = torch.zeros(logits.size(0), dtype=torch.float32, device=logits.device)
    positions = labels.size(1)
    step = -(-positions // chunks) if positions else 1
    for start in range(0, positions, step):
        part = logits[:, start:start + step].float()
        # Masked positions are gathered at token 0 and zeroed (a pad id may lie outside the vocabulary).
        index = labels[:, start:start + step].masked_fill(~mask[:, start:start + step], 0)
        logps = torch.log_softmax(part, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
        total = total + logps.masked_fill(~mask[:, start:start + step], 0.0).sum(dim=1)
    return total


def split_pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) halves of a per-row tensor of a PreferenceBatch."""
    chosen, rejected = values.chunk(2, dim=0)
    return chosen, rejected


def dpo_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
    loss: DpoLoss = DpoLoss.SIGMOID,
    completion_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss of each pair (TRL's `per_sequence_loss`; DPOTrainer's loss is their mean).

    `ipo` needs the batch's `completion_mask` (chosen rows then rejected rows): TRL divides each
    log-ratio by its completion's token count, so beta means the same whatever the lengths."""
    chosen = policy_chosen - reference_chosen
    rejected = policy_rejected - reference_rejected
    if loss is DpoLoss.SIGMOID:
        return -F.logsigmoid(beta * (chosen - rejected))
    if loss is DpoLoss.IPO:
        if completion_mask is None:
            raise ValueError("the ipo loss needs the completion_mask (it normalises by completion length)")
        chosen_mask, rejected_mask = split_pairs(completion_mask)
        delta = chosen / chosen_mask.sum(dim=1).clamp(min=1.0) - rejected / rejected_mask.sum(dim=1).clamp(min=1.0)
        return (delta - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown DPO loss {loss!r}")


@dataclass(frozen=True)
class DpoMetrics:
    """Sums over pairs of what TRL averages, so ranks and micro-batches add up before dividing.

    `tensor` holds [pairs, rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
    logps/chosen, logps/rejected] sums (fp64, detached): all-reduce it with SUM, add those of the
    micro-batches of a logging window, then read `means()`. TRL averages per-micro-batch means
    (`DPOTrainer.log`), which equals this when micro-batches hold the same number of pairs."""

    tensor: torch.Tensor

    @classmethod
    def of(
        cls,
        policy_chosen: torch.Tensor,
        policy_rejected: torch.Tensor,
        reference_chosen: torch.Tensor,
        reference_rejected: torch.Tensor,
        beta: float,
    ) -> DpoMetrics:
        with torch.no_grad():
            chosen_rewards = beta * (policy_chosen - reference_chosen).detach()
            rejected_rewards = beta * (policy_rejected - reference_rejected).detach()
            values = [
                chosen_rewards.sum(), rejected_rewards.sum(), (chosen_rewards > rejected_rewards).float().sum(),
                (chosen_rewards - rejected_rewards).sum(), policy_chosen.detach().sum(), policy_rejected.detach().sum(),
            ]
            pairs = torch.tensor(float(policy_chosen.numel()), device=policy_chosen.device)
            return cls(torch.stack([pairs, *values]).double())

    def __add__(self, other: DpoMetrics) -> DpoMetrics:
        return DpoMetrics(self.tensor + other.tensor.to(self.tensor.device))

    def means(self) -> dict[str, float]:
        """TRL's metrics: each sum over the pairs divided by their number."""
        pairs, *sums = self.tensor.tolist()
        if pairs <= 0:
            raise ValueError("no pairs were scored")
        return {name: value / pairs for name, value in zip(METRIC_NAMES, sums, strict=True)}
