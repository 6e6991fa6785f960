"""observed objects -> status. Pure functions: the kopf handlers feed them what they read.

Phase comes from the job's conditions as its backend reads them (render.backends: a PyTorchJob's
Created, Running, Restarting, Succeeded, Failed, Suspended; a TrainJob's Complete, Failed, Suspended); worker counts from replicaStatuses; progress from the trainer's /progress document
(docs/progress-contract.md). Conditions follow the Kubernetes API conventions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llamaft.api.contracts import ProgressDocument
from llamaft.api.status import EvaluationStatus, LlamaFineTuneStatus, Phase, as_written
from llamaft.render import backends

Obj = Mapping[str, Any]


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Observation:
    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)


def set_condition(
    conditions: list[dict[str, Any]], type_: str, status: str, reason: str, message: str,
    generation: int | None, now: str,
) -> list[dict[str, Any]]:
    """Add or update one condition; lastTransitionTime changes only when `status` changes."""
    out = [dict(c) for c in conditions if c.get("type") != type_]
    previous = next((c for c in conditions if c.get("type") == type_), None)
    transition = now if previous is None or previous.get("status") != status else previous.get("lastTransitionTime", now)
    entry = {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": transition}
    if generation is not None:
        entry["observedGeneration"] = generation
    out.append(entry)
    return sorted(out, key=lambda c: str(c["type"]))


def job_phase(job: Obj | None) -> tuple[Phase, str, str]:
    """(phase, reason, message) from the job's conditions, read by its backend (render.backends)."""
    return backends.job_phase(job)


def progress_status(doc: ProgressDocument | None, previous: Mapping[str, Any]) -> dict[str, Any]:
    """status.progress: what the document has (ProgressDocument.status_progress) over what status knew."""
    if doc is None:
        return dict(previous)
    return {**previous, **doc.status_progress().to_k8s()}


EVALUATION_KEYS = tuple(str(f.alias) for f in EvaluationStatus.model_fields.values())


def tracking_status(doc: ProgressDocument | None, previous: Mapping[str, Any] | None) -> dict[str, Any]:
    """status.tracking: where the trackers keep the run, kept once known (a new attempt's
    document has it again only after its trackers opened)."""
    found = doc.tracking.to_k8s() if doc is not None and doc.tracking is not None else {}
    out = {**(previous or {}), **{k: str(v) for k, v in found.items() if v}}
    if doc is not None and doc.tracking_warning:
        out["warning"] = doc.tracking_warning[:1024]
    return out


EVENT_FOR_PHASE = {
    Phase.RUNNING: ("Normal", "Running"),
    Phase.RESTARTING: ("Warning", "Restarting"),
    Phase.SUCCEEDED: ("Normal", "Succeeded"),
    Phase.FAILED: ("Warning", "Failed"),
    Phase.SUSPENDED: ("Normal", "Suspended"),
}


def observe(
    job: Obj | None, pods: Sequence[Obj], doc: ProgressDocument | None, before: LlamaFineTuneStatus, *,
    generation: int | None, now: str,
) -> Observation:
    """The status the LlamaFineTune should have, and the events that explain its transition:
    `doc` is the leader's /progress document (read once, by Step), `before` the status it has."""
    phase, reason, message = job_phase(job)
    job_status = (job or {}).get("status", {})
    workers = job_status.get("replicaStatuses", {}).get("Worker", {})
    status: dict[str, Any] = {
        "phase": phase.value,
        "message": message or reason,
        "workers": {k: int(workers.get(k, 0) or 0) for k in ("active", "succeeded", "failed")},
        "observedGeneration": generation,
    }
    for key in ("startTime", "completionTime"):
        if job_status.get(key):
            status[key] = job_status[key]
    status["progress"] = progress_status(doc, as_written(before.progress))
    if doc is not None and doc.pod:
        status["leaderPod"] = doc.pod
    if doc is not None and doc.export_path:
        status["exportPath"] = doc.export_path
    tracking = tracking_status(doc, as_written(before.tracking) if before.tracking is not None else None)
    if tracking:
        status["tracking"] = tracking
    evaluation = ((doc.evaluation.to_k8s() if doc is not None and doc.evaluation is not None else None)
                  or (as_written(before.evaluation) if before.evaluation is not None else None))
    if evaluation:
        status["evaluation"] = {k: evaluation[k] for k in EVALUATION_KEYS if evaluation.get(k) is not None}
    restarts = before.restarts
    if phase is Phase.RESTARTING and before.phase is not Phase.RESTARTING:
        restarts += 1
    status["restarts"] = restarts
    conditions = [as_written(c) for c in before.conditions]
    for type_, active in (
        ("Running", phase is Phase.RUNNING),
        ("Succeeded", phase is Phase.SUCCEEDED),
        ("Failed", phase is Phase.FAILED),
        ("Suspended", phase is Phase.SUSPENDED),
    ):
        if active or any(c.get("type") == type_ for c in conditions):
            conditions = set_condition(
                conditions, type_, "True" if active else "False", reason if active else f"Not{type_}",
                message if active else "", generation, now,
            )
    status["conditions"] = conditions
    events = []
    warning = tracking.get("warning")
    if warning and warning != (before.tracking.warning if before.tracking is not None else None):
        events.append(Event("Normal" if "reachable again" in warning else "Warning", "Tracking", warning))
    if before.phase is not phase and phase in EVENT_FOR_PHASE:
        kind, event_reason = EVENT_FOR_PHASE[phase]
        events.append(Event(kind, event_reason, f"{(job or {}).get('kind', 'PyTorchJob')} {(job or {}).get('metadata', {}).get('name')}: {message or reason}"))
    return Observation(status, events)
