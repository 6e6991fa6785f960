"""A change of .spec: suspend/resume, elastic worker changes and DCGM monitoring are applied in
place; any other change restarts the run from its latest checkpoint as a new attempt; an invalid
change is refused and the running attempt continues."""

from __future__ import annotations

from typing import Any

import kopf

from llamaft.api.status import read_status
from llamaft.api.validation import SpecInvalid
from llamaft.operator import lifecycle, observe, rendezvous, timestamps
from llamaft.operator.kube import owned_by
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
    `lifecycle.decide_spec_change`, act in its order.

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
        decision = lifecycle.decide_spec_change(lifecycle.SpecChanged(
            spec=parsed, status=read_status(status), changed=frozenset(lifecycle.changed_fields(old, parsed)),
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
