"""observed objects -> status. Pure functions: the kopf handlers feed them what they read.

Phase comes from the job's conditions as its backend reads them (render.backends: a PyTorchJob's
Created, Running, Restarting, Succeeded, Failed, Suspended; a TrainJob's Complete, Failed, Suspended); worker counts from replicaStatuses; progress from the trainer's /progress document
(docs/progress-contract.md). Conditions follow the Kubernetes API conventions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llamaft.api.base import ApiModel
from llamaft.api.contracts import ProgressDocument
from llamaft.api.status import (
    Condition,
    EvaluationStatus,
    FailureRecord,
    LlamaFineTuneStatus,
    PerformanceStatus,
    Phase,
    Progress,
    TrackingStatus,
    WorkerCounts,
    as_written,
)
from llamaft.render import backends

Obj = Mapping[str, Any]


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


class StatusChange(ApiModel):
    """The fields of .status one step sets, typed: what `observe` reads off the job and the
    leader's document, and what `lifecycle` decides on top of it. A field never assigned is not
    in the patch; one assigned None is (a JSON merge patch removes it). `merge_patch` is the one
    way it becomes the dict that is written, so every decision's patch has one shape."""

    phase: Phase | None = None
    message: str | None = None
    attempt: int | None = None
    job_name: str | None = None
    rendezvous_id: str | None = None
    total_gpus: int | None = None
    backend: str | None = None
    queue: str | None = None
    retries_used: int | None = None
    retry_after: str | None = None
    attempt_start_time: str | None = None
    last_progress_time: str | None = None
    start_time: str | None = None
    completion_time: str | None = None
    leader_pod: str | None = None
    export_path: str | None = None
    restarts: int | None = None
    workers: WorkerCounts | None = None
    progress: Progress | None = None
    tracking: TrackingStatus | None = None
    evaluation: EvaluationStatus | None = None
    performance: PerformanceStatus | None = None
    conditions: list[Condition] | None = None
    failures: list[FailureRecord] | None = None
    excluded_nodes: list[str] | None = None
    observed_generation: int | None = None

    def merge_patch(self) -> dict[str, Any]:
        """The JSON merge patch of .status: the assigned fields by their camelCase names, each
        nested part (progress, a condition, a kept failure record) with the keys it was read or
        built with, as plain JSON values."""
        return self.model_dump(by_alias=True, exclude_unset=True, mode="json")

    def take(self, other: StatusChange) -> None:
        """Assign every field `other` assigns (a later look overrides an earlier one)."""
        for name in other.model_fields_set:
            setattr(self, name, getattr(other, name))

    def set_conditions(self, base: Sequence[Condition], updates: Sequence[tuple[str, bool, str, str]],
                       generation: int | None, now: str) -> None:
        """conditions = `base` with each (type, ok, reason, message) set (`with_condition`)."""
        conditions = list(base)
        for type_, ok, reason, message in updates:
            conditions = with_condition(conditions, type_, "True" if ok else "False", reason, message, generation, now)
        self.conditions = conditions


@dataclass
class Observation:
    """What the job, its pods and the leader's document say, typed (`observe`)."""

    change: StatusChange
    """The status they imply (phase, workers, progress, leader, tracking, evaluation, conditions)."""
    phase: Phase
    """The job's phase as its backend reads it (`render.backends.phase_of_job`)."""
    live: Progress | None = None
    """The leader's document's own progress fields (None: no document this look)."""
    events: list[Event] = field(default_factory=list)

    @property
    def status(self) -> dict[str, Any]:
        """The merge patch this observation alone would write."""
        return self.change.merge_patch()


def _condition(type_: str, status: str, reason: str, message: str, generation: int | None, now: str,
               previous_status: str | None, previous_time: str | None) -> Condition:
    """One condition; lastTransitionTime changes only when `status` changes."""
    transition = now if previous_status != status or previous_time is None else previous_time
    fields: dict[str, Any] = {"type": type_, "status": status, "reason": reason, "message": message,
                              "last_transition_time": transition}
    if generation is not None:
        fields["observed_generation"] = generation
    return Condition(**fields)


def with_condition(conditions: Sequence[Condition], type_: str, status: str, reason: str, message: str,
                   generation: int | None, now: str) -> list[Condition]:
    """Add or update one condition of a typed status, sorted by type."""
    previous = next((c for c in conditions if c.type == type_), None)
    entry = _condition(type_, status, reason, message, generation, now,
                       previous.status.value if previous is not None else None,
                       previous.last_transition_time if previous is not None else None)
    return sorted([*(c for c in conditions if c.type != type_), entry], key=lambda c: c.type)


def set_condition(
    conditions: list[dict[str, Any]], type_: str, status: str, reason: str, message: str,
    generation: int | None, now: str,
) -> list[dict[str, Any]]:
    """`with_condition` for a status held as stored (children, spec_changes): the other entries
    stay exactly as they are."""
    previous = next((c for c in conditions if c.get("type") == type_), None)
    entry = _condition(type_, status, reason, message, generation, now,
                       previous.get("status") if previous is not None else None,
                       previous.get("lastTransitionTime", now) if previous is not None else None)
    out = [dict(c) for c in conditions if c.get("type") != type_] + [entry.model_dump(by_alias=True, exclude_unset=True, mode="json")]
    return sorted(out, key=lambda c: str(c["type"]))


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
PHASE_CONDITIONS = (Phase.RUNNING, Phase.SUCCEEDED, Phase.FAILED, Phase.SUSPENDED)
"""The phases with a condition of their own name: True in that phase, False once seen and left."""


def _written(model: ApiModel | None) -> dict[str, Any] | None:
    return as_written(model) if model is not None else None


def _phase_conditions(before: Sequence[Condition], phase: Phase, reason: str, message: str, generation: int | None,
                      now: str) -> list[Condition]:
    conditions = list(before)
    for type_ in PHASE_CONDITIONS:
        active = phase is type_
        if active or any(c.type == type_.value for c in conditions):
            conditions = with_condition(conditions, type_.value, "True" if active else "False",
                                        reason if active else f"Not{type_.value}", message if active else "", generation, now)
    return conditions


def _events(job: Obj | None, before: LlamaFineTuneStatus, phase: Phase, summary: str,
            tracking: TrackingStatus | None) -> list[Event]:
    """A Tracking event when a tracker's health changed, and the job's phase transition."""
    events = []
    warning = tracking.warning if tracking is not None else None
    if warning and warning != (before.tracking.warning if before.tracking is not None else None):
        events.append(Event("Normal" if "reachable again" in warning else "Warning", "Tracking", warning))
    if before.phase is not phase and phase in EVENT_FOR_PHASE:
        kind, event_reason = EVENT_FOR_PHASE[phase]
        events.append(Event(kind, event_reason, f"{(job or {}).get('kind', 'PyTorchJob')} {(job or {}).get('metadata', {}).get('name')}: {summary}"))
    return events


def observe(
    job: Obj | None, pods: Sequence[Obj], doc: ProgressDocument | None, before: LlamaFineTuneStatus, *,
    generation: int | None, now: str,
) -> Observation:
    """The status the LlamaFineTune should have, and the events that explain its transition:
    `doc` is the leader's /progress document (read once, by Step), `before` the status it has.
    The one place the document's fields become status fields."""
    phase, reason, message = backends.phase_of_job(job)
    job_status = (job or {}).get("status", {})
    workers = job_status.get("replicaStatuses", {}).get("Worker", {})
    change = StatusChange(phase=phase, message=message or reason,
                          workers=WorkerCounts(**{k: int(workers.get(k, 0) or 0) for k in ("active", "succeeded", "failed")}))
    if job_status.get("startTime"):
        change.start_time = job_status["startTime"]
    if job_status.get("completionTime"):
        change.completion_time = job_status["completionTime"]
    change.progress = Progress.model_validate(progress_status(doc, as_written(before.progress)))
    if doc is not None and doc.pod:
        change.leader_pod = doc.pod
    if doc is not None and doc.export_path:
        change.export_path = doc.export_path
    tracking = tracking_status(doc, _written(before.tracking))
    if tracking:
        change.tracking = TrackingStatus.model_validate(tracking)
    evaluation = (doc.evaluation.to_k8s() if doc is not None and doc.evaluation is not None else None) or _written(before.evaluation)
    if evaluation:
        change.evaluation = EvaluationStatus.model_validate({k: evaluation[k] for k in EVALUATION_KEYS if evaluation.get(k) is not None})
    change.restarts = before.restarts + (phase is Phase.RESTARTING and before.phase is not Phase.RESTARTING)
    change.conditions = _phase_conditions(before.conditions, phase, reason, message, generation, now)
    return Observation(change, phase, live=doc.status_progress() if doc is not None else None,
                       events=_events(job, before, phase, message or reason, change.tracking))
