"""Failure evidence the pod watch keeps for pods deleted before a step lists them (evidence.py):
which pods are kept, which attempt they can explain, and the step that no longer finds the
evicted pod still records why its attempt ended."""

from __future__ import annotations

from typing import Any

import pytest
from llamaft.api.status import read_status
from llamaft.api.validation import validate_spec
from llamaft.operator import daemon, failures, lifecycle
from llamaft.operator.evidence import PodEvidence, selector_matches
from llamaft.operator.settings import OperatorSettings
from llamaft.operator.state import new_memo, operator_state
from llamaft.operator.step import Step
from llamaft.render.naming import LABEL_FINETUNE, Owner

from tests.operator.conftest import tiny_spec

OWNER = Owner("x", "default", "1234abcd-0000")
JOB = OWNER.job_name(1)
SELECTOR = f"training.kubeflow.org/job-name={JOB}"
KEY = ("default", "x")


def pod(name: str, uid: str, *, job: str = JOB, created: str = "2026-12-03T10:00:05Z", phase: str = "Running",
        disruption: str | None = None, reason: str | None = None, exit_code: int | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "conditions": []}
    if disruption:
        status["conditions"].append({"type": "DisruptionTarget", "status": "True", "reason": disruption,
                                     "message": "Eviction API: evicting"})
    if reason:
        status["reason"] = reason
    if exit_code is not None:
        status["containerStatuses"] = [{"name": "pytorch", "state": {"terminated": {"exitCode": exit_code,
                                                                                  "reason": "Error"}}}]
    return {"kind": "Pod", "metadata": {
        "name": name, "namespace": "default", "uid": uid, "creationTimestamp": created,
        "labels": {LABEL_FINETUNE: "x", "app.kubernetes.io/component": "trainer", "training.kubeflow.org/job-name": job}},
        "spec": {"nodeName": f"node-{name[-1]}"}, "status": status}


FINAL_REPORT = '{"phase": "Succeeded", "step": 12, "totalSteps": 12, "loss": 0.7, "exportPath": "/checkpoints/run/export"}'


def reported(the_pod: dict[str, Any], message: str) -> dict[str, Any]:
    """`the_pod` with `message` as its trainer container's termination message."""
    the_pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = message
    return the_pod


def job(created: str = "2026-12-03T10:00:00Z") -> dict[str, Any]:
    return {"kind": "PyTorchJob", "metadata": {"name": JOB, "namespace": "default", "uid": "job-uid",
                                                "creationTimestamp": created}}


@pytest.mark.parametrize(("the_pod", "kept"), [
    (pod("w-0", "a", disruption="EvictionByEvictionAPI"), True),
    (pod("w-0", "a", disruption="PreemptionByScheduler"), True),
    (pod("w-0", "a", disruption="DeletionByTaintManager", phase="Failed", reason="NodeLost"), True),
    (pod("w-0", "a", phase="Failed", reason="Evicted"), True),
    (pod("w-0", "a"), False),  # running, nothing to explain
    (pod("w-0", "a", phase="Failed", exit_code=1), False),  # a crash stays on the pod, which stays
    ({**pod("w-0", "a"), "status": {"conditions": [{"type": "DisruptionTarget", "status": "False"}]}}, False),
    (reported(pod("w-0", "a", phase="Succeeded", exit_code=0), FINAL_REPORT), True),  # the leader's final report
    (pod("w-1", "b", phase="Succeeded", exit_code=0), False),  # another worker's end says nothing more
], ids=["eviction-api", "preemption", "node-lost", "kubelet-evicted", "running", "crashed", "condition-false",
        "leader-final-report", "succeeded-without-report"])
def test_which_pods_carry_evidence_their_deletion_erases(the_pod: dict[str, Any], kept: bool) -> None:
    assert failures.erasable(the_pod) is kept
    store = PodEvidence()
    assert store.keep(KEY, the_pod) is kept
    assert len(store) == int(kept)


@pytest.mark.parametrize(("selector", "labels", "matches"), [
    ("a=1", {"a": "1"}, True),
    ("a=1,b=2", {"a": "1", "b": "2", "c": "3"}, True),
    ("a=1,b=2", {"a": "1"}, False),
    ("a=1", {"a": "2"}, False),
    ("a=1", None, False),
    ("", {"a": "1"}, True),
])
def test_selector_matches(selector: str, labels: dict[str, str] | None, matches: bool) -> None:
    assert selector_matches(selector, labels) is matches


def test_recall_adds_the_kept_pods_of_this_job_the_list_no_longer_has() -> None:
    store = PodEvidence()
    evicted = pod(f"{JOB}-worker-1", "b", disruption="EvictionByEvictionAPI")
    store.keep(KEY, evicted)
    peer = pod(f"{JOB}-worker-0", "a")
    assert store.recall(KEY, SELECTOR, job(), [peer]) == [peer, {**evicted, "spec": {"nodeName": "node-1"}}]
    # Still listed: the list's version is the current one, nothing is added.
    listed_again = pod(f"{JOB}-worker-1", "b", disruption="EvictionByEvictionAPI", phase="Failed")
    assert store.recall(KEY, SELECTOR, job(), [peer, listed_again]) == [peer, listed_again]
    # No job: nothing to explain.
    assert store.recall(KEY, SELECTOR, None, []) == []
    assert store.recall(("default", "other"), SELECTOR, job(), []) == []


def test_a_kept_pod_explains_only_its_own_job() -> None:
    store = PodEvidence()
    store.keep(KEY, pod("x-0-worker-0", "old-attempt", job="x-0", disruption="EvictionByEvictionAPI"))
    # The same job name in an earlier incarnation (deleted and created again): created before this job.
    store.keep(KEY, pod(f"{JOB}-worker-0", "old-incarnation", created="2026-12-03T09:00:00Z", disruption="EvictionByEvictionAPI"))
    mine = pod(f"{JOB}-worker-1", "mine", disruption="EvictionByEvictionAPI")
    store.keep(KEY, mine)
    assert [p["metadata"]["uid"] for p in store.recall(KEY, SELECTOR, job(), [])] == ["mine"]
    assert len(store) == 1, "the other jobs' pods are dropped"
    store.forget(KEY)
    assert len(store) == 0 and store.recall(KEY, SELECTOR, job(), []) == []


def test_a_later_version_replaces_the_kept_one_and_the_store_is_bounded() -> None:
    store = PodEvidence(max_per_owner=3)
    store.keep(KEY, pod(f"{JOB}-worker-0", "a", disruption="EvictionByEvictionAPI"))
    store.keep(KEY, pod(f"{JOB}-worker-0", "a", disruption="EvictionByEvictionAPI", phase="Failed", exit_code=143))
    [kept] = store.recall(KEY, SELECTOR, job(), [])
    assert kept["status"]["phase"] == "Failed"
    for i in range(5):
        store.keep(KEY, pod(f"{JOB}-worker-{i + 1}", f"u{i}", disruption="EvictionByEvictionAPI"))
    assert [p["metadata"]["uid"] for p in store.recall(KEY, SELECTOR, job(), [])] == ["u2", "u3", "u4"]


def test_the_pod_watch_keeps_evidence_and_the_finetune_deletion_forgets_it() -> None:
    memo: Any = new_memo(OperatorSettings())
    store = operator_state(memo).evidence
    evicted = pod(f"{JOB}-worker-1", "b", disruption="EvictionByEvictionAPI")
    daemon.wake_for_child(memo, "DELETED", evicted, evicted["metadata"])
    daemon.wake_for_child(memo, "MODIFIED", pod(f"{JOB}-worker-0", "a"), pod(f"{JOB}-worker-0", "a")["metadata"])
    assert len(store) == 1
    daemon.finetune_event(memo, "DELETED", "default", "x", None, {"metadata": {"name": "x"}}, None)
    assert len(store) == 0


class RunningJobKube:
    """An API client for one running attempt whose evicted pod was deleted before the step's list."""

    def __init__(self, owner: Owner, pods: list[dict[str, Any]], suspended: bool = False) -> None:
        self.pods = pods
        self.job = {**job(), "metadata": {**job()["metadata"], "labels": {LABEL_FINETUNE: "x"}, "ownerReferences": [
            {"apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune", "name": "x", "uid": owner.uid, "controller": True}]},
            "spec": {"runPolicy": {"suspend": suspended}},
            "status": {"conditions": [{"type": "Running", "status": "True", "reason": "PyTorchJobRunning"}]}}

    def list_jobs(self, *_: Any) -> list[dict[str, Any]]:
        return [self.job]

    def get_job(self, *_: Any) -> dict[str, Any]:
        return self.job

    def list_pods(self, _namespace: str, selector: str) -> list[dict[str, Any]]:
        assert selector == SELECTOR
        return self.pods


@pytest.mark.parametrize("suspended", [False, True], ids=["running", "suspended"])
def test_the_step_records_the_eviction_of_a_pod_already_gone(suspended: bool) -> None:
    owner = OWNER
    peer = pod(f"{JOB}-worker-0", "a", phase="Failed", exit_code=143)  # SIGTERMed by its agent once the peer went
    memo: Any = new_memo(OperatorSettings(), kube=RunningJobKube(owner, [peer], suspended))
    evicted = pod(f"{JOB}-worker-1", "b", disruption="EvictionByEvictionAPI", phase="Running")
    daemon.wake_for_child(memo, "DELETED", evicted, evicted["metadata"])
    step = Step(memo, "default", "x", logger=None)
    spec = validate_spec(tiny_spec())
    status = read_status({"phase": "Running", "attempt": 1, "jobName": JOB, "backend": "PyTorchJob",
                          "attemptStartTime": "2026-12-03T10:00:00Z"})
    obs = step._observe({"metadata": {"name": "x", "namespace": "default", "uid": owner.uid, "generation": 1}},
                        owner, spec, status, 1, 1)
    names = [p["metadata"]["name"] for p in obs.pods]
    if suspended:  # Kueue or the user suspended it: its pods' deletions explain nothing
        assert names == [f"{JOB}-worker-0"]
        return
    assert names == [f"{JOB}-worker-0", f"{JOB}-worker-1"]
    failure = failures.classify(obs.job, obs.pods, None)
    assert failure is not None and failure.reason == failures.EVICTED and failure.pod == f"{JOB}-worker-1"
    decision = lifecycle.decide(obs)
    [record] = decision.status["failures"]
    assert record["reason"] == "Evicted" and record["pod"] == f"{JOB}-worker-1", decision.status
