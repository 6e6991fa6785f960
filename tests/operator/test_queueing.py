"""Shared clusters (issue 9): Kueue queueing and gang scheduling, as pure functions.

- Rendering: the Kueue labels (queue name, WorkloadPriorityClass) on the job of either backend,
  the PyTorchJob's runPolicy.schedulingPolicy and the pods' schedulerName for Volcano /
  scheduler-plugins, all valid against the vendored Kubeflow CRD.
- The lifecycle: a job Kueue holds (suspended, not by the user) is Queued with its queue, never
  a failure, and its startup clock starts at admission; Kueue's preemption (suspend of a running
  job; its pods end with SIGTERM) spends no retry.
The handshake with the real Kueue (suspended at creation, admitted when its ClusterQueue has quota,
the job's suspend never written by the operator; an elastic job it cannot admit shrunk until it
can) is tests/controlplane/test_queueing.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.status import read_status
from llamaft.api.validation import SpecInvalid, validate_spec
from llamaft.operator.lifecycle import Observed, decide
from llamaft.render import desired, trainjob
from llamaft.render.admission import child_errors
from llamaft.render.naming import Owner

from tests.operator.conftest import tiny_spec

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
