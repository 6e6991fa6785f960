"""Train loop: AdamW, warmup + decay, gradient accumulation with sharded gradients, clipping, eval,
metrics and checkpoints.

Gradient accumulation (as torchtitan): FULL_SHARD / SHARD_GRAD_OP reduce-scatter on every
micro-step, so gradients stay sharded and accumulate in the shards; HYBRID_SHARD and NO_SHARD (a 2-D
mesh) reduce-scatter inside the shard group every micro-step and skip only the all-reduce across
replicas until the last micro-step (`set_requires_all_reduce`). Turning gradient sync off
altogether (`set_requires_gradient_sync(False)`) would keep every gradient unsharded, in the
reduce dtype, between micro-steps: a whole model's worth per rank. FSDP1 has no "all-reduce only"
switch: it communicates on every micro-step (its sharded gradients accumulate), except NO_SHARD,
whose `no_sync` holds full gradients that it holds anyway.

Loss normalisation: each optimizer step's loss is the sum of token losses over the whole global
batch (every micro-step on every rank) divided by its number of target tokens, so any sharding
strategy, world size or accumulation split gives the same loss and gradients as one process on
the same batch. FSDP averages gradients over ranks, so each rank scales by world_size / tokens.

Host synchronisation (as torchtitan): a step reads nothing back from the device. Its figures (the
loss sum, the token counts, the grad norm) stay in device tensors until a read point: a logging
step, a checkpoint, a stop check and the end. There one all-reduce and one `.tolist()` settle every
step since the last read (`Trainer._read`), so the log line, the progress and the run record carry
the same per-step figures as if each step had been read at once. What a step needs from the other
ranks before its backward (the global target-token count, the loss's denominator) is counted on the
host from the CPU batches and all-reduced as a device tensor that the loss uses on the device. On a
GPU, tensors go to the device from pinned memory, asynchronously (`to_device`): a plain
`.to(device)` from pageable memory synchronises the stream.

Stopping on SIGTERM (preemption.py): a signal only sets a flag; the ranks agree on it inside the
read (the flag rides on its all-reduce), so all of them stop after the same step; the save happens
where a scheduled checkpoint would (a resumed run continues exactly as from any other checkpoint).
The reads with a stop signal come at least every STOP_CHECK_SECONDS of training (the step time
measured between reads, the same number on every rank), so the stop comes within that much
training, plus a step, after the signal, instead of after the step it arrived in: long steps are
checked every step, short ones every so many steps, and the sync costs at most one device queue
drain per STOP_CHECK_SECONDS.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from llamaft.api.sharding import GradientSync, ShardingPlan
from llamaft.api.spec import FsdpImplementation, MixedPrecision, SchedulerType, TrainingJobConfig
from torch import nn
from torch.distributed.tensor import DTensor

from llamaft_trainer.checkpoint.dcp import Checkpointer, TrainState
from llamaft_trainer.data import global_order
from llamaft_trainer.data.batching import Data, StepGroup, StepOrder
from llamaft_trainer.data.encoding import IGNORE_INDEX
from llamaft_trainer.evaluation import Evaluator
from llamaft_trainer.parallel import float8
from llamaft_trainer.process import faults
from llamaft_trainer.process.errors import ConfigError
from llamaft_trainer.process.preemption import (
    EXIT_RESERVE_S,
    StopReport,
    StopSignal,
    agree_to_save,
    estimate_save_seconds,
    local_checkpoint_bytes,
)
from llamaft_trainer.process.runtime import Runtime
from llamaft_trainer.process.termination import RunRecord
from llamaft_trainer.report import profiling
from llamaft_trainer.report.metrics import ProgressPublisher, log_json, peak_memory_bytes

if TYPE_CHECKING:  # dpo_step is imported where a DPO run needs it
    from llamaft_trainer.methods.dpo_step import DpoMethod

STOP_CHECK_SECONDS = 1.0
"""With a stop signal: the most training time between two reads, where the ranks agree on it
(see the module docstring). Deterministic: the next check's step comes from figures every rank
shares."""


def lr_factor(kind: SchedulerType, step: int, warmup: int, total: int) -> float:
    """The learning-rate multiplier at `step`: a linear warm-up over `warmup` steps, then constant,
    linear decay to 0 or a half cosine to 0 at `total`. The formulas are transformers' (its
    `get_scheduler` "constant_with_warmup", "linear" and "cosine"), so a run matches HF Trainer's
    schedule step for step; written here on torch's LambdaLR because importing transformers'
    scheduler imports its Trainer stack (peft, accelerate, torchao), seconds of every worker's start."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if kind is SchedulerType.CONSTANT:
        return 1.0
    if kind is SchedulerType.LINEAR:
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


@dataclass
class LoopResult:
    state: TrainState
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    stopped: StopReport | None = None
    """Set when the loop ended early because some rank got SIGTERM."""


def build_optimizer(model: nn.Module, cfg: TrainingJobConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, foreach on every device. torch picks foreach by itself
    only for CUDA tensors; on CPU its per-parameter loop is a large share of a small
    model's step, and foreach computes the same update (with one temporary the size of the shard,
    which the planner counts)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.training.learning_rate, weight_decay=cfg.training.weight_decay, foreach=True)


def total_steps(cfg: TrainingJobConfig, batches_per_epoch: int) -> int:
    if cfg.training.max_steps is not None:
        return cfg.training.max_steps
    assert cfg.training.epochs is not None
    return cfg.training.epochs * max(1, batches_per_epoch // cfg.training.gradient_accumulation_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingJobConfig, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    kind, warmup = cfg.training.scheduler, cfg.training.warmup_steps
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, kind, warmup=warmup, total=steps))


def build_scaler(cfg: TrainingJobConfig, rt: Runtime) -> Any | None:
    """fp16's dynamic gradient scaler (None for other precisions); checkpoints save its state."""
    if cfg.fsdp.mixed_precision is not MixedPrecision.FP16:
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=rt.device.type)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without stalling the host: from a CPU tensor to a GPU through pinned memory,
    asynchronously (torch's blocking copy from pageable memory synchronises the stream, i.e. waits
    for everything queued on the device); a plain `.to` otherwise."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def target_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The number of target tokens (next-token labels that count) of a CPU batch: host data."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def token_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device,
                   chunks: int = 1) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropy over target tokens, and their count (from the batch as
    given, before it goes to the device: no read back). `chunks` > 1: the LM head and the loss over
    that many slices of the sequence (training.lossChunks, methods/sft.py)."""
    count = target_tokens(batch)
    input_ids = to_device(batch["input_ids"], device)
    labels = to_device(batch["labels"], device)
    # Packed examples (data.PackedExamples) carry position ids restarting per example and go to the
    # model with no attention mask: transformers then masks each example from the others.
    positions = to_device(batch["position_ids"], device) if "position_ids" in batch else None
    attention_mask = None if positions is not None else to_device(batch["attention_mask"], device)
    if chunks > 1:
        from llamaft_trainer.methods.sft import chunked_token_loss_sum

        loss = chunked_token_loss_sum(model, input_ids, attention_mask, labels, chunks, position_ids=positions)
        return loss, count
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
    logits = out.logits[:, :-1, :].float()
    targets = labels[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, count


def stop_agreed(stop: StopSignal | None, device: torch.device) -> bool:
    """Whether some rank got the stop signal: a collective, so every rank calls it at the same
    point and all of them get the same answer (and stop together)."""
    return stop is not None and _all_reduce_sum([1.0 if stop.requested else 0.0], device)[0] > 0


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return [float(v) for v in t.tolist()]


def _all_reduce_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, cfg: TrainingJobConfig,
                   timers: profiling.PhaseTimers | None = None) -> torch.Tensor:
    """Unscale (fp16), clip to training.maxGradNorm, step, zero the gradients, and with float8
    all-gather precompute the float8 weights' scales; the global grad norm, a tensor on the device
    (not read here). fp16's scaler reads its inf check on the host in `step` (torch's GradScaler).
    (bench/plan_accuracy.py replays the trainer's step with this and `micro_step_sync`.)"""
    if scaler is not None:
        scaler.unscale_(optimizer)
    with profiling.phase(timers, "grad_norm"):
        grad_norm = clip_gradients(model, cfg.training.max_grad_norm, cfg)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    float8.after_optimizer_step(model, cfg.fsdp)
    return grad_norm


def micro_step_sync(model: nn.Module, last: bool, plan: ShardingPlan) -> Any:
    """The communication of one micro-step's backward, as the sharding plan says
    (`ShardingPlan.gradient_sync`, see the module docstring): a context to run it in. `last`: the
    micro-step whose backward completes the optimizer step's gradients."""
    sync = plan.gradient_sync
    if sync is GradientSync.NO_SYNC_UNTIL_LAST and not last:
        return model.no_sync()  # type: ignore[operator]
    if sync is GradientSync.ALL_REDUCE_ON_LAST:
        model.set_requires_all_reduce(last)  # type: ignore[operator]
    return contextlib.nullcontext()


def clip_gradients(model: nn.Module, max_norm: float, cfg: TrainingJobConfig) -> torch.Tensor:
    """Clip to `max_norm` (0: no clipping) and return the global norm before clipping, as a tensor
    (on the device: clipping scales by it there, nothing is read back)."""
    limit = max_norm if max_norm > 0 else float("inf")
    if cfg.fsdp.implementation is FsdpImplementation.FSDP1:
        return torch.as_tensor(model.clip_grad_norm_(limit))  # type: ignore[operator]
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, limit, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm


def evaluate(model: nn.Module, data: Data, rt: Runtime, loss_chunks: int = 1) -> float | None:
    """The validation loss per target token; `loss_chunks` as in training (the logits of a whole
    micro-batch need not fit during evaluation either)."""
    if data.validation_loader is None:
        return None
    model.eval()
    loss_sum, tokens = torch.zeros((), dtype=torch.float64, device=rt.device), 0
    with torch.no_grad():
        for batch in data.validation_loader:
            loss, n = token_loss_sum(model, batch, rt.device, loss_chunks)
            loss_sum += loss  # summed in float64 on the device, read once below
            tokens += n
    model.train()
    totals = torch.stack([loss_sum, to_device(torch.tensor(float(tokens), dtype=torch.float64), rt.device)])
    dist.all_reduce(totals)
    total_loss, total_tokens = totals.tolist()
    return float(total_loss) / max(float(total_tokens), 1.0)


def _micro_batches(data: Data, state: TrainState, accum: int) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Groups of `accum` micro-batches, continuing from the saved epoch and position forever."""
    while True:
        group: list[dict[str, torch.Tensor]] = []
        produced = False
        for batch in data.batches(state.epoch, state.batches_in_epoch):
            group.append(batch)
            if len(group) == accum:
                produced = True
                yield group
                group = []
        if not produced and state.batches_in_epoch == 0:
            # A stream of unknown length can turn out too short; an epoch without a step never ends.
            raise ConfigError(
                f"spec.dataset: one epoch of the data gives fewer than gradientAccumulationSteps ({accum}) "
                "micro-batches per rank: use more data, a smaller perDeviceBatchSize or fewer accumulation steps"
            )
        state.epoch += 1
        state.batches_in_epoch = 0


def _global_steps(order: StepOrder, state: TrainState) -> Iterator[StepGroup]:
    """training.globalBatchSize: the steps of the global order (global_order.py), continuing from
    the saved epoch and its items consumed, forever. The state moves to the step's end as the step
    is handed out: the loop runs it before anything saves the state."""
    while True:
        for group in order.steps(state.epoch, state.items_in_epoch):
            state.items_in_epoch = group.items_after
            yield group
        state.epoch += 1
        state.batches_in_epoch = state.items_in_epoch = 0


@dataclass
class StepFigures:
    """One optimizer step's figures as the step leaves them, on the device until the loop reads
    them (`Trainer._read`)."""

    step: int
    loss_sum: torch.Tensor
    """This rank's sum of token losses over the step's micro-batches (float64, 0-d)."""
    counts: torch.Tensor
    """[target tokens, real tokens] of the step over every rank (float64, all-reduced)."""
    grad_norm: torch.Tensor
    lr: float
    seconds: float = 0.0
    """The step's wall time on the host."""
    extra: torch.Tensor | None = None
    """training.method dpo: this rank's DpoMetrics sums of the step (fp64, on the device)."""


@dataclass
class Session:
    """Everything built before the first step (main.setup)."""

    cfg: TrainingJobConfig
    rt: Runtime
    model: nn.Module
    tokenizer: Any
    model_config: Any
    data: Data
    optimizer: torch.optim.Optimizer
    scheduler: Any
    steps: int
    flops_per_token: float
    n_params: int
    plan: ShardingPlan
    """The sharding plan the model was parallelized by, and the loop syncs gradients by."""
    dpo: DpoMethod | None = None
    """training.method dpo: its micro-step; None for SFT."""


class Trainer:
    """One run's training loop and the state it holds (torchtitan's Trainer): the session's model,
    optimizer, scheduler and data, the train state, fp16's scaler, the checkpointer (built once
    with the run's state), and where it reports: the progress document, the run record for the
    termination message, experiment trackers through the progress, the evaluator."""

    def __init__(
        self, session: Session, *, state: TrainState | None = None, scaler: Any | None = None,
        checkpointer: Checkpointer | None = None, progress: ProgressPublisher | None = None, record: RunRecord | None = None,
        stop: StopSignal | None = None, evaluator: Evaluator | None = None, peak_flops: float | None = None,
    ) -> None:
        """`state`/`scaler`: as a resume restored them (the checkpointer's run state; new ones when
        not given). `stop`: SIGTERM, agreed on by all ranks at the loop's reads (module docstring)."""
        self.s, self.cfg, self.rt = session, session.cfg, session.rt
        self.model, self.optimizer, self.scheduler, self.data = session.model, session.optimizer, session.scheduler, session.data
        self.state = state if state is not None else TrainState()
        self.scaler = scaler if scaler is not None else build_scaler(self.cfg, self.rt)
        self.checkpointer, self.progress, self.stop, self.evaluator = checkpointer, progress, stop, evaluator
        self.record = record if record is not None else RunRecord()
        self.peak_flops = peak_flops
        self.result = LoopResult(self.state)
        self.timers: profiling.PhaseTimers | None = None
        """The phase timers of the running loop (LLAMAFT_PHASE_TIMERS=1), None when off."""
        self._pending: list[StepFigures] = []
        """The steps since the last read, their figures still on the device."""
        self._last_read = time.perf_counter()
        self._next_stop_check = 0
        """With a stop signal, the step after which the ranks next agree on it at the latest."""
        self._method_metrics: dict[str, float] = {}
        """training.method dpo: TRL's metrics of the step last read (dpo_step.metric_means)."""

    # ------------------------------------------------------------------ the loop
    def train(self, stop_after: int | None = None) -> LoopResult:
        """Run optimizer steps from `state.step` to the session's steps (or `stop_after`, for
        tests), or until some rank got SIGTERM."""
        s, rt, state, record, result = self.s, self.rt, self.state, self.record, self.result
        steps, tc = s.steps, self.cfg.training
        record.step, record.total_steps = state.step, steps
        record.world_size, record.flops_per_token, record.peak_flops = rt.world_size, s.flops_per_token, self.peak_flops
        if self.stop is not None and stop_agreed(self.stop, rt.device):
            # SIGTERM during the resume: nothing new to save.
            result.stopped = StopReport(state.step, self.stop.requested, False, "the signal came before the first step: nothing new to save")
            return result
        self.model.train()
        timers = self.timers = profiling.start(self.model)  # LLAMAFT_PHASE_TIMERS=1: a `phases` event per step (None: off)
        order = self.data.order
        groups = (_global_steps(order, state) if order is not None
                  else _micro_batches(self.data, state, tc.gradient_accumulation_steps))
        log_items = order is not None and global_order.log_items()
        started, first_step = time.perf_counter(), state.step
        self._pending, self._last_read, self._next_stop_check = [], started, state.step + 1
        while state.step < steps and (stop_after is None or state.step < stop_after):
            step_start = time.perf_counter()
            group = next(groups)
            figures = self._step(group)
            if log_items:
                assert isinstance(group, StepGroup)
                log_json("items", step=state.step, rank=rt.rank, items=group.items)
            elapsed = figures.seconds = time.perf_counter() - step_start
            record.step = state.step
            if timers is not None:
                log_json("phases", step=state.step, rank=rt.rank, world_size=rt.world_size, **timers.end_step(elapsed))
            # Every condition below is the same on every rank: so are the reads (collectives).
            logging = state.step % tc.log_interval == 0 or state.step == steps
            saving = self.checkpointer is not None and (state.step % self.cfg.checkpointing.every_n_steps == 0 or state.step == steps)
            last = state.step >= steps or (stop_after is not None and state.step >= stop_after)
            stop_votes = 0.0
            if logging or saving or last or (self.stop is not None and state.step >= self._next_stop_check):
                stop_votes, (step_loss, grad_norm, tokens) = self._read(first_step)
                if logging:
                    self._log_step(step_loss, grad_norm, figures.lr, tokens, elapsed,
                                   (time.perf_counter() - started) / max(state.step - first_step, 1))
            faults.after_step(state.step, rt.rank)  # test-only (LLAMAFT_TEST_FAULT); a no-op otherwise
            if tc.eval_interval and state.step % tc.eval_interval == 0 and state.step < steps:
                self._eval()
            if self.checkpointer is not None:
                self._report_completed()  # a background save that finished (no collective)
            if self.stop is not None and (stop_votes > 0 or (saving and self._stop_while_previous_save_runs(self.stop))):
                result.stopped = self._save_on_stop(self.stop)
                return result
            if saving:
                self._save()
        if state.step >= steps:
            self._eval()
            record.peak_memory_bytes = int(_all_reduce_max(float(peak_memory_bytes(rt.device)), rt.device))
        if self.checkpointer is not None:
            # The last save, written in the background during the final eval: a stop signal while
            # it runs is agreed on as in the loop, and the write gets what is left of the grace period.
            if self.stop is not None and self._stop_while_previous_save_runs(self.stop):
                result.stopped = self._save_on_stop(self.stop)
                return result
            self.checkpointer.wait()
            self._report_completed()
        return result

    def _step(self, group: list[dict[str, torch.Tensor]]) -> StepFigures:
        """One optimizer step over a group of micro-batches, with no read back from the device:
        its figures, every value the same on every rank once read."""
        rt, state, scaler, tc = self.rt, self.state, self.scaler, self.cfg.training
        accum = len(group)
        with profiling.phase(self.timers, "data"):
            # Counted on the host from the CPU batches: the target tokens (the loss's denominator)
            # and the real tokens (padding, per-batch when packing is off, is neither work nor progress).
            # DPO: the step's pairs are the denominator (dpo_step), as target tokens are SFT's.
            units = dpo.pairs if (dpo := self.s.dpo) is not None else target_tokens
            # A filler (global_order.py) counts neither: no target, no pair, no token trained on.
            local = [float(sum(units(b) for b in group)),
                     float(sum(int(b["attention_mask"].sum()) for b in group if not global_order.is_filler(b)))]
        with profiling.phase(self.timers, "sync"):
            counts = to_device(torch.tensor(local, dtype=torch.float64), rt.device)
            dist.all_reduce(counts)
        # On the device: world_size / the global target tokens (FSDP averages gradients over ranks).
        global_targets = counts[0].clamp(min=1.0)
        scale = torch.full_like(global_targets, float(rt.world_size)) / global_targets
        loss_sum = torch.zeros((), dtype=torch.float64, device=rt.device)
        extra: torch.Tensor | None = None
        for index, batch in enumerate(group):
            with micro_step_sync(self.model, index == accum - 1, self.s.plan):
                with profiling.phase(self.timers, "forward"):
                    if dpo is not None:
                        loss, metrics = dpo.micro_step(self.model, batch, rt.device)
                        extra = metrics if extra is None else extra + metrics
                    else:
                        loss, _ = token_loss_sum(self.model, batch, rt.device, tc.loss_chunks)
                    scaled = loss * scale.to(loss.dtype)
                with profiling.phase(self.timers, "backward"):
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
            loss_sum += loss.detach()
        with profiling.phase(self.timers, "optimizer"):
            grad_norm = optimizer_step(self.model, self.optimizer, scaler, self.cfg, self.timers)
            lr = float(self.scheduler.get_last_lr()[0])
            self.scheduler.step()
        state.step += 1
        state.batches_in_epoch += accum
        figures = StepFigures(state.step, loss_sum, counts, grad_norm, lr, extra=extra)
        self._pending.append(figures)
        return figures

    def _read(self, first_step: int) -> tuple[float, tuple[float, float, int]]:
        """The loop's read of the device (a collective: every rank at the same step): one
        all-reduce of the pending steps' loss sums with the stop flag and the seconds since the
        last read, then one `.tolist()` of everything. Accounts for each pending step, in order,
        as if it had been read at once, and sets when the next stop check is due at the latest.
        Returns the stop votes (> 0: some rank got the signal) and the newest step's loss, grad
        norm and real tokens."""
        rt, pending = self.rt, self._pending
        assert pending, "a read follows a step"
        now = time.perf_counter()
        vote = 1.0 if self.stop is not None and self.stop.requested else 0.0
        shared = to_device(torch.tensor([vote, now - self._last_read], dtype=torch.float64), rt.device)
        extra = pending[-1].extra  # DPO: the newest step's metric sums, read with its loss
        reduced = torch.cat([torch.stack([f.loss_sum for f in pending]), shared, *([extra] if extra is not None else [])])
        dist.all_reduce(reduced)
        norms = torch.stack([f.grad_norm.to(device=rt.device, dtype=torch.float64) for f in pending])
        values = torch.cat([reduced, torch.stack([f.counts for f in pending]).flatten(), norms]).tolist()
        n = len(pending)
        if extra is not None:
            from llamaft_trainer.methods.dpo_step import metric_means

            k = int(extra.numel())
            self._method_metrics = metric_means(values[n + 2:n + 2 + k])
            self.record.reward_accuracy = self._method_metrics.get("rewards/accuracies")
            self.record.reward_margin = self._method_metrics.get("rewards/margins")
            values = values[:n + 2] + values[n + 2 + k:]
        loss_totals, (votes, seconds), counts, grad_norms = values[:n], values[n:n + 2], values[n + 2:3 * n + 2], values[3 * n + 2:]
        for i, f in enumerate(pending):
            targets, real = counts[2 * i], counts[2 * i + 1]
            newest = (loss_totals[i] / max(targets, 1.0), grad_norms[i], int(real))
            self._account(f.step, *newest, f.seconds, first_step)
        seconds_per_step = seconds / rt.world_size / n
        self._next_stop_check = self.state.step + max(1, int(STOP_CHECK_SECONDS / seconds_per_step) if seconds_per_step > 0 else 1)
        self._pending, self._last_read = [], time.perf_counter()
        return float(votes), newest

    def _account(self, step: int, step_loss: float, grad_norm: float, tokens: int, elapsed: float, first_step: int) -> None:
        state, record = self.state, self.record
        state.tokens_seen += tokens
        self.result.losses.append(step_loss)
        self.result.grad_norms.append(grad_norm)
        record.loss = step_loss
        record.tokens += tokens
        record.train_seconds += elapsed
        if step - first_step > 1:
            record.steady_steps += 1
            record.steady_tokens += tokens
            record.steady_seconds += elapsed

    def _log_step(self, step_loss: float, grad_norm: float, lr: float, tokens: int, elapsed: float,
                  seconds_per_step: float) -> None:
        rt, state, steps = self.rt, self.state, self.s.steps
        tps = tokens / elapsed
        mfu = (tps / rt.world_size) * self.s.flops_per_token / self.peak_flops if self.peak_flops else None
        metrics = {
            "step": state.step, "total_steps": steps, "epoch": state.epoch, "loss": round(step_loss, 6),
            "lr": lr, "grad_norm": round(grad_norm, 6), "tokens": tokens,
            "tokens_per_second": round(tps, 2), "tokens_per_second_per_device": round(tps / rt.world_size, 2),
            "mfu": round(mfu, 5) if mfu is not None else None, "peak_memory_bytes": peak_memory_bytes(rt.device),
            "eta_seconds": int(seconds_per_step * (steps - state.step)), "step_seconds": round(elapsed, 4),
            **{name: round(value, 6) for name, value in self._method_metrics.items()},
        }
        if rt.is_leader:
            log_json("step", **metrics)
        if self.progress is not None:
            self.progress.record_step(metrics)

    # ------------------------------------------------------------------ checkpoints
    def _save(self, *, blocking: bool = False) -> None:
        """Save this step (collective). Async: the loop waits for the previous save (one in flight
        at a time) and the staging copy, logs `checkpoint_staged`, and `checkpoint` follows once the
        background write is complete; otherwise `checkpoint` comes at once."""
        assert self.checkpointer is not None
        staged = self.checkpointer.save(blocking=blocking)
        self._report_completed()  # the previous save, if this one waited for it
        if staged.background and self.rt.is_leader:
            log_json("checkpoint_staged", step=staged.step, path=staged.path, stall_seconds=round(staged.stall_seconds, 4),
                     waited_seconds=round(staged.waited_seconds, 4))

    def _report_completed(self) -> None:
        """Log and record the checkpoints completed since the last call (this rank's view, no collective)."""
        assert self.checkpointer is not None
        for done in self.checkpointer.poll():
            self.result.checkpoints.append(done.path)
            self.record.checkpoint_step = done.step
            if self.rt.is_leader:
                log_json("checkpoint", step=done.step, path=done.path, stall_seconds=round(done.stall_seconds, 4),
                         write_seconds=round(done.write_seconds, 4), **{"async": done.background})

    def _stop_while_previous_save_runs(self, stop: StopSignal) -> bool:
        """Before an async save: wait for the previous one (one in flight at a time) in slices of
        STOP_CHECK_SECONDS, agreeing on the stop signal after each (collective, the same number of
        slices on every rank). True when some rank got the signal meanwhile: the caller stops
        instead, and `_save_on_stop` gives the write what is left of the grace period. Without
        this, a signal that comes while the loop waits on a write longer than the grace period
        would go unseen until SIGKILL, with no termination report."""
        checkpointer = self.checkpointer
        assert checkpointer is not None
        if checkpointer.in_flight_step is None:
            return False
        while True:
            error: Exception | None = None
            try:
                done = checkpointer.wait(timeout=STOP_CHECK_SECONDS)
            except Exception as exc:  # noqa: BLE001 - re-raised below, once every rank knows
                done, error = True, exc
            still_running, stop_votes, errors = _all_reduce_sum(
                [0.0 if done else 1.0, 1.0 if stop.requested else 0.0, 0.0 if error is None else 1.0], self.rt.device)
            if error is not None:
                raise error
            if errors > 0:
                # Checkpointer._commit agrees on a failure, so this rank's write fails too: raise
                # it here rather than in a collective the failed rank never joins.
                checkpointer.wait()
                raise RuntimeError(f"the background save of step {checkpointer.in_flight_step} failed on another rank")
            if stop_votes > 0:
                return True
            if still_running == 0:
                return False

    def _save_on_stop(self, stop: StopSignal) -> StopReport:
        """Save when every rank has time for it (a collective decision), else leave the newest
        complete checkpoint as it is: an interrupted save has no COMPLETE marker and is never resumed.

        A background save still in flight goes first: every rank waits for it until the same
        deadline (the least time left anywhere, less the exit reserve). If it is not complete
        everywhere by then, it stays unmarked and no new save starts; otherwise the stop's own save
        is decided on as before and runs synchronously."""
        rt, state, checkpointer = self.rt, self.state, self.checkpointer
        if checkpointer is None:
            return StopReport(state.step, stop.requested, False, "checkpointing is off")
        in_flight = checkpointer.in_flight_step
        left = _least_time_left(stop, rt.device)
        problem = ""
        try:
            finished = checkpointer.wait(timeout=max(0.0, left - EXIT_RESERVE_S))
            if not finished:
                problem = f"did not finish within the grace period ({left:.1f} s to SIGKILL)"
        except Exception as exc:  # the same on every rank (Checkpointer._commit agrees on it)
            finished, problem = False, f"failed: {type(exc).__name__}: {exc}"
        self._report_completed()
        if not _on_every_rank(finished, rt.device):
            why = f"the background save of step {in_flight} {problem or 'did not finish on another rank'}; no new save"
            if rt.is_leader:
                log_json("preempted", step=state.step, save=False, detail=why, signal=stop.name)
            return StopReport(state.step, stop.requested, False, why)
        if in_flight == state.step:
            # The save of this very step (the last one's, after the loop) is complete: saving it
            # again would replace a complete checkpoint with a copy of itself.
            why = f"the background save of step {in_flight} completed"
            if rt.is_leader:
                log_json("preempted", step=state.step, save=True, detail=why, signal=stop.name)
            return StopReport(state.step, stop.requested, True, why)
        estimate = estimate_save_seconds(checkpointer.save_seconds, local_checkpoint_bytes(self.model, self.optimizer))
        save, why = agree_to_save(stop, estimate, rt.device)
        if rt.is_leader:
            log_json("preempted", step=state.step, save=save, detail=why, signal=stop.name)
        if save:
            self._save(blocking=True)
        return StopReport(state.step, stop.requested, save, why)

    # ------------------------------------------------------------------ evaluation
    def _eval(self) -> None:
        if self.s.dpo is not None:
            self._eval_dpo()
            return
        eval_loss = evaluate(self.model, self.data, self.rt, self.cfg.training.loss_chunks)
        if eval_loss is None:
            return
        step, progress = self.state.step, self.progress
        self.result.eval_losses.append(eval_loss)
        self.record.eval_loss = eval_loss
        perplexity = math.exp(min(eval_loss, 50))
        if self.rt.is_leader:
            log_json("eval", step=step, eval_loss=round(eval_loss, 6), perplexity=round(perplexity, 4))
        if progress is not None:
            progress.record_eval(step, eval_loss, perplexity)
        if self.evaluator is not None:
            report = self.evaluator.run(self.model, self.rt, step)  # every rank generates; rank 0 reports
            if report is not None:
                log_json("generations", **report)
                if progress is not None:
                    progress.record_generations(report)

    def _eval_dpo(self) -> None:
        """DPO's loss and TRL's metrics on the held-out pairs (dpo_step.evaluate)."""
        from llamaft_trainer.methods.dpo_step import evaluate as evaluate_pairs

        assert self.s.dpo is not None
        report = evaluate_pairs(self.s.dpo, self.model, self.data, self.rt)
        if report is None:
            return
        self.result.eval_losses.append(report["eval_loss"])
        self.record.eval_loss = report["eval_loss"]
        self.record.eval_reward_accuracy = report.get("eval_rewards/accuracies")
        self.record.eval_reward_margin = report.get("eval_rewards/margins")
        if self.rt.is_leader:
            log_json("eval", step=self.state.step, **{k: round(v, 6) for k, v in report.items()})
        if self.progress is not None:
            self.progress.record_dpo_eval(self.state.step, report)


def _least_time_left(stop: StopSignal, device: torch.device) -> float:
    """Collective: the least time to SIGKILL of any rank."""
    t = torch.tensor([-stop.seconds_left()], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return -float(t[0])


def _on_every_rank(ok: bool, device: torch.device) -> bool:
    """Collective: whether `ok` holds on every rank."""
    t = torch.tensor([1.0 if ok else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t[0] > 0)
