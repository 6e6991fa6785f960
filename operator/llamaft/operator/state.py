"""What the handlers share through kopf's memo, typed, and the small helpers every module uses.

The operator's memo holds one `OperatorState` (settings, the API and HTTP clients, the registries
of wake-ups, phases, applied children, drift, validated specs and jobs just created), made at start-up
(`startup.configure`). kopf copies the memo shallowly into each object's memo, so every object
sees that one state, and adds its own `ObjectState` (its lock, its validation, what was applied
for it) that goes with the object."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from llamaft.api.status import TERMINAL_PHASES, LlamaFineTuneStatus, Phase
from llamaft.operator.evidence import PodEvidence
from llamaft.operator.http import HttpClient
from llamaft.operator.kube import Kube
from llamaft.operator.operator_metrics import FINETUNES, RECONCILE_SECONDS, RECONCILES
from llamaft.operator.settings import OperatorSettings
from llamaft.render.admission import CheckCache

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


# ------------------------------------------------------------------------------- the memo
Key = tuple[str, str]
"""(namespace, name) of a LlamaFineTune."""


SPEC_CACHE_SIZE = 256


class SpecCache:
    """What is pure per spec, by spec content, the latest `size` distinct specs (OperatorState.specs:
    validation, OperatorState.capacities: the capacity planner's verdict): LlamaFineTunes made from
    one template cost one computation, not one each, and concurrent steps with the same spec wait
    for the one running (a future per key, where functools.lru_cache would run them all). Keyed by
    a hash of the canonical JSON."""

    def __init__(self, size: int = SPEC_CACHE_SIZE) -> None:
        self.size = size
        self._futures: collections.OrderedDict[str, concurrent.futures.Future[Any]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._futures)

    def get(self, spec: Mapping[str, Any], validate: Callable[[dict[str, Any]], Any],
            invalid: type[Exception] | tuple[type[Exception], ...] = ()) -> Any:
        """validate(spec), or the `invalid` exception it raised (a verdict too), computed once per content."""
        key = hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":"), default=repr).encode()).hexdigest()
        with self._lock:
            future = self._futures.get(key)
            mine = future is None
            if future is None:
                future = self._futures[key] = concurrent.futures.Future()
                while len(self._futures) > self.size:
                    self._futures.popitem(last=False)
            else:
                self._futures.move_to_end(key)
        if mine:
            try:
                future.set_result(validate(dict(spec)))
            except invalid as exc:
                future.set_result(exc)
            except BaseException as exc:  # not a verdict (a bug, an interrupt): the next call tries again
                with self._lock:
                    if self._futures.get(key) is future:
                        del self._futures[key]
                future.set_exception(exc)
        return future.result()


@dataclass
class OperatorState:
    """The operator's memo, one per process (memo["operator"], set at start-up): kopf copies the
    memo shallowly into every object's memo, so each object sees this same object."""

    settings: OperatorSettings
    http: HttpClient | None = None
    """etcd, Prometheus and /progress: one pool, timeouts and retries."""
    kube: Kube | None = None
    """The API client, made at login once the credentials are loaded."""
    executor: concurrent.futures.ThreadPoolExecutor | None = None
    """The lifecycle steps' threads (None: the loop's default executor)."""
    wakers: dict[Key, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=dict)
    """Each object's lifecycle wake-up (`wake`), registered by its daemon or its first step."""
    phases: dict[Key, str] = field(default_factory=dict)
    """Each object's phase, for the per-phase gauge (`record_phase`)."""
    applied: dict[Key, dict[tuple[str, str], str]] = field(default_factory=dict)
    """Each object's children as llamaft last applied them: (kind, name) -> resourceVersion."""
    drifted: set[Key] = field(default_factory=set)
    """Objects whose children someone else edited or deleted (children.note_drift)."""
    specs: SpecCache = field(default_factory=SpecCache)
    """Validated specs by content (specs.cached_spec)."""
    capacities: SpecCache = field(default_factory=SpecCache)
    """The capacity planner's verdict by spec content (Step._capacity): it reads the spec alone."""
    checks: CheckCache = field(default_factory=CheckCache)
    """The children's admission check of each template found clean (admission.checked_children):
    LlamaFineTunes made from one template are checked once."""
    evidence: PodEvidence = field(default_factory=PodEvidence)
    """Trainer pods whose failure evidence goes with them when they are deleted, as the watch last
    showed them (evidence.py): a step that lists after the deletion still sees why."""
    created_jobs: dict[Key, str] = field(default_factory=dict)
    """(namespace, job name) -> resourceVersion of a job as llamaft just created it (its ADDED
    event is that write's echo and wakes nobody)."""


@dataclass
class ObjectState:
    """One LlamaFineTune's memo (memo["object"]): what a step remembers of the object between
    looks, lost on restart without harm."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    """The daemon and the update handler of one object never interleave."""
    validated: tuple[int | None, Any] | None = None
    """(generation, the parsed spec or SpecInvalid) of the current generation (specs.validated)."""
    rendered: tuple[tuple[str, Any], list[dict[str, Any]]] | None = None
    """((uid, generation), children) the validation rendered and checked, handed to the first apply."""
    capacity: tuple[int | None, Any] | None = None
    """(generation, the capacity planner's Admission)."""
    sized_capacity: dict[tuple[int | None, int], str | None] = field(default_factory=dict)
    """(generation, workers) -> why that many workers do not fit (None: they fit), for an elastic
    run's shrink (Step._fits)."""
    progress_cursor: int = 0
    """Which running pod to ask for /progress next while the leader is not known."""
    children_source: tuple[str, Any] | None = None
    """(uid, generation) the children were last applied for."""
    children_digest: str | None = None
    """The digest of the children last applied."""
    owner_checked: str | None = None
    """The incarnation (uid) whose children's owners were checked in this process."""
    first_step: asyncio.Future[tuple[bool, float | None]] | None = None
    """The step the creation event started, for the daemon to wait on."""


def new_memo(settings: OperatorSettings, **shared: Any) -> kopf.Memo:
    """An operator memo holding a fresh OperatorState (start-up, and tests that run handlers)."""
    return kopf.Memo(operator=OperatorState(settings, **shared))


def operator_state(memo: Mapping[str, Any]) -> OperatorState:
    return memo["operator"]  # type: ignore[no-any-return]


def object_state(memo: kopf.Memo) -> ObjectState:
    """This object's own state (made on first use; dict.setdefault is atomic)."""
    return memo.setdefault("object", ObjectState())  # type: ignore[no-any-return]


def settings_of(memo: Mapping[str, Any]) -> OperatorSettings:
    return operator_state(memo).settings


def kube_of(memo: Mapping[str, Any]) -> Kube:
    kube = operator_state(memo).kube
    assert kube is not None, "the API client is made at login"
    return kube


def object_lock(memo: kopf.Memo) -> threading.Lock:
    """The daemon and the update handler of one object never interleave."""
    return object_state(memo).lock


def wake(memo: Mapping[str, Any], namespace: str, name: str) -> None:
    """Make the object's lifecycle daemon look now (safe from any thread)."""
    entry = operator_state(memo).wakers.get((namespace, name))
    if entry is not None:
        loop, event = entry
        loop.call_soon_threadsafe(event.set)


PHASES = {p.value for p in Phase}


def record_phase(memo: Mapping[str, Any], namespace: str, name: str, phase: str | None) -> None:
    """The per-phase gauge, from the phases the objects have (pruned on delete): moved by one
    object's change, not recounted over every object on every event."""
    phases = operator_state(memo).phases
    before = phases.pop((namespace, name), None) if phase is None else phases.get((namespace, name))
    if phase is not None:
        phases[(namespace, name)] = phase
    if before == phase:
        return
    if before in PHASES:
        FINETUNES.labels(before).dec()
    if phase in PHASES:
        FINETUNES.labels(phase).inc()


def condition_is(status: LlamaFineTuneStatus, type_: str, value: str, generation: int | None) -> bool:
    """The status has this condition at this value, computed from this generation."""
    return any(c.type == type_ and c.status == value and c.observed_generation == generation for c in status.conditions)
