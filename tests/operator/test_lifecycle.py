"""The run lifecycle as a table: (observed state) -> (actions, status), for every path a run can take.

No cluster, no clock: `lifecycle.decide` and `failures.classify` are pure, so each row builds the
objects the handlers would read and asserts what the operator does and writes.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from llamaft.api.contracts import read_progress
from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.status import read_status
from llamaft.operator import failures, lifecycle, spec_changes
from llamaft.operator.lifecycle import Observed, decide

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
JOB = "ft-abcd-1"


def spec(**run_policy: Any) -> LlamaFineTuneSpec:
    return LlamaFineTuneSpec.model_validate({
        "model": {"source": "/models/tiny"}, "dataset": {"format": "samsum", "source": "/data/x.jsonl"},
        "cluster": {"workers": 2, "gpusPerWorker": 0}, "runPolicy": {"retryBudget": 3, **run_policy},
    })


def job(*conditions: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": JOB}, "status": {
        "conditions": [{"type": c, "status": "True", "reason": f"PyTorchJob{c}", "message": f"job {c.lower()}"} for c in conditions],
        **status}}


def pod(index: int = 0, phase: str = "Running", node: str = "node-0", exit_code: int | None = None,
        reason: str | None = None, message: str | None = None, **status: Any) -> dict[str, Any]:
    cs: dict[str, Any] = {"name": "pytorch", "state": {"running": {}}}
    if exit_code is not None:
        cs["state"] = {"terminated": {"exitCode": exit_code, "reason": reason or ("Completed" if exit_code == 0 else "Error"),
                                      "message": message or ""}}
    return {"metadata": {"name": f"{JOB}-worker-{index}"}, "spec": {"nodeName": node},
            "status": {"phase": phase, "podIP": f"127.0.0.{index + 2}", "containerStatuses": [cs], **status}}


def report(**fields: Any) -> str:
    return json.dumps(fields)


RUNNING = {"phase": "Running", "attempt": 1, "jobName": JOB, "attemptStartTime": "2026-11-30T11:00:00Z",
           "lastProgressTime": "2026-11-30T11:59:00Z", "progress": {"step": 12, "totalSteps": 30}}


def observed(status: dict[str, Any] | None = None, **kw: Any) -> Observed:
    """An Observed as Step builds it: the status and a /progress document (given as written) read once."""
    base = dict(spec=spec(), status=read_status(dict(RUNNING if status is None else status)), now=NOW, job_name=JOB,
                retry_backoff_s=10.0)
    if isinstance(kw.get("progress"), dict):
        kw["progress"] = read_progress(kw["progress"])
    base.update(kw)
    return Observed(**base)


# ------------------------------------------------------------------------------ starting
def test_a_new_run_creates_its_first_attempt() -> None:
    d = decide(observed({}, job=None))
    assert d.start_attempt == 1 and d.status["phase"] == "Creating" and d.status["attempt"] == 1
    assert d.status["attemptStartTime"] == "2026-11-30T12:00:00Z" and not d.delete_jobs


def test_a_job_still_being_deleted_is_waited_for_never_adopted() -> None:
    d = decide(observed({"phase": "Creating", "attempt": 1}, job=None, job_deleting=True))
    assert d.start_attempt is None and d.requeue_after == 1.0 and "waiting for the earlier PyTorchJob" in d.status["message"]


def test_a_missing_job_of_an_active_run_is_recreated() -> None:
    d = decide(observed(dict(RUNNING), job=None))
    assert d.start_attempt == 1 and d.status["phase"] == "Restarting"


def test_stale_jobs_of_other_attempts_are_deleted() -> None:
    d = decide(observed(job=job("Created", "Running"), pods=[pod(0), pod(1)], stale_jobs=["ft-abcd-0"]))
    assert d.delete_jobs == ["ft-abcd-0"] and d.start_attempt is None


def test_backoff_is_waited_for() -> None:
    st = {**RUNNING, "attempt": 2, "phase": "Restarting", "retryAfter": "2026-11-30T12:00:20Z"}
    d = decide(observed(st, job=None))
    assert d.start_attempt is None and d.requeue_after == 20.0
    d = decide(observed(st, job=None, now=NOW + timedelta(seconds=21)))
    assert d.start_attempt == 2 and d.status["retryAfter"] is None


# ------------------------------------------------------------------------------ terminal
@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
@pytest.mark.parametrize("job_obj", [None, job("Succeeded"), job("Failed")])
def test_terminal_phases_are_terminal(phase: str, job_obj: dict[str, Any] | None) -> None:
    d = decide(observed({**RUNNING, "phase": phase}, job=job_obj, pods=[pod(0, "Failed", exit_code=1)]))
    assert d == lifecycle.Decision(), "nothing after Succeeded/Failed changes the status or the cluster"


def test_success_takes_the_trainers_final_report() -> None:
    final = report(phase="Succeeded", step=30, totalSteps=30, loss=0.91, evalLoss=1.1, exportPath="/ckpt/export", tokensPerSecond=900.0)
    pods = [pod(0, "Succeeded", exit_code=0, message=final), pod(1, "Succeeded", exit_code=0)]
    d = decide(observed(job=job("Created", "Succeeded"), pods=pods, progress=None))
    assert d.status["phase"] == "Succeeded"
    assert d.status["progress"]["step"] == 30 and d.status["progress"]["stepOfTotal"] == "30/30"
    assert d.status["progress"]["loss"] == 0.91 and d.status["exportPath"] == "/ckpt/export"
    succeeded = next(c for c in d.status["conditions"] if c["type"] == "Succeeded")
    assert succeeded["status"] == "True"


def test_a_dpo_success_says_its_reward_accuracy_where_sfts_says_its_loss() -> None:
    """The Succeeded condition, the status message and the event carry the final figures; a DPO
    run's include its reward accuracy and margin (training and held out), also in status.progress."""
    final = report(phase="Succeeded", step=30, totalSteps=30, loss=0.41, evalLoss=0.52, rewardAccuracy=0.875,
                   rewardMargin=0.912, evalRewardAccuracy=0.8333, evalRewardMargin=0.701)
    d = decide(observed(job=job("Created", "Succeeded"), pods=[pod(0, "Succeeded", exit_code=0, message=final)],
                        progress=None))
    words = ("succeeded at step 30: loss 0.4100, reward accuracy 0.875 (margin 0.912); "
             "held out: loss 0.5200, reward accuracy 0.833 (margin 0.701)")
    succeeded = next(c for c in d.status["conditions"] if c["type"] == "Succeeded")
    assert succeeded["message"].endswith(words) and d.status["message"].endswith(words)
    assert [e.message for e in d.events if e.reason == "Succeeded"] == [succeeded["message"]]
    progress = d.status["progress"]
    assert (progress["rewardAccuracy"], progress["rewardMargin"]) == (0.875, 0.912)
    assert (progress["evalRewardAccuracy"], progress["evalRewardMargin"]) == (0.8333, 0.701)
    sft = decide(observed(job=job("Created", "Succeeded"), progress=None,
                          pods=[pod(0, "Succeeded", exit_code=0, message=report(phase="Succeeded", step=30, loss=0.91))]))
    assert sft.status["message"].endswith("succeeded at step 30: loss 0.9100")
    assert "rewardAccuracy" not in sft.status["progress"]


@pytest.mark.parametrize(("performance", "expected"), [
    ({"steps": 29, "worldSize": 2, "tokensPerSecond": 900.0, "tokensPerSecondPerDevice": 450.0, "stepSeconds": 0.5,
      "mfu": None, "peakMemoryBytes": 1024},
     {"steps": 29, "worldSize": 2, "tokensPerSecond": 900.0, "tokensPerSecondPerDevice": 450.0, "stepSeconds": 0.5,
      "peakMemoryBytes": 1024}),
    ({"steps": 3, "worldSize": 1, "tokensPerSecond": 10.0, "newerFigure": 1}, {"steps": 3, "worldSize": 1, "tokensPerSecond": 10.0}),
    ({"steps": "many"}, None),  # not a report this operator can read: no status.performance rather than a wrong one
    (None, None),
])
def test_success_keeps_what_the_run_sustained(performance: dict[str, Any] | None, expected: dict[str, Any] | None) -> None:
    final = report(phase="Succeeded", step=30, totalSteps=30, loss=0.91, performance=performance)
    d = decide(observed(job=job("Created", "Succeeded"), pods=[pod(0, "Succeeded", exit_code=0, message=final)], progress=None))
    assert d.status["phase"] == "Succeeded" and d.status.get("performance") == expected


def test_success_waits_for_the_leaders_report_before_settling() -> None:
    pods = [pod(0, "Running"), pod(1, "Succeeded", exit_code=0)]  # rank 0 runs on worker-0, still exporting
    d = decide(observed(job=job("Created", "Succeeded"), pods=pods))
    assert d.status.get("phase") != "Succeeded" and d.requeue_after == 1.0


def test_success_without_any_report_settles_on_the_last_progress() -> None:
    d = decide(observed(job=job("Created", "Succeeded"), pods=[]))
    assert d.status["phase"] == "Succeeded" and d.status["progress"]["step"] == 12


# ------------------------------------------------------------------------------- failures
def failing(pods: list[dict[str, Any]], status: dict[str, Any] | None = None, **kw: Any) -> lifecycle.Decision:
    return decide(observed(status, job=job("Created", "Running"), pods=pods, **kw))


CASES = [
    # (pods, reason, retryable, node excluded)
    ([pod(0), pod(1, "Failed", exit_code=1, message=report(phase="Failed", reason="ConfigError", message="spec.dataset.source: no such file"))],
     "ConfigError", False, None),
    ([pod(0), pod(1, "Failed", node="node-3")], "TrainerError", True, None),
    ([pod(0), {**pod(1, "Failed", node="node-3"), "status": {"phase": "Failed", "reason": "NodeLost"}}], "NodeLost", True, "node-3"),
    ([pod(0), {**pod(1, "Failed", node="node-2"), "status": {"phase": "Failed", "reason": "Evicted", "message": "low on memory"}}],
     "Evicted", True, "node-2"),
    ([pod(0), pod(1, "Running", node="node-5", conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}])],
     "Preempted", True, None),
    ([pod(0), pod(1, "Running", node="node-5", conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}])],
     "NodeLost", True, "node-5"),
    # Pod GC deletes the pods of a node that is gone (the operator cannot read Nodes: this is how it knows).
    ([pod(0), pod(1, "Running", node="node-6", conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC"}])],
     "NodeLost", True, "node-6"),
    ([pod(0), pod(1, "Failed", exit_code=137, reason="OOMKilled")], "OOMKilled", True, None),
    ([pod(0), pod(1, "Failed", exit_code=137)], "Killed", True, None),
    ([pod(0, "Failed", exit_code=1, message=report(phase="Failed", reason="CollectiveTimeout", message="gloo timed out", step=12))],
     "CollectiveTimeout", True, None),
    ([pod(0, "Failed", exit_code=1, message="... RendezvousClosedError: Rendezvous for run_id=x was observed to be closed")],
     "RendezvousClosed", True, None),
    ([pod(0, "Failed", exit_code=1, message="Traceback ...\nRuntimeError: CUDA error: an illegal memory access")], "TrainerError", True, None),
    ([pod(0, "Failed", exit_code=143, message=report(phase="Failed", reason="Preempted", message="SIGTERM", step=12, checkpointStep=12))],
     "Preempted", True, None),
    # etcd lost mid-run: torchrun's agent fails with RendezvousConnectionError and SIGTERMs the
    # trainer; the evidence of the lost store wins over the SIGTERM's "Preempted".
    ([pod(0, "Failed", exit_code=1, message="torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The "
                                            "connection to etcd has failed. See inner exception for details.")],
     "RendezvousLost", True, None),
    ([pod(0, "Failed", exit_code=143, message=report(phase="Failed", reason="RendezvousLost", step=16, message=(
        "torchrun's agent stopped the workers: its rendezvous store (etcd at x-etcd:2379) is unreachable: SIGTERM: "
        "stopped after step 16"))), pod(1, "Failed", exit_code=143, message=report(phase="Failed", reason="Preempted",
                                                                                  message="SIGTERM", step=16))],
     "RendezvousLost", True, None),
    ([pod(0, "Failed", exit_code=1, message="etcd.EtcdConnectionFailed: Connection to etcd failed due to "
                                            "MaxRetryError"), pod(1, "Failed", exit_code=143, message=report(
        phase="Failed", reason="Preempted", message="SIGTERM: stopped after step 16", step=16))],
     "RendezvousLost", True, None),
]


def test_the_trainers_precedence_follows_the_operators_priority() -> None:
    """termination.PRECEDENCE (which failure a rank may overwrite in its pod's shared termination
    message) must rank the trainer's reasons as failures.PRIORITY ranks them, TrainerError
    standing for any other exception (OTHER_ERROR_PRECEDENCE); else a pod's message could keep a
    cause the operator ranks below the one a peer overwrote."""
    from llamaft_trainer.process import termination

    ranks = {**termination.PRECEDENCE, failures.TRAINER_ERROR: termination.OTHER_ERROR_PRECEDENCE}
    assert set(ranks) <= set(failures.PRIORITY)
    by_trainer = sorted(ranks, key=lambda r: -ranks[r])
    assert by_trainer == sorted(ranks, key=failures.PRIORITY.index)
    assert len(set(ranks.values())) == len(ranks)
    assert set(termination.PRECEDENCE) - {failures.TRAINER_ERROR} <= set(failures.TRAINER_REASONS)


@pytest.mark.parametrize(("pods", "reason", "retryable", "node"), CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_every_failure_is_classified(pods: list[dict[str, Any]], reason: str, retryable: bool, node: str | None) -> None:
    d = failing(pods)
    record = d.status["failures"][-1]
    assert record["reason"] == reason and record["retryable"] is retryable and record["attempt"] == 1
    assert record.get("node") == node
    if retryable:
        assert d.status["phase"] == "Restarting" and d.start_attempt == 2 and d.delete_jobs == [JOB]
        assert d.status["retriesUsed"] == 1 and d.status["attempt"] == 2 and d.retry is not None
        assert d.status.get("excludedNodes", []) == ([node] if node else [])
    else:
        assert d.status["phase"] == "Failed" and d.start_attempt is None and d.retry is None
        assert "not retrying" in d.status["message"] and "spec.dataset.source" in d.status["message"]


def test_the_most_specific_evidence_wins() -> None:
    """A lost node explains its peer's dead-peer error, not the other way round."""
    peer = pod(0, "Failed", exit_code=1, message=report(phase="Failed", reason="PeerLost", message="Connection closed by peer"))
    lost = {**pod(1, "Failed", node="node-7"), "status": {"phase": "Failed", "reason": "NodeLost"}}
    assert failing([peer, lost]).status["failures"][-1]["reason"] == "NodeLost"


def test_first_retry_is_immediate_later_ones_back_off() -> None:
    first = failing([pod(0, "Failed", exit_code=137)])
    assert first.start_attempt == 2 and first.requeue_after is None and first.status["retryAfter"] is None
    second = failing([pod(0, "Failed", exit_code=137)], {**RUNNING, "retriesUsed": 1, "attempt": 2})
    assert second.start_attempt is None and second.requeue_after == 10.0
    assert second.status["retryAfter"] == "2026-11-30T12:00:10Z" and second.status["attempt"] == 3
    third = failing([pod(0, "Failed", exit_code=137)], {**RUNNING, "retriesUsed": 2, "attempt": 3})
    assert third.requeue_after == 20.0
    assert lifecycle.backoff(30, 10.0) == lifecycle.MAX_BACKOFF_SECONDS


def test_budget_used_up_fails_with_the_history() -> None:
    history = [{"attempt": 1, "reason": "Killed", "retryable": True, "step": 4, "time": "t"}]
    d = failing([pod(0, "Failed", exit_code=137)], {**RUNNING, "retriesUsed": 3, "attempt": 4, "failures": history})
    assert d.status["phase"] == "Failed" and "retry budget (3) is used up" in d.status["message"]
    assert [f["attempt"] for f in d.status["failures"]] == [1, 4]
    assert any(e.reason == "RetryBudgetExhausted" for e in d.events)
    assert d.delete_jobs == [], "the training operator fails the job for its failed pod: it stays for kubectl logs"
    xid = failures.gpu_failure("XidError", "XID 79 on node-4", ["node-4"], 12)
    d = failing([pod(0), pod(1)], {**RUNNING, "retriesUsed": 3, "attempt": 4, "failures": history}, gpu=xid)
    assert d.status["phase"] == "Failed" and d.delete_jobs == [JOB], "nothing ends a job whose pods all run: it goes"


def test_the_same_failure_at_the_same_step_repeatedly_is_permanent() -> None:
    same = {"reason": "TrainerError", "step": 12, "retryable": True, "time": "t"}
    history = [{**same, "attempt": 1}, {**same, "attempt": 2}]
    crash = pod(0, "Failed", exit_code=1, message="RuntimeError: boom")
    d = failing([crash], {**RUNNING, "attempt": 3, "retriesUsed": 2, "failures": history})
    assert d.status["phase"] == "Failed" and "in 3 consecutive attempts" in d.status["message"]
    other_step = [{**same, "attempt": 1}, {**same, "attempt": 2, "step": 8}]
    d = failing([crash], {**RUNNING, "attempt": 3, "retriesUsed": 2, "failures": other_step})
    assert d.status["phase"] == "Restarting"


def test_failure_history_and_excluded_nodes_are_bounded() -> None:
    history = [{"attempt": i, "reason": "Killed", "retryable": True, "time": "t"} for i in range(30)]
    excluded = [f"n{i}" for i in range(16)]
    lost = {**pod(1, "Failed", node="node-x"), "status": {"phase": "Failed", "reason": "NodeLost"}}
    d = failing([lost], {**RUNNING, "retriesUsed": 0, "failures": history, "excludedNodes": excluded})
    assert len(d.status["failures"]) == lifecycle.MAX_FAILURE_HISTORY and d.status["failures"][-1]["reason"] == "NodeLost"
    assert len(d.status["excludedNodes"]) == 16 and d.status["excludedNodes"][-1] == "node-x" and "n0" not in d.status["excludedNodes"]


def test_a_gpu_xid_restarts_without_that_node() -> None:
    xid = failures.gpu_failure("XidError", "XID 79 on pod p GPU 3 on node-4: GPU has fallen off the bus", ["node-4"], 12)
    d = failing([pod(0), pod(1)], gpu=xid)
    assert d.status["failures"][-1]["reason"] == "GPUXid" and d.status["excludedNodes"] == ["node-4"]
    assert failures.gpu_failure("LowUtilization", "idle", [], None) is None


def test_a_stall_names_the_leader_and_the_last_step() -> None:
    st = {**RUNNING, "leaderPod": f"{JOB}-worker-1", "lastProgressTime": "2026-11-30T11:40:00Z"}
    d = failing([pod(0), pod(1)], st, spec=spec(progressDeadlineSeconds=600))
    record = d.status["failures"][-1]
    assert record["reason"] == "Stalled" and record["step"] == 12 and f"{JOB}-worker-1" in record["message"]
    fresh = {**st, "lastProgressTime": "2026-11-30T11:55:00Z"}
    assert "failures" not in failing([pod(0), pod(1)], fresh, spec=spec(progressDeadlineSeconds=600)).status


def test_startup_grace_before_the_first_step() -> None:
    st = {**RUNNING, "lastProgressTime": None, "attemptStartTime": "2026-11-30T11:30:00Z"}
    quick = spec(progressDeadlineSeconds=600, startupGraceSeconds=1800)
    assert "failures" not in failing([pod(0), pod(1)], st, spec=quick).status, "30 min < 10 min + 30 min grace"
    late = spec(progressDeadlineSeconds=600, startupGraceSeconds=600)
    assert failing([pod(0), pod(1)], st, spec=late).status["failures"][-1]["reason"] == "Stalled"


def test_a_step_advance_moves_the_progress_clock() -> None:
    st = {**RUNNING, "lastProgressTime": "2026-11-30T11:00:00Z"}
    d = failing([pod(0), pod(1)], st, spec=spec(progressDeadlineSeconds=600), progress={"rank": 0, "step": 13, "totalSteps": 30})
    assert d.status["lastProgressTime"] == "2026-11-30T12:00:00Z" and d.status["phase"] == "Running"
    assert d.status["progress"]["step"] == 13


def test_suspended_runs_are_not_failures() -> None:
    st = {**RUNNING, "phase": "Suspended"}
    s = spec()
    s = s.model_copy(update={"run_policy": s.run_policy.model_copy(update={"suspend": True})})
    d = decide(observed(st, spec=s, job=job("Suspended"), pods=[pod(0, "Failed", exit_code=143)]))
    assert "failures" not in d.status and d.status["phase"] == "Suspended" and d.start_attempt is None


CONFIG_ERROR = report(phase="Failed", reason="ConfigError", message="spec.dataset.source: /data/x.jsonl: no such file")


def config_error(index: int = 0) -> dict[str, Any]:
    """The pod of a trainer that found no dataset: Failed, its termination message a FailedReport."""
    return pod(index, "Failed", exit_code=2, message=CONFIG_ERROR)


def test_a_permanent_verdict_keeps_a_job_the_training_operator_failed() -> None:
    d = decide(observed(job=job("Created", "Failed"), pods=[config_error()]))
    assert d.status["phase"] == "Failed" and d.delete_jobs == []


def test_job_level_failures() -> None:
    d = decide(observed(job=job("Created", "Failed"), pods=[]))
    assert d.status["failures"][-1]["reason"] == "JobFailed" and d.status["phase"] == "Restarting"
    deadline = job("Created")
    deadline["status"]["conditions"].append({"type": "Failed", "status": "True", "reason": "DeadlineExceeded", "message": "too long"})
    assert decide(observed(job=deadline, pods=[])).status["phase"] == "Failed"


def test_observed_is_a_value() -> None:
    """replace() keeps rows short; a sanity check that Observed stays a frozen dataclass."""
    o = observed()
    assert replace(o, job=None).job is None and o.job is None


def test_a_job_whose_creating_step_never_wrote_its_status_is_recorded_as_the_attempt() -> None:
    """The operator died between creating attempt 1's job and writing that step's status (a leader
    killed mid-step): the next look records the attempt instead of leaving attempt 0 behind."""
    d = decide(observed({}, job=job("Created", "Running"), pods=[pod(0), pod(1)]))
    assert d.status["attempt"] == 1 and d.status["jobName"] == JOB and d.start_attempt is None
    assert d.status["phase"] == "Running"


# ------------------------------------------------------------------------------ the table
def queued_spec() -> LlamaFineTuneSpec:
    s = spec()
    return s.model_copy(update={"scheduling": s.scheduling.model_copy(update={"queue_name": "team-a-gpus"})})


ROWS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # (row, observed state, what the decision does: start, deletes, rendezvous resets, phase, events)
    ("new run creates attempt 1", dict(status={}), dict(start=1, phase="Creating")),
    ("missing job of a running attempt is recreated", dict(), dict(start=1, phase="Restarting")),
    ("stale jobs are deleted", dict(stale_jobs=["ft-abcd-0"], job=job("Created", "Running"), pods=[pod(0)]),
     dict(delete=["ft-abcd-0"], phase="Running")),
    ("a job still being deleted is waited for", dict(job_deleting=True), dict(phase="Running", requeue=1.0)),
    ("a finished run is final", dict(status={**RUNNING, "phase": "Succeeded"}), dict(status={})),
    ("capacity refusal: no attempt, Failed WillNotFit", dict(status={}, capacity_refusal="needs 80 GiB per GPU, has 40"),
     dict(phase="Failed", failed="WillNotFit", events=["WillNotFit"])),
    ("capacity refusal does not touch a running attempt", dict(capacity_refusal="x", job=job("Created", "Running"), pods=[pod(0)]),
     dict(phase="Running")),
    ("Kueue suspends a started job: Queued, its rendezvous reset",
     dict(spec=queued_spec(), job=job("Created", "Suspended"), pods=[]), dict(phase="Queued", reset=[1], events=["Queued"])),
    ("still queued: no second reset", dict(spec=queued_spec(), status={**RUNNING, "phase": "Queued"}, job=job("Created", "Suspended")),
     dict(phase="Queued")),
    ("queued at creation (no attempt recorded yet): nothing to reset",
     dict(spec=queued_spec(), status={}, job=job("Created", "Suspended")), dict(phase="Queued")),
    ("a user's suspend is Suspended, not queued", dict(spec=spec(suspend=True), job=job("Suspended")), dict(phase="Suspended")),
    # A permanent failure, whichever reaches the operator first: the failed pod's termination report
    # or the job's Failed condition. The training operator fails the job for its failed pod
    # (restartPolicy Never) and removes only the pods still running (cleanPodPolicy Running); the
    # job is never deleted, which would take its failed pods and their logs with it.
    ("permanent, the pod's report before the job's Failed condition: the job and its failed pod stay",
     dict(job=job("Created", "Running"), pods=[config_error()]),
     dict(phase="Failed", failed="ConfigError", events=["ConfigError"])),
    ("permanent, the job's Failed condition first: the job and its failed pod stay",
     dict(job=job("Created", "Failed"), pods=[config_error()]),
     dict(phase="Failed", failed="ConfigError", events=["ConfigError"])),
    ("permanent on 2 workers, the report first: the training operator stops the running one, the job stays",
     dict(job=job("Created", "Running"), pods=[pod(0), config_error(1)]),
     dict(phase="Failed", failed="ConfigError", events=["ConfigError"])),
    ("permanent on 2 workers, the job's Failed condition first: the job stays",
     dict(job=job("Created", "Running", "Failed"), pods=[pod(0), config_error(1)]),
     dict(phase="Failed", failed="ConfigError", events=["ConfigError"])),
    ("permanent, the failed pod already being deleted: nothing fails the job, it goes",
     dict(job=job("Created", "Running"), pods=[{**config_error(), "metadata": {"name": f"{JOB}-worker-0",
                                                                            "deletionTimestamp": "2026-11-30T11:59:59Z"}}]),
     dict(phase="Failed", failed="ConfigError", delete=[JOB], events=["ConfigError"])),
    ("permanent on a TrainJob, whose Job replaces a failed pod: the job goes",
     dict(job_kind="TrainJob", job={**job(), "kind": "TrainJob"}, pods=[config_error()]),
     dict(phase="Failed", failed="ConfigError", delete=[JOB], events=["ConfigError"])),
]


@pytest.mark.parametrize(("row", "state", "want"), ROWS, ids=[r[0] for r in ROWS])
def test_the_lifecycle_table(row: str, state: dict[str, Any], want: dict[str, Any]) -> None:
    d = decide(observed(**state))
    assert d.start_attempt == want.get("start"), row
    assert d.delete_jobs == want.get("delete", []), row
    assert d.reset_rendezvous == want.get("reset", []), row
    if "status" in want:
        assert d.status == want["status"], row
    if "phase" in want:  # the phase once the patch is written
        assert d.status.get("phase", state.get("status", RUNNING).get("phase")) == want["phase"], row
    if "failed" in want:
        assert next(c for c in d.status["conditions"] if c["type"] == "Failed")["reason"] == want["failed"], row
    if "events" in want:
        assert [e.reason for e in d.events] == want["events"], row
    if "requeue" in want:
        assert d.requeue_after == want["requeue"], row


def test_a_child_the_api_server_rejects_fails_the_run_once() -> None:
    """The event `the API server rejected a child` (422 on create) -> Failed, ChildRejected; the
    same event on a run already Failed posts no second event."""
    d = lifecycle.refused(observed({}), "ChildRejected", "the API server rejected a child object: spec.foo: Invalid value")
    assert d.status["phase"] == "Failed" and [e.reason for e in d.events] == ["ChildRejected"] and d.start_attempt is None
    again = lifecycle.refused(observed({**RUNNING, "phase": "Failed"}), "ChildRejected", "same")
    assert again.events == []


# ------------------------------------------------------------------------------ spec changes
def change(status: dict[str, Any] | None = None, changed: set[tuple[str, ...]] | None = None, **kw: Any) -> spec_changes.SpecChanged:
    base: dict[str, Any] = dict(spec=spec(), status=dict(RUNNING if status is None else status),
                                changed=frozenset(changed or set()), job_name=JOB, generation=2)
    base.update(kw)
    return spec_changes.SpecChanged(**base)


SUSPEND, WORKERS, LR = ("runPolicy", "suspend"), ("cluster", "workers"), ("training", "learningRate")
SPEC_ROWS: list[tuple[str, spec_changes.SpecChanged, dict[str, Any]]] = [
    ("never started: the lifecycle starts it", change({}, {LR}), dict(wake=True, status={})),
    ("started but unrecorded: attempt 1 restarts as 2", change({}, {LR}, first_job_exists=True),
     dict(wake=True, delete=JOB, attempt=2, events=["SpecChanged"])),
    ("a finished run stays finished", change({**RUNNING, "phase": "Succeeded"}, {LR}),
     dict(status={"observedGeneration": 2}, events=["Finished"])),
    ("nothing the run sees changed", change(changed=set()), dict(status={"observedGeneration": 2})),
    ("suspend in place", change(changed={SUSPEND}, spec=spec(suspend=True)),
     dict(wake=True, suspend=True, status={"observedGeneration": 2}, events=["Suspended"])),
    ("resume in place, the rendezvous reset first", change(changed={SUSPEND}),
     dict(wake=True, suspend=False, reset=[1], status={"observedGeneration": 2}, events=["Resumed"])),
    ("elastic workers in place", change(changed={WORKERS}, scalable=True),
     dict(wake=True, scale=2, status={"observedGeneration": 2, "workers": {
         "current": 2, "desired": 2, "reason": "AsSpecified", "message": "spec.cluster.workers changed: scaled in place"}},
          events=["Scaled"])),
    ("workers of a backend that cannot scale: restart", change(changed={WORKERS}, scalable=False),
     dict(wake=True, delete=JOB, attempt=2, events=["SpecChanged"])),
    ("monitoring in place", change(changed={("monitoring", "dcgm", "enabled")}),
     dict(wake=True, status={"observedGeneration": 2}, events=["MonitoringChanged"])),
    ("anything else restarts from the checkpoint", change(changed={LR, SUSPEND}),
     dict(wake=True, delete=JOB, attempt=2, events=["SpecChanged"])),
]


@pytest.mark.parametrize(("row", "event", "want"), SPEC_ROWS, ids=[r[0] for r in SPEC_ROWS])
def test_the_spec_change_table(row: str, event: spec_changes.SpecChanged, want: dict[str, Any]) -> None:
    d = spec_changes.decide_spec_change(event)
    assert d.wake == want.get("wake", False), row
    assert d.delete_job == want.get("delete"), row
    assert d.suspend == want.get("suspend"), row
    assert d.scale_to == want.get("scale"), row
    assert d.reset_rendezvous == want.get("reset", []), row
    assert [e.reason for e in d.events] == want.get("events", []), row
    if "status" in want:
        assert d.status == want["status"], row
    if "attempt" in want:
        assert d.status["attempt"] == want["attempt"] and d.status["phase"] == "Restarting" and d.status["retryAfter"] is None
        assert "restarting from the latest checkpoint as attempt" in d.status["message"], row


# ------------------------------------------------------------------------------ one look, one patch
@pytest.mark.parametrize(("row", "state", "want"), ROWS, ids=[r[0] for r in ROWS])
def test_a_decision_asks_observe_once_and_its_patch_is_its_typed_change(
    row: str, state: dict[str, Any], want: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """lifecycle consults observe from one place (`_look`), at most once per decision, and the
    status a decision writes is its typed change's merge patch, nothing added on the way."""
    from llamaft.operator import observe

    looks: list[object] = []
    real = observe.observe

    def counted(*args: Any, **kwargs: Any) -> observe.Observation:
        looks.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(observe, "observe", counted)
    d = decide(observed(**state))
    assert len(looks) <= 1, row
    assert d.status == d.change.merge_patch() and set(d.status) == {
        str(observe.StatusChange.model_fields[name].alias) for name in d.change.model_fields_set}, row
