"""The real kopf runtime, started as `llamaft operator`, against the emulator: a LlamaFineTune's
life, with this test playing the Kubeflow training operator (it writes the PyTorchJob's status)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.operator.conftest import Cluster, Operator, own_cluster, tiny_spec, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def operator(kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    op = Operator(kubeconfig, tmp_path_factory.mktemp("op") / "operator.log", cli=True).start()
    yield op
    op.stop()


def test_create_running_succeeded(cluster: Cluster, operator: Operator) -> None:
    cluster.create("happy", tiny_spec())
    job = wait_for("PyTorchJob happy-1", lambda: cluster.attempt_job("happy", 1), timeout=30)
    # The job is created before the handler's status patch lands (kopf patches status after the
    # handler returns): wait for the status that records it.
    created = wait_for("status of attempt 1", lambda: (s := cluster.status("happy")).get("rendezvousId") and s)
    assert job["spec"]["elasticPolicy"]["rdzvId"] == created["rendezvousId"]
    assert job["metadata"]["ownerReferences"][0]["name"] == "happy"
    assert created["phase"] == "Creating"
    cluster.set_job_status(cluster.job_name("happy", 1), [("Created", "PyTorchJobCreated", "created"), ("Running", "PyTorchJobRunning", "running")],
                           replicaStatuses={"Worker": {"active": 2}}, startTime="2026-11-29T20:00:00Z")
    status = wait_for("Running", lambda: (s := cluster.status("happy"))["phase"] == "Running" and s)
    assert status["workers"]["active"] == 2 and status["totalGpus"] == 16 and status["startTime"]
    cluster.set_job_status(cluster.job_name("happy", 1), [("Created", "PyTorchJobCreated", "created"), ("Succeeded", "PyTorchJobSucceeded", "done")],
                           replicaStatuses={"Worker": {"succeeded": 2}}, completionTime="2026-11-29T21:00:00Z")
    status = wait_for("Succeeded", lambda: (s := cluster.status("happy"))["phase"] == "Succeeded" and s)
    types = {c["type"]: c["status"] for c in status["conditions"]}
    assert types["Succeeded"] == "True" and types["Running"] == "False" and types["Valid"] == "True"
    assert types["MonitoringReady"] == "True"
    monitors = cluster.custom.list_namespaced_custom_object("monitoring.coreos.com", "v1", "default", "podmonitors")["items"]
    assert [m["metadata"]["name"] for m in monitors if m["metadata"]["name"].startswith("happy")] == ["happy-trainer"]
    assert cluster.exists("ConfigMap", "happy-dashboard")
    cluster.wait_reasons("happy", "JobCreated", "Running", "Succeeded")


def test_an_eviction_is_recorded_after_its_pod_is_gone(cluster: Cluster, operator: Operator) -> None:
    """The Eviction API's DisruptionTarget, then the pod deleted at once (grace 0), before the
    operator lists it: the pod watch kept the evidence (operator.evidence), so the attempt ends
    Evicted with the pod named, not with a lesser cause."""
    cluster.create("gone", tiny_spec(runPolicy={"retryBudget": 2}))
    wait_for("job", lambda: cluster.attempt_job("gone", 1))
    job = cluster.job_name("gone", 1)
    pod = f"{job}-worker-1"
    cluster.create_pod(pod, job, labels={"llamaft.io/finetune": "gone", "app.kubernetes.io/component": "trainer"})
    cluster.set_job_status(job, [("Created", "PyTorchJobCreated", "c"), ("Running", "PyTorchJobRunning", "r")],
                           replicaStatuses={"Worker": {"active": 2}})
    wait_for("Running", lambda: cluster.status("gone").get("phase") == "Running")
    cluster.core.patch_namespaced_pod_status(pod, cluster.ns, {"status": {"conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
         "message": "Eviction API: evicting", "lastTransitionTime": "2026-12-03T10:00:00Z"}]}})
    cluster.core.delete_namespaced_pod(pod, cluster.ns, grace_period_seconds=0)
    status = wait_for("the failure", lambda: (s := cluster.status("gone")).get("failures") and s)
    [failure] = status["failures"]
    assert failure["reason"] == "Evicted" and failure["pod"] == pod, status
    assert failure["retryable"] is True


def test_invalid_spec_names_the_field_in_status_and_events(cluster: Cluster, operator: Operator) -> None:
    spec = tiny_spec(fsdp={"shardingStrategy": "HYBRID_SHARD", "hybridShard": {"shardGroupSize": 3, "replicaGroupSize": 2}})
    cluster.create("broken", spec)
    status = wait_for("Failed", lambda: (s := cluster.status("broken")).get("phase") == "Failed" and s)
    valid = next(c for c in status["conditions"] if c["type"] == "Valid")
    assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
    assert "spec.fsdp.hybridShard.shardGroupSize: shardGroupSize must divide workers x gpusPerWorker (the world size)" in valid["message"]
    events = wait_for("InvalidSpec events", lambda: [e for e in cluster.events("broken") if e["reason"] == "InvalidSpec"])
    assert any("spec.fsdp.hybridShard.shardGroupSize" in e["message"] for e in events)
    assert cluster.jobs("llamaft.io/finetune=broken") == []


def test_cluster_without_the_prometheus_operator_still_runs_jobs(tmp_path: Path) -> None:
    """Monitoring is best effort: no monitoring.coreos.com API -> a warning and a condition, and the job runs."""
    from kubernetes import client

    from tests.operator.emulator import EmulatorThread, write_kubeconfig

    bare = EmulatorThread(without=("monitoring.coreos.com/v1/podmonitors", "monitoring.coreos.com/v1/prometheusrules")).start()
    try:
        kubeconfig = write_kubeconfig(bare.url, tmp_path / "config")
        config = client.Configuration()
        config.host = bare.url
        cluster = Cluster(client.ApiClient(config))
        op = Operator(kubeconfig, tmp_path / "operator.log").start()
        try:
            cluster.create("nomon", tiny_spec())
            wait_for("job", lambda: cluster.attempt_job("nomon", 1))
            status = wait_for("condition", lambda: (s := cluster.status("nomon")) and any(
                c["type"] == "MonitoringReady" for c in s.get("conditions", [])) and s)
            monitoring_ready = next(c for c in status["conditions"] if c["type"] == "MonitoringReady")
            assert monitoring_ready["status"] == "False" and monitoring_ready["reason"] == "PrometheusOperatorMissing"
            wait_for("event", lambda: [e for e in cluster.events("nomon") if e["reason"] == "MonitoringUnavailable"])
            assert cluster.exists("ConfigMap", "nomon-config")
        finally:
            op.stop()
    finally:
        bare.stop()


NOT_FITTING = {"model": {"source": "meta-llama/Llama-2-70b-hf"}, "cluster": {"workers": 1, "gpusPerWorker": 8,
               "instanceType": "p4d.24xlarge"}, "fsdp": {"shardingStrategy": "NO_SHARD"}}


def test_a_run_that_cannot_fit_is_refused_before_anything_is_created(cluster: Cluster, operator: Operator) -> None:
    cluster.create("toobig", tiny_spec(**NOT_FITTING))
    status = wait_for("Failed", lambda: (s := cluster.status("toobig")).get("phase") == "Failed" and s)
    capacity = next(c for c in status["conditions"] if c["type"] == "CapacityFits")
    assert capacity["status"] == "False" and capacity["reason"] == "WillNotFit"
    assert "will not fit" in capacity["message"] and "cheapest fix" in capacity["message"]
    assert "WillNotFit" in status["message"] or "will not fit" in status["message"]
    assert cluster.jobs("llamaft.io/finetune=toobig") == [] and not cluster.exists("ConfigMap", "toobig-config")
    wait_for("event", lambda: [e for e in cluster.events("toobig") if e["reason"] == "WillNotFit" and e["type"] == "Warning"])


def test_preflight_warn_runs_anyway_and_off_does_not_check(cluster: Cluster, operator: Operator) -> None:
    cluster.create("warned", tiny_spec(**NOT_FITTING, preflight="Warn"))
    wait_for("job despite the warning", lambda: cluster.attempt_job("warned", 1))
    status = wait_for("condition", lambda: (s := cluster.status("warned")) and any(
        c["type"] == "CapacityFits" for c in s.get("conditions", [])) and s)
    assert next(c for c in status["conditions"] if c["type"] == "CapacityFits")["status"] == "False"
    cluster.create("unchecked", tiny_spec(**NOT_FITTING, preflight="Off"))
    wait_for("job", lambda: cluster.attempt_job("unchecked", 1))
    assert not any(c["type"] == "CapacityFits" for c in cluster.status("unchecked").get("conditions", []))


def test_children_the_cluster_would_reject_are_caught_before_anything_is_created(cluster: Cluster, operator: Operator) -> None:
    cluster.create("rejected", tiny_spec(cluster={"podTemplateOverrides": {"spec": {"hostNetwork": "yes"}}}))
    status = wait_for("Failed", lambda: (s := cluster.status("rejected")).get("phase") == "Failed" and s)
    valid = next(c for c in status["conditions"] if c["type"] == "Valid")
    assert valid["status"] == "False" and "spec.cluster.podTemplateOverrides" in valid["message"] and "hostNetwork" in valid["message"]
    wait_for("event", lambda: [e for e in cluster.events("rejected") if e["reason"] == "InvalidSpec"])
    assert cluster.jobs("llamaft.io/finetune=rejected") == [] and not cluster.exists("ConfigMap", "rejected-config")


def test_a_child_the_api_server_still_rejects_fails_the_run_with_its_message() -> None:
    """422 is final: the run ends Failed with the API server's words, no endless retry loop (the
    lifecycle step with a client whose create is refused)."""
    import json as _json

    from kubernetes.client.exceptions import ApiException
    from llamaft.operator.settings import OperatorSettings
    from llamaft.operator.state import new_memo
    from llamaft.operator.step import Step

    class RefusingKube:
        def __init__(self) -> None:
            self.status: dict[str, Any] = {}

        def list_jobs(self, *_: Any) -> list[Any]:
            return []

        def get_job(self, *_: Any) -> None:
            return None

        def check_owner(self, *_: Any) -> None:
            return None

        def apply(self, _ns: str, obj: dict[str, Any]) -> dict[str, Any]:
            return {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}

        def list_children(self, *_: Any) -> list[Any]:
            return []

        def create_job(self, *_: Any) -> bool:
            error = ApiException(status=422, reason="Unprocessable Entity")
            error.body = _json.dumps({"message": 'PyTorchJob.kubeflow.org "x" is invalid: spec.foo: Invalid value'})
            raise error

        def patch_finetune_status(self, _ns: str, _name: str, patch: dict[str, Any]) -> None:
            self.status.update(patch)

    kube = RefusingKube()
    memo: Any = new_memo(OperatorSettings(), kube=kube)
    events: list[tuple[str, str]] = []
    step = Step(memo, "default", "x", logger=None)
    step.event = lambda obj, type_, reason, message: events.append((reason, message))  # type: ignore[method-assign]
    obj = {"metadata": {"name": "x", "namespace": "default", "uid": "1234abcd-0000", "generation": 1},
           "spec": tiny_spec(rendezvous={"backend": "c10d"}), "status": {}}
    assert step._run(obj) is None, "a rejected attempt is final: no requeue"
    assert kube.status["phase"] == "Failed" and "spec.foo: Invalid value" in kube.status["message"]
    assert next(c for c in kube.status["conditions"] if c["type"] == "Failed")["reason"] == "ChildRejected"
    assert [r for r, _ in events].count("ChildRejected") == 1


def test_a_cluster_without_the_training_operator_says_so(tmp_path: Path) -> None:
    with own_cluster(tmp_path, ("kubeflow.org/v1/pytorchjobs",)) as cluster:
        cluster.create("nokf", tiny_spec())
        status = wait_for("message", lambda: (s := cluster.status("nokf")).get("message", "").startswith(
            "the cluster does not serve kubeflow.org/v1 PyTorchJobs") and s)
        assert status.get("phase") in (None, "Pending", "Creating")
        wait_for("event", lambda: [e for e in cluster.events("nokf") if e["reason"] == "TrainingOperatorMissing"])
