"""training.method dpo in the train loop: the micro-step, the reference log-probabilities and the
evaluation on held-out pairs (the loop itself, its accumulation, clipping, optimizer, reads,
checkpoints and export are train.py's, the same as for SFT).

Micro-step (`DpoMethod.micro_step`): the batch is preference_data's concatenated batch (chosen
rows, then rejected rows, each sequence truncated to maxSeqLength keeping its start, as TRL's
collator); ONE forward of the policy scores both sides (dpo.sequence_logps: summed completion
log-probabilities), dpo.dpo_losses gives each pair's loss against the reference log-probabilities,
and the micro-step returns their SUM with TRL's metric sums (dpo.DpoMetrics). The loop divides by
the number of pairs of the whole optimizer step over every rank (counted on the host: `pairs`),
as it divides SFT's token losses by the step's target tokens, so any world size and accumulation
split gives TRL's mean over the batch.

Reference:

* full fine-tuning, `reference: precomputed` (`precompute_reference`): before training, one
  no-grad pass of the loaded (sharded) initial model over every training and validation pair,
  each rank its share (dpo_pairs.PairShare), the shares summed across ranks (each pair's
  values come from one rank, the others add exact zeros), stored beside the token store as
  float32 (chosen, rejected) per pair, keyed by the model and the precision. A later attempt or a
  resumed run finds the files (every rank must) and reads them back bit for bit: no second pass.
  The batches then carry each pair's reference log-probabilities (`reference_logps`).
* LoRA/DoRA: the base model is the reference: per batch, a no-grad forward with the adapters
  disabled (peft's `disable_adapter()`), before the policy's forward. No copy, nothing stored.
* full fine-tuning, `reference: live` (`frozen`): a second copy of the initial model, loaded by
  the same code as the policy (main.build_model: the same files, no second download) and sharded
  by the same parallelize (FSDP2 or FSDP1, the same mixed precision), its shards in the compute
  dtype, every parameter requires_grad=False, in eval mode, never given to the optimizer nor to a
  checkpoint (it is the initial model: a resumed run loads it again). Per micro-batch, a no-grad
  forward of it over the same concatenated batch, before the policy's. It costs a second
  parameter set in GPU memory and a forward per micro-batch, where `precomputed` costs one pass
  before training and a file; it is what a run needs when the pairs are many or change.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from llamaft.api.spec import (
    DpoLoss,
    DpoReference,
    DpoSpec,
    TrainingJobConfig,
    TrainingMethod,
)
from torch import nn

from llamaft_trainer.methods.dpo import METRIC_NAMES, DpoMetrics, dpo_losses, sequence_logps, split_pairs
from llamaft_trainer.methods.dpo_pairs import PairCollate, PairShare, PreferencePairs, is_filler, pairs_in
from llamaft_trainer.methods.dpo_reference import (
    REFERENCE_DIR,
    read_reference,
    reference_key,
    write_reference,
)
from llamaft_trainer.process.runtime import Runtime
from llamaft_trainer.report.metrics import log_json


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def uses_lora(cfg: TrainingJobConfig) -> bool:
    return cfg.training.lora is not None and cfg.training.lora.enabled


def live_reference(cfg: TrainingJobConfig) -> bool:
    """Whether the run needs the frozen copy (`reference: live` under full fine-tuning)."""
    return (cfg.training.method is TrainingMethod.DPO and not uses_lora(cfg)
            and (cfg.training.dpo or DpoSpec()).reference is DpoReference.LIVE)


def frozen(model: nn.Module) -> nn.Module:
    """`model` as the live reference: no parameter takes a gradient (so no optimizer, no gradient
    buffer, no FSDP reduction ever touches it), eval mode (as TRL prepares its ref_model)."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model.eval()


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: the peft model inside `model` (under FSDP or DDP) with its adapters off.

    peft's `disable_adapter()` also sets requires_grad False on every adapter parameter
    (peft/tuners/tuners_utils.py BaseTunerLayer.enable_adapters); the flags are put back at once.
    FSDP2 takes a parameter group's gradient dtypes from them at its lazy initialisation, which is
    the first forward, i.e. this one: with no parameter trainable then, it reduces bf16 gradients
    into fp32 parameters under mixedPrecision bf16 (a 'grad_dtype' RuntimeError). The forward runs
    under no_grad, so the flags change nothing else."""
    from peft import PeftModel

    peft = next((m for m in model.modules() if isinstance(m, PeftModel)), None)
    if peft is None:
        raise RuntimeError("the LoRA reference needs a peft model, and the model holds none")
    trainable = [p for p in model.parameters() if p.requires_grad]
    with peft.disable_adapter():
        for parameter in trainable:
            parameter.requires_grad_(True)
        yield


@dataclass
class DpoMethod:
    """The loop's DPO micro-step (see the module docstring)."""

    beta: float
    loss: DpoLoss
    lora: bool
    chunks: int = 1
    reference: nn.Module | None = None
    """The live reference (`frozen`), or None (precomputed, or LoRA's adapter-disabled base)."""

    @classmethod
    def of(cls, cfg: TrainingJobConfig) -> DpoMethod:
        spec = cfg.training.dpo or DpoSpec()
        return cls(spec.beta, spec.loss, uses_lora(cfg), cfg.training.loss_chunks)

    @staticmethod
    def pairs(batch: dict[str, torch.Tensor]) -> int:
        """The pairs a micro-batch counts in the step's denominator (host data)."""
        return pairs_in(batch)

    def logps(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              completion_mask: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return sequence_logps(out.logits, input_ids, completion_mask, self.chunks)

    def micro_step(self, model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sum of the batch's pair losses, its DpoMetrics sums), both on the device, nothing read."""
        input_ids = _to(batch["input_ids"], device)
        attention_mask = _to(batch["attention_mask"], device)
        completion_mask = _to(batch["completion_mask"], device)
        if "reference_logps" in batch:
            reference = _to(batch["reference_logps"], device)
            ref_chosen, ref_rejected = reference[:, 0], reference[:, 1]
        elif self.reference is not None:
            with torch.no_grad():
                ref_chosen, ref_rejected = split_pairs(self.logps(self.reference, input_ids, attention_mask, completion_mask))
            reshard(self.reference)  # FSDP2 keeps a root unsharded after a forward no backward follows
        elif self.lora:
            with torch.no_grad(), adapters_disabled(model):
                ref_chosen, ref_rejected = split_pairs(self.logps(model, input_ids, attention_mask, completion_mask))
        else:
            raise RuntimeError("a DPO batch without reference log-probabilities (the precomputed pass did not run)")
        chosen, rejected = split_pairs(self.logps(model, input_ids, attention_mask, completion_mask))
        losses = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, self.beta, self.loss, completion_mask)
        metrics = DpoMetrics.of(chosen, rejected, ref_chosen, ref_rejected, self.beta).tensor
        if is_filler(batch):  # scored only so every rank runs the same forwards
            return losses.sum() * 0.0, metrics * 0.0
        return losses.sum(), metrics


def metric_means(sums: list[float]) -> dict[str, float]:
    """TRL's metrics from a DpoMetrics tensor's values, read and all-reduced: {} with no pairs."""
    if not sums or sums[0] <= 0:
        return {}
    return {name: value / sums[0] for name, value in zip(METRIC_NAMES, sums[1:], strict=True)}


def evaluate(method: DpoMethod, model: nn.Module, data: Any, rt: Runtime) -> dict[str, float] | None:
    """The DPO loss and TRL's metrics over the held-out pairs (every pair once), or None without any."""
    if data.validation_loader is None:
        return None
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=rt.device)
    sums = torch.zeros(len(METRIC_NAMES) + 1, dtype=torch.float64, device=rt.device)
    with torch.no_grad():
        for batch in data.validation_loader:
            loss, metrics = method.micro_step(model, batch, rt.device)
            loss_sum += loss.double()
            sums += metrics
    model.train()
    totals = torch.cat([loss_sum.reshape(1), sums])
    dist.all_reduce(totals)
    values = totals.tolist()
    pairs = max(values[1], 1.0)
    return {"eval_loss": values[0] / pairs, **{f"eval_{k}": v for k, v in metric_means(values[1:]).items()}}


# --------------------------------------------------------------------------- the reference
def _score(model: nn.Module, pairs: PreferencePairs, collate: PairCollate, rt: Runtime, batch_size: int,
           method: DpoMethod) -> np.ndarray[Any, Any]:
    """(chosen, rejected) log-probabilities of every pair of the part, float32 [pairs, 2], on every rank."""
    values = torch.zeros((len(pairs), 2), dtype=torch.float32, device=rt.device)
    with torch.no_grad():
        for batch in PairShare(pairs, rt.rank, rt.world_size, batch_size, collate):
            input_ids = _to(batch["input_ids"], rt.device)
            logps = method.logps(model, input_ids, _to(batch["attention_mask"], rt.device),
                                 _to(batch["completion_mask"], rt.device))
            if not is_filler(batch):
                chosen, rejected = split_pairs(logps)
                values[_to(batch["index"], rt.device)] = torch.stack([chosen, rejected], dim=1).float()
    dist.all_reduce(values)  # one rank's values plus exact zeros: the same bits everywhere
    return values.cpu().numpy()


def reshard(model: nn.Module) -> None:
    """FSDP2 leaves the root's parameters unsharded after a forward that no backward follows: shard
    them again, so the optimizer (built next) and the checkpoint see the sharded parameters."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def precompute_reference(cfg: TrainingJobConfig, rt: Runtime, model: nn.Module, data: Any) -> dict[str, Any]:
    """Set the batches' reference log-probabilities: read back from beside the token store, or
    scored by the initial model now and stored (see the module docstring). Collective: every rank
    calls it, before the checkpoint (if any) is loaded."""
    if data.stream is not None:  # dataset.streaming: one pass over the stream (methods/dpo_stream.py)
        from llamaft_trainer.methods.dpo_stream import precompute_stream_reference

        method, size = DpoMethod.of(cfg), cfg.training.per_device_batch_size
        try:
            return precompute_stream_reference(cfg, rt, model, data,
                                               lambda pairs, collate: _score(model, pairs, collate, rt, size, method))
        finally:
            reshard(model)
    assert data.store_path is not None and data.loader is not None
    folder = Path(data.store_path) / REFERENCE_DIR / reference_key(cfg)
    parts: list[tuple[str, PreferencePairs, PairCollate]] = [("train", data.train, data.loader.collate_fn)]
    if data.validation is not None and data.validation_loader is not None:
        parts.append(("validation", data.validation, data.validation_loader.collate))
    found = [read_reference(folder / f"{name}.f32", len(pairs)) for name, pairs, _ in parts]
    have = torch.tensor([1.0 if all(f is not None for f in found) else 0.0], dtype=torch.float64, device=rt.device)
    dist.all_reduce(have, op=dist.ReduceOp.MIN)  # every rank reads, or every rank scores
    reused = bool(have.item() > 0)
    started = time.perf_counter()
    method = DpoMethod.of(cfg)
    was_training = model.training
    model.eval()
    try:
        for k, (name, pairs, collate) in enumerate(parts):
            values = found[k] if reused else None
            if values is None:
                values = _score(model, pairs, collate, rt, cfg.training.per_device_batch_size, method)
                if rt.local_rank == 0:  # one writer per node (the store may be per node); same bytes anyway
                    write_reference(folder / f"{name}.f32", values)
            collate.reference = values
    finally:
        model.train(was_training)
        reshard(model)
    if not reused and dist.is_initialized():
        dist.barrier()  # the files are complete before any rank could stop and a retry read them
    report = {"path": str(folder), "reused": reused, "pairs": sum(len(p) for _, p, _ in parts),
              "seconds": round(time.perf_counter() - started, 3)}
    if rt.is_leader:
        log_json("reference", **report)
    return report


def prepare(cfg: TrainingJobConfig, rt: Runtime, model: nn.Module, data: Any,
            reference: nn.Module | None = None) -> DpoMethod | None:
    """The loop's DPO method (None for SFT): with `reference: live` it scores with `reference` (the
    frozen copy main.setup built, `live_reference`), else for full fine-tuning the precomputed
    reference is put in place."""
    if cfg.training.method is not TrainingMethod.DPO:
        return None
    method = DpoMethod.of(cfg)
    if live_reference(cfg):
        if reference is None:
            raise RuntimeError("reference: live needs the frozen copy of the initial model, and none was built")
        method.reference = reference
    elif not method.lora:
        precompute_reference(cfg, rt, model, data)
    return method
