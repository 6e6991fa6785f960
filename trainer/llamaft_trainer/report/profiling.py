"""Opt-in wall-clock timers per train-loop phase: where a step's time goes.

    LLAMAFT_PHASE_TIMERS=1 torchrun ... -m llamaft_trainer --config ...

Off (the default) every hook is `phase(None, name)` returning one shared no-op context manager: a
function call per hook, a few per micro-step. On, `Trainer.train` calls `start`, which returns the
timers the Trainer holds for the loop and, for FSDP2, gives each FSDP unit an all-gather and a
reduce-scatter wrapped in a timer: the same collectives parallelize.py uses, written with public
torch.distributed calls, installed through the public `FSDPModule.set_custom_all_gather` /
`set_custom_reduce_scatter` (torch >= 2.7); every rank then logs one `phases` event
per optimizer step with milliseconds per phase:

  data            next micro-batch group from the loader and counting its target tokens
  forward         model forward + loss, less the all-gathers inside it
  backward        autograd backward, less the all-gathers and reduce-scatters inside it
  all_gather      FSDP2 parameter all-gathers (forward and backward; async ones: issue + wait)
  reduce_scatter  FSDP2 gradient reduce-scatters (and the HSDP/NO_SHARD replica all-reduce)
  grad_norm       the global gradient norm and clipping (with FSDP2 its norm all-reduce is in here, and
                  so is the wait for a slower rank)
  optimizer       AdamW step, zero_grad, LR scheduler (and fp16's unscale)
  sync            the loop's own small all-reduces (token count; loss, tokens and stop vote): also
                  where a rank waits for a slower one
  other           the rest of the step's wall time (Python, metrics)

Time is exclusive: a phase entered inside another pauses the outer one, so the phases sum to the
step's wall time. On CPU (gloo) FSDP2's collectives block the calling thread (its streams and
events are no-ops there), so `all_gather` + `reduce_scatter` is the exposed communication time; on
GPU a collective's call returns once it is queued on its stream, so these timers see only the issue
and the waits the CPU does, not the GPU-side overlap (use torch.profiler there). FSDP1 has no
custom-collective hook: its collectives stay inside forward/backward.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ENV_VAR = "LLAMAFT_PHASE_TIMERS"
PHASES = ("data", "forward", "backward", "all_gather", "reduce_scatter", "grad_norm", "optimizer", "sync", "other")
COLLECTIVES = ("all_gather", "reduce_scatter")
_NULL: AbstractContextManager[None] = contextlib.nullcontext()


def enabled_by_env(environ: dict[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return value.strip().lower() not in ("", "0", "false", "no", "off")


class _Open:
    """A phase being timed: its name and when it (re)started counting."""

    __slots__ = ("name", "since")

    def __init__(self, name: str, since: float) -> None:
        self.name, self.since = name, since


class PhaseTimers:
    """Exclusive wall time per phase, accumulated until `end_step` hands it over and resets."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        # Bytes of the full (unsharded) buffers per collective kind, this step.
        self.volumes: dict[str, int] = dict.fromkeys(COLLECTIVES, 0)
        # The open phases, innermost last.
        self._stack: list[_Open] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        now = time.perf_counter()
        if self._stack:
            outer = self._stack[-1]
            self.totals[outer.name] = self.totals.get(outer.name, 0.0) + now - outer.since
        entry = _Open(name, now)
        self._stack.append(entry)
        try:
            yield
        finally:
            now = time.perf_counter()
            self._stack.pop()
            self.totals[name] = self.totals.get(name, 0.0) + now - entry.since
            if self._stack:
                self._stack[-1].since = now

    def count(self, collective: str, nbytes: int) -> None:
        self.volumes[collective] = self.volumes.get(collective, 0) + nbytes

    def end_step(self, step_seconds: float) -> dict[str, float]:
        """Milliseconds per phase for the step that took `step_seconds` (`other`: the rest),
        `<collective>_bytes` (the full buffers' bytes of this step's collectives) and `threads`
        (torch's intra-op threads); then reset."""
        totals = dict(self.totals)
        totals["other"] = max(0.0, step_seconds - sum(v for k, v in totals.items() if k != "other"))
        out: dict[str, float] = {k: round(v * 1e3, 3) for k, v in totals.items()}
        out.update({f"{k}_bytes": v for k, v in self.volumes.items()})
        out["threads"] = torch.get_num_threads()  # intra-op threads of this rank
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.volumes = dict.fromkeys(COLLECTIVES, 0)
        return out


def phase(timers: PhaseTimers | None, name: str) -> AbstractContextManager[None]:
    """Time the block as `name` on `timers`; with timers off (None) a shared no-op context."""
    return _NULL if timers is None else timers.phase(name)


def start(model: nn.Module | None = None, *, enabled: bool | None = None) -> PhaseTimers | None:
    """New timers for a loop when they are on (`enabled`, default: the LLAMAFT_PHASE_TIMERS
    variable), timing `model`'s FSDP2 collectives too; None when off. The caller holds them (the
    Trainer does): nothing here is process-wide."""
    if not (enabled_by_env() if enabled is None else enabled):
        return None
    timers = PhaseTimers()
    if model is not None:
        instrument_fsdp2(model, timers)
    return timers


# ------------------------------------------------------------------ FSDP2 collectives
class _TimedWork(dist.Work):
    """An async collective's handle whose wait counts as the collective's phase."""

    def __init__(self, inner: dist.Work, timers: PhaseTimers, name: str) -> None:
        super().__init__()
        self._inner, self._timers, self._name = inner, timers, name

    def wait(self, timeout: Any = None) -> bool:
        with self._timers.phase(self._name):
            return bool(self._inner.wait() if timeout is None else self._inner.wait(timeout))

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def get_future(self) -> Any:
        return self._inner.get_future()


class TimedAllGather:
    """`inner`'s all-gather, its time (and async wait) counted as `all_gather` on `timers`."""

    def __init__(self, inner: Any, timers: PhaseTimers) -> None:
        self.inner, self.timers = inner, timers

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)  # type: ignore[no-any-return]

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False) -> Any:
        self.timers.count("all_gather", output_tensor.numel() * output_tensor.element_size())
        with self.timers.phase("all_gather"):
            return _timed(self.inner(output_tensor, input_tensor, group, async_op), self.timers, "all_gather")


class TimedReduceScatter:
    """`inner`'s reduce-scatter, its time counted as `reduce_scatter` on `timers`."""

    def __init__(self, inner: Any, timers: PhaseTimers) -> None:
        self.inner, self.timers = inner, timers

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)  # type: ignore[no-any-return]

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        self.timers.count("reduce_scatter", input_tensor.numel() * input_tensor.element_size())
        with self.timers.phase("reduce_scatter"):
            return _timed(self.inner(output_tensor, input_tensor, group, op, async_op), self.timers, "reduce_scatter")


def _timed(result: Any, timers: PhaseTimers, name: str) -> Any:
    return _TimedWork(result, timers, name) if isinstance(result, dist.Work) else result


def instrument_fsdp2(model: nn.Module, timers: PhaseTimers) -> int:
    """Time the all-gather and reduce-scatter of every FSDP2 unit of `model` on `timers`: the
    same collectives parallelize.py runs (`parallelize.fsdp2_collectives`), wrapped, through the
    public `set_custom_all_gather` / `set_custom_reduce_scatter`. Returns how many units; FSDP1 and non-FSDP models: 0. Calling it
    again replaces the wrappers (never wraps a wrapper)."""
    from torch.distributed.fsdp import FSDPModule

    from llamaft_trainer.parallel.parallelize import fsdp2_collectives

    first = next(model.parameters(), None)
    if first is None:
        return 0
    device_type = first.device.type
    units = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            all_gather, reduce_scatter = fsdp2_collectives(device_type)
            module.set_custom_all_gather(TimedAllGather(all_gather, timers))  # type: ignore[arg-type]
            module.set_custom_reduce_scatter(TimedReduceScatter(reduce_scatter, timers))  # type: ignore[arg-type]
        except ValueError:  # several parameter groups (per-parameter meshes): leave the unit as it is
            continue
        units += 1
    return units


# --------------------------------------------------------------------- summaries
def summarize(events: Sequence[dict[str, Any]], skip_steps: int = 0, stat: str = "median") -> dict[str, float]:
    """ms per phase per step from `phases` log records, each step's figures averaged over ranks,
    steps after the first `skip_steps`. `stat` "median": per phase, the median over steps, and
    `step` the median step time (the phases' sum); "min": the fastest step's figures (least
    disturbed by other load on a shared machine). `<collective>_bytes`: per step and rank."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for event in events:
        by_step.setdefault(int(event["step"]), []).append(event)
    keys = (*PHASES, *(f"{c}_bytes" for c in COLLECTIVES))
    rows = []
    for step in sorted(s for s in by_step if s > skip_steps):
        ranks = by_step[step]
        row = {k: sum(float(e.get(k, 0.0)) for e in ranks) / len(ranks) for k in keys}
        row["step"] = sum(row[p] for p in PHASES)
        rows.append(row)
    if not rows:
        return dict.fromkeys((*keys, "step"), 0.0)
    if stat == "min":
        return min(rows, key=lambda r: r["step"])
    if stat != "median":
        raise ValueError(f"stat must be median or min, not {stat!r}")
    return {k: _median(sorted(r[k] for r in rows)) for k in (*keys, "step")}


def _median(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
