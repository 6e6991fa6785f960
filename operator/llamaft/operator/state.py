"""What the handlers share through kopf's memo, and the small helpers every module uses.

The operator's memo is filled at start-up (`startup.configure`): settings, the API and HTTP
clients, the registries (lifecycle wake-ups, phases, applied children, drift, jobs just created).
kopf copies it shallowly into each object's memo, so the registries are shared, while the keys an
object adds (its lock, its validation, what was applied for it) go with the object."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import kopf

from llamaft.api.status import TERMINAL_PHASES, Phase
from llamaft.operator.kube import Kube
from llamaft.operator.metrics import FINETUNES, RECONCILE_SECONDS, RECONCILES
from llamaft.operator.settings import OperatorSettings

TERMINAL = {p.value for p in TERMINAL_PHASES}
Obj = dict[str, Any]

def now() -> datetime:
    return datetime.now(UTC)


@contextmanager
def measured(handler: str) -> Iterator[None]:
    started = time.perf_counter()
    result = "ok"
    try:
        yield
    except kopf.TemporaryError:
        result = "retry"
        raise
    except Exception:
        result = "error"
        raise
    finally:
        RECONCILES.labels(handler, result).inc()
        RECONCILE_SECONDS.labels(handler).observe(time.perf_counter() - started)


# ------------------------------------------------------------------------------- memo access
def settings_of(memo: kopf.Memo) -> OperatorSettings:
    return memo["settings"]  # type: ignore[no-any-return]


def kube_of(memo: kopf.Memo) -> Kube:
    return memo["kube"]  # type: ignore[no-any-return]


def object_lock(memo: kopf.Memo) -> threading.Lock:
    """The daemon and the update handler of one object never interleave (dict.setdefault is atomic)."""
    return memo.setdefault("lock", threading.Lock())  # type: ignore[no-any-return]


def wake(memo: kopf.Memo, namespace: str, name: str) -> None:
    """Make the object's lifecycle daemon look now (safe from any thread)."""
    entry = memo["wakers"].get((namespace, name))
    if entry is not None:
        loop, event = entry
        loop.call_soon_threadsafe(event.set)


PHASES = {p.value for p in Phase}


def record_phase(memo: kopf.Memo, namespace: str, name: str, phase: str | None) -> None:
    """The per-phase gauge, from the phases the objects have (pruned on delete): moved by one
    object's change, not recounted over every object on every event."""
    phases: dict[tuple[str, str], str] = memo["phases"]
    before = phases.pop((namespace, name), None) if phase is None else phases.get((namespace, name))
    if phase is not None:
        phases[(namespace, name)] = phase
    if before == phase:
        return
    if before in PHASES:
        FINETUNES.labels(before).dec()
    if phase in PHASES:
        FINETUNES.labels(phase).inc()

def condition_is(status: Mapping[str, Any], type_: str, value: str, generation: int | None) -> bool:
    return any(c.get("type") == type_ and c.get("status") == value and c.get("observedGeneration") == generation
               for c in status.get("conditions", []) or [])
