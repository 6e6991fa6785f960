"""The termination message: the one document the operator reads after a trainer process ends.

Kubernetes copies the file (`LLAMAFT_TERMINATION_LOG`, default /dev/termination-log) into the
container status, keeping at most 4096 bytes; the operator classifies the failed attempt from it
(docs/progress-contract.md section 3). Because torchrun, the container's PID 1, exits 1 whenever a
worker fails *and* whenever it got SIGTERM itself, the pod's exit code cannot tell a preemption from
a crash: this message is the evidence.

All local ranks of a pod share the one file, so a write does not blindly replace what another rank
wrote: a consequence (a peer's connection closed) never hides the cause (the exception on the rank
that died first). See `PRECEDENCE`.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from llamaft.api import contracts
from llamaft.api.contracts import FailedReport, FailureReason, SucceededReport
from llamaft.api.status import PerformanceStatus

from llamaft_trainer.process.errors import (
    EXIT_CONFIG_ERROR,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    ConfigError,
)

LIMIT_BYTES = 4096
"""Kubernetes truncates a container's termination message to 4096 bytes."""

CONFIG_ERROR = FailureReason.CONFIG_ERROR
PREEMPTED = FailureReason.PREEMPTED
INTERRUPTED = FailureReason.INTERRUPTED
"""SIGINT: a person stopped the run (Ctrl-C of `llamaft run --local`, which passes it on as SIGINT);
the kubelet only ever sends SIGTERM, so on a cluster a stop is Preempted."""
COLLECTIVE_TIMEOUT = FailureReason.COLLECTIVE_TIMEOUT
PEER_LOST = FailureReason.PEER_LOST
RENDEZVOUS_LOST = FailureReason.RENDEZVOUS_LOST
"""SIGTERM from torchrun's agent while its rendezvous store is unreachable: the agent lost the
rendezvous (RendezvousConnectionError) and stopped the workers; no preemption happened."""

PRECEDENCE = contracts.PRECEDENCE
"""Which failure a rank may overwrite in the shared file: a higher (or equal) rank wins; any other
exception type ranks OTHER_ERROR_PRECEDENCE. Derived from the order of `contracts.FailureReason`,
which is the operator's failures.PRIORITY too ("TrainerError" standing for any other exception):
a lost rendezvous explains the SIGTERM, a preemption explains its peers' errors, and a timeout or
a lost peer is usually the echo of another rank's failure."""
OTHER_ERROR_PRECEDENCE = contracts.OTHER_ERROR_PRECEDENCE

_TIMED_OUT = re.compile(r"timed out|timeout|watchdog caught collective", re.IGNORECASE)
_PEER_GONE = re.compile(
    r"connection (closed|reset|refused)|by peer|broken pipe|socket closed|remote process|network error", re.IGNORECASE
)


DPO_FIGURES = ("reward_accuracy", "reward_margin", "eval_reward_accuracy", "eval_reward_margin")
"""RunRecord's and SucceededReport's training.method dpo fields."""


@dataclass
class RunRecord:
    """What this process knows about the run so far, kept current by the train loop so that the
    message is right even when an exception unwinds everything else."""

    step: int | None = None
    """Last completed optimizer step (a resumed run starts at its checkpoint's step)."""
    total_steps: int | None = None
    checkpoint_step: int | None = None
    """Newest complete checkpoint this run resumed from or wrote."""
    loss: float | None = None
    eval_loss: float | None = None
    tokens: int = 0
    """Tokens trained on by all ranks in this attempt."""
    train_seconds: float = 0.0
    """Wall time of this attempt's optimizer steps."""
    export_path: str | None = None
    steady_steps: int = 0
    """Optimizer steps of this attempt after its first (the first pays one-time costs: allocator
    growth, lazy initialisation, compilation), and their tokens and step time below."""
    steady_tokens: int = 0
    steady_seconds: float = 0.0
    world_size: int | None = None
    flops_per_token: float | None = None
    peak_flops: float | None = None
    """Dense peak of one device (None when unknown, e.g. CPU: then no MFU)."""
    peak_memory_bytes: int | None = None
    """The largest peak memory of any rank (device memory on GPUs, resident memory on CPU), set
    collectively when the last step is done."""
    reward_accuracy: float | None = None
    """training.method dpo: the last read step's rewards/accuracies (None for SFT)."""
    reward_margin: float | None = None
    eval_reward_accuracy: float | None = None
    """training.method dpo: the last eval's, over the held-out pairs."""
    eval_reward_margin: float | None = None

    def tokens_per_second(self) -> float | None:
        return round(self.tokens / self.train_seconds, 2) if self.train_seconds > 0 else None

    def performance(self) -> dict[str, Any] | None:
        """What a run of this size sustained: the figures a scaling sweep (llamaft sweep)
        compares across sizes. Over the steady steps (the first excluded) when there are any,
        else over every step; checkpoint saves and evals are not step time. None: no step timed."""
        steps, tokens, seconds = self.steady_steps, self.steady_tokens, self.steady_seconds
        if steps == 0:
            steps, tokens, seconds = (1 if self.train_seconds > 0 else 0), self.tokens, self.train_seconds
        if steps == 0 or seconds <= 0 or not self.world_size:
            return None
        tps = tokens / seconds
        per_device = tps / self.world_size
        mfu = per_device * self.flops_per_token / self.peak_flops if self.flops_per_token and self.peak_flops else None
        return {
            "steps": steps, "worldSize": self.world_size, "tokensPerSecond": round(tps, 2),
            "tokensPerSecondPerDevice": round(per_device, 2), "stepSeconds": round(seconds / steps, 6),
            "mfu": round(mfu, 5) if mfu is not None else None, "peakMemoryBytes": self.peak_memory_bytes,
        }


def classify_exception(exc: BaseException) -> tuple[str, bool]:
    """(reason, retryable) for an exception that ended the run.

    gloo raises a plain RuntimeError ("Timed out waiting 15000ms for recv operation", "Connection
    reset by peer"); NCCL and the store raise the torch.distributed Dist*Error types. Only a
    configuration error is permanent: running it again gives the same answer."""
    import torch.distributed as dist  # here, not at the top: __main__ reads this module before torch loads

    if isinstance(exc, ConfigError):
        return CONFIG_ERROR, False
    text = str(exc)  # the Dist*Error types are RuntimeErrors too
    if isinstance(exc, RuntimeError) and _TIMED_OUT.search(text):
        return COLLECTIVE_TIMEOUT, True
    if isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and _PEER_GONE.search(text)):
        return PEER_LOST, True
    return type(exc).__name__, True


def succeeded(record: RunRecord) -> dict[str, Any]:
    """Global rank 0's message after a finished run (contracts.SucceededReport; `write` adds
    restartCount)."""
    performance = record.performance()
    report = SucceededReport(
        step=record.step, total_steps=record.total_steps, loss=record.loss, eval_loss=record.eval_loss,
        tokens_per_second=record.tokens_per_second(), export_path=record.export_path,
        performance=PerformanceStatus.model_validate(performance) if performance is not None else None,
        reward_accuracy=record.reward_accuracy, reward_margin=record.reward_margin,
        eval_reward_accuracy=record.eval_reward_accuracy, eval_reward_margin=record.eval_reward_margin,
    )
    # An SFT run's message carries no DPO keys (the message is size-limited, and SFT has none).
    absent = {name for name in DPO_FIGURES if getattr(report, name) is None}
    return report.model_dump(by_alias=True, exclude={"restart_count", *absent})


def exit_code(reason: str) -> int:
    """The trainer process's exit code for a failure `reason` (docs/progress-contract.md)."""
    if reason == CONFIG_ERROR:
        return EXIT_CONFIG_ERROR
    if reason in (PREEMPTED, RENDEZVOUS_LOST):  # both stopped on a SIGTERM
        return EXIT_PREEMPTED
    if reason == INTERRUPTED:
        return EXIT_INTERRUPTED
    return EXIT_FAILURE


def failed(reason: str, message: str, record: RunRecord, *, retryable: bool) -> dict[str, Any]:
    """The message of every rank that fails (or stops for a preemption; contracts.FailedReport;
    `write` adds restartCount). `exitCode` is the trainer process's own code: under torchrun the
    pod's exit code is torchrun's (1), so the message is where a 2 (permanent configuration error)
    reaches the container status."""
    report = FailedReport(
        reason=reason, message=message, step=record.step, checkpoint_step=record.checkpoint_step,
        retryable=retryable, exit_code=exit_code(reason),
    )
    return report.model_dump(by_alias=True, exclude={"restart_count"})


def read(path: str | None = None) -> dict[str, Any] | None:
    """The document in the termination log (None: absent, empty or not JSON). Never raises."""
    path = path or os.environ.get("LLAMAFT_TERMINATION_LOG", "/dev/termination-log")
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.loads(f.read() or "null")
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def fit(doc: dict[str, Any], limit: int = LIMIT_BYTES) -> str:
    """`doc` as JSON of at most `limit` bytes: the message is cut (never the JSON), so what
    Kubernetes keeps still parses."""
    text = json.dumps(doc, default=str)
    if len(text.encode()) <= limit:
        return text
    message = str(doc.get("message", ""))
    low, high, best = 0, len(message), None
    while low <= high:  # the longest prefix of the message that fits
        middle = (low + high) // 2
        candidate = json.dumps({**doc, "message": message[:middle] + "..."}, default=str)
        if len(candidate.encode()) <= limit:
            best, low = candidate, middle + 1
        else:
            high = middle - 1
    return best if best is not None else json.dumps({"phase": doc.get("phase"), "reason": doc.get("reason")})


def _precedence(doc: dict[str, Any] | None) -> int:
    if not doc or doc.get("phase") != "Failed":
        return -1
    return PRECEDENCE.get(str(doc.get("reason")), OTHER_ERROR_PRECEDENCE)


def write(doc: dict[str, Any]) -> bool:
    """Write the message unless another rank of this worker already wrote a failure that explains
    more (see PRECEDENCE); True when written. Never raises: a missing or read-only file must not
    turn into a second error."""
    path = os.environ.get("LLAMAFT_TERMINATION_LOG", "/dev/termination-log")
    doc = {**doc, "restartCount": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    try:
        with open(path, "a+", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # local ranks write concurrently
            f.seek(0)
            try:
                existing = json.loads(f.read() or "null")
            except ValueError:
                existing = None
            same_attempt = isinstance(existing, dict) and existing.get("restartCount") == doc["restartCount"]
            if doc["phase"] == "Failed" and same_attempt and _precedence(existing) > _precedence(doc):
                return False
            f.seek(0)
            f.truncate()
            f.write(fit(doc))
            return True
    except OSError:
        return False
