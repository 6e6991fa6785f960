"""What keeps the operator cheap per LlamaFineTune (issue 9, scale): one CEL evaluation per
distinct spec, not per object; children checked from kopf's index instead of listed; a bounded
number of /progress requests per sync whatever the number of pods; the per-phase gauge moved, not
recounted; the children's watches filtered by the API server. No timing asserts: the speed is
bench/operator_latency.py's to show. Pure where it can be (a Step with a recording client)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import kopf
import pytest
from llamaft.api.validation import SpecInvalid
from llamaft.operator import children, handlers, specs, startup, state
from llamaft.operator import daemon as daemon_module
from llamaft.operator import step as step_module
from llamaft.operator.kube import ForeignObject
from llamaft.operator.operator_metrics import FINETUNES
from llamaft.operator.settings import OperatorSettings
from llamaft.operator.step import Step
from llamaft.render import objects
from llamaft.render.naming import Owner

from tests.operator.conftest import tiny_spec
from tests.operator.emulator import STATS_PATH, EmulatorThread

UID = "1234abcd-0000-0000-0000-000000000000"


@pytest.fixture
def memo() -> Any:
    """An operator's memo: its OperatorState holds the validated-spec cache."""
    return state.new_memo(OperatorSettings())


def counting_validate(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []
    real = specs.validate_spec

    def validate_spec(spec: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(spec)
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(specs, "validate_spec", validate_spec)
    return calls


# ------------------------------------------------------------------------- validation cache
def test_one_cel_evaluation_per_distinct_spec_shared_by_objects(monkeypatch: pytest.MonkeyPatch, memo: Any) -> None:
    calls = counting_validate(monkeypatch)
    spec = tiny_spec()
    reordered = dict(reversed(list(tiny_spec().items())))  # the same content, keys in another order
    first = specs.cached_spec(memo, spec)
    assert specs.cached_spec(memo, reordered) is first and len(calls) == 1
    other = specs.cached_spec(memo, tiny_spec(cluster={"workers": 4}))
    assert other is not first and len(calls) == 2


def test_one_capacity_verdict_per_distinct_spec_shared_by_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """The capacity planner reads the spec alone: objects made from one template share a verdict."""
    from llamaft.api.status import read_status

    memo = state.new_memo(OperatorSettings(), kube=RecordingKube())

    planned: list[Any] = []
    real = step_module.admission
    monkeypatch.setattr(step_module, "admission", lambda spec: planned.append(spec) or real(spec))
    verdicts = []
    for name, spec in (("a", tiny_spec()), ("b", tiny_spec()), ("c", tiny_spec(cluster={"workers": 4}))):
        obj = {"metadata": {"name": name, "namespace": "default", "generation": 1}, "spec": spec}
        step = Step(kopf.Memo(memo), "default", name, logger=None)  # each object's memo: its own ObjectState
        step.event = lambda *_: None  # type: ignore[method-assign]
        verdicts.append(step._capacity(obj, specs.cached_spec(memo, spec), read_status({}), 1))
    assert len(planned) == 2 and verdicts[0] is verdicts[1] and verdicts[2] is not verdicts[0]
    assert verdicts[0] == real(specs.cached_spec(memo, tiny_spec()))


def test_an_invalid_spec_is_cached_as_its_errors(monkeypatch: pytest.MonkeyPatch, memo: Any) -> None:
    calls = counting_validate(monkeypatch)
    broken = tiny_spec(fsdp={"shardingStrategy": "HYBRID_SHARD", "hybridShard": {"shardGroupSize": 3, "replicaGroupSize": 2}})
    for _ in range(3):
        result = specs.cached_spec(memo, broken)
        assert isinstance(result, SpecInvalid) and "shardGroupSize" in str(result)
    assert len(calls) == 1


def test_concurrent_steps_with_one_spec_wait_for_one_evaluation(monkeypatch: pytest.MonkeyPatch, memo: Any) -> None:
    calls = counting_validate(monkeypatch)
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(specs.cached_spec(memo, tiny_spec()))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and all(r is results[0] for r in results)


def test_the_cache_keeps_the_latest_distinct_specs(monkeypatch: pytest.MonkeyPatch, memo: Any) -> None:
    state.operator_state(memo).specs = state.SpecCache(size=2)
    calls = counting_validate(monkeypatch)
    for workers in (1, 2, 3, 1):
        specs.cached_spec(memo, tiny_spec(cluster={"workers": workers}))
    assert len(calls) == 4, "workers=1 was evicted by 2 and 3"
    assert len(state.operator_state(memo).specs) == 2


def test_validated_caches_per_generation_and_not_with_the_old_spec(monkeypatch: pytest.MonkeyPatch, memo: Any) -> None:
    calls = counting_validate(monkeypatch)
    obj = {"metadata": {"name": "x", "namespace": "default", "uid": UID, "generation": 1}, "spec": tiny_spec()}
    assert specs.validated(memo, obj) is specs.validated(memo, obj)
    other = kopf.Memo(memo)  # kopf's shallow copy for another object: the same OperatorState
    other.pop("object")
    specs.validated(other, {**obj, "metadata": {**obj["metadata"], "name": "y", "generation": 3}})
    assert len(calls) == 1
    specs.validated(memo, obj, old=tiny_spec())  # an update: transition rules need the old spec
    assert len(calls) == 2


# -------------------------------------------------------------------- children, first apply
class RecordingKube:
    """What Step calls on the client, recorded; children applied as the API server would answer."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **_: Any) -> Any:
            self.calls.append((name, args[1:] if len(args) > 1 else args))
            if name == "apply":
                obj = args[1]
                return {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}
            if name in ("list_children", "list_jobs"):
                return []
            return True
        return call

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


def step_with(index: dict[tuple[str, str], list[Any]] | None) -> tuple[Step, RecordingKube]:
    kube = RecordingKube()
    memo: Any = state.new_memo(OperatorSettings(), kube=kube)
    step = Step(memo, "default", "x", logger=None)
    step.event = lambda *_: None  # type: ignore[method-assign]
    step.children_index = index
    return step, kube


def reconcile(step: Step) -> tuple[float | None, dict[str, Any]]:
    obj = {"apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune",
           "metadata": {"name": "x", "namespace": "default", "uid": UID, "generation": 1}, "spec": tiny_spec(), "status": {}}
    spec = specs.cached_spec(step.memo, obj["spec"])
    assert not isinstance(spec, SpecInvalid)
    patch: dict[str, Any] = {}
    return step._reconcile_children(obj, Owner("x", "default", UID), spec, patch, force=True), patch


def indexed(kind: str, name: str, uid: str, deleting: bool = False) -> dict[str, Any]:
    return {"kind": kind, "metadata": {"name": name, "ownerReferences": [{"uid": uid}],
                                       "deletionTimestamp": "2026-11-30T12:00:00Z" if deleting else None}}


class CreatingKube(RecordingKube):
    """RecordingKube whose job creations succeed and whose managed etcd is ready as given."""

    def __init__(self, etcd_ready: bool = True) -> None:
        super().__init__()
        self.etcd_ready = etcd_ready

    def create_job(self, namespace: str, job: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("create_job", (job,)))
        return {**job, "metadata": {**job["metadata"], "resourceVersion": "2"}}

    def deployment_ready(self, namespace: str, name: str) -> bool:
        return self.etcd_ready


def start_attempt(kube: RecordingKube, **spec: Any) -> tuple[float | None, list[tuple[str, str]]]:
    """A first attempt's start (Step._start_attempt) with the events it posts, as (reason, message)."""
    from llamaft.api.status import read_status

    memo: Any = state.new_memo(OperatorSettings(), kube=kube)
    step = Step(memo, "default", "x", logger=None)
    events: list[tuple[str, str]] = []
    step.event = lambda obj, type_, reason, message: events.append((reason, message))  # type: ignore[method-assign]
    step.children_index = {}
    obj = {"apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune",
           "metadata": {"name": "x", "namespace": "default", "uid": UID, "generation": 1}, "spec": tiny_spec(**spec),
           "status": {}}
    parsed = specs.cached_spec(memo, obj["spec"])
    assert not isinstance(parsed, SpecInvalid)
    return step._start_attempt(obj, Owner("x", "default", UID), parsed, 1, read_status({}), {}, 1), events


def test_a_start_says_what_it_applied_in_its_job_created_event() -> None:
    """One event per start (each is an API write and a watch event for whoever reads events): the
    children applied are named in JobCreated, not in an event of their own."""
    kube = CreatingKube()
    requeue, events = start_attempt(kube)
    assert requeue is None and [reason for reason, _ in events] == ["JobCreated"], events
    applied = [args[0] for name, args in kube.calls if name == "apply"]
    assert applied and all(f"{o['kind']} {o['metadata']['name']}" in events[0][1] for o in applied), events[0][1]


def test_children_applied_for_a_job_not_created_yet_get_their_own_event() -> None:
    """A start that waits (here for its managed etcd) still says what it applied."""
    kube = CreatingKube(etcd_ready=False)
    requeue, events = start_attempt(kube, rendezvous={"backend": "etcd-v2"})
    assert requeue == 2.0 and "create_job" not in kube.names()
    assert [reason for reason, _ in events] == ["ChildrenApplied"] and "Deployment x-etcd" in events[0][1], events


def test_a_new_incarnation_applies_from_the_index_without_a_read() -> None:
    step, kube = step_with({})
    assert reconcile(step)[0] is None
    assert set(kube.names()) == {"apply"}, kube.calls


def test_without_the_index_the_children_are_listed() -> None:
    step, kube = step_with(None)
    reconcile(step)
    assert "list_children" in kube.names() and "apply" in kube.names()


def test_the_previous_incarnations_objects_in_the_index_are_waited_for() -> None:
    step, kube = step_with({("default", "x"): [indexed("ConfigMap", "x-config", "the-predecessor")]})
    requeue, patch = reconcile(step)
    assert requeue == 1.0 and "previous incarnation" in patch["message"]
    assert kube.names() == [], "nothing applied over the predecessor's objects"
    step, _ = step_with({("default", "x"): [indexed("PodMonitor", "x-trainer", UID, deleting=True)]})
    assert reconcile(step)[0] == 1.0, "nor over one of its own being deleted"
    with pytest.raises(ForeignObject):
        step._check_owners([{"kind": "ConfigMap", "metadata": {"name": "x-config"}}],
                           {"ConfigMap": [indexed("ConfigMap", "x-config", "other")]}, Owner("x", "default", UID))


def test_what_an_earlier_process_applied_and_the_spec_no_longer_wants_is_pruned() -> None:
    leftovers = [indexed("Deployment", "x-etcd", UID), indexed("Service", "x-etcd", UID),
                 indexed("Deployment", "x-other", "someone-else")]
    step, kube = step_with({("default", "x"): leftovers})
    reconcile(step)
    deleted = [args for name, args in kube.calls if name == "delete"]
    assert sorted(deleted) == [("Deployment", "x-etcd"), ("Service", "x-etcd")], kube.calls
    state.operator_state(step.memo).drifted.add(("default", "x"))  # a later apply prunes from what it applied, not the index
    kube.calls.clear()
    reconcile(step)
    assert "list_children" not in kube.names() and "delete" not in kube.names()


def test_a_step_of_an_unchanged_generation_does_not_render_the_children(monkeypatch: pytest.MonkeyPatch) -> None:
    step, kube = step_with({})
    reconcile(step)
    rendered: list[Any] = []
    real = objects.children
    monkeypatch.setattr(objects, "children", lambda *a, **k: rendered.append(a) or real(*a, **k))
    obj = {"apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune",
           "metadata": {"name": "x", "namespace": "default", "uid": UID, "generation": 1}, "spec": tiny_spec(), "status": {}}
    spec = specs.cached_spec(step.memo, obj["spec"])
    assert not isinstance(spec, SpecInvalid)
    kube.calls.clear()
    assert step._reconcile_children(obj, Owner("x", "default", UID), spec, {}) is None
    assert rendered == [] and kube.calls == []
    state.operator_state(step.memo).drifted.add(("default", "x"))  # a hand edit: rendered and applied again
    step._reconcile_children(obj, Owner("x", "default", UID), spec, {})
    assert len(rendered) == 1 and "apply" in kube.names()


def test_the_index_records_name_owners_and_deletion() -> None:
    import asyncio

    meta = {"name": "x-config", "namespace": "default", "labels": {"llamaft.io/finetune": "x"},
            "ownerReferences": [{"uid": UID, "kind": "LlamaFineTune"}], "deletionTimestamp": None}
    resource = kopf.Resource("", "v1", "configmaps", kind="ConfigMap")
    entry = asyncio.run(handlers.children_by_owner(resource=resource, meta=meta))
    assert entry == {("default", "x"): indexed("ConfigMap", "x-config", UID)}
    assert asyncio.run(handlers.children_by_owner(resource=resource, meta={"name": "unlabelled", "namespace": "default"})) == {}


def test_the_index_notes_a_change_llamaft_did_not_make_and_the_event_handler_only_deletions() -> None:
    """One handler per child event: the index (every version of a child) notes drift; the event
    handler is filtered to deletions, which the index never sees."""
    import asyncio

    memo = state.new_memo(OperatorSettings())
    shared = state.operator_state(memo)
    shared.applied[("default", "x")] = {("ConfigMap", "x-config"): "5"}
    resource = kopf.Resource("", "v1", "configmaps", kind="ConfigMap")

    def seen(version: str) -> set[tuple[str, str]]:
        shared.drifted.clear()
        meta = {"name": "x-config", "namespace": "default", "labels": {"llamaft.io/finetune": "x"}, "resourceVersion": version}
        body = kopf.Body({"kind": "ConfigMap", "metadata": meta})
        asyncio.run(handlers.children_by_owner(resource=resource, meta=kopf.Meta(body), body=body, memo=memo))
        return set(shared.drifted)

    assert seen("5") == set(), "the version llamaft's own apply returned"
    assert seen("6") == {("default", "x")}, "someone else's edit"
    registry = kopf.get_default_registry()
    deletion_handlers = [h for h in registry._watching.get_all_handlers() if h.fn is handlers.child_deleted]
    assert len(deletion_handlers) == 5 and all(h.when is children.deleted for h in deletion_handlers)
    assert children.deleted(type="DELETED") and not any(children.deleted(type=t) for t in ("ADDED", "MODIFIED", None))


# ------------------------------------------------------------------------- leader progress
class CountingHttp:
    def __init__(self, leader_ip: str) -> None:
        self.leader_ip, self.asked = leader_ip, 0

    def get_json(self, url: str, **_: Any) -> dict[str, Any]:
        self.asked += 1
        ip = url.split("//")[1].split(":")[0]
        return {"rank": 0 if ip == self.leader_ip else 3, "pod": f"pod-{ip}"}


def pods(n: int) -> list[dict[str, Any]]:
    return [{"metadata": {"name": f"pod-10.0.0.{i}", "labels": {"training.kubeflow.org/replica-index": str(i)}},
             "status": {"phase": "Running", "podIP": f"10.0.0.{i}"}} for i in range(n)]


def test_a_sync_asks_a_bounded_number_of_pods_and_finds_the_leader_in_turn() -> None:
    step, _ = step_with(None)
    http = CountingHttp("10.0.0.13")
    step.http = http  # type: ignore[assignment]
    spec = specs.cached_spec(step.memo, tiny_spec())
    assert not isinstance(spec, SpecInvalid)
    leader: str | None = None
    found, syncs = None, 0
    while found is None and syncs < 20:
        syncs += 1
        before = http.asked
        found = step._leader_progress(pods(32), spec, leader)
        assert http.asked - before <= step_module.PROGRESS_REQUESTS_PER_SYNC
    assert found is not None and found.pod == "pod-10.0.0.13" and syncs <= 32 // step_module.PROGRESS_REQUESTS_PER_SYNC
    leader = found.pod
    before = http.asked
    assert step._leader_progress(pods(32), spec, leader) == found
    assert http.asked - before == 1, "the steady state: one request to the known leader"


def test_replica_zero_is_asked_first() -> None:
    step, _ = step_with(None)
    http = CountingHttp("10.0.0.0")
    step.http = http  # type: ignore[assignment]
    spec = specs.cached_spec(step.memo, tiny_spec())
    assert not isinstance(spec, SpecInvalid)
    assert step._leader_progress(list(reversed(pods(8))), spec, None) is not None and http.asked == 1


# ------------------------------------------------------------------------------ gauge, watch
def test_the_phase_gauge_moves_with_one_object() -> None:
    memo: Any = state.new_memo(OperatorSettings())

    def value(phase: str) -> float:
        return float(FINETUNES.labels(phase)._value.get())

    before = {p: value(p) for p in ("Pending", "Running", "Creating")}
    state.record_phase(memo, "ns", "a", "Pending")
    state.record_phase(memo, "ns", "b", "Pending")
    state.record_phase(memo, "ns", "a", "Running")
    state.record_phase(memo, "ns", "a", "Running")
    state.record_phase(memo, "ns", "b", None)
    state.record_phase(memo, "ns", "c", "NotAPhase")
    assert value("Pending") - before["Pending"] == 0 and value("Running") - before["Running"] == 1
    assert value("Creating") == before["Creating"]


def test_a_finetunes_event_handler_runs_only_where_it_has_something_to_do() -> None:
    """kopf's `when=` filter: a modification that leaves the phase as recorded (kopf's own write,
    a run's progress) is not handed to the handler; a phase change, a creation, a listing and a
    deletion are."""
    memo: Any = state.new_memo(OperatorSettings())
    state.record_phase(memo, "ns", "a", "Running")

    def matters(type_: str | None, status: dict[str, Any]) -> bool:
        body = kopf.Body({"metadata": {"name": "a", "namespace": "ns"}, "status": status})
        return daemon_module.finetune_event_matters(type=type_, memo=memo, namespace="ns", name="a", body=body)

    assert not matters("MODIFIED", {"phase": "Running", "progress": {"step": 7}})
    assert matters("MODIFIED", {"phase": "Succeeded"})
    assert all(matters(t, {"phase": "Running"}) for t in ("ADDED", None, "DELETED"))
    state.record_phase(memo, "ns", "a", "Pending")
    assert not matters("MODIFIED", {}), "no phase yet is Pending, as the gauge counts it"
    registry = kopf.get_default_registry()
    [handler] = [h for h in registry._watching.get_all_handlers() if h.fn is handlers.finetune_seen]
    assert handler.when is daemon_module.finetune_event_matters


def test_the_childrens_watches_are_filtered_by_the_api_server() -> None:
    """Every child kind the handlers watch with a label filter gets the same filter as a
    server-side selector (kopf's `labels=` alone filters in the operator)."""
    registry = kopf.get_default_registry()
    watched = {(h.selector.group, h.selector.version, h.selector.any_name)
               for h in registry._watching.get_all_handlers() if h.labels}
    watched |= {(h.selector.group, h.selector.version, h.selector.any_name)
                for h in registry._indexing.get_all_handlers() if h.labels}
    assert watched == set(startup.CHILD_SELECTORS)
    settings = kopf.OperatorSettings()
    for child, selector in startup.CHILD_SELECTORS.items():
        settings.watching.label_selectors[child] = selector
    pods = kopf.Resource("", "v1", "pods", kind="Pod", preferred=True)
    assert list(settings.watching.label_selectors.collect(pods)) == ["llamaft.io/finetune,app.kubernetes.io/component=trainer"]
    assert list(settings.watching.label_selectors.collect(kopf.Resource("llamaft.io", "v1alpha1", "llamafinetunes",
                                                                            preferred=True))) == []


# ------------------------------------------------------------------------ emulator timings
def test_the_emulator_times_its_requests_when_asked() -> None:
    emulator = EmulatorThread(timed=True, record=True).start()
    try:
        urllib.request.urlopen(f"{emulator.url}/api/v1/namespaces/default/configmaps").read()
        with urllib.request.urlopen(f"{emulator.url}{STATS_PATH}?reset=1") as response:
            stats = json.loads(response.read())
        assert [method for method, _ in stats["timings"]] == ["GET"] and stats["timings"][0][1] >= 0
        assert [r["path"] for r in stats["requests"]] == ["/api/v1/namespaces/default/configmaps"]
        with urllib.request.urlopen(f"{emulator.url}{STATS_PATH}") as response:
            assert json.loads(response.read())["timings"] == [], "reset"
    finally:
        emulator.stop()
    untimed = EmulatorThread().start()
    try:
        assert untimed.emulator is not None and untimed.emulator.timings is None
    finally:
        untimed.stop()


def test_the_emulator_serves_from_a_process_of_its_own() -> None:
    from tests.operator.emulator_server import EmulatorProcess

    emulator = EmulatorProcess(timed=True, record=True, gc_delay=1.0).start()
    try:
        urllib.request.urlopen(f"{emulator.url}/apis/llamaft.io/v1alpha1/namespaces/default/llamafinetunes").read()
        stats = emulator.stats(reset=True)
        assert len(stats["timings"]) == 1 and stats["requests"][0]["method"] == "GET"
        assert emulator.stats()["requests"] == []
    finally:
        emulator.stop()
    assert emulator.proc is not None and emulator.proc.returncode == 0


# ------------------------------------------------------------------- the first step, at creation
class Stopped:
    """kopf.DaemonStopped's surface the daemon uses: truthiness and wait()."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    async def wait(self) -> None:
        await self.event.wait()


def first_step_flow(monkeypatch: pytest.MonkeyPatch, *, wake_before_daemon: bool) -> list[str]:
    """finetune_seen(ADDED) starts a step; then the daemon starts (as kopf does after adding its
    finalizer) and runs until stopped. Returns who ran steps."""
    ran: list[str] = []
    monkeypatch.setattr(Step, "run", lambda self: ran.append(threading.current_thread().name) or None)

    async def flow() -> None:
        memo = state.new_memo(OperatorSettings.from_env(), kube=RecordingKube())
        await handlers.finetune_seen(type="ADDED", name="a", namespace="ns", status=kopf.Status({"status": {}}), memo=memo, logger=None,
                                     body=kopf.Body({"metadata": {"name": "a", "namespace": "ns"}}))
        first = state.object_state(memo).first_step
        assert first is not None and ("ns", "a") in state.operator_state(memo).wakers, "the step and the wake-up are registered at once"
        await asyncio.wait([first])
        if wake_before_daemon:
            state.wake(memo, "ns", "a")  # e.g. the job's ADDED event, before the daemon listens
        stopped = Stopped()
        daemon = asyncio.ensure_future(handlers.run_lifecycle(name="a", namespace="ns", memo=memo, stopped=stopped, logger=None))
        await asyncio.sleep(0.3)
        stopped.event.set()
        await asyncio.wait_for(daemon, 5)
        assert ("ns", "a") not in state.operator_state(memo).wakers

    asyncio.run(flow())
    return ran


def test_a_created_object_gets_its_first_step_from_the_event_and_the_daemon_does_not_repeat_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(first_step_flow(monkeypatch, wake_before_daemon=False)) == 1


def test_a_wake_up_before_the_daemon_listens_is_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(first_step_flow(monkeypatch, wake_before_daemon=True)) == 2


def test_an_object_listed_at_start_or_already_started_waits_for_its_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Step, "run", lambda self: pytest.fail("no step outside the daemon"))

    async def flow() -> None:
        for type_, status in ((None, {}), ("ADDED", {"attempt": 1}), ("MODIFIED", {})):
            memo = state.new_memo(OperatorSettings.from_env())
            await handlers.finetune_seen(type=type_, name="a", namespace="ns", status=kopf.Status({"status": status}), memo=memo,
                                         logger=None, body=kopf.Body({"metadata": {"name": "a"}, "status": status}))
            assert state.object_state(memo).first_step is None

    asyncio.run(flow())


def test_the_first_step_reads_nothing_it_was_given_and_its_own_job_does_not_wake_it() -> None:
    """A first step given the creation event's object makes no read of it; the job it creates is
    remembered, so the job's creation event (the echo of that write) wakes nobody, while any later
    event of the job, or a job created by someone else, does."""
    with created_in_emulator() as (emulator, custom, created):
        step = first_step(custom, created, lambda *_: None)

        def finetune_reads() -> int:
            return sum(1 for r in emulator.requests() if r.method == "GET" and r.path.endswith("/llamafinetunes/x"))

        step.run()
        assert finetune_reads() == 0
        memo = step.memo
        created_jobs = state.operator_state(memo).created_jobs
        [(namespace, job_name)] = created_jobs
        job = custom.get_namespaced_custom_object("kubeflow.org", "v1", "default", "pytorchjobs", job_name)
        assert created_jobs == {("default", job_name): job["metadata"]["resourceVersion"]}
        step.run()
        assert finetune_reads() == 1, "later steps read the object afresh"

    woken: list[tuple[str, str]] = []

    async def events() -> None:
        original = daemon_module.wake
        daemon_module.wake = lambda memo, ns, name: woken.append((ns, name))  # type: ignore[assignment]
        try:
            meta = {"name": job["metadata"]["name"], "namespace": "default", "labels": job["metadata"]["labels"],
                    "resourceVersion": job["metadata"]["resourceVersion"]}
            echo = kopf.Memo(operator=dataclasses.replace(state.operator_state(memo), created_jobs=dict(created_jobs)))
            await handlers.child_changed(type="ADDED", body=kopf.Body({**job}), meta=kopf.Meta({"metadata": meta}), memo=echo)
            assert woken == [] and state.operator_state(echo).created_jobs == {}, "the echo of llamaft's own create"
            await handlers.child_changed(type="MODIFIED", body=kopf.Body({**job}), meta=kopf.Meta({"metadata": meta}), memo=echo)
            assert woken == [("default", "x")], "the training operator's first status update"
            other = kopf.Memo(operator=dataclasses.replace(state.operator_state(memo), created_jobs={}))
            await handlers.child_changed(type="ADDED", body=kopf.Body({**job}), meta=kopf.Meta({"metadata": meta}), memo=other)
            assert len(woken) == 2, "a job llamaft did not just create (another replica's, a restart's)"
        finally:
            daemon_module.wake = original  # type: ignore[assignment]

    asyncio.run(events())


def test_the_first_step_of_a_new_object_lists_no_jobs_and_records_one_it_meets_all_the_same() -> None:
    """A new object's first step (from its creation event, no attempt recorded) makes no LIST of
    jobs: none can exist yet. Should one be there all the same (a step that created it and died
    before writing the status), creating it meets it and the attempt is recorded, not doubled."""
    with created_in_emulator() as (emulator, custom, created):
        events: list[str] = []
        for _ in range(2):  # the second step: the job is there, its status not (the creation event's object)
            step = first_step(custom, created, lambda obj, type_, reason, message: events.append(reason))
            step.run()
        def job_lists() -> int:  # the steps' (by label), not this test's
            return sum(1 for r in emulator.requests() if r.method == "GET" and r.path.endswith("/pytorchjobs")
                       and r.params.get("labelSelector"))

        assert job_lists() == 0
        jobs = custom.list_namespaced_custom_object("kubeflow.org", "v1", "default", "pytorchjobs")["items"]
        status = custom.get_namespaced_custom_object("llamaft.io", "v1alpha1", "default", "llamafinetunes", "x")["status"]
        assert [j["metadata"]["name"] for j in jobs] == [status["jobName"]] and status["attempt"] == 1
        assert events.count("JobCreated") == 1, "the second step met the job: no second creation"
        step.run()  # a later step (no creation event) lists, and finds the job
        assert job_lists() == 1


@contextlib.contextmanager
def created_in_emulator() -> Iterator[tuple[EmulatorThread, Any, dict[str, Any]]]:
    """A recording API emulator, a CustomObjectsApi client of it, and LlamaFineTune `x` as its
    creation returned it (what a creation event carries)."""
    from kubernetes import client

    emulator = EmulatorThread(record=True).start()
    try:
        config = client.Configuration()
        config.host = emulator.url
        custom = client.CustomObjectsApi(client.ApiClient(config))
        created = custom.create_namespaced_custom_object("llamaft.io", "v1alpha1", "default", "llamafinetunes", {
            "apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune", "metadata": {"name": "x"}, "spec": tiny_spec()})
        yield emulator, custom, created
    finally:
        emulator.stop()


def first_step(custom: Any, created: dict[str, Any], event: Any) -> Step:
    """The first step of `x` in a fresh operator, given its creation event's object; `event`
    takes the events the step would post."""
    from llamaft.operator.kube import Kube

    step = Step(state.new_memo(OperatorSettings(), kube=Kube(custom.api_client)), "default", "x", logger=None)
    step.event = event  # type: ignore[method-assign]
    step.children_index = {}
    step.created = created
    return step
