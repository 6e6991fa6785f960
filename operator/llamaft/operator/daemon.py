"""The lifecycle daemon's loop: one step now (or the one the creation event started), then one per
wake-up or requeue, in the operator's thread pool; and the first step a creation event starts."""

from __future__ import annotations

import asyncio
import contextvars
import copy
from collections.abc import Mapping
from typing import Any

import kopf

from llamaft.api.status import Phase
from llamaft.operator.state import object_state, operator_state, record_phase, wake
from llamaft.operator.step import Step
from llamaft.render.backends import BACKENDS
from llamaft.render.naming import LABEL_FINETUNE


def _waker(memo: kopf.Memo, namespace: str, name: str) -> asyncio.Event:
    """The object's wake-up event on this loop (registered once: by the first of the creation
    event's step and the daemon)."""
    loop = asyncio.get_running_loop()
    wakers = operator_state(memo).wakers
    entry = wakers.get((namespace, name))
    if entry is None or entry[0] is not loop:
        entry = wakers[(namespace, name)] = (loop, asyncio.Event())
    return entry[1]  # type: ignore[no-any-return]

def _first_step(step: Step, logger: Any) -> tuple[bool, float | None]:
    """(whether the step ran, when to look again); a failure is logged and the daemon looks itself."""
    try:
        return True, step.run()
    except Exception as exc:
        logger.warning(f"first lifecycle step failed (the daemon looks again): {exc}")
        return False, None


async def lifecycle_loop(name: str, namespace: str, memo: kopf.Memo, stopped: kopf.DaemonStopped, logger: Any,
                         children_index: Any) -> None:
    """The object's lifecycle loop: one step now (or the one the creation event started, see
    `start_first_step`), then one per wake-up or requeue, until kopf stops the daemon."""
    loop = asyncio.get_running_loop()
    woken = _waker(memo, namespace, name)
    step = Step(memo, namespace, name, logger)
    step.children_index = children_index
    executor = operator_state(memo).executor  # None: the loop's default executor
    own = object_state(memo)
    first, own.first_step = own.first_step, None
    delay: float | None = None
    looked = False
    if first is not None:
        # Wake-ups since the creation event are on `woken` (registered before that step ran).
        looked, delay = await first
    try:
        while not stopped:
            if not looked:
                woken.clear()
                try:
                    # As asyncio.to_thread, in the operator's own pool: the context goes along (kopf.event needs it).
                    delay = await loop.run_in_executor(executor, contextvars.copy_context().run, step.run)
                except kopf.TemporaryError as exc:
                    delay = exc.delay or 5.0
                except Exception as exc:  # an API hiccup must not end the object's lifecycle
                    logger.exception(f"lifecycle step failed: {exc}")
                    delay = 5.0
            looked = False
            waits = [asyncio.ensure_future(woken.wait()), asyncio.ensure_future(stopped.wait())]
            try:
                await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
    finally:
        wakers = operator_state(memo).wakers
        if wakers.get((namespace, name), (None, None))[1] is woken:
            del wakers[(namespace, name)]


def start_first_step(memo: kopf.Memo, namespace: str, name: str, logger: Any, body: Mapping[str, Any],
                     children_index: Any) -> None:
    """A LlamaFineTune just created gets its first lifecycle step at once, from its creation event:
    kopf starts the daemon only after a round trip to add its finalizer (a PATCH and the watch
    event it causes), which under a burst of creates queues behind every other object's events.
    The step is the daemon's own (same lock, same memo), idempotent, and the daemon waits for it
    before its first look. Nothing is lost without the finalizer yet: every child is owned by the CR."""
    _waker(memo, namespace, name).clear()  # wake-ups from here on reach the daemon
    step = Step(memo, namespace, name, logger)
    step.children_index = children_index
    step.created = copy.deepcopy(dict(body))
    object_state(memo).first_step = asyncio.get_running_loop().run_in_executor(
        operator_state(memo).executor, contextvars.copy_context().run, _first_step, step, logger)


def wake_for_child(memo: kopf.Memo, type: str | None, body: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    """A job or trainer pod changed: its owner's lifecycle looks now, not at the next sync. Not
    for the creation event of a job the lifecycle itself just created (what it wrote is what it
    knows; the training operator's first status update wakes it). A pod version with evidence
    its deletion would erase is kept for the steps (evidence.py)."""
    owner, namespace = (meta.get("labels") or {}).get(LABEL_FINETUNE), meta.get("namespace")
    if not owner or not namespace:
        return
    if body.get("kind") in BACKENDS:
        ours = operator_state(memo).created_jobs.pop((str(namespace), str(meta.get("name"))), None)
        if type == "ADDED" and ours is not None and ours == str(meta.get("resourceVersion")):
            return
    elif body.get("kind") == "Pod":
        operator_state(memo).evidence.keep((str(namespace), str(owner)), body)
    wake(memo, str(namespace), str(owner))


def _phase(status: Mapping[str, Any]) -> str:
    return str(status.get("phase") or Phase.PENDING.value)


def finetune_event_matters(type: str | None, memo: kopf.Memo, namespace: str | None, name: str | None,
                           body: Mapping[str, Any], **_: Any) -> bool:
    """kopf's `when=` filter of a LlamaFineTune's event handler (`finetune_event`): a modification
    that leaves the phase as recorded changes nothing there (kopf's own write on a new object, a
    run's progress: most of the events), so kopf need not invoke (and log) the handler for it."""
    if type != "MODIFIED" or not namespace or not name:
        return True
    return operator_state(memo).phases.get((namespace, name)) != _phase(body.get("status") or {})


def finetune_event(memo: kopf.Memo, type: str | None, namespace: str, name: str, logger: Any, body: Mapping[str, Any],
                   children_index: Any) -> None:
    """A LlamaFineTune's watch event: the per-phase gauge moves, a creation starts the first step
    (`start_first_step`), a deletion before the daemon started drops its wake-up."""
    # The plain dict under kopf's view: each lookup through the view re-resolves its path (a
    # measurable share of the loop's time under a burst, for one field).
    raw_status = body.get("status") or {}
    record_phase(memo, namespace, name, None if type == "DELETED" else _phase(raw_status))
    own = object_state(memo)
    if type == "DELETED":
        operator_state(memo).evidence.forget((namespace, name))
        if own.first_step is not None:  # gone before its daemon started
            operator_state(memo).wakers.pop((namespace, name), None)
    if type == "ADDED" and not raw_status.get("attempt") and own.first_step is None:
        start_first_step(memo, namespace, name, logger, body, children_index)
