"""observed objects -> status, without any server."""

from __future__ import annotations

from typing import Any

from llamaft.api.contracts import read_progress
from llamaft.api.status import Phase, Progress, as_written, read_status
from llamaft.operator import observe
from llamaft.render import backends

NOW = "2026-11-29T20:00:00Z"


def job(*conditions: tuple[str, str, str], **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "ft-1"}, "status": {
        "conditions": [{"type": t, "status": s, "reason": r, "message": f"{t} message"} for t, s, r in conditions], **status}}


def test_phase_priority_follows_the_training_operator() -> None:
    assert backends.phase_of_job(None)[0] == "Creating"
    assert backends.phase_of_job(job(("Created", "True", "PyTorchJobCreated")))[0] == "Creating"
    running = job(("Created", "True", "c"), ("Running", "True", "PyTorchJobRunning"))
    assert backends.phase_of_job(running)[:2] == ("Running", "PyTorchJobRunning")
    assert backends.phase_of_job(job(("Running", "False", "r"), ("Succeeded", "True", "s")))[0] == "Succeeded"
    assert backends.phase_of_job(job(("Running", "True", "r"), ("Restarting", "True", "x")))[0] == "Restarting"
    assert backends.phase_of_job(job(("Running", "True", "r"), ("Failed", "True", "f")))[0] == "Failed"
    assert backends.phase_of_job(job(("Suspended", "True", "PyTorchJobSuspended")))[0] == "Suspended"


def test_conditions_keep_transition_time_until_status_changes() -> None:
    first = observe.set_condition([], "Running", "True", "R", "m", 1, "t1")
    again = observe.set_condition(first, "Running", "True", "R", "m2", 2, "t2")
    flipped = observe.set_condition(again, "Running", "False", "NotRunning", "", 2, "t3")
    assert again[0]["lastTransitionTime"] == "t1" and again[0]["message"] == "m2" and again[0]["observedGeneration"] == 2
    assert flipped[0]["lastTransitionTime"] == "t3"


def test_the_typed_and_the_stored_condition_updates_agree() -> None:
    """with_condition (a typed status) and set_condition (a status as stored) follow one rule."""
    stored = observe.set_condition([{"type": "Zeta", "status": "True", "custom": 1}], "Running", "True", "R", "m", 1, "t1")
    typed = observe.with_condition([], "Running", "True", "R", "m", 1, "t1")
    assert stored[0] == as_written(typed[0]) == {"type": "Running", "status": "True", "reason": "R", "message": "m",
                                                  "lastTransitionTime": "t1", "observedGeneration": 1}
    assert stored[1] == {"type": "Zeta", "status": "True", "custom": 1}, "an entry as stored stays as it was"
    again = observe.with_condition(typed, "Running", "True", "R2", "m2", None, "t2")
    assert as_written(again[0]) == {"type": "Running", "status": "True", "reason": "R2", "message": "m2", "lastTransitionTime": "t1"}


def test_a_status_change_patches_what_it_assigns_and_removes_what_it_sets_to_none() -> None:
    change = observe.StatusChange(phase=Phase.RESTARTING)
    change.retry_after = None
    change.progress = Progress(step=3)
    change.take(observe.StatusChange(attempt=2, leader_pod=None))
    assert change.merge_patch() == {"phase": "Restarting", "attempt": 2, "retryAfter": None, "leaderPod": None,
                                    "progress": {"step": 3}}
    assert observe.StatusChange().merge_patch() == {}


def test_closed_rendezvous_is_found_in_job_conditions_or_termination_messages() -> None:
    """failures.classify finds it (observe.closed_rendezvous, which only this test called, is gone)."""
    from llamaft.operator import failures

    def closed(job_: dict[str, Any], pods: list[dict[str, Any]]) -> str | None:
        found = failures.classify(job_, pods, None)
        return found.message if found is not None and found.reason == failures.RENDEZVOUS_CLOSED else None

    assert closed(job(("Failed", "True", "f")), []) is None
    failed = job(("Failed", "True", "PyTorchJobFailed"))
    failed["status"]["conditions"][0]["message"] = "torch.distributed.elastic.rendezvous.api.RendezvousClosedError: run closed"
    assert "RendezvousClosedError" in (closed(failed, []) or "")
    pod = {"status": {"containerStatuses": [{"lastState": {"terminated": {"message": "... RendezvousClosedError ..."}}}]}}
    assert closed(job(("Failed", "True", "f")), [pod]) is not None


def test_observe_status_progress_leader_and_events() -> None:
    previous = read_status({"phase": "Creating", "conditions": [], "restarts": 0})
    doc = read_progress({"rank": 0, "pod": "ft-1-worker-0", "step": 10, "totalSteps": 100, "loss": 1.5,
                         "tokensPerSecond": 1234.5, "mfu": 0.41, "etaSeconds": 90, "epoch": 0})
    obs = observe.observe(job(("Running", "True", "PyTorchJobRunning"), replicaStatuses={"Worker": {"active": 2}}, startTime=NOW),
                          [], doc, previous, generation=3, now=NOW)
    s = obs.status
    assert s["phase"] == "Running" and s["workers"] == {"active": 2, "succeeded": 0, "failed": 0}
    assert s["progress"]["stepOfTotal"] == "10/100" and s["progress"]["loss"] == 1.5 and s["leaderPod"] == "ft-1-worker-0"
    assert s["startTime"] == NOW and s["conditions"][0]["observedGeneration"] == 3
    assert "observedGeneration" not in s, "Step writes the reconciled generation, once, for every patch"
    assert obs.phase == "Running" and obs.live is not None and obs.live.step == 10
    assert [(e.type, e.reason) for e in obs.events] == [("Normal", "Running")]
    same = observe.observe(job(("Running", "True", "PyTorchJobRunning")), [], None, read_status(s), generation=3, now=NOW)
    assert same.events == [] and same.status["progress"]["step"] == 10  # progress survives a missed poll


def test_restarts_count_each_restarting_transition() -> None:
    s = observe.observe(job(("Restarting", "True", "x")), [], None, read_status({"phase": "Running", "restarts": 1}),
                        generation=1, now=NOW).status
    assert s["restarts"] == 2 and s["phase"] == "Restarting"
    again = observe.observe(job(("Restarting", "True", "x")), [], None, read_status(s), generation=1, now=NOW).status
    assert again["restarts"] == 2


def test_tracking_status_is_kept_once_known_and_each_health_change_is_one_event() -> None:
    running = job(("Running", "True", "PyTorchJobRunning"))
    doc = {"rank": 0, "step": 3, "tracking": {"mlflowRunId": "r1", "tensorboardDirectory": "/ckpt/tensorboard",
                                              "secretish": "never copied"}}
    first = observe.observe(running, [], read_progress(doc), read_status({"phase": "Running"}), generation=1, now=NOW)
    assert first.status["tracking"] == {"mlflowRunId": "r1", "tensorboardDirectory": "/ckpt/tensorboard"}
    assert not [e for e in first.events if e.reason == "Tracking"]
    # A new attempt's document before its trackers opened: what status knew stays.
    later = observe.observe(running, [], read_progress({"rank": 0, "step": 1}), read_status(first.status), generation=1, now=NOW)
    assert later.status["tracking"] == first.status["tracking"]
    down = {**doc, "trackingWarning": "mlflow: ConnectionError: refused; training goes on"}
    warned = observe.observe(running, [], read_progress(down), read_status(later.status), generation=1, now=NOW)
    assert [(e.type, e.reason, e.message) for e in warned.events if e.reason == "Tracking"] == [
        ("Warning", "Tracking", "mlflow: ConnectionError: refused; training goes on")]
    again = observe.observe(running, [], read_progress(down), read_status(warned.status), generation=1, now=NOW)
    assert not [e for e in again.events if e.reason == "Tracking"], "the same warning is not posted twice"
    back = observe.observe(running, [], read_progress({**doc, "trackingWarning": "mlflow: reachable again"}), read_status(again.status),
                           generation=1, now=NOW)
    assert [(e.type, e.message) for e in back.events if e.reason == "Tracking"] == [("Normal", "mlflow: reachable again")]


def test_evaluation_scores_go_to_status_and_stay_until_the_next_ones() -> None:
    running = job(("Running", "True", "PyTorchJobRunning"))
    doc = {"rank": 0, "evaluation": {"step": 30, "samples": 4, "rouge1": 0.41, "rouge2": 0.17, "rougeL": 0.33,
                                     "generations": [{"generated": "not in status"}]}}
    first = observe.observe(running, [], read_progress(doc), read_status({"phase": "Running"}), generation=1, now=NOW).status
    assert first["evaluation"] == {"step": 30, "samples": 4, "rouge1": 0.41, "rouge2": 0.17, "rougeL": 0.33}
    kept = observe.observe(running, [], read_progress({"rank": 0, "step": 31}), read_status(first), generation=1, now=NOW).status
    assert kept["evaluation"] == first["evaluation"]
