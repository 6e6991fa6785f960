"""kopf's records on a LlamaFineTune (operator/persistence.py): the essence is kopf's own, the
creation's diff base rides on the finalizer's write, and a later spec change still reaches the
update handler with the spec it replaced."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kopf
import pytest
from llamaft.operator import handlers, persistence

from tests.operator.conftest import Cluster, Operator, tiny_spec, wait_for
from tests.operator.emulator import EmulatorThread, write_kubeconfig

KOPF = kopf.AnnotationsDiffBaseStorage(prefix="llamaft.io", key="last-handled-spec")
"""kopf's storage as the operator configured it before: the reference for the essence."""
RESOURCE = kopf.Resource(*handlers.RESOURCE, kind="LlamaFineTune", namespaced=True, preferred=True)


def body(**meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune",
        "metadata": {"name": "x", "namespace": "default", "uid": "u-1", "generation": 1, "resourceVersion": "7",
                     "managedFields": [{"manager": "kubectl", "fieldsV1": {f"f:{i}": {} for i in range(20)}}], **meta},
        "spec": tiny_spec(),
        "status": {"phase": "Running", "conditions": [{"type": "Valid", "status": "True", "message": "m" * 200}]},
    }


def kopf_fields() -> set[Any]:
    """The fields kopf adds to the essence for the handlers registered on LlamaFineTunes
    (kopf/_core/reactor/processing.py: _detect_causes)."""
    registry = kopf.get_default_registry()
    return (registry._changing.get_extra_fields(resource=RESOURCE) | registry._watching.get_extra_fields(resource=RESOURCE)
            | registry._spawning.get_extra_fields(resource=RESOURCE))


@pytest.mark.parametrize("meta", [
    {},
    {"labels": {"team": "a"}, "annotations": {"note": "n", "kubectl.kubernetes.io/last-applied-configuration": "{}"}},
    {"annotations": {"llamaft.io/last-handled-spec": '{"spec":{}}', "llamaft.io/kopf-managed": "yes", "other.io/x": "1"}},
    {"ownerReferences": [{"kind": "Thing", "name": "t", "uid": "o"}], "finalizers": [persistence.FINALIZER]},
])
def test_the_essence_is_kopfs_own(meta: dict[str, Any]) -> None:
    raw = body(**meta)
    for fields in (kopf_fields(), [persistence.SPEC_FIELD], ["spec.model.source", "spec.nothing"], ["status.phase"], []):
        assert persistence.DIFFBASE.build(body=kopf.Body(raw), extra_fields=fields) == \
            KOPF.build(body=kopf.Body(raw), extra_fields=fields), fields
    assert kopf_fields() <= {(persistence.SPEC_FIELD,)}, "a handler watches another field: creation_essence must add it"


def test_the_children_get_an_empty_essence_because_no_cause_of_theirs_reads_it() -> None:
    """kopf hands the essence only to changing and spawning causes (processing.py: _detect_causes):
    no child kind has such handlers, so their watch events skip the copy. A handler added on a
    child kind's updates would need the real essence: this fails then."""
    from llamaft.operator.startup import CHILD_SELECTORS

    registry = kopf.get_default_registry()
    kinds = {"pytorchjobs": "PyTorchJob", "trainjobs": "TrainJob", "pods": "Pod", "configmaps": "ConfigMap",
             "services": "Service", "deployments": "Deployment", "podmonitors": "PodMonitor",
             "prometheusrules": "PrometheusRule"}
    for group, version, plural in CHILD_SELECTORS:
        child = kopf.Resource(group, version, plural, kind=kinds[plural], namespaced=True, preferred=True)
        assert not registry._changing.has_handlers(resource=child), plural
        assert not registry._spawning.has_handlers(resource=child), plural
        job = {"apiVersion": f"{group}/{version}" if group else version, "kind": kinds[plural],
               "metadata": {"name": "x", "namespace": "default", "labels": {"llamaft.io/finetune": "x"}},
               "spec": {"template": {"spec": {"containers": [{"name": "c"}]}}}}
        assert persistence.DIFFBASE.build(body=kopf.Body(job), extra_fields=kopf_fields()) == {}
    assert registry._changing.has_handlers(resource=RESOURCE) and registry._spawning.has_handlers(resource=RESOURCE)
    assert persistence.DIFFBASE.build(body=kopf.Body(body()), extra_fields=kopf_fields())["spec"] == tiny_spec()


@pytest.mark.parametrize("essence", [
    {"spec": tiny_spec()},
    {"spec": tiny_spec(), "metadata": {"labels": {"a": "b"}, "annotations": {"llamaft.io/x": "1", "other.io/y": "2"}}},
    {"spec": tiny_spec(), "metadata": {"annotations": {"llamaft.io/x": "1"}, "labels": {}}, "status": {}},
    {"spec": tiny_spec(), "metadata": {"annotations": {"other.io/y": "2"}}, "status": {"phase": "Running"}},
])
def test_clearing_the_progress_is_kopfs_own_and_leaves_the_essence_given_alone(essence: dict[str, Any]) -> None:
    reference = kopf.AnnotationsProgressStorage(prefix="llamaft.io")
    given = copy.deepcopy(essence)
    cleared = persistence.PROGRESS.clear(essence=given)  # type: ignore[arg-type]
    assert cleared == reference.clear(essence=copy.deepcopy(essence))  # type: ignore[arg-type]
    assert given == essence, "the essence given is not changed"


def test_the_creation_is_recorded_as_kopf_would_store_it() -> None:
    raw = body(labels={"team": "a"})
    patch = kopf.Patch()
    persistence.record_creation(kopf.Body(raw), patch)
    assert not dict(patch), "no merge patch: kopf's finalizer goes in a JSON patch, guarded by the resourceVersion"
    written = copy.deepcopy(raw)
    for fn in patch.fns:
        fn(written)
    # What kopf itself stores once the creation is handled (processing.py: process_changing_cause).
    expected = kopf.Patch()
    new = kopf.AnnotationsProgressStorage(prefix="llamaft.io").clear(essence=KOPF.build(body=kopf.Body(raw),
                                                                                          extra_fields=kopf_fields()))
    KOPF.store(body=kopf.Body(raw), patch=expected, essence=new)
    assert written["metadata"]["annotations"] == dict(expected["metadata"]["annotations"])
    assert KOPF.fetch(body=kopf.Body(written)) == new
    # The next cycle finds nothing changed: kopf's NOOP, no update handler.
    assert persistence.PROGRESS.clear(essence=persistence.DIFFBASE.build(body=kopf.Body(written), extra_fields=kopf_fields())) == new


@pytest.mark.parametrize("meta", [
    {"finalizers": [persistence.FINALIZER]},
    {"annotations": {"llamaft.io/last-handled-spec": '{"spec":{}}\n'}},
    {"deletionTimestamp": "2026-12-05T00:00:00Z", "finalizers": ["someone.else/f"]},
])
def test_nothing_is_added_where_kopf_handles_the_creation_itself(meta: dict[str, Any]) -> None:
    patch = kopf.Patch()
    persistence.record_creation(kopf.Body(body(**meta)), patch)
    assert not patch


def test_a_new_finetune_costs_kopf_one_write_and_a_spec_change_still_reaches_the_update_handler(tmp_path: Path) -> None:
    emulator = EmulatorThread(record=True).start()
    operator = Operator(write_kubeconfig(emulator.url, tmp_path / "config"), tmp_path / "operator.log").start()
    try:
        from kubernetes import client

        config = client.Configuration()
        config.host = emulator.url
        cluster = Cluster(client.ApiClient(config))
        wait_for("the operator watching", lambda: any(r.path.endswith("/llamafinetunes") and r.params.get("watch")
                                                      for r in emulator.requests()), timeout=60)
        cluster.create("once", tiny_spec())
        wait_for("attempt 1", lambda: cluster.status("once").get("jobName"), timeout=60)
        obj = wait_for("the finalizer", lambda: (o := cluster.finetune("once"))["metadata"].get("finalizers") and o)
        assert obj["metadata"]["finalizers"] == [persistence.FINALIZER]
        stored = json.loads(obj["metadata"]["annotations"]["llamaft.io/last-handled-spec"])
        assert stored == persistence.creation_essence(kopf.Body(obj))
        kopf_writes = [r for r in emulator.requests() if r.path.endswith("/llamafinetunes/once") and r.method == "PATCH"
                       and not r.user_agent.startswith("llamaft")]
        assert [r.content_type for r in kopf_writes] == ["application/json-patch+json"], "finalizer and diff base in one write"
        assert "spec_changed" not in operator.logs(), "the creation is no update"

        cluster.patch_finetune("once", {"spec": {"runPolicy": {"suspend": True}}})
        wait_for("the update handler", lambda: "Handler 'spec_changed/spec' succeeded" in operator.logs(), timeout=30)
        job_name = cluster.status("once")["jobName"]
        wait_for("the job suspended", lambda: ((cluster.job(job_name) or {})["spec"].get("runPolicy") or {}).get("suspend"))
        # The handler's own event: the change it saw is the one field (the spec it replaced was
        # the stored one), so the job is suspended in place, not restarted.
        wait_for("the handler's event", lambda: any(e["reason"] == "Suspended" and e["message"] == f"PyTorchJob {job_name} suspended"
                                                    for e in cluster.events("once")))
        assert "SpecChanged" not in {e["reason"] for e in cluster.events("once")}
    finally:
        operator.stop()
        emulator.stop()
