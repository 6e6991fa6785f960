"""A change of .spec: suspend/resume, elastic worker changes and DCGM monitoring are applied in
place; any other change restarts the run from its latest checkpoint as a new attempt; an invalid
change is refused and the running attempt continues.

The update handler (`spec_changed`) reads and validates; the decision is pure (`SpecChanged` ->
`decide_spec_change` -> `SpecDecision`, every path a row of tests/operator/test_lifecycle.py's spec
change table), and the handler acts in its order. The rules live here, beside their one caller,
not in lifecycle.py, whose `decide` is the run's lifecycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import kopf

from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.status import TERMINAL_PHASES, LlamaFineTuneStatus, Phase, WorkerCounts, read_status
from llamaft.api.validation import SpecInvalid
from llamaft.operator import elastic, observe, rendezvous, timestamps
from llamaft.operator.kube import owned_by
from llamaft.operator.observe import Event, StatusChange
from llamaft.operator.specs import invalid_message, validated
from llamaft.operator.state import (
    kube_of,
    measured,
    now,
    object_lock,
    object_state,
    operator_state,
    settings_of,
    wake,
)
from llamaft.render.backends import backend_for
from llamaft.render.naming import Owner


def spec_changed(body: kopf.Body, old: Any, meta: kopf.Meta, memo: kopf.Memo) -> None:
    """Carry out a change of .spec (the update handler's body): read the status, validate, ask
    `decide_spec_change`, act in its order.

    The change judged is the one kopf delivered, from `old` to this event's spec (`body`), which
    kopf records as handled once this returns; never from `old` to a newer spec read meanwhile. Two
    edits in quick succession (suspend, then a learning rate) come as two events: judging the first
    against the second's spec would restart the run for the learning rate there, and the second
    event, whose `old` is the first's spec, would restart it again."""
    namespace, name = str(meta["namespace"]), str(meta["name"])
    k, settings = kube_of(memo), settings_of(memo)
    with measured("update"), object_lock(memo):
        obj = k.get_finetune(namespace, name)
        if obj is None:
            return
        status = dict(obj.get("status") or {})  # fresh: the attempt and phase as they are now
        generation = body["metadata"].get("generation")
        attempt = int(status.get("attempt") or 0)
        kind = str(status.get("backend") or "PyTorchJob")
        parsed = validated(memo, body, old=old, backend=kind)
        object_state(memo).validated = None
        if isinstance(parsed, SpecInvalid):
            for error in parsed.errors:
                kopf.warn(body, reason="InvalidSpec", message=str(error))
            conditions = observe.set_condition(list(status.get("conditions", [])), "Valid", "False", "InvalidSpec",
                                               invalid_message(parsed), generation, timestamps.iso(now()))
            k.patch_finetune_status(namespace, name, {"conditions": conditions})
            return  # the running attempt continues with the last valid spec
        owner = Owner(name, namespace, obj["metadata"].get("uid", ""))
        backend = backend_for(kind)
        first_job_exists = False
        if attempt == 0:
            first = k.get_job(namespace, owner.job_name(1), kind)
            first_job_exists = first is not None and owned_by(first, owner.uid)
        decision = decide_spec_change(SpecChanged(
            spec=parsed, status=read_status(status), changed=frozenset(changed_fields(old, parsed)),
            job_name=owner.job_name(max(attempt, 1)), job_kind=kind, scalable=backend.scalable(parsed),
            first_job_exists=first_job_exists, generation=generation))
        job_name = decision.job_name
        if decision.reset_rendezvous:
            rendezvous.reset_attempts(settings, operator_state(memo).http, owner, parsed, decision.reset_rendezvous,
                             lambda r, m: kopf.info(body, reason=r, message=m))
        if decision.suspend is not None and job_name is not None:
            k.patch_job(namespace, job_name, backend.suspend_patch(decision.suspend), kind)
        if decision.scale_to is not None and job_name is not None:
            k.patch_job(namespace, job_name, backend.scale_patch(decision.scale_to), kind)
        if decision.status:
            k.patch_finetune_status(namespace, name, decision.status)
        if decision.delete_job is not None:
            k.delete_job(namespace, decision.delete_job, kind)
        for event in decision.events:
            kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    if decision.wake:
        wake(memo, namespace, name)


# ------------------------------------------------------------------------------ spec changes
IN_PLACE_FIELDS = {("runPolicy", "suspend"), ("cluster", "workers")}


def in_place(path: tuple[str, ...]) -> bool:
    """Changes the running attempt does not see: applied in place (suspend, elastic scale) or
    only to the children (DCGM monitoring: PodMonitor, alerts, dashboard)."""
    return path in IN_PLACE_FIELDS or path[:2] == ("monitoring", "dcgm")


def _leaves(value: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    if isinstance(value, dict):
        out: dict[tuple[str, ...], Any] = {}
        for key, child in value.items():
            out.update(_leaves(child, (*prefix, str(key))))
        return out
    return {prefix: value}


def changed_fields(old: Any, new: LlamaFineTuneSpec) -> set[tuple[str, ...]]:
    """Leaf fields whose effective (defaulted) value changed: `runPolicy: {suspend: true}` added to
    a spec without runPolicy is a change of ("runPolicy", "suspend"), not of the whole section."""
    try:
        before = _leaves(LlamaFineTuneSpec.model_validate(dict(old or {})).to_k8s())
    except ValueError:
        before = {}
    after = _leaves(new.to_k8s())
    return {path for path in before.keys() | after.keys() if before.get(path) != after.get(path)}


@dataclass(frozen=True)
class SpecChanged:
    """A valid change of .spec, with what the update handler read to decide on it."""

    spec: LlamaFineTuneSpec
    """The new spec (validated, transition rules included)."""
    status: LlamaFineTuneStatus
    """The LlamaFineTune's status, read once (status.read_status) by Step."""
    changed: frozenset[tuple[str, ...]]
    """changed_fields(old, new)."""
    job_name: str
    """The current attempt's job name (attempt 1's while no attempt is recorded)."""
    job_kind: str = "PyTorchJob"
    scalable: bool = False
    """The backend can change the running job's workers in place (JobBackend.scalable)."""
    first_job_exists: bool = False
    """Only read while no attempt is recorded: attempt 1's job exists and is this incarnation's
    (the step that created it never wrote the status)."""
    generation: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.status, LlamaFineTuneStatus):
            object.__setattr__(self, "status", read_status(self.status))


@dataclass
class SpecDecision:
    """What a spec change does; the update handler carries it out in this order."""

    change: StatusChange = field(default_factory=StatusChange)
    """The status fields it sets (observedGeneration at least, unless `wake` hands over to the lifecycle)."""
    reset_rendezvous: list[int] = field(default_factory=list)
    """Attempts whose rendezvous state to remove first (resumed pods must not meet a closed one)."""
    suspend: bool | None = None
    """Patch the current job's suspension to this."""
    scale_to: int | None = None
    """Patch the current job's workers to this."""
    delete_job: str | None = None
    job_name: str | None = None
    """The current attempt's job (the one patched or deleted)."""
    events: list[Event] = field(default_factory=list)
    wake: bool = False
    """The lifecycle looks now (it starts a never-started run, applies changed children, creates
    the restarted attempt)."""

    @property
    def status(self) -> dict[str, Any]:
        """Merge patch for .status (StatusChange.merge_patch)."""
        return self.change.merge_patch()


def decide_spec_change(change: SpecChanged) -> SpecDecision:
    """The rules, in order: a run never started (its spec was invalid) is left to the lifecycle,
    which starts it; a finished run stays finished; a change nothing in the run sees (e.g. a default
    written out) does nothing; suspend, elastic workers (where the backend scales in place) and DCGM
    monitoring apply in place; anything else restarts the run from its newest checkpoint as the
    next attempt, the current job deleted."""
    st, d = change.status, SpecDecision()
    attempt = st.attempt
    if attempt == 0:
        if not change.first_job_exists:
            d.wake = True
            return d
        attempt = 1  # started, but the step that created the job never wrote the status
    d.change.observed_generation = change.generation
    if st.phase in TERMINAL_PHASES:
        d.events.append(Event("Normal", "Finished", f"the run has {st.phase.value.lower()}: spec changes do not start it "
                              "again; create a new LlamaFineTune (or delete and re-apply this one)"))
        return d
    job_name = d.job_name = change.job_name
    changed, spec, kind = change.changed, change.spec, change.job_kind
    if not changed:
        return d
    if all(in_place(path) for path in changed) and (("cluster", "workers") not in changed or change.scalable):
        if ("runPolicy", "suspend") in changed:
            suspend = spec.run_policy.suspend
            if not suspend:
                d.reset_rendezvous = [attempt]
            d.suspend = suspend
            d.events.append(Event("Normal", "Suspended" if suspend else "Resumed",
                                  f"{kind} {job_name} {'suspended' if suspend else 'resumed'}"))
        if ("cluster", "workers") in changed:
            d.scale_to = spec.cluster.workers
            d.change.workers = WorkerCounts(current=spec.cluster.workers, desired=spec.cluster.workers,
                                            reason=elastic.AS_SPECIFIED, message="spec.cluster.workers changed: scaled in place")
            d.events.append(Event("Normal", "Scaled", f"elastic workers -> {spec.cluster.workers}"))
        if any(path[:2] == ("monitoring", "dcgm") for path in changed):
            d.events.append(Event("Normal", "MonitoringChanged", "monitoring applied in place; training continues"))
        d.wake = True
        return d
    fields = ", ".join(".".join(c) for c in sorted(changed))
    message = f"{fields} changed: restarting from the latest checkpoint as attempt {attempt + 1}"
    c = d.change
    c.attempt, c.phase, c.retry_after, c.last_progress_time, c.message = attempt + 1, Phase.RESTARTING, None, None, message
    d.delete_job, d.wake = job_name, True
    d.events.append(Event("Normal", "SpecChanged", message))
    return d
