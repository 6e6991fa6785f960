"""Shared clusters (issue 9): Kueue queueing and gang scheduling.

- Rendering: the Kueue labels (queue name, WorkloadPriorityClass) on the job of either backend,
  the PyTorchJob's runPolicy.schedulingPolicy and the pods' schedulerName for Volcano /
  scheduler-plugins, all valid against the vendored Kubeflow CRD.
- The lifecycle: a job Kueue holds (suspended, not by the user) is Queued with its queue, never
  a failure, and its startup clock starts at admission; Kueue's preemption (suspend of a running
  job; its pods end with SIGTERM) spends no retry.
- Shrinking an elastic job Kueue cannot admit, against the emulator with the real kopf runtime:
  the test plays Kueue's Workload (pending for an hour).
The handshake with the real Kueue (suspended at creation, admitted when its ClusterQueue has quota,
the job's suspend never written by the operator) is tests/controlplane/test_queueing.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.status import read_status
from llamaft.api.validation import SpecInvalid, validate_spec
from llamaft.operator.kube import USER_AGENT
from llamaft.operator.lifecycle import Observed, decide
from llamaft.render import desired, trainjob
from llamaft.render.admission import child_errors
from llamaft.render.naming import Owner

from tests.operator.conftest import Cluster, Operator, tiny_spec, wait_for
from tests.operator.emulator import EmulatorThread, now_rfc3339

OWNER = Owner("ft", "team-a", "abcd1234-0000-0000-0000-000000000000")
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def parsed(**sections: Any) -> LlamaFineTuneSpec:
    return validate_spec(tiny_spec(**sections))


# ----------------------------------------------------------------------------------- rendering
def test_kueue_labels_on_the_job_of_either_backend() -> None:
    spec = parsed(scheduling={"queueName": "team-a-gpus", "priorityClass": "research-low"})
    for job in (desired.pytorch_job(OWNER, spec, 1), trainjob.train_job(OWNER, spec, 1)):
        labels = job["metadata"]["labels"]
        assert labels["kueue.x-k8s.io/queue-name"] == "team-a-gpus"
        assert labels["kueue.x-k8s.io/priority-class"] == "research-low"
    pytorch_job = desired.pytorch_job(OWNER, spec, 1)
    assert pytorch_job["spec"]["runPolicy"]["suspend"] is False, "Kueue's webhook suspends it; llamaft does not fight that"
    assert child_errors(spec, "ft", "team-a") == []


def test_gang_scheduling_fills_the_scheduling_policy() -> None:
    spec = parsed(cluster={"workers": 4}, scheduling={"gang": {"schedulerName": "volcano", "queue": "research",
                                                                "priorityClass": "high", "scheduleTimeoutSeconds": 600}})
    job = desired.pytorch_job(OWNER, spec, 1)
    assert job["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 4, "queue": "research", "priorityClass": "high",
                                                           "scheduleTimeoutSeconds": 600}
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["schedulerName"] == "volcano"
    assert child_errors(spec, "ft", "team-a") == [], "valid against the vendored PyTorchJob CRD"
    elastic = parsed(cluster={"workers": 4, "elastic": {"minWorkers": 2, "maxWorkers": 4}}, rendezvous={"backend": "etcd-v2"},
                     scheduling={"gang": {}})
    assert desired.pytorch_job(OWNER, elastic, 1)["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 2}, \
        "an elastic job can start with minWorkers"


def test_queue_and_gang_are_exclusive_and_gang_needs_the_pytorchjob_backend() -> None:
    with pytest.raises(SpecInvalid, match="spec.scheduling.gang: queueName hands the job to Kueue"):
        parsed(scheduling={"queueName": "q", "gang": {}})
    with pytest.raises(SpecInvalid, match="spec.scheduling.priorityClass: priorityClass is Kueue's"):
        parsed(scheduling={"priorityClass": "p"})
    problems = child_errors(parsed(scheduling={"gang": {}}, backend="TrainJob"), "ft", "team-a")
    assert [str(p).split(":")[0] for p in problems] == ["spec.scheduling.gang"]


# ----------------------------------------------------------------------------------- lifecycle
def job(*conditions: str) -> dict[str, Any]:
    return {"kind": "PyTorchJob", "metadata": {"name": OWNER.job_name(1)},
            "status": {"conditions": [{"type": c, "status": "True", "reason": c, "message": c} for c in conditions]}}


def observed(status: dict[str, Any], job_: dict[str, Any], pods: list[dict[str, Any]] = (), **spec: Any) -> Observed:  # type: ignore[assignment]
    return Observed(spec=parsed(**spec), status=read_status(status), now=NOW, job_name=OWNER.job_name(1), job=job_, pods=list(pods))


QUEUE = {"scheduling": {"queueName": "team-a-gpus"}}
CREATING = {"phase": "Creating", "attempt": 1, "attemptStartTime": "2026-11-30T08:00:00Z"}


def test_a_job_kueue_holds_is_queued_not_failed_nor_stalled() -> None:
    d = decide(observed(CREATING, job("Created", "Suspended"), **QUEUE))
    assert d.status["phase"] == "Queued" and d.status["queue"] == "team-a-gpus" and "LocalQueue team-a-gpus" in d.status["message"]
    assert d.status["attemptStartTime"] == "2026-11-30T12:00:00Z", "the startup grace starts at admission"
    assert next(c for c in d.status["conditions"] if c["type"] == "Queued")["status"] == "True"
    assert d.start_attempt is None and d.delete_jobs == [] and d.retry is None
    assert [e.reason for e in d.events] == ["Queued"]
    admitted = decide(observed({**CREATING, **d.status}, job("Created", "Running"), **QUEUE))
    assert admitted.status["phase"] == "Running"
    assert next(c for c in admitted.status["conditions"] if c["type"] == "Queued")["reason"] == "Admitted"


def test_the_users_suspend_beside_kueue_is_suspended() -> None:
    d = decide(observed(CREATING, job("Created", "Suspended"), runPolicy={"suspend": True}, **QUEUE))
    assert d.status["phase"] == "Suspended"


def test_kueue_preempting_a_running_job_spends_no_retry() -> None:
    """Kueue suspends the running job; the training operator deletes its pods, which end by SIGTERM."""
    running = {"phase": "Running", "attempt": 1, "retriesUsed": 0, "attemptStartTime": "2026-11-30T11:00:00Z",
               "lastProgressTime": (NOW - timedelta(hours=2)).isoformat(), "progress": {"step": 40}}
    pod = {"metadata": {"name": f"{OWNER.job_name(1)}-worker-0", "deletionTimestamp": "2026-11-30T11:59:59Z"},
           "spec": {"nodeName": "node-0"},
           "status": {"phase": "Failed", "containerStatuses": [{"name": "pytorch", "state": {"terminated": {
               "exitCode": 143, "reason": "Error", "message": '{"phase": "Failed", "reason": "Preempted", "step": 40}'}}}]}}
    d = decide(observed(running, job("Created", "Suspended"), [pod], **QUEUE))
    assert d.status["phase"] == "Queued" and d.retry is None and d.start_attempt is None
    assert "retriesUsed" not in d.status or d.status["retriesUsed"] == 0


# ------------------------------------------------------------------- the handshake, end to end
@pytest.fixture(scope="module")
def emulator() -> Iterator[EmulatorThread]:
    emu = EmulatorThread(record=True).start()
    yield emu
    emu.stop()


@pytest.fixture(scope="module")
def operator(kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    op = Operator(kubeconfig, tmp_path_factory.mktemp("op") / "operator.log").start()
    yield op
    op.stop()


def test_an_elastic_job_kueue_cannot_admit_asks_for_fewer_workers(cluster: Cluster, operator: Operator,
                                                                   emulator: EmulatorThread) -> None:
    """The test plays Kueue: its webhook suspends the PyTorchJob, its scheduler finds no quota for 2
    workers (the Workload's QuotaReserved False, Pending, since an hour ago). The operator lists
    the Workload by Kueue's job-uid label, patches the suspended job to 1 worker and says why;
    Kueue, seeing the job's pod count changed, rewrites the Workload and admits it."""
    elastic_ = {"workers": 2, "elastic": {"minWorkers": 1, "maxWorkers": 2, "shrinkAfterSeconds": 60}}
    cluster.create("kq", tiny_spec(cluster=elastic_, scheduling={"queueName": "team-a-gpus"}))
    name = cluster.job_name("kq", 1)
    job_ = wait_for("job", lambda: cluster.attempt_job("kq", 1))
    cluster.custom.patch_namespaced_custom_object("kubeflow.org", "v1", cluster.ns, "pytorchjobs", name,
                                                  {"spec": {"runPolicy": {"suspend": True}}})
    cluster.set_job_status(name, [("Created", "PyTorchJobCreated", "created"), ("Suspended", "PyTorchJobSuspended", "suspended")])
    no_quota = ("couldn't assign flavors to pod set worker: insufficient unused quota for nvidia.com/gpu in flavor h100, "
                "8 more needed")
    workloads = ("kueue.x-k8s.io", "v1beta2", cluster.ns, "workloads")
    wl_name = f"pytorchjob-{name}-5c1e2"
    cluster.custom.create_namespaced_custom_object(*workloads, {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {"name": wl_name, "labels": {"kueue.x-k8s.io/job-uid": job_["metadata"]["uid"]}},
        "spec": {"queueName": "team-a-gpus", "podSets": [{"name": "worker", "count": 2}]}})
    an_hour_ago = (datetime.now(UTC) - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    cluster.custom.patch_namespaced_custom_object_status(*workloads, wl_name, {"status": {"conditions": [
        {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": no_quota, "lastTransitionTime": an_hour_ago}]}})
    replicas = lambda: ((cluster.attempt_job("kq", 1) or {}).get("spec", {}).get("pytorchReplicaSpecs", {})  # noqa: E731
                        .get("Worker", {}).get("replicas"))
    wait_for("scaled to 1", lambda: replicas() == 1)
    status = wait_for("Shrunk", lambda: (s := cluster.status("kq")).get("workers", {}).get("reason") == "Shrunk" and s)
    assert status["phase"] == "Queued" and status["workers"]["current"] == 1 and status["workers"]["desired"] == 2
    assert no_quota in status["workers"]["message"] and "shrinking to 1 worker" in status["workers"]["message"]
    assert status["totalGpus"] == 8 and status.get("retriesUsed", 0) == 0 and status["attempt"] == 1
    shrunk = wait_for("event", lambda: [e for e in cluster.events("kq") if e["reason"] == "Shrunk"])
    assert shrunk[0]["type"] == "Warning" and "Kueue has reserved no quota for 2 worker(s)" in shrunk[0]["message"]
    # Kueue's job reconciler rewrites the suspended job's Workload to its new count; it fits and is admitted.
    cluster.custom.patch_namespaced_custom_object(*workloads, wl_name, {"spec": {"podSets": [{"name": "worker", "count": 1}]}})
    cluster.custom.patch_namespaced_custom_object_status(*workloads, wl_name, {"status": {"conditions": [
        {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "Quota reserved in ClusterQueue gpus",
         "lastTransitionTime": now_rfc3339()}]}})
    cluster.custom.patch_namespaced_custom_object("kubeflow.org", "v1", cluster.ns, "pytorchjobs", name,
                                                  {"spec": {"runPolicy": {"suspend": False}}})
    cluster.set_job_status(name, [("Created", "PyTorchJobCreated", "created"), ("Running", "PyTorchJobRunning", "running")],
                           replicaStatuses={"Worker": {"active": 1}})
    status = wait_for("Running", lambda: (s := cluster.status("kq")).get("phase") == "Running" and s)
    assert status["workers"]["current"] == 1 and status["workers"]["reason"] == "Shrunk" and replicas() == 1
    listed = [r for r in emulator.requests() if r.user_agent == USER_AGENT and r.path.endswith("/workloads")]
    assert listed and all(r.method == "GET" and r.params.get("labelSelector") == f"kueue.x-k8s.io/job-uid={job_['metadata']['uid']}"
                          for r in listed), "the operator only lists the job's Workloads"
