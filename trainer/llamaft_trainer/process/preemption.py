"""SIGTERM -> stop at a step boundary every rank agrees on, and save only when there is time.

What reaches the trainer (torch 2.13, torch/distributed/elastic): Kubernetes signals the container's
PID 1, torchrun. Its handler (`multiprocessing/api.py` `_terminate_process_handler`) raises
SignalException in the agent, which (`agent/server/api.py` `run`) calls `_shutdown(SIGTERM,
timeout=shutdown_timeout)`: every worker's process group gets SIGTERM at once (`os.killpg`,
`subprocess_handler.py` `close`), then SIGKILL once `shutdown_timeout` has passed
(`multiprocessing/api.py` `SubprocessContext._close`; `--shutdown-timeout` or
TORCH_ELASTIC_SHUTDOWN_TIMEOUT, default 30 s, `launcher/api.py`). The SignalException is then
re-raised out of torchrun's `main`, so torchrun, and with it the pod, exits 1 whatever the workers
did (or 137 if the kubelet's own SIGKILL comes first). The trainer therefore gets
min(terminationGracePeriodSeconds, torchrun's shutdown timeout) from the signal to its end.

Only the signal handler runs asynchronously, and it only records the time: the train loop adds
the flag to the all-reduce of its reads of the device (train.py: every logging step, and at least
every STOP_CHECK_SECONDS of training), so every rank sees the same sum and stops after the same step. A rank that stops alone would leave the others blocked in
the next collective, and a save that some ranks skip deadlocks DCP, so the save decision is agreed
on too (the least time left anywhere against the slowest save anywhere).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from types import FrameType

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

TORCHRUN_SHUTDOWN_TIMEOUT_S = 30.0
"""torchrun's default --shutdown-timeout (launcher/api.py: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, "30")."""
SAVE_SAFETY_FACTOR = 1.5
"""A save may take longer than the estimate (page cache full, a slower shared filesystem)."""
EXIT_RESERVE_S = 3.0
"""Time kept back after the save for the termination message, the teardown and the exit."""
SAVE_OVERHEAD_S = 2.0
"""Fixed cost of a save without an earlier one to measure: DCP planning, barriers, the COMPLETE marker."""
DEFAULT_WRITE_BYTES_PER_SECOND = 100e6
"""Assumed checkpoint write speed per rank before the run has measured one (a network volume);
LLAMAFT_CHECKPOINT_BYTES_PER_SECOND overrides it."""
NOT_SIGNALLED_S = 1e9
"""'Time left' of a rank that got no signal (a healthy pod whose peer is being preempted)."""


@dataclass(frozen=True)
class StopReport:
    """How a stop on SIGTERM went, for the termination message."""

    step: int
    signalled: bool
    """Whether this rank got the signal (otherwise a peer did)."""
    saved: bool
    detail: str
    """Why it saved or not, in numbers."""

    def message(self, checkpoint_step: int | None, signal_name: str = "SIGTERM") -> str:
        """`signal_name`: the signal this rank got (a rank that got none cannot know its peer's)."""
        who = signal_name if self.signalled else "a peer got SIGTERM"
        action = "saved a checkpoint of it" if self.saved else f"no new checkpoint (newest complete: step {checkpoint_step})"
        return f"{who}: stopped after step {self.step}, {action}; {self.detail}"


def grace_budget_seconds() -> float:
    """Seconds between SIGTERM and SIGKILL for this process.

    The kubelet kills after terminationGracePeriodSeconds (the operator passes it as
    LLAMAFT_TERMINATION_GRACE_SECONDS); under torchrun the agent kills its workers after its own
    shutdown timeout, which is shorter unless TORCH_ELASTIC_SHUTDOWN_TIMEOUT raises it (the
    workers inherit torchrun's environment, so they see the same value torchrun used)."""
    budgets = []
    if "LLAMAFT_TERMINATION_GRACE_SECONDS" in os.environ:
        budgets.append(float(os.environ["LLAMAFT_TERMINATION_GRACE_SECONDS"]))
    if "TORCHELASTIC_RUN_ID" in os.environ or "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in os.environ:
        budgets.append(float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", TORCHRUN_SHUTDOWN_TIMEOUT_S)))
    return min(budgets) if budgets else TORCHRUN_SHUTDOWN_TIMEOUT_S


class StopSignal:
    """Records when SIGTERM (or SIGINT) arrived and which came first; never interrupts anything by
    itself.

    SIGINT is handled the same way (stop after an agreed step, save when there is time) instead of
    Python's KeyboardInterrupt mid-step: `llamaft run --local` passes a user's Ctrl-C on as SIGINT
    (torchrun's agent forwards the signal it got to its workers: torch 2.13,
    `agent/server/api.py` `run` -> `_shutdown(e.sigval)`), so the trainer can report the stop as
    Interrupted rather than Preempted. The kubelet only sends SIGTERM."""

    def __init__(self, budget_s: float | None = None) -> None:
        self.budget_s = grace_budget_seconds() if budget_s is None else budget_s
        self.received_at: float | None = None
        self.signum: int | None = None
        """The first stop signal this process got."""

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
            self.signum = signum

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    @property
    def interrupted(self) -> bool:
        """A person asked for the stop (SIGINT), not the cluster (SIGTERM)."""
        return self.signum == signal.SIGINT

    @property
    def name(self) -> str:
        """The signal's name for messages (SIGTERM when none came: a peer's stop)."""
        return signal.Signals(self.signum).name if self.signum is not None else "SIGTERM"

    def seconds_left(self) -> float:
        """Time until SIGKILL for a signalled rank; NOT_SIGNALLED_S otherwise."""
        if self.received_at is None:
            return NOT_SIGNALLED_S
        return self.budget_s - (time.monotonic() - self.received_at)


def local_checkpoint_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank writes in a checkpoint: its shards of the parameters and optimizer state."""

    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return int(local.numel()) * int(local.element_size())

    total = sum(nbytes(p) for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def estimate_save_seconds(earlier_saves: list[float], local_bytes: int) -> float:
    """The slowest save of this run so far, or (before the first) the model size at an assumed
    write speed plus a fixed overhead."""
    if earlier_saves:
        return max(earlier_saves)
    speed = float(os.environ.get("LLAMAFT_CHECKPOINT_BYTES_PER_SECOND", DEFAULT_WRITE_BYTES_PER_SECOND))
    return SAVE_OVERHEAD_S + local_bytes / speed


def agree_to_save(stop: StopSignal, estimate_s: float, device: torch.device) -> tuple[bool, str]:
    """Collective: (save?, why) from the least time left on any rank and the slowest estimated
    save on any rank. Every rank gets the same answer, so all of them enter the (collective) save
    or none does."""
    values = torch.tensor([-stop.seconds_left(), estimate_s], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    left, estimate = -float(values[0]), float(values[1])
    needed = estimate * SAVE_SAFETY_FACTOR + EXIT_RESERVE_S
    why = f"{left:.1f} s to SIGKILL, a save needs {needed:.1f} s (estimate {estimate:.1f} s x {SAVE_SAFETY_FACTOR} + {EXIT_RESERVE_S:.0f} s)"
    return left >= needed, why
