"""DPO/IPO pieces (llamaft_trainer.methods.dpo): the concatenated batch, summed completion log-probabilities,
the losses and TRL's metrics, by hand and against TRL's DPOTrainer._compute_loss on the same tiny
model and pairs (TRL run in .venv-peers: tests/trainer/trl_peer.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from llamaft.api.spec import DpoLoss
from llamaft_trainer.data.preference import PreferenceExample
from llamaft_trainer.methods.dpo import (
    DpoMetrics,
    concatenated_batch,
    dpo_losses,
    sequence_logps,
    split_pairs,
)
from transformers import AutoModelForCausalLM

from tests.trainer.trl_compare import run_trl

# DataCollatorForPreference's docstring example (trl/trainer/dpo_trainer.py, TRL 1.16.0), verbatim.
TRL_DOC_EXAMPLES = [PreferenceExample([1, 2, 3], [4, 5], [6]), PreferenceExample([7, 8], [9], [10, 11])]


def test_the_batch_is_trls_collator_example() -> None:
    batch = concatenated_batch(TRL_DOC_EXAMPLES, pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 0, 0], [1, 2, 3, 6, 0], [7, 8, 10, 11, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]]
    assert batch.completion_mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 1, 1, 0]]
    assert batch.pairs == 2


def test_truncation_keeps_the_start_or_the_end_of_each_sequence() -> None:
    start = concatenated_batch(TRL_DOC_EXAMPLES, pad_token_id=0, max_length=3)
    assert start.input_ids.tolist() == [[1, 2, 3], [7, 8, 9], [1, 2, 3], [7, 8, 10]]
    assert start.completion_mask.tolist() == [[0, 0, 0], [0, 0, 1], [0, 0, 0], [0, 0, 1]]
    end = concatenated_batch(TRL_DOC_EXAMPLES, pad_token_id=0, max_length=3, truncation_mode="keep_end")
    assert end.input_ids.tolist() == [[3, 4, 5], [7, 8, 9], [2, 3, 6], [8, 10, 11]]
    assert end.completion_mask.tolist() == [[0, 1, 1], [0, 0, 1], [0, 0, 1], [0, 1, 1]]
    padded = concatenated_batch(TRL_DOC_EXAMPLES, pad_token_id=0, pad_to_multiple_of=4)
    assert padded.input_ids.shape == (4, 8)
    with pytest.raises(ValueError, match="truncation_mode"):
        concatenated_batch(TRL_DOC_EXAMPLES, pad_token_id=0, truncation_mode="middle")


def test_sequence_logps_sum_the_completion_tokens_only() -> None:
    torch.manual_seed(0)
    batch = concatenated_batch(TRL_DOC_EXAMPLES, pad_token_id=99)  # a pad id outside the vocabulary
    logits = torch.randn(4, 5, 16)
    logps = torch.log_softmax(logits, dim=-1)
    expected = []
    for row in range(4):
        total = 0.0
        for t in range(1, 5):
            if batch.completion_mask[row, t]:
                total += float(logps[row, t - 1, batch.input_ids[row, t]])
        expected.append(total)
    assert sequence_logps(logits, batch.input_ids, batch.completion_mask).tolist() == pytest.approx(expected, abs=1e-6)
    for chunks in (2, 3, 7):
        chunked = sequence_logps(logits.bfloat16(), batch.input_ids, batch.completion_mask, chunks=chunks)
        whole = sequence_logps(logits.bfloat16(), batch.input_ids, batch.completion_mask)
        assert torch.equal(chunked, whole)


def test_the_losses_by_hand() -> None:
    pc, pr = torch.tensor([-10.0, -4.0]), torch.tensor([-12.0, -3.0])
    rc, rr = torch.tensor([-11.0, -5.0]), torch.tensor([-11.0, -2.0])
    # chosen log-ratios (1, 1), rejected (-1, -1): margin 2 for both pairs
    sigmoid = dpo_losses(pc, pr, rc, rr, beta=0.1)
    assert sigmoid.tolist() == pytest.approx([math.log1p(math.exp(-0.2))] * 2, abs=1e-7)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 0], [0, 1, 1, 1], [1, 1, 1, 1]])  # lengths chosen 2, 1; rejected 3, 4
    ipo = dpo_losses(pc, pr, rc, rr, beta=0.5, loss=DpoLoss.IPO, completion_mask=mask)
    assert ipo.tolist() == pytest.approx([(1 / 2 + 1 / 3 - 1) ** 2, (1 / 1 + 1 / 4 - 1) ** 2], abs=1e-7)
    with pytest.raises(ValueError, match="completion_mask"):
        dpo_losses(pc, pr, rc, rr, beta=0.5, loss=DpoLoss.IPO)


def test_the_metrics_by_hand_and_summed_over_micro_batches() -> None:
    pc, pr = torch.tensor([-10.0, -4.0]), torch.tensor([-12.0, -3.0])
    rc, rr = torch.tensor([-11.0, -5.0]), torch.tensor([-11.0, -1.0])
    metrics = DpoMetrics.of(pc, pr, rc, rr, beta=0.1)
    # rewards: chosen (0.1, 0.1), rejected (-0.1, -0.2)
    assert metrics.means() == pytest.approx({
        "rewards/chosen": 0.1, "rewards/rejected": -0.15, "rewards/accuracies": 1.0, "rewards/margins": 0.25,
        "logps/chosen": -7.0, "logps/rejected": -7.5,
    })
    halves = DpoMetrics.of(pc[:1], pr[:1], rc[:1], rr[:1], 0.1) + DpoMetrics.of(pc[1:], pr[1:], rc[1:], rr[1:], 0.1)
    assert halves.means() == pytest.approx(metrics.means())
    worse = DpoMetrics.of(pr, pc, rr, rc, beta=0.1)
    assert worse.means()["rewards/accuracies"] == 0.0


# --------------------------------------------------------------------------- against TRL
EXAMPLES = [
    PreferenceExample([350, 80, 304, 85], [224, 55, 262, 92, 2], [224, 49, 82, 2]),
    PreferenceExample([76, 93], [72, 29, 479, 333, 287, 2], [224, 2]),
    PreferenceExample([1, 37, 82, 69, 17, 224, 55, 262, 92], [333, 287, 17, 2], [503, 342, 397, 17, 224, 55, 2]),
]
REF_CHOSEN = [-30.5, -41.25, -25.0]
REF_REJECTED = [-28.0, -12.5, -44.75]
MAX_LENGTH = 14  # cuts the third pair's rejected sequence


@pytest.mark.parametrize(("loss", "beta"), [(DpoLoss.SIGMOID, 0.1), (DpoLoss.IPO, 0.1), (DpoLoss.SIGMOID, 0.5)])
def test_loss_and_metrics_equal_trls_on_the_same_model_and_pairs(tiny_model: Path, loss: DpoLoss, beta: float) -> None:
    theirs = run_trl({
        "do": "loss", "model": str(tiny_model), "pad_token_id": 3, "max_length": MAX_LENGTH, "beta": beta,
        "loss": loss.value, "ref_chosen": REF_CHOSEN, "ref_rejected": REF_REJECTED,
        "examples": [{"prompt_ids": e.prompt_ids, "chosen_ids": e.chosen_ids, "rejected_ids": e.rejected_ids}
                     for e in EXAMPLES],
    })
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    batch = concatenated_batch(EXAMPLES, pad_token_id=3, max_length=MAX_LENGTH)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logps = sequence_logps(logits, batch.input_ids, batch.completion_mask, chunks=2)
    assert logps.tolist() == pytest.approx(theirs["logps"], rel=1e-6)
    chosen, rejected = split_pairs(logps)
    ref_chosen, ref_rejected = torch.tensor(REF_CHOSEN), torch.tensor(REF_REJECTED)
    value = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, beta, loss, batch.completion_mask).mean()
    assert float(value) == pytest.approx(theirs["loss"], rel=1e-6)
    metrics = DpoMetrics.of(chosen, rejected, ref_chosen, ref_rejected, beta).means()
    assert metrics == pytest.approx({k: theirs["metrics"][k] for k in metrics}, rel=1e-6, abs=1e-6)
