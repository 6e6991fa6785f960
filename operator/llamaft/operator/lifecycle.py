"""(observed state) -> decision: the run lifecycle as one pure function.

The kopf handlers gather what is true now (the LlamaFineTune's status, the current attempt's
PyTorchJob and pods, the leader's live progress, GPU health, the clock) into `Observed`; `decide`
returns what to do (`Decision`: jobs to delete, the attempt to start, the status to write, events,
when to look again) and the handlers carry it out. Nothing here talks to the API or reads a clock,
so every path is a row in a table test (tests/operator/test_lifecycle.py).

The rules, in order:
1. A finished run (Succeeded, or Failed after it started) is final: nothing regresses its status
   (the job going away through ttlSecondsAfterFinished, a manual delete, a late pod event).
2. Jobs of other attempts that are not yet being deleted are deleted: one live job per run.
3. The current attempt has no job: wait while a job of that name is still being deleted or
   belongs to another incarnation (uid); wait for a pending retry's backoff; else create it.
4. The attempt succeeded (a pod's final report, or the job Succeeded and every pod ended): the
   final status is the trainer's final report.
5. The attempt failed (`failures.classify`, a GPU XID, or no step advance within the progress
   deadline): a retryable cause within `runPolicy.retryBudget` (and not the same failure at the same
   step `repeatedFailureLimit` times in a row) starts the next attempt from the newest checkpoint,
   the first retry at once and later ones with exponential backoff; anything else ends `Failed`.
6. Otherwise the status follows the job (Creating, Running, Restarting, Suspended) and progress.
7. An attempt the capacity planner refuses (spec.preflight Enforce) is not created: Failed
   (WillNotFit); the API server rejecting a child when it is created is Failed too (`refused`).
8. Kueue suspending a started job (Queued) resets its rendezvous: when Kueue admits it again the
   training operator recreates the pods, which must not meet a closed rendezvous.

A change of .spec is decided by `decide_spec_change` (in place, a restart as the next attempt,
or nothing), with its own rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from llamaft.api.contracts import ProgressDocument, SucceededReport
from llamaft.api.resource import MAX_ATTEMPTS
from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.status import (
    TERMINAL_PHASES,
    Condition,
    FailureRecord,
    LlamaFineTuneStatus,
    Phase,
    as_written,
    read_status,
)
from llamaft.operator import failures, observe
from llamaft.operator.failures import Failure
from llamaft.operator.observe import Event

Obj = Mapping[str, Any]
MAX_FAILURE_HISTORY = 20
MAX_EXCLUDED_NODES = 16
MAX_BACKOFF_SECONDS = 600.0
SUCCESS_REPORT_WAIT_SECONDS = 30.0
"""After the job succeeds, how long to wait for the pod that ran global rank 0 to end (its
termination message is the final report) before settling for the last live progress."""


@dataclass(frozen=True)
class Observed:
    """Everything the lifecycle decides on, as read by the handlers."""

    spec: LlamaFineTuneSpec
    status: LlamaFineTuneStatus
    """The LlamaFineTune's status, read once (status.read_status) by Step."""
    now: datetime
    job_name: str
    """The current attempt's job name."""
    job: Obj | None = None
    """The current attempt's job, when it exists and is this incarnation's (a TrainJob as
    trainjob.job_view shows it)."""
    job_kind: str = "PyTorchJob"
    """PyTorchJob or TrainJob (status.backend)."""
    job_deleting: bool = False
    """A job of the current attempt's name is being deleted (or belongs to another incarnation)."""
    stale_jobs: Sequence[str] = ()
    """This run's jobs of other attempts that are not yet being deleted."""
    pods: Sequence[Obj] = ()
    """Pods of the current attempt's job."""
    progress: ProgressDocument | None = None
    """The leader's live /progress document, read once (contracts.read_progress) by Step."""
    gpu: Failure | None = None
    """A GPU XID on one of the job's GPUs (failures.gpu_failure)."""
    retry_backoff_s: float = 10.0
    generation: int | None = None
    """metadata.generation, for the conditions' observedGeneration."""
    capacity_refusal: str | None = None
    """The capacity planner's verdict when it refuses the run (spec.preflight Enforce and it will
    not fit): no attempt is created."""


@dataclass
class Decision:
    status: dict[str, Any] = field(default_factory=dict)
    """Merge patch for .status."""
    delete_jobs: list[str] = field(default_factory=list)
    start_attempt: int | None = None
    """Create this attempt's job (after resetting its rendezvous)."""
    requeue_after: float | None = None
    """Look again after this many seconds even without an event."""
    events: list[Event] = field(default_factory=list)
    retry: Failure | None = None
    """Set when this decision spends a retry (for metrics)."""
    reset_rendezvous: list[int] = field(default_factory=list)
    """Attempts whose rendezvous state to remove (Kueue suspended the job: when it admits it again
    the training operator recreates the pods, which must not meet a closed rendezvous)."""


def iso(t: datetime) -> str:
    return t.isoformat(timespec="seconds").replace("+00:00", "Z")


def parse_time(text: Any) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None


def backoff(retries_used: int, base_s: float) -> float:
    """The first retry goes at once; later ones wait base, 2 x base, ... up to 10 minutes."""
    if retries_used <= 0:
        return 0.0
    return float(min(base_s * 2 ** (retries_used - 1), MAX_BACKOFF_SECONDS))


def _written(conditions: Sequence[Condition]) -> list[dict[str, Any]]:
    return [as_written(c) for c in conditions]


def _conditions(status: LlamaFineTuneStatus, updates: Sequence[tuple[str, bool, str, str]], generation: int | None,
                now: str) -> list[dict[str, Any]]:
    conditions = _written(status.conditions)
    for type_, ok, reason, message in updates:
        conditions = observe.set_condition(conditions, type_, "True" if ok else "False", reason, message, generation, now)
    return conditions


def _last_step(obs: Observed) -> int | None:
    if obs.progress is not None and obs.progress.step is not None:
        return obs.progress.step
    return obs.status.progress.step


def _final_report(pods: Sequence[Obj]) -> SucceededReport | None:
    """The trainer's Succeeded report (written by global rank 0's pod only)."""
    for pod in pods:
        state = failures.terminated(pod)
        report = failures.trainer_report(state.get("message") if state else None)
        if isinstance(report, SucceededReport):
            return report
    return None


def _all_pods_ended(pods: Sequence[Obj]) -> bool:
    return all(p.get("status", {}).get("phase") in ("Succeeded", "Failed") for p in pods)


def _job_succeeded(job: Obj | None) -> bool:
    return any(c.get("type") == "Succeeded" and c.get("status") == "True"
               for c in (job or {}).get("status", {}).get("conditions", []) or [])


def _succeeded_since(job: Obj | None) -> datetime | None:
    status = (job or {}).get("status", {})
    for c in status.get("conditions", []) or []:
        if c.get("type") == "Succeeded" and c.get("status") == "True":
            return parse_time(c.get("lastTransitionTime")) or parse_time(status.get("completionTime"))
    return None


def _job_failed(job: Obj | None) -> bool:
    return any(c.get("type") == "Failed" and c.get("status") == "True"
               for c in (job or {}).get("status", {}).get("conditions", []) or [])


def _progress_with_report(previous: Mapping[str, Any], report: SucceededReport | None, now: str) -> dict[str, Any]:
    progress = dict(previous)
    if report is not None:
        progress.update(report.status_progress(now).to_k8s())
    if progress.get("step") is not None and progress.get("totalSteps") is not None:
        progress["stepOfTotal"] = f"{progress['step']}/{progress['totalSteps']}"
    return progress


def decide(obs: Observed) -> Decision:
    st = obs.status
    phase, attempt = st.phase, st.attempt
    d = Decision()
    if phase in TERMINAL_PHASES and attempt > 0:
        return d  # rule 1
    d.delete_jobs = list(obs.stale_jobs)  # rule 2
    attempt = max(attempt, 1)
    if obs.job is None:
        d = _no_job(obs, attempt, d)  # rule 3
        if d.start_attempt is not None and obs.capacity_refusal is not None:
            return will_not_fit(obs, obs.capacity_refusal)  # rule 7
    else:
        _record_attempt(obs, attempt, d)
        d = _with_job(obs, attempt, d)
    if d.status.get("phase") == Phase.QUEUED.value and phase is not Phase.QUEUED and st.attempt:
        d.reset_rendezvous = [st.attempt]  # rule 8
    return d


def _record_attempt(obs: Observed, attempt: int, d: Decision) -> None:
    st = obs.status
    if st.attempt == 0:
        # The job exists but the step that created it never wrote its status (the operator died in
        # between, e.g. a leader killed mid-step): record the attempt now, or a later spec change
        # would take the run for never started.
        d.status.update(attempt=attempt, jobName=obs.job_name, attemptStartTime=st.attempt_start_time or iso(obs.now),
                        retriesUsed=st.retries_used)


def _no_job(obs: Observed, attempt: int, d: Decision) -> Decision:
    st, now = obs.status, iso(obs.now)
    if obs.job_deleting:
        d.status.update(phase=st.phase.value if "phase" in st.model_fields_set else Phase.CREATING.value,
                        message=f"waiting for the earlier {obs.job_kind} {obs.job_name} to be deleted")
        d.requeue_after = 1.0
        return d
    retry_at = parse_time(st.retry_after)
    if retry_at is not None and retry_at > obs.now:
        d.requeue_after = max(0.5, (retry_at - obs.now).total_seconds())
        return d
    d.start_attempt = attempt
    first = st.attempt == 0
    d.status.update(
        attempt=attempt, jobName=obs.job_name, retryAfter=None, attemptStartTime=now, lastProgressTime=None,
        retriesUsed=st.retries_used,  # written, so `kubectl get` shows Restarts 0
    )
    if first or st.phase in (Phase.PENDING, Phase.CREATING):
        d.status.update(phase=Phase.CREATING.value, message=f"creating {obs.job_kind} {obs.job_name}")
    else:
        d.status.update(phase=Phase.RESTARTING.value,
                        message=f"resubmitted as attempt {attempt}: {obs.job_kind} {obs.job_name} resumes from the newest checkpoint")
    return d


def _stalled(obs: Observed, progress_step: int | None, last_progress: datetime | None) -> Failure | None:
    """No step advance within the deadline (with the startup grace before the attempt's first step)."""
    policy = obs.spec.run_policy
    started = parse_time(obs.status.attempt_start_time)
    if last_progress is not None:
        since, allowed = last_progress, policy.progress_deadline_seconds
    elif started is not None:
        since, allowed = started, policy.progress_deadline_seconds + policy.startup_grace_seconds
    else:
        return None
    if obs.now - since <= timedelta(seconds=allowed):
        return None
    leader = obs.status.leader_pod or "the leader pod"
    where = f"last step {progress_step}" if progress_step is not None else "no step yet in this attempt"
    return Failure(failures.STALLED, f"no step advance for {allowed}s ({where}; leader {leader}): "
                   "a hung collective, a stuck data loader or a stopped process", True,
                   pod=obs.status.leader_pod, step=progress_step)


def _with_job(obs: Observed, attempt: int, d: Decision) -> Decision:
    st, now, generation = obs.status, iso(obs.now), st_generation(obs)
    report = _final_report(obs.pods)
    if report is not None or (_job_succeeded(obs.job) and _all_pods_ended(obs.pods)):
        return _succeeded(obs, d, report)  # rule 4
    if _job_succeeded(obs.job):
        if obs.now - (_succeeded_since(obs.job) or obs.now) < timedelta(seconds=SUCCESS_REPORT_WAIT_SECONDS):
            d.requeue_after = 1.0
            d.status["message"] = f"{obs.job_kind} {obs.job_name} succeeded: waiting for the leader's final report"
            return d
        return _succeeded(obs, d, None)
    queued = _queued(obs)
    # A suspended job is not failing: the user suspended it, or Kueue holds it (not admitted yet,
    # or preempted: Kueue suspends the job and its pods go).
    suspended = obs.spec.run_policy.suspend or queued
    failure = None
    last_step = _last_step(obs)
    progress_doc = obs.progress
    # Progress clock: the operator's own observation of the step changing.
    last_progress = parse_time(st.last_progress_time)
    live_step = progress_doc.step if progress_doc is not None else None
    known_step = st.progress.step
    if live_step is not None and (last_progress is None or live_step != known_step):
        last_progress = obs.now
        d.status["lastProgressTime"] = now
    if not suspended:
        failure = failures.classify(obs.job, obs.pods, last_step) or obs.gpu
        job_phase, _, _ = observe.job_phase(obs.job)
        if failure is None and job_phase is Phase.RUNNING:
            failure = _stalled(obs, last_step, last_progress)
    if failure is not None:
        return _failed_attempt(obs, attempt, d, failure)  # rule 5
    o = observe.observe(obs.job, obs.pods, progress_doc, st, generation=generation, now=now)
    d.status.update({k: v for k, v in o.status.items() if k != "observedGeneration"})
    if o.status["phase"] == Phase.CREATING.value and st.phase is Phase.RESTARTING:
        d.status["phase"] = Phase.RESTARTING.value  # the new attempt's job exists; its pods are not running yet
        d.status["message"] = st.message
    d.events += o.events
    queue = obs.spec.scheduling.queue_name
    if queue:
        d.status["queue"] = queue
        d.status["conditions"] = _queued_condition(obs, queued, queue, d.status.get("conditions", _written(st.conditions)), now)
    if queued:
        assert queue is not None
        d.status.update(phase=Phase.QUEUED.value, message=f"waiting for Kueue to admit {obs.job_kind} {obs.job_name} "
                        f"(LocalQueue {queue}); it stays suspended until then",
                        attemptStartTime=now)  # the startup grace counts from admission, not from queueing
        d.events = [e for e in d.events if e.reason != "Suspended"]
        if st.phase is not Phase.QUEUED:
            d.events.append(Event("Normal", "Queued", f"{obs.job_kind} {obs.job_name} waits in Kueue LocalQueue {queue}"))
    return d


def _queued(obs: Observed) -> bool:
    """Kueue holds the job: it has a queue, it is suspended, and not by the user."""
    if not obs.spec.scheduling.queue_name or obs.spec.run_policy.suspend:
        return False
    return observe.job_phase(obs.job)[0] is Phase.SUSPENDED


def _queued_condition(obs: Observed, queued: bool, queue: str, conditions: Sequence[Mapping[str, Any]],
                      now: str) -> list[dict[str, Any]]:
    if queued:
        return observe.set_condition([dict(c) for c in conditions], "Queued", "True", "WaitingForAdmission",
                                     f"suspended by Kueue until LocalQueue {queue} admits it", obs.generation, now)
    if any(c.get("type") == "Queued" for c in conditions):
        return observe.set_condition([dict(c) for c in conditions], "Queued", "False", "Admitted",
                                     f"admitted by Kueue from LocalQueue {queue}", obs.generation, now)
    return [dict(c) for c in conditions]


def st_generation(obs: Observed) -> int | None:
    return obs.generation


def _succeeded(obs: Observed, d: Decision, report: SucceededReport | None) -> Decision:
    st, now = obs.status, iso(obs.now)
    o = observe.observe(obs.job, obs.pods, obs.progress, st, generation=st_generation(obs),
                        now=now)
    progress = _progress_with_report(o.status.get("progress", {}), report, now)
    message = f"{obs.job_kind} {obs.job_name} succeeded" + (f" at step {progress['step']}" if progress.get("step") is not None else "")
    d.status.update({k: v for k, v in o.status.items() if k not in ("observedGeneration", "conditions", "phase", "message")})
    d.status.update(
        phase=Phase.SUCCEEDED.value, message=message, progress=progress,
        completionTime=(obs.job or {}).get("status", {}).get("completionTime") or now,
        conditions=_conditions(st, [("Running", False, "NotRunning", ""), ("Succeeded", True, "Succeeded", message),
                                    ("Failed", False, "NotFailed", "")], st_generation(obs), now),
    )
    if report is not None and report.export_path:
        d.status["exportPath"] = report.export_path
    performance = performance_status(report)
    if performance is not None:
        d.status["performance"] = performance
    d.events.append(Event("Normal", "Succeeded", message))
    return d


def performance_status(report: SucceededReport | None) -> dict[str, Any] | None:
    """status.performance from the trainer's final report (None: it has none, or not a valid one:
    contracts.read_termination drops a `performance` that does not validate)."""
    if report is None or report.performance is None:
        return None
    return report.performance.to_k8s() or None


def _repeated(history: Sequence[FailureRecord], failure: Failure, attempt: int, limit: int) -> bool:
    """The same failure at the same step in `limit` consecutive attempts, this one included."""
    needed = limit - 1
    recent = list(history)[-needed:] if needed else []
    if len(recent) < needed:
        return False
    for offset, record in enumerate(reversed(recent), start=1):
        if record.attempt != attempt - offset or (record.reason, record.step) != failure.signature():
            return False
    return True


def _failed_attempt(obs: Observed, attempt: int, d: Decision, failure: Failure) -> Decision:
    st, now, policy = obs.status, iso(obs.now), obs.spec.run_policy
    used, budget = st.retries_used, policy.retry_budget
    history = st.failures
    record: dict[str, Any] = {
        "attempt": attempt, "reason": failure.reason, "retryable": failure.retryable, "message": failure.message,
        "node": failure.node, "pod": failure.pod, "exitCode": failure.exit_code, "step": failure.step, "time": now,
    }
    d.status["failures"] = ([as_written(f) for f in history] + [{k: v for k, v in record.items() if v is not None}])[
        -MAX_FAILURE_HISTORY:]
    excluded = list(st.excluded_nodes)
    if failure.node and failure.node not in excluded:
        excluded = (excluded + [failure.node])[-MAX_EXCLUDED_NODES:]
        d.status["excludedNodes"] = excluded
        d.events.append(Event("Warning", "NodeExcluded", f"later attempts avoid node {failure.node}: {failure.reason}"))
    progress = _progress_with_report(as_written(st.progress), None, now)
    if obs.progress is not None:
        progress = observe.progress_status(obs.progress, progress)
    d.status["progress"] = progress
    verdict: str | None = None
    if not failure.retryable:
        verdict = f"{failure.reason} is permanent"
        event_reason = failure.reason
    elif _repeated(history, failure, attempt, policy.repeated_failure_limit):
        verdict = f"{failure.reason} at step {failure.step} in {policy.repeated_failure_limit} consecutive attempts"
        event_reason = "RepeatedFailure"
    elif used >= budget:
        verdict = f"the retry budget ({budget}) is used up"
        event_reason = "RetryBudgetExhausted"
    elif attempt >= MAX_ATTEMPTS:
        verdict = f"attempt {attempt} is the last one a LlamaFineTune may use"
        event_reason = "TooManyAttempts"
    if verdict is not None:
        message = f"attempt {attempt} failed ({failure.reason}): {failure.message}; not retrying: {verdict}"
        d.status.update(
            phase=Phase.FAILED.value, message=message[:2000], completionTime=now, retryAfter=None,
            conditions=_conditions(st, [("Running", False, "NotRunning", ""), ("Failed", True, failure.reason, message[:2000])],
                                   st_generation(obs), now),
        )
        if not _job_failed(obs.job):
            # The training operator has not failed the job (a stall, an XID, one pod's evidence):
            # its pods may still hold GPUs, so the job goes. A Failed job stays for `kubectl logs`
            # (cleanPodPolicy Running already removed its running pods).
            d.delete_jobs.append(obs.job_name)
        d.events.append(Event("Warning", event_reason, message[:1000]))
        return d
    delay = backoff(used, obs.retry_backoff_s)
    nxt = attempt + 1
    d.retry = failure
    d.delete_jobs.append(obs.job_name)
    d.status.update(
        attempt=nxt, retriesUsed=used + 1, lastProgressTime=None, leaderPod=None,
        phase=Phase.RESTARTING.value,
        conditions=_conditions(st, [("Running", False, failure.reason, failure.message[:2000])], st_generation(obs), now),
    )
    when = "now" if delay == 0 else f"in {delay:.0f}s"
    message = (f"attempt {attempt} failed ({failure.reason}): {failure.message[:600]}; restarting from the newest "
               f"checkpoint as attempt {nxt} {when} ({used + 1}/{budget} retries)")
    d.status["message"] = message
    d.events.append(Event("Warning", failure.reason, message))
    if delay == 0:
        d.start_attempt = nxt
        d.status.update(retryAfter=None, attemptStartTime=now)
    else:
        d.status["retryAfter"] = iso(obs.now + timedelta(seconds=delay))
        d.requeue_after = delay
    return d


def refused(obs: Observed, reason: str, message: str) -> Decision:
    """The attempt cannot be created at all (the capacity planner refuses it, or the API server
    rejects a child as invalid): Failed with the reason, never an endless retry loop."""
    now = iso(obs.now)
    d = Decision()
    d.delete_jobs = list(obs.stale_jobs)
    d.status.update(
        phase=Phase.FAILED.value, message=message[:2000], completionTime=now, retryAfter=None,
        conditions=_conditions(obs.status, [("Failed", True, reason, message[:2000])], obs.generation, now),
    )
    if obs.status.phase is not Phase.FAILED:
        d.events.append(Event("Warning", reason, message[:1000]))
    return d


def will_not_fit(obs: Observed, message: str) -> Decision:
    """The capacity planner refuses the attempt (spec.preflight Enforce): Failed before any job."""
    return refused(obs, "WillNotFit", f"refused before creating anything (spec.preflight Enforce): {message}")


# ------------------------------------------------------------------------------ spec changes
IN_PLACE_FIELDS = {("runPolicy", "suspend"), ("cluster", "workers")}


def in_place(path: tuple[str, ...]) -> bool:
    """Changes the running attempt does not see: applied in place (suspend, elastic scale) or
    only to the children (DCGM monitoring: PodMonitor, alerts, dashboard)."""
    return path in IN_PLACE_FIELDS or path[:2] == ("monitoring", "dcgm")


def _leaves(value: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    if isinstance(value, dict):
        out: dict[tuple[str, ...], Any] = {}
        for key, child in value.items():
            out.update(_leaves(child, (*prefix, str(key))))
        return out
    return {prefix: value}


def changed_fields(old: Any, new: LlamaFineTuneSpec) -> set[tuple[str, ...]]:
    """Leaf fields whose effective (defaulted) value changed: `runPolicy: {suspend: true}` added to
    a spec without runPolicy is a change of ("runPolicy", "suspend"), not of the whole section."""
    try:
        before = _leaves(LlamaFineTuneSpec.model_validate(dict(old or {})).to_k8s())
    except ValueError:
        before = {}
    after = _leaves(new.to_k8s())
    return {path for path in before.keys() | after.keys() if before.get(path) != after.get(path)}


@dataclass(frozen=True)
class SpecChanged:
    """A valid change of .spec, with what the update handler read to decide on it."""

    spec: LlamaFineTuneSpec
    """The new spec (validated, transition rules included)."""
    status: LlamaFineTuneStatus
    """The LlamaFineTune's status, read once (status.read_status) by Step."""
    changed: frozenset[tuple[str, ...]]
    """changed_fields(old, new)."""
    job_name: str
    """The current attempt's job name (attempt 1's while no attempt is recorded)."""
    job_kind: str = "PyTorchJob"
    scalable: bool = False
    """The backend can change the running job's workers in place (JobBackend.scalable)."""
    first_job_exists: bool = False
    """Only read while no attempt is recorded: attempt 1's job exists and is this incarnation's
    (the step that created it never wrote the status)."""
    generation: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.status, LlamaFineTuneStatus):
            object.__setattr__(self, "status", read_status(self.status))


@dataclass
class SpecDecision:
    """What a spec change does; the update handler carries it out in this order."""

    status: dict[str, Any] = field(default_factory=dict)
    """Merge patch for .status (observedGeneration at least, unless `wake` hands over to the lifecycle)."""
    reset_rendezvous: list[int] = field(default_factory=list)
    """Attempts whose rendezvous state to remove first (resumed pods must not meet a closed one)."""
    suspend: bool | None = None
    """Patch the current job's suspension to this."""
    scale_to: int | None = None
    """Patch the current job's workers to this."""
    delete_job: str | None = None
    job_name: str | None = None
    """The current attempt's job (the one patched or deleted)."""
    events: list[Event] = field(default_factory=list)
    wake: bool = False
    """The lifecycle looks now (it starts a never-started run, applies changed children, creates
    the restarted attempt)."""


def decide_spec_change(change: SpecChanged) -> SpecDecision:
    """The rules, in order: a run never started (its spec was invalid) is left to the lifecycle,
    which starts it; a finished run stays finished; a change nothing in the run sees (e.g. a default
    written out) does nothing; suspend, elastic workers (where the backend scales in place) and DCGM
    monitoring apply in place; anything else restarts the run from its newest checkpoint as the
    next attempt, the current job deleted."""
    st, d = change.status, SpecDecision()
    attempt = st.attempt
    if attempt == 0:
        if not change.first_job_exists:
            d.wake = True
            return d
        attempt = 1  # started, but the step that created the job never wrote the status
    observed = {"observedGeneration": change.generation}
    if st.phase in TERMINAL_PHASES:
        d.status = observed
        d.events.append(Event("Normal", "Finished", f"the run has {st.phase.value.lower()}: spec changes do not start it "
                              "again; create a new LlamaFineTune (or delete and re-apply this one)"))
        return d
    job_name = d.job_name = change.job_name
    changed, spec, kind = change.changed, change.spec, change.job_kind
    if not changed:
        d.status = observed
        return d
    if all(in_place(path) for path in changed) and (("cluster", "workers") not in changed or change.scalable):
        if ("runPolicy", "suspend") in changed:
            suspend = spec.run_policy.suspend
            if not suspend:
                d.reset_rendezvous = [attempt]
            d.suspend = suspend
            d.events.append(Event("Normal", "Suspended" if suspend else "Resumed",
                                  f"{kind} {job_name} {'suspended' if suspend else 'resumed'}"))
        if ("cluster", "workers") in changed:
            d.scale_to = spec.cluster.workers
            d.events.append(Event("Normal", "Scaled", f"elastic workers -> {spec.cluster.workers}"))
        if any(path[:2] == ("monitoring", "dcgm") for path in changed):
            d.events.append(Event("Normal", "MonitoringChanged", "monitoring applied in place; training continues"))
        d.status, d.wake = observed, True
        return d
    fields = ", ".join(".".join(c) for c in sorted(changed))
    message = f"{fields} changed: restarting from the latest checkpoint as attempt {attempt + 1}"
    d.status = {"attempt": attempt + 1, "phase": Phase.RESTARTING.value, "retryAfter": None, "lastProgressTime": None,
                "message": message, **observed}
    d.delete_job, d.wake = job_name, True
    d.events.append(Event("Normal", "SpecChanged", message))
    return d
