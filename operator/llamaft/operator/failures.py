"""Evidence -> failure: why an attempt died, and whether running it again can help.

Pure functions over the objects the operator reads (the attempt's PyTorchJob or TrainJob, its pods
(with those deleted since the watch showed their evidence: evidence.py), the GPU health verdict,
the trainer's progress). Nodes are not among them: the operator has no
RBAC to read Node objects, so a lost node is known from what the control plane writes on its pods
(reason NodeLost, the taint manager's or pod GC's DisruptionTarget). Each way an attempt can
die leaves its own evidence; this module reads all of it and names one cause:

| evidence | cause | retryable | node excluded |
| --- | --- | --- | --- |
| the trainer's termination message, reason ConfigError (exit 2) | ConfigError | no | no |
| pod reason NodeLost, DisruptionTarget DeletionByTaintManager or DeletionByPodGC | NodeLost | yes | yes |
| pod reason Evicted, DisruptionTarget TerminationByKubelet (node pressure, shutdown) | Evicted | yes | yes |
| DisruptionTarget EvictionByEvictionAPI (drain) | Evicted | yes | no |
| torchrun's agent lost its rendezvous store: `RendezvousConnectionError` (or etcd's connection errors) in the container's message, or the trainer's reason RendezvousLost | RendezvousLost | yes | no |
| DisruptionTarget PreemptionByScheduler, trainer reason Preempted (SIGTERM) | Preempted | yes | no |
| container terminated reason OOMKilled | OOMKilled | yes | no |
| container exit 137 / 143 without a trainer message | Killed | yes | no |
| GPUHealthy=False with a hardware XID | GPUXid | yes | yes (the XID's host) |
| RendezvousClosedError anywhere | RendezvousClosed | yes | no |
| the trainer's error (NCCL/gloo timeout, dead peer, any exception) | CollectiveTimeout, PeerLost, TrainerError | yes | no |
| no step advance for runPolicy.progressDeadlineSeconds | Stalled | yes | no |
| PyTorchJob Failed, reason DeadlineExceeded (activeDeadlineSeconds) | DeadlineExceeded | no | no |
| PyTorchJob Failed without other evidence | JobFailed | yes | no |

When several pods carry evidence, the most specific cause wins (the order of `PRIORITY`): a lost
node explains its peers' "connection closed" errors, not the other way round. A retryable cause
that repeats at the same step in `runPolicy.repeatedFailureLimit` consecutive attempts is treated
as permanent by the lifecycle (`lifecycle.py`), so a deterministic crash does not burn the budget.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llamaft.api import contracts
from llamaft.api.contracts import FailedReport, FailureReason, SucceededReport
from llamaft.render.backends import TRAINER_CONTAINERS

Obj = Mapping[str, Any]

CONFIG_ERROR = FailureReason.CONFIG_ERROR
NODE_LOST = FailureReason.NODE_LOST
EVICTED = FailureReason.EVICTED
PREEMPTED = FailureReason.PREEMPTED
OOM_KILLED = FailureReason.OOM_KILLED
KILLED = FailureReason.KILLED
GPU_XID = FailureReason.GPU_XID
RENDEZVOUS_CLOSED = FailureReason.RENDEZVOUS_CLOSED
RENDEZVOUS_LOST = FailureReason.RENDEZVOUS_LOST
COLLECTIVE_TIMEOUT = FailureReason.COLLECTIVE_TIMEOUT
PEER_LOST = FailureReason.PEER_LOST
TRAINER_ERROR = FailureReason.TRAINER_ERROR
STALLED = FailureReason.STALLED
DEADLINE_EXCEEDED = FailureReason.DEADLINE_EXCEEDED
JOB_FAILED = FailureReason.JOB_FAILED

PRIORITY: list[str] = list(contracts.PRIORITY)
"""Most specific first: the declaration order of contracts.FailureReason, from which the trainer's
termination.PRECEDENCE is derived too."""
PERMANENT = frozenset({CONFIG_ERROR, DEADLINE_EXCEEDED})
CLOSED_RENDEZVOUS_TEXT = "RendezvousClosedError"
LOST_RENDEZVOUS_TEXTS = ("RendezvousConnectionError", "EtcdConnectionFailed", "The connection to etcd has failed")
"""What torchrun's agent (and python-etcd under it) says when the rendezvous store is gone. The
agent then SIGTERMs its workers, whose own report says Preempted: this evidence wins."""
# DisruptionTarget reasons (Kubernetes pod disruption conditions) -> (cause, exclude the node)
DISRUPTIONS = {
    "DeletionByTaintManager": (NODE_LOST, True),
    "TerminationByKubelet": (EVICTED, True),
    "EvictionByEvictionAPI": (EVICTED, False),
    "PreemptionByScheduler": (PREEMPTED, False),
    "DeletionByPodGC": (NODE_LOST, True),
}
TRAINER_REASONS = contracts.TRAINER_REASONS
"""The reasons the trainer reports by name; any other (an exception's type name) is TrainerError."""


@dataclass(frozen=True)
class Failure:
    """Why an attempt died."""

    reason: str
    message: str
    retryable: bool
    node: str | None = None
    """The node the evidence blames (only set when the node should be avoided)."""
    pod: str | None = None
    exit_code: int | None = None
    step: int | None = None

    def signature(self) -> tuple[str, int | None]:
        """What 'the same failure' means for the repeated-failure rule."""
        return self.reason, self.step


def trainer_report(message: str | None) -> SucceededReport | FailedReport | None:
    """The trainer's JSON termination message (contracts.read_termination), if that is what it is."""
    if not message:
        return None
    text = message.strip()
    if not text.startswith("{"):
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return contracts.read_termination(doc)


def terminated(pod: Obj) -> dict[str, Any] | None:
    """The trainer container's terminated state (current or last), if it has ended."""
    for cs in pod.get("status", {}).get("containerStatuses", []) or []:
        if cs.get("name") not in (None, *TRAINER_CONTAINERS):  # None: a status that names no container
            continue
        for key in ("state", "lastState"):
            state = (cs.get(key) or {}).get("terminated")
            if state:
                return dict(state)
    return None


def _condition(pod: Obj, type_: str) -> dict[str, Any] | None:
    for c in pod.get("status", {}).get("conditions", []) or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return dict(c)
    return None


def _name(obj: Obj) -> str:
    return str(obj.get("metadata", {}).get("name", ""))


def _node(pod: Obj) -> str | None:
    node = pod.get("spec", {}).get("nodeName")
    return str(node) if node else None


ERASABLE_REASONS = ("Evicted", "NodeLost")


def erasable(pod: Obj) -> bool:
    """Whether the pod carries evidence that goes when the pod is deleted, and it may be: a
    DisruptionTarget condition (an eviction, a preemption, the taint manager or PodGC delete the
    pod they mark), status.reason Evicted/NodeLost, or the trainer's final Succeeded report in its
    termination message: training-operator v1.9 calls an elastic PyTorchJob Succeeded once any
    worker has succeeded and deletes the workers still running (cleanPodPolicy Running), often the
    leader's pod right after it wrote that report. The watch keeps such a pod (evidence.py)."""
    reason = (pod.get("status") or {}).get("reason")
    if _condition(pod, "DisruptionTarget") is not None or reason in ERASABLE_REASONS:
        return True
    state = terminated(pod)
    return isinstance(trainer_report(state.get("message") if state else None), SucceededReport)


def pod_failure(pod: Obj, last_step: int | None) -> Failure | None:
    """The evidence one pod carries, or None when it is healthy (running, pending or succeeded)."""
    status = pod.get("status", {})
    name, node = _name(pod), _node(pod)
    state = terminated(pod)
    report = trainer_report(state.get("message") if state else None)
    step = report.step if report is not None and report.step is not None else last_step
    exit_code = int(state["exitCode"]) if state and state.get("exitCode") is not None else None
    failed = report if isinstance(report, FailedReport) else None
    if failed is not None and failed.reason == CONFIG_ERROR:
        return Failure(CONFIG_ERROR, (failed.message or "")[:1500], False, None, name, exit_code, step)
    if status.get("phase") == "Succeeded" or (state is not None and exit_code == 0):
        return None
    if status.get("reason") == "NodeLost":
        return Failure(NODE_LOST, f"node {node} of pod {name} is gone", True, node, name, exit_code, step)
    disruption = _condition(pod, "DisruptionTarget")
    if disruption is not None:
        cause, exclude = DISRUPTIONS.get(str(disruption.get("reason")), (EVICTED, False))
        text = f"pod {name} on {node}: {disruption.get('reason')}: {disruption.get('message', '')}".strip()
        return Failure(cause, text[:1500], True, node if exclude else None, name, exit_code, step)
    if status.get("reason") == "Evicted":
        return Failure(EVICTED, f"pod {name} evicted from {node}: {status.get('message', '')}"[:1500], True, node, name, exit_code, step)
    if state is None:
        if status.get("phase") == "Failed":
            detail = f"{status.get('reason') or 'no reason given'}: {status.get('message') or ''}".strip(": ")
            return Failure(TRAINER_ERROR, f"pod {name} on {node} failed ({detail})"[:1500], True, None, name, None, step)
        return None
    text = str(state.get("message") or "")
    if CLOSED_RENDEZVOUS_TEXT in text:
        return Failure(RENDEZVOUS_CLOSED, text[-1500:], True, None, name, exit_code, step)
    if any(t in text for t in LOST_RENDEZVOUS_TEXTS):
        return Failure(RENDEZVOUS_LOST, f"pod {name}: torchrun's agent lost its rendezvous store: {text[-1400:]}", True,
                       None, name, exit_code, step)
    if state.get("reason") == "OOMKilled":
        return Failure(OOM_KILLED, f"pod {name} on {node} was OOM-killed (exit {exit_code})", True, None, name, exit_code, step)
    if failed is not None:
        detail = f"{failed.reason}: {failed.message or ''}"
        return Failure(contracts.trainer_reason(failed.reason), f"pod {name}: {detail}"[:1500], True, None, name,
                       exit_code, step)
    if exit_code in (137, 143):
        return Failure(KILLED, f"pod {name} on {node}: container killed (exit {exit_code})", True, None, name, exit_code, step)
    tail = text[-1200:] if text else str(state.get("reason") or "")
    return Failure(TRAINER_ERROR, f"pod {name} exited {exit_code}: {tail}", True, None, name, exit_code, step)


def job_failure(job: Obj | None, last_step: int | None) -> Failure | None:
    """Evidence from the PyTorchJob alone (used when no pod explains the failure)."""
    for c in (job or {}).get("status", {}).get("conditions", []) or []:
        if c.get("type") != "Failed" or c.get("status") != "True":
            continue
        message = str(c.get("message") or c.get("reason") or "")
        if CLOSED_RENDEZVOUS_TEXT in message:
            return Failure(RENDEZVOUS_CLOSED, message[-1500:], True, step=last_step)
        if c.get("reason") == DEADLINE_EXCEEDED or "DeadlineExceeded" in message:
            return Failure(DEADLINE_EXCEEDED, f"runPolicy.activeDeadlineSeconds exceeded: {message}"[:1500], False, step=last_step)
        return Failure(JOB_FAILED, f"{(job or {}).get('kind', 'PyTorchJob')} {_name(job or {})} failed: {message}"[:1500], True, step=last_step)
    return None


def most_specific(failures: Iterable[Failure]) -> Failure | None:
    ranked = sorted(failures, key=lambda f: PRIORITY.index(f.reason) if f.reason in PRIORITY else len(PRIORITY))
    return ranked[0] if ranked else None


def classify(job: Obj | None, pods: Sequence[Obj], last_step: int | None) -> Failure | None:
    """The cause of the attempt's death, or None while nothing has failed."""
    found = [f for f in (pod_failure(p, last_step) for p in pods) if f is not None]
    return most_specific(found) or job_failure(job, last_step)


def gpu_failure(unhealthy_reason: str | None, message: str, nodes: Sequence[str], last_step: int | None) -> Failure | None:
    """A hardware XID on one of the job's GPUs: the attempt cannot make progress on that node."""
    if unhealthy_reason != "XidError":
        return None
    return Failure(GPU_XID, message[:1500], True, nodes[0] if nodes else None, step=last_step)
