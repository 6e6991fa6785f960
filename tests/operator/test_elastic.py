"""An elastic run's size as tables: `elastic.shrink` / `elastic.grow` (which size, when), and the
lifecycle rows that carry them out (in place on a PyTorchJob, a new attempt on a TrainJob), each
resize an event and a status change. No cluster, no clock."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.status import WorkerCounts, read_status
from llamaft.operator import elastic, lifecycle
from llamaft.operator.elastic import Placement

from tests.operator.test_lifecycle import JOB, NOW, RUNNING, job, observed, pod

INDEX = "training.kubeflow.org/replica-index"


def elastic_spec(workers: int = 2, low: int = 1, high: int = 2, every: int = 10, **fields: Any) -> LlamaFineTuneSpec:
    return LlamaFineTuneSpec.model_validate({
        "model": {"source": "/models/tiny"}, "dataset": {"format": "samsum", "source": "/data/x.jsonl"},
        "checkpointing": {"everyNSteps": every},
        "cluster": {"workers": workers, "gpusPerWorker": 0,
                    "elastic": {"minWorkers": low, "maxWorkers": high, "shrinkAfterSeconds": 60, "growBackAfterSeconds": 300,
                                **fields}},
        "runPolicy": {"retryBudget": 3},
    })


def pending(index: int, since: datetime | None = NOW - timedelta(seconds=61), message: str = "0/1 nodes are available: "
            "1 Insufficient cpu.", reason: str = "Unschedulable") -> dict[str, Any]:
    """A worker pod the scheduler could not place, as kube-scheduler leaves it."""
    conditions = [] if since is None else [{
        "type": "PodScheduled", "status": "False", "reason": reason, "message": message,
        "lastTransitionTime": since.isoformat().replace("+00:00", "Z")}]
    return {"metadata": {"name": f"{JOB}-worker-{index}", "labels": {INDEX: str(index)}}, "spec": {},
            "status": {"phase": "Pending", "conditions": conditions}}


def placed(index: int) -> dict[str, Any]:
    out = pod(index)
    out["metadata"]["labels"] = {INDEX: str(index)}
    return out


def fits_all(n: int) -> str | None:
    return None


# ------------------------------------------------------------------------------ placement
def test_placement_counts_only_pods_the_scheduler_marked_unschedulable() -> None:
    early = NOW - timedelta(seconds=90)
    pods = [placed(0), pending(1, early, "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."), pending(2),
            pending(3, since=None),  # not tried yet: no PodScheduled condition
            pending(4, reason="SchedulingGated"),
            {**pending(5), "metadata": {"name": "x", "deletionTimestamp": "2026-11-30T11:00:00Z"}}]
    got = elastic.placement(pods)
    assert (got.unschedulable, got.since, got.message) == (2, early, "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    assert elastic.unschedulable_indices(pods, INDEX) == [1, 2]
    assert elastic.placement([placed(0), placed(1)]) == Placement()


# ------------------------------------------------------------------------------ shrink
SHRINK_ROWS: list[tuple[str, dict[str, Any], tuple[int, str] | None]] = [
    # (row, arguments, (workers, reason) or None: nothing due)
    ("not elastic: waits as before", dict(spec=LlamaFineTuneSpec.model_validate({
        "model": {"source": "/m"}, "dataset": {"format": "samsum", "source": "/d.jsonl"},
        "cluster": {"workers": 2, "gpusPerWorker": 0}})), None),
    ("nothing unschedulable", dict(placed=Placement()), None),
    ("unschedulable, but not for shrinkAfterSeconds yet", dict(placed=Placement(1, NOW - timedelta(seconds=59))), None),
    ("one of two unschedulable past the timeout: 1 worker", dict(), (1, elastic.SHRUNK)),
    ("a new attempt's pod waits for its predecessor's to go (grace 120 s): not yet",
     dict(attempt_start=NOW - timedelta(seconds=150)), None),
    ("... and once the grace period and the timeout have passed: 1 worker",
     dict(attempt_start=NOW - timedelta(seconds=181)), (1, elastic.SHRUNK)),
    ("the largest placed size: 4 of 6 placed", dict(spec=elastic_spec(6, 1, 8), current=6, placed=Placement(2, NOW - timedelta(hours=1))),
     (4, elastic.SHRUNK)),
    ("the planner refuses 4 and 3: 2", dict(spec=elastic_spec(6, 1, 8), current=6, placed=Placement(2, NOW - timedelta(hours=1)),
                                             fits=lambda n: "needs 90 GiB per GPU" if n > 2 else None), (2, elastic.SHRUNK)),
    ("no size down to minWorkers fits: it waits, the reason says so",
     dict(spec=elastic_spec(4, 3, 4), current=4, fits=lambda n: f"{n} workers: needs 90 GiB per GPU, has 80"),
     (4, elastic.NO_SMALLER_SIZE_FITS)),
    ("placed fewer than minWorkers: it waits", dict(spec=elastic_spec(3, 2, 3), current=3, placed=Placement(2, NOW - timedelta(hours=1))),
     (3, elastic.NO_SMALLER_SIZE_FITS)),
]


@pytest.mark.parametrize(("row", "args", "want"), SHRINK_ROWS, ids=[r[0] for r in SHRINK_ROWS])
def test_the_shrink_table(row: str, args: dict[str, Any], want: tuple[int, str] | None) -> None:
    base: dict[str, Any] = dict(spec=elastic_spec(), current=2, placed=Placement(1, NOW - timedelta(seconds=61), "0/1 nodes"),
                                now=NOW, fits=fits_all)
    base.update(args)
    got = elastic.shrink(**base)
    assert (None if got is None else (got.workers, got.reason)) == want, row


def test_a_refusal_names_each_size_and_the_planners_words() -> None:
    got = elastic.shrink(elastic_spec(4, 2, 4), 4, Placement(1, NOW - timedelta(hours=1), "0/3 nodes are available"), NOW,
                         lambda n: f"needs {100 - n} GiB")
    assert got is not None and not got.resizes
    assert "no size from 3 down to elastic.minWorkers 2 fits" in got.message
    assert "3: needs 97 GiB; 2: needs 98 GiB" in got.message and "0/3 nodes are available" in got.message


def test_the_planner_decides_on_the_smaller_size_with_the_same_spec() -> None:
    """The check goes to the planner with cluster.workers = n and nothing else changed."""
    asked: list[LlamaFineTuneSpec] = []
    spec = elastic_spec(4, 1, 4)
    elastic.shrink(spec, 4, Placement(2, NOW - timedelta(hours=1)), NOW,
                   lambda n: asked.append(elastic.sized(spec, n)) or "no")  # type: ignore[func-returns-value]
    assert [s.cluster.workers for s in asked] == [2, 1]
    assert all(s.model_copy(update={"cluster": spec.cluster}) == spec for s in asked)


# ------------------------------------------------------------------------------ Kueue holds the job
def workload(status: str = "False", since: datetime = NOW - timedelta(seconds=61), deleting: bool = False,
             message: str = "couldn't assign flavors to pod set worker: insufficient unused quota for nvidia.com/gpu in "
                            "flavor h100, 8 more needed") -> dict[str, Any]:
    """A job's Workload as Kueue's scheduler leaves it when it does not fit (QuotaReserved False, Pending)."""
    meta: dict[str, Any] = {"name": "pytorchjob-ft-abcd-1-9f2c1", "labels": {elastic.WORKLOAD_JOB_UID: "job-uid"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-30T11:59:00Z"
    return {"metadata": meta, "status": {"conditions": [
        {"type": "QuotaReserved", "status": status, "reason": "Pending" if status == "False" else "QuotaReserved",
         "message": message, "lastTransitionTime": since.isoformat().replace("+00:00", "Z")}]}}


def test_the_quota_wait_is_the_workloads_quota_reserved_false() -> None:
    wait = elastic.quota_wait([workload()])
    assert wait is not None and wait.since == NOW - timedelta(seconds=61) and "8 more needed" in wait.message
    assert elastic.quota_wait([workload("True")]) is None, "Kueue reserved quota: admitted or about to be"
    assert elastic.quota_wait([{"metadata": {"name": "w"}, "status": {}}]) is None, "not looked at by Kueue yet"
    assert elastic.quota_wait([workload(deleting=True)]) is None and elastic.quota_wait([]) is None
    assert elastic.quota_wait([workload(deleting=True), workload(since=NOW)]) == elastic.QuotaWait(NOW, workload()["status"][
        "conditions"][0]["message"]), "the one not being deleted"


def waited(seconds: float) -> elastic.QuotaWait:
    return elastic.QuotaWait(NOW - timedelta(seconds=seconds), "insufficient unused quota for nvidia.com/gpu")


QUEUED_SHRINK_ROWS: list[tuple[str, dict[str, Any], tuple[int, str] | None]] = [
    ("admitted or not looked at: nothing", dict(wait=None), None),
    ("waiting for quota, not for shrinkAfterSeconds yet", dict(wait=waited(59)), None),
    ("waiting past the timeout: one worker fewer", dict(), (3, elastic.SHRUNK)),
    ("shrunk 30 s ago, the condition older (it stays False through Kueue's rewrite): not yet",
     dict(last_resize=NOW - timedelta(seconds=30)), None),
    ("... and 61 s after that resize: one fewer again", dict(current=3, last_resize=NOW - timedelta(seconds=61)), (2, elastic.SHRUNK)),
    ("the planner refuses 3: 2", dict(fits=lambda n: "needs 90 GiB per GPU" if n == 3 else None), (2, elastic.SHRUNK)),
    ("at minWorkers: it waits in the queue, the reason says so", dict(current=2), (2, elastic.NO_SMALLER_SIZE_FITS)),
    ("no smaller size fits in memory: it waits", dict(fits=lambda n: "needs 90 GiB per GPU"), (4, elastic.NO_SMALLER_SIZE_FITS)),
    ("not elastic: nothing", dict(spec=LlamaFineTuneSpec.model_validate({
        "model": {"source": "/m"}, "dataset": {"format": "samsum", "source": "/d.jsonl"},
        "cluster": {"workers": 4, "gpusPerWorker": 0}})), None),
]


@pytest.mark.parametrize(("row", "args", "want"), QUEUED_SHRINK_ROWS, ids=[r[0] for r in QUEUED_SHRINK_ROWS])
def test_the_queued_shrink_table(row: str, args: dict[str, Any], want: tuple[int, str] | None) -> None:
    base: dict[str, Any] = dict(spec=elastic_spec(4, 2, 4), current=4, wait=waited(3600), now=NOW, fits=fits_all, last_resize=None)
    base.update(args)
    got = elastic.shrink_queued(**base)
    assert (None if got is None else (got.workers, got.reason)) == want, row
    if got is not None:
        assert "Kueue has reserved no quota" in got.message and "insufficient unused quota" in got.message, row


# ------------------------------------------------------------------------------ grow
def shrunk(at_step: int | None = 15, ago: float = 301) -> WorkerCounts:
    return WorkerCounts(current=1, desired=2, reason=elastic.SHRUNK, last_resize_step=at_step,
                        last_resize_time=(NOW - timedelta(seconds=ago)).isoformat().replace("+00:00", "Z"))


GROW_ROWS: list[tuple[str, dict[str, Any], int | None]] = [
    ("at its size: nothing", dict(current=2, workers=WorkerCounts(current=2, reason=elastic.AS_SPECIFIED)), None),
    ("shrunk, the next checkpoint passed, growBackAfterSeconds passed: back to 2", dict(), 2),
    ("shrunk, growBackAfterSeconds not passed yet", dict(workers=shrunk(ago=299)), None),
    ("shrunk, no checkpoint since the shrink (steps 15 -> 19, every 10)", dict(step=19), None),
    ("shrunk before any step: the first checkpoint", dict(workers=shrunk(at_step=None), step=10), 2),
    ("no progress seen: no checkpoint known", dict(step=None), None),
]


@pytest.mark.parametrize(("row", "args", "want"), GROW_ROWS, ids=[r[0] for r in GROW_ROWS])
def test_the_grow_table(row: str, args: dict[str, Any], want: int | None) -> None:
    base: dict[str, Any] = dict(spec=elastic_spec(), current=1, workers=shrunk(), step=21, now=NOW)
    base.update(args)
    got = elastic.grow(**base)
    assert (None if got is None else got.workers) == want, row
    assert got is None or got.reason == elastic.GROWING_BACK


def test_the_current_size_follows_the_spec_unless_shrunk() -> None:
    spec = elastic_spec(3, 1, 4)
    assert elastic.current_workers(spec, WorkerCounts()) == 3
    assert elastic.current_workers(spec, WorkerCounts(current=2, reason=elastic.AS_SPECIFIED)) == 3, "the spec changed since"
    assert elastic.current_workers(spec, WorkerCounts(current=2, reason=elastic.SHRUNK)) == 2
    assert elastic.current_workers(elastic_spec(2, 2, 4), WorkerCounts(current=1, reason=elastic.SHRUNK)) == 2, "minWorkers rose"


# ------------------------------------------------------------------------------ lifecycle rows
def queued_spec(workers: int = 2, low: int = 1) -> LlamaFineTuneSpec:
    """An elastic spec whose job Kueue admits (scheduling.queueName)."""
    spec = elastic_spec(workers, low, workers)
    return spec.model_copy(update={"scheduling": spec.scheduling.model_copy(update={"queue_name": "team-a-gpus"})})


CREATING = {"phase": "Creating", "attempt": 1, "attemptStartTime": "2026-11-30T08:00:00Z"}
SHRUNK_STATUS = {**RUNNING, "workers": {"current": 1, "desired": 2, "reason": "Shrunk", "lastResizeTime": "2026-11-30T11:00:00Z",
                                        "lastResizeStep": 5}}
RUNNING_JOB = job("Created", "Running", replicaStatuses={"Worker": {"active": 1}})
STALE = {**RUNNING, "lastProgressTime": "2026-11-30T11:40:00Z"}
"""No step for 20 minutes: past runPolicy.progressDeadlineSeconds (900 s by default)."""
LIFECYCLE_ROWS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # (row, observed state, what the decision does)
    ("first attempt of an elastic run: its size in the status", dict(spec=elastic_spec(), status={}),
     dict(start=1, workers=2, size=(2, "AsSpecified"))),
    ("PyTorchJob, worker-1 unschedulable: scaled to 1 in place",
     dict(spec=elastic_spec(), job=RUNNING_JOB, pods=[placed(0), pending(1)], scalable=True),
     dict(scale=1, size=(1, "Shrunk"), events=["Shrunk"], resized=True)),
    ("PyTorchJob, worker-0 unschedulable: an in-place scale would remove the running one: next attempt",
     dict(spec=elastic_spec(), job=RUNNING_JOB, pods=[pending(0), placed(1)], scalable=True),
     dict(start=2, workers=1, delete=[JOB], size=(1, "Shrunk"), phase="Restarting", events=["Shrunk"], resized=True)),
    ("TrainJob: each size change is the next attempt from the newest checkpoint",
     dict(spec=elastic_spec(), job_kind="TrainJob", job=RUNNING_JOB, pods=[placed(0), pending(1)]),
     dict(start=2, workers=1, delete=[JOB], size=(1, "Shrunk"), phase="Restarting", events=["Shrunk"], resized=True)),
    ("unschedulable, not long enough: nothing", dict(spec=elastic_spec(), job=RUNNING_JOB, scalable=True,
                                                   pods=[placed(0), pending(1, NOW - timedelta(seconds=30))]), dict()),
    ("the planner fits no smaller size: waits, says so once",
     dict(spec=elastic_spec(), job=RUNNING_JOB, pods=[placed(0), pending(1)], scalable=True, fits=lambda n: "needs 90 GiB"),
     dict(size=(2, "NoSmallerSizeFits"), events=["NoSmallerSizeFits"])),
    ("just scaled down in place: the pod its controller is about to remove does not count",
     dict(spec=elastic_spec(), status=SHRUNK_STATUS, job=RUNNING_JOB, pods=[placed(0), pending(1)], scalable=True,
          now=NOW - timedelta(minutes=59)), dict()),
    ("still nothing fits: no second event",
     dict(spec=elastic_spec(), status={**RUNNING, "workers": {"current": 2, "reason": "NoSmallerSizeFits"}}, job=RUNNING_JOB,
          pods=[placed(0), pending(1)], scalable=True, fits=lambda n: "needs 90 GiB"),
     dict(size=(2, "NoSmallerSizeFits"))),
    ("shrunk, a checkpoint later: grows back in place",
     dict(spec=elastic_spec(), status=SHRUNK_STATUS, job=RUNNING_JOB, pods=[placed(0)], scalable=True),
     dict(scale=2, size=(2, "GrowingBack"), events=["GrowingBack"], resized=True)),
    ("shrunk TrainJob, a checkpoint later: grows back as the next attempt",
     dict(spec=elastic_spec(), job_kind="TrainJob", status=SHRUNK_STATUS, job=RUNNING_JOB, pods=[placed(0)]),
     dict(start=2, workers=2, delete=[JOB], size=(2, "GrowingBack"), phase="Restarting", events=["GrowingBack"], resized=True)),
    ("grown back and every worker runs: AsSpecified",
     dict(spec=elastic_spec(), status={**RUNNING, "workers": {"current": 2, "reason": "GrowingBack"}},
          job=job("Created", "Running", replicaStatuses={"Worker": {"active": 2}}), pods=[placed(0), placed(1)], scalable=True),
     dict(size=(2, "AsSpecified"), events=["GrewBack"])),
    ("a retry of a shrunk run keeps its size", dict(spec=elastic_spec(), status={**SHRUNK_STATUS, "phase": "Restarting"}),
     dict(start=1, workers=1, size=(1, "Shrunk"))),
    ("a worker waits for a node past progressDeadlineSeconds, the shrink's clock still runs: no Stalled retry",
     dict(spec=elastic_spec(shrinkAfterSeconds=1500), status=STALE, job=RUNNING_JOB, scalable=True,
          pods=[placed(0), pending(1, NOW - timedelta(seconds=1000))]), dict()),
    ("stalled and the shrink due at one look: the shrink, not a retry",
     dict(spec=elastic_spec(), status=STALE, job=RUNNING_JOB, pods=[placed(0), pending(1)], scalable=True),
     dict(scale=1, size=(1, "Shrunk"), events=["Shrunk"], resized=True)),
    ("a suspended job is not resized", dict(spec=elastic_spec(), job=job("Suspended"), pods=[pending(1)], scalable=True),
     dict(events=["Suspended"])),
    ("Kueue holds the PyTorchJob, its Workload waits for quota past the timeout: scaled to 1 while queued",
     dict(spec=queued_spec(), status=CREATING, job=job("Created", "Suspended"), scalable=True, quota=waited(61)),
     dict(scale=1, size=(1, "Shrunk"), phase="Queued", events=["Shrunk", "Queued"], resized=True)),
    ("Kueue holds the TrainJob: the next attempt at 1 worker (its size is immutable)",
     dict(spec=queued_spec(), status=CREATING, job_kind="TrainJob", job=job("Created", "Suspended"), quota=waited(61)),
     dict(start=2, workers=1, delete=[JOB], size=(1, "Shrunk"), phase="Restarting", events=["Shrunk"], resized=True)),
    ("Kueue holds it, waiting for quota under the timeout: queued as before",
     dict(spec=queued_spec(), status=CREATING, job=job("Created", "Suspended"), scalable=True, quota=waited(30)),
     dict(phase="Queued", events=["Queued"])),
    ("shrunk while Kueue held it, admitted and a checkpoint later: grows back in place (Kueue admits the new size)",
     dict(spec=queued_spec(), status=SHRUNK_STATUS, job=RUNNING_JOB, pods=[placed(0)], scalable=True),
     dict(scale=2, size=(2, "GrowingBack"), events=["GrowingBack"], resized=True)),
    ("shrunk TrainJob under Kueue, a checkpoint later: grows back as the next attempt",
     dict(spec=queued_spec(), job_kind="TrainJob", status=SHRUNK_STATUS, job=RUNNING_JOB, pods=[placed(0)]),
     dict(start=2, workers=2, delete=[JOB], size=(2, "GrowingBack"), phase="Restarting", events=["GrowingBack"], resized=True)),
    ("Kueue holds it at minWorkers: NoSmallerSizeFits, queued",
     dict(spec=queued_spec(low=2), status=CREATING, job=job("Created", "Suspended"), scalable=True, quota=waited(61)),
     dict(size=(2, "NoSmallerSizeFits"), phase="Queued", events=["NoSmallerSizeFits", "Queued"])),
]


@pytest.mark.parametrize(("row", "state", "want"), LIFECYCLE_ROWS, ids=[r[0] for r in LIFECYCLE_ROWS])
def test_the_elastic_lifecycle_table(row: str, state: dict[str, Any], want: dict[str, Any]) -> None:
    obs = observed(**state)
    d = lifecycle.decide(obs)
    assert d.start_attempt == want.get("start"), row
    assert d.workers == want.get("workers"), row
    assert d.scale_to == want.get("scale"), row
    assert d.delete_jobs == want.get("delete", []), row
    assert [e.reason for e in d.events if e.reason not in ("Running", "Created")] == want.get("events", []), row
    workers = d.status.get("workers")
    if "size" in want:
        assert (workers["current"], workers["reason"]) == want["size"], row
        assert d.status.get("totalGpus", 0) == workers["current"] * obs.spec.cluster.gpus_per_worker, row
        assert workers["desired"] == obs.spec.cluster.workers
    else:
        assert workers is None or "current" not in workers or workers["current"] == read_status(obs.status).workers.current
    if want.get("resized"):
        assert workers["lastResizeTime"] == "2026-11-30T12:00:00Z" and workers["message"], row
    if "phase" in want:
        assert d.status["phase"] == want["phase"], row
    assert "retriesUsed" not in d.status or d.status["retriesUsed"] == obs.status.retries_used, "a resize spends no retry"


@pytest.mark.parametrize(("row", "state"), [
    ("at minWorkers: no smaller size can run", dict(spec=elastic_spec(2, 2, 2))),
    ("the planner fits no smaller size", dict(spec=elastic_spec(), fits=lambda n: "needs 90 GiB")),
    ("not elastic", dict(spec=LlamaFineTuneSpec.model_validate({
        "model": {"source": "/m"}, "dataset": {"format": "samsum", "source": "/d.jsonl"},
        "cluster": {"workers": 2, "gpusPerWorker": 0}}))),
])
def test_a_wait_no_shrink_can_end_is_a_stall_as_for_any_run(row: str, state: dict[str, Any]) -> None:
    """The shrink rule takes a waiting worker from the stall deadline only where it can end the wait."""
    d = lifecycle.decide(observed(STALE, job=RUNNING_JOB, pods=[placed(0), pending(1)], scalable=True, **state))
    assert d.status["failures"][-1]["reason"] == "Stalled", row
    assert d.scale_to is None, row


def test_an_unchanged_size_writes_no_change() -> None:
    """Observe's pod counts carry the stored size fields: a look that decides nothing new patches
    exactly what is stored."""
    stored = {"active": 1, "succeeded": 0, "failed": 0, "current": 1, "desired": 2, "reason": "Shrunk", "message": "m",
              "lastResizeTime": "2026-11-30T11:59:00Z", "lastResizeStep": 5}
    d = lifecycle.decide(observed({**RUNNING, "workers": stored}, spec=elastic_spec(), job=RUNNING_JOB, pods=[placed(0)],
                                  scalable=True))
    assert d.status["workers"] == stored and d.scale_to is None and d.start_attempt is None
