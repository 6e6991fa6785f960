"""(observed state) -> decision: the run lifecycle as one pure function.

The kopf handlers gather what is true now (the LlamaFineTune's status, the current attempt's
PyTorchJob and pods, the leader's live progress, GPU health, the clock) into `Observed`, typed;
`decide` asks `observe` once what the job, its pods and the leader's document say (`_look`: an
`observe.Observation`), applies the rules below to it and returns what to do (`Decision`: jobs to
delete, the attempt to start, the status fields to set as a typed `observe.StatusChange`, events,
when to look again); the handlers carry it out and write `StatusChange.merge_patch()`. Nothing here
talks to the API or reads a clock, so every path is a row in a table test
(tests/operator/test_lifecycle.py).

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
   A failed run keeps a job that failed, or that the training operator is failing for a pod that
   failed (its failed pods stay for `kubectl logs`, its running ones are removed by
   cleanPodPolicy Running); a job nothing will end (a stall, an XID) is deleted.
6. Otherwise the status follows the job (Creating, Running, Restarting, Suspended) and progress.
7. An attempt the capacity planner refuses (spec.preflight Enforce) is not created: Failed
   (WillNotFit); the API server rejecting a child when it is created is Failed too (`refused`).
8. Kueue suspending a started job (Queued) resets its rendezvous: when Kueue admits it again the
   training operator recreates the pods, which must not meet a closed rendezvous.
9. An elastic run whose pods stay unschedulable shrinks, and grows back at a later checkpoint
   (`elastic`: which size, when): in place where the backend scales the job and the pods that go are
   the unschedulable ones, else as the next attempt from the newest checkpoint. No retry is spent.
   A job Kueue holds whose Workload waits for quota asks for one worker fewer at a time
   (`elastic.shrink_queued`), in place while suspended, or as the next attempt.

A change of .spec is decided by spec_changes.decide_spec_change, with its own rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from llamaft.api.contracts import ProgressDocument, SucceededReport
from llamaft.api.resource import MAX_ATTEMPTS
from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.status import (
    TERMINAL_PHASES,
    FailureRecord,
    LlamaFineTuneStatus,
    PerformanceStatus,
    Phase,
    Progress,
)
from llamaft.operator import elastic, failures, observe
from llamaft.operator.failures import Failure
from llamaft.operator.observe import Event, Observation, StatusChange
from llamaft.operator.timestamps import iso, parse_time
from llamaft.render import backends

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
    fits: Callable[[int], str | None] | None = None
    """The capacity planner on n workers (elastic.Fits): None when that size fits or it cannot tell,
    else why not. None: every size is taken to fit."""
    scalable: bool = False
    """The backend changes the running job's workers in place (JobBackend.scalable)."""
    index_label: str = "training.kubeflow.org/replica-index"
    """The pods' replica-index label (an in-place scale-down removes the highest indices)."""
    quota: elastic.QuotaWait | None = None
    """An elastic run's job Kueue holds: its Workload's wait for quota (elastic.quota_wait)."""


@dataclass
class Decision:
    change: StatusChange = field(default_factory=StatusChange)
    """The status fields this decision sets (`status` is their merge patch)."""
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
    workers: int | None = None
    """The worker count of the attempt it starts (spec.cluster.workers, or an elastic run's size)."""
    scale_to: int | None = None
    """Patch the current job's workers to this, in place (an elastic resize)."""

    @property
    def status(self) -> dict[str, Any]:
        """Merge patch for .status (StatusChange.merge_patch)."""
        return self.change.merge_patch()


def backoff(retries_used: int, base_s: float) -> float:
    """The first retry goes at once; later ones wait base, 2 x base, ... up to 10 minutes."""
    if retries_used <= 0:
        return 0.0
    return float(min(base_s * 2 ** (retries_used - 1), MAX_BACKOFF_SECONDS))


def _look(obs: Observed) -> Observation:
    """What the job, its pods and the leader's document say (`observe.observe`): the one place
    the lifecycle asks `observe`, once per decision, before any rule."""
    return observe.observe(obs.job, obs.pods, obs.progress, obs.status, generation=obs.generation, now=iso(obs.now))


def _last_step(obs: Observed, seen: Observation) -> int | None:
    if seen.live is not None and seen.live.step is not None:
        return seen.live.step
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


def _failing_with_a_pod(obs: Observed) -> bool:
    """The job's controller is failing the job for a pod of it that failed and stays (not being
    deleted: a pod on its way out, or one the pod watch kept after its deletion, is replaced, not
    a reason to fail the job): with a PyTorchJob (restartPolicy Never), whatever the order in which
    the pod's end and the job's Failed condition reach the operator (`JobBackend.fails_with_a_pod`)."""
    if not backends.backend_for(obs.job_kind).fails_with_a_pod:
        return False
    return any((p.get("status") or {}).get("phase") == "Failed" and not (p.get("metadata") or {}).get("deletionTimestamp")
               for p in obs.pods)


def _overlay(base: Progress, top: Progress | None) -> Progress:
    """`base` with every field `top` has (not None): a newer report over what status knew."""
    return base if top is None else base.model_copy(update=top.model_dump(exclude_none=True))


def _with_step_of_total(progress: Progress) -> Progress:
    """stepOfTotal from the step and the total, when both are known."""
    if progress.step is None or progress.total_steps is None:
        return progress
    return progress.model_copy(update={"step_of_total": f"{progress.step}/{progress.total_steps}"})


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
        d = _with_job(obs, _look(obs), attempt, d)
    if d.change.phase is Phase.QUEUED and phase is not Phase.QUEUED and st.attempt:
        d.reset_rendezvous = [st.attempt]  # rule 8
    return d


def _record_attempt(obs: Observed, attempt: int, d: Decision) -> None:
    st = obs.status
    if st.attempt == 0:
        # The job exists but the step that created it never wrote its status (the operator died in
        # between, e.g. a leader killed mid-step): record the attempt now, or a later spec change
        # would take the run for never started.
        c = d.change
        c.attempt, c.job_name = attempt, obs.job_name
        c.attempt_start_time, c.retries_used = st.attempt_start_time or iso(obs.now), st.retries_used


def _no_job(obs: Observed, attempt: int, d: Decision) -> Decision:
    st, now, c = obs.status, iso(obs.now), d.change
    if obs.job_deleting:
        c.phase = st.phase if "phase" in st.model_fields_set else Phase.CREATING
        c.message = f"waiting for the earlier {obs.job_kind} {obs.job_name} to be deleted"
        d.requeue_after = 1.0
        return d
    retry_at = parse_time(st.retry_after)
    if retry_at is not None and retry_at > obs.now:
        d.requeue_after = max(0.5, (retry_at - obs.now).total_seconds())
        return d
    d.start_attempt = attempt
    _size_attempt(obs, d)
    first = st.attempt == 0
    c.attempt, c.job_name, c.retry_after, c.attempt_start_time, c.last_progress_time = attempt, obs.job_name, None, now, None
    c.retries_used = st.retries_used  # written, so `kubectl get` shows Restarts 0
    if first or st.phase in (Phase.PENDING, Phase.CREATING):
        c.phase, c.message = Phase.CREATING, f"creating {obs.job_kind} {obs.job_name}"
    else:
        c.phase = Phase.RESTARTING
        c.message = f"resubmitted as attempt {attempt}: {obs.job_kind} {obs.job_name} resumes from the newest checkpoint"
    return d


def _size_attempt(obs: Observed, d: Decision) -> None:
    """The size of the attempt `d` starts: spec.cluster.workers, or the elastic run's current size
    (status.workers keeps what a shrink decided until it grows back)."""
    spec, st, c = obs.spec, obs.status, d.change
    size = d.workers = elastic.current_workers(spec, st.workers)
    base = c.workers or st.workers
    reason = elastic.AS_SPECIFIED if size == spec.cluster.workers else (base.reason or elastic.SHRUNK)
    c.workers = elastic.status(spec, base, size, reason, None, iso(obs.now), None, resized=False)
    c.total_gpus = size * spec.cluster.gpus_per_worker


def _size_fields(st: LlamaFineTuneStatus, c: StatusChange) -> None:
    """Observe's worker counts with the size fields status.workers holds, so that an unchanged
    size is no change of the written status."""
    if c.workers is None:
        return
    kept: dict[str, Any] = {name: getattr(st.workers, name) for name in ("current", "desired", "reason", "message", "last_resize_time",
                                                          "last_resize_step") if name in st.workers.model_fields_set}
    c.workers = c.workers.model_copy(update=kept)


def _elastic(obs: Observed, seen: Observation, attempt: int, d: Decision) -> None:
    """Rule 9: the elastic run's size (`elastic.shrink`, `elastic.grow`), on the running attempt."""
    spec, st, now, c = obs.spec, obs.status, iso(obs.now), d.change
    if spec.cluster.elastic is None:
        return
    current = elastic.current_workers(spec, st.workers)
    placed = elastic.placement(obs.pods, obs.index_label, current)
    step = _last_step(obs, seen)
    base = c.workers or st.workers
    resize = elastic.shrink(spec, current, placed, obs.now, obs.fits or (lambda n: None), parse_time(st.attempt_start_time))
    if resize is None and placed.unschedulable == 0:
        if st.workers.reason == elastic.GROWING_BACK and base.active >= current:
            message = f"back at {current} worker(s), as spec.cluster.workers says"
            c.workers = elastic.status(spec, base, current, elastic.AS_SPECIFIED, message, now, None, resized=False)
            d.events.append(Event("Normal", "GrewBack", message))
            return
        resize = elastic.grow(spec, current, st.workers, step, obs.now)
    if resize is not None:
        in_place = obs.scalable and all(i >= resize.workers for i in elastic.unschedulable_indices(obs.pods, obs.index_label))
        _resize(obs, attempt, d, resize, current, step, in_place)


def _elastic_queued(obs: Observed, seen: Observation, attempt: int, d: Decision) -> None:
    """Rule 9 while Kueue holds the job: fewer workers when its Workload waits for quota
    (`elastic.shrink_queued`); a job that scales in place is patched while suspended (Kueue
    rewrites its Workload), another is replaced by the next attempt at the smaller size."""
    spec, st = obs.spec, obs.status
    if spec.cluster.elastic is None:
        return
    current = elastic.current_workers(spec, st.workers)
    resize = elastic.shrink_queued(spec, current, obs.quota, obs.now, obs.fits or (lambda n: None),
                                   parse_time(st.workers.last_resize_time))
    if resize is not None:
        _resize(obs, attempt, d, resize, current, _last_step(obs, seen), obs.scalable)


def _resize(obs: Observed, attempt: int, d: Decision, resize: elastic.Resize, current: int, step: int | None,
            in_place: bool) -> None:
    """Carry out a size decision: status.workers and an event; the job scaled in place, or the next
    attempt at the new size."""
    spec, st, now, c = obs.spec, obs.status, iso(obs.now), d.change
    base = c.workers or st.workers
    if not resize.resizes:
        c.workers = elastic.status(spec, base, current, resize.reason, resize.message, now, None, resized=False)
        if st.workers.reason != resize.reason:
            d.events.append(Event("Warning", resize.reason, resize.message[:1000]))
        return
    n = resize.workers
    if not in_place and attempt >= MAX_ATTEMPTS:
        return  # no attempt left to resize into: the pods wait, as without cluster.elastic
    c.workers = elastic.status(spec, base, n, resize.reason, resize.message, now, step, resized=True)
    c.total_gpus = n * spec.cluster.gpus_per_worker
    d.events.append(Event("Warning" if resize.reason == elastic.SHRUNK else "Normal", resize.reason, resize.message[:1000]))
    if in_place:
        d.scale_to = n
        return
    # A job whose size cannot change in place: the next attempt, at the new size, from the newest checkpoint.
    nxt = attempt + 1
    d.delete_jobs.append(obs.job_name)
    d.start_attempt, d.workers = nxt, n
    c.attempt, c.last_progress_time, c.leader_pod, c.phase = nxt, None, None, Phase.RESTARTING
    c.retry_after, c.attempt_start_time = None, now
    c.message = (f"{resize.reason}: {obs.job_kind} {obs.job_name} cannot change its size in place; restarting from the "
                 f"newest checkpoint as attempt {nxt} on {n} worker(s)")


def _shrink_owns_the_wait(obs: Observed) -> bool:
    """An elastic run whose worker waits for a node is rule 9's to shrink, not a stall (`elastic.owns_the_wait`)."""
    spec, st = obs.spec, obs.status
    if spec.cluster.elastic is None:
        return False
    current = elastic.current_workers(spec, st.workers)
    return elastic.owns_the_wait(spec, current, elastic.placement(obs.pods, obs.index_label, current), obs.now,
                                 obs.fits or (lambda n: None), parse_time(st.attempt_start_time))


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


def _progress_clock(obs: Observed, seen: Observation, d: Decision) -> datetime | None:
    """When the step last advanced, as the operator saw it: now, when the live step differs from
    the one status knew (or no advance was seen yet)."""
    last_progress = parse_time(obs.status.last_progress_time)
    live_step = seen.live.step if seen.live is not None else None
    if live_step is not None and (last_progress is None or live_step != obs.status.progress.step):
        d.change.last_progress_time = iso(obs.now)
        return obs.now
    return last_progress


def _with_job(obs: Observed, seen: Observation, attempt: int, d: Decision) -> Decision:
    st, now = obs.status, iso(obs.now)
    report = _final_report(obs.pods)
    if report is not None or (_job_succeeded(obs.job) and _all_pods_ended(obs.pods)):
        return _succeeded(obs, seen, d, report)  # rule 4
    if _job_succeeded(obs.job):
        if obs.now - (_succeeded_since(obs.job) or obs.now) < timedelta(seconds=SUCCESS_REPORT_WAIT_SECONDS):
            d.requeue_after = 1.0
            d.change.message = f"{obs.job_kind} {obs.job_name} succeeded: waiting for the leader's final report"
            return d
        return _succeeded(obs, seen, d, None)
    queued = _queued(obs, seen)
    # A suspended job is not failing: the user suspended it, or Kueue holds it (not admitted yet,
    # or preempted: Kueue suspends the job and its pods go).
    suspended = obs.spec.run_policy.suspend or queued
    failure = None
    last_step = _last_step(obs, seen)
    last_progress = _progress_clock(obs, seen, d)
    if not suspended:
        failure = failures.classify(obs.job, obs.pods, last_step) or obs.gpu
        if failure is None and seen.phase is Phase.RUNNING and not _shrink_owns_the_wait(obs):
            failure = _stalled(obs, last_step, last_progress)
    if failure is not None:
        return _failed_attempt(obs, seen, attempt, d, failure)  # rule 5
    c = d.change
    c.take(seen.change)
    _size_fields(st, c)
    if not suspended and seen.phase is not Phase.SUSPENDED:
        _elastic(obs, seen, attempt, d)  # rule 9
        if d.start_attempt is not None:
            return d
    if seen.phase is Phase.CREATING and st.phase is Phase.RESTARTING:
        c.phase, c.message = Phase.RESTARTING, st.message  # the new attempt's job exists; its pods are not running yet
    d.events += seen.events
    queue = obs.spec.scheduling.queue_name
    if queue:
        c.queue = queue
        _queued_condition(obs, queued, queue, c, now)
    if queued:
        assert queue is not None
        d.events = [e for e in d.events if e.reason != "Suspended"]
        _elastic_queued(obs, seen, attempt, d)  # rule 9, queued
        if d.start_attempt is not None:
            return d
        c.phase = Phase.QUEUED
        c.message = (f"waiting for Kueue to admit {obs.job_kind} {obs.job_name} (LocalQueue {queue}); it stays suspended "
                     "until then")
        c.attempt_start_time = now  # the startup grace counts from admission, not from queueing
        if st.phase is not Phase.QUEUED:
            d.events.append(Event("Normal", "Queued", f"{obs.job_kind} {obs.job_name} waits in Kueue LocalQueue {queue}"))
    return d


def _queued(obs: Observed, seen: Observation) -> bool:
    """Kueue holds the job: it has a queue, it is suspended, and not by the user."""
    if not obs.spec.scheduling.queue_name or obs.spec.run_policy.suspend:
        return False
    return seen.phase is Phase.SUSPENDED


def _queued_condition(obs: Observed, queued: bool, queue: str, c: StatusChange, now: str) -> None:
    """Queued: True while Kueue holds the job, False once it admitted it (absent before)."""
    conditions = c.conditions if c.conditions is not None else obs.status.conditions
    if queued:
        c.set_conditions(conditions, [("Queued", True, "WaitingForAdmission",
                                       f"suspended by Kueue until LocalQueue {queue} admits it")], obs.generation, now)
    elif any(cond.type == "Queued" for cond in conditions):
        c.set_conditions(conditions, [("Queued", False, "Admitted", f"admitted by Kueue from LocalQueue {queue}")],
                         obs.generation, now)
    else:
        c.conditions = list(conditions)


def _succeeded(obs: Observed, seen: Observation, d: Decision, report: SucceededReport | None) -> Decision:
    st, now, c = obs.status, iso(obs.now), d.change
    progress = _with_step_of_total(_overlay(seen.change.progress or Progress(),
                                            report.status_progress(now) if report is not None else None))
    message = f"{obs.job_kind} {obs.job_name} succeeded" + (f" at step {progress.step}" if progress.step is not None else "")
    figures = report.figures() if report is not None else ""
    if figures:  # the final loss, and DPO's reward accuracy and margin, where the user reads the outcome
        message += f": {figures}"
    c.take(seen.change)
    c.phase, c.message, c.progress = Phase.SUCCEEDED, message, progress
    c.completion_time = (obs.job or {}).get("status", {}).get("completionTime") or now
    c.set_conditions(st.conditions, [("Running", False, "NotRunning", ""), ("Succeeded", True, "Succeeded", message),
                                     ("Failed", False, "NotFailed", "")], obs.generation, now)
    if report is not None and report.export_path:
        c.export_path = report.export_path
    performance = performance_status(report)
    if performance is not None:
        c.performance = performance
    d.events.append(Event("Normal", "Succeeded", message))
    return d


def performance_status(report: SucceededReport | None) -> PerformanceStatus | None:
    """status.performance from the trainer's final report (None: it has none, or not a valid one:
    contracts.read_termination drops a `performance` that does not validate)."""
    if report is None or report.performance is None or not report.performance.to_k8s():
        return None
    return PerformanceStatus.model_validate(report.performance.to_k8s())


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


def _record(failure: Failure, attempt: int, now: str) -> FailureRecord:
    """status.failures' entry for this failure: the fields it knows."""
    known = {"attempt": attempt, "reason": failure.reason, "retryable": failure.retryable, "message": failure.message,
             "node": failure.node, "pod": failure.pod, "exit_code": failure.exit_code, "step": failure.step, "time": now}
    return FailureRecord(**{k: v for k, v in known.items() if v is not None})


def _verdict(obs: Observed, attempt: int, failure: Failure) -> tuple[str, str] | None:
    """(why not, event reason) when this failure ends the run; None: it is retried."""
    st, policy = obs.status, obs.spec.run_policy
    if not failure.retryable:
        return f"{failure.reason} is permanent", failure.reason
    if _repeated(st.failures, failure, attempt, policy.repeated_failure_limit):
        return f"{failure.reason} at step {failure.step} in {policy.repeated_failure_limit} consecutive attempts", "RepeatedFailure"
    if st.retries_used >= policy.retry_budget:
        return f"the retry budget ({policy.retry_budget}) is used up", "RetryBudgetExhausted"
    if attempt >= MAX_ATTEMPTS:
        return f"attempt {attempt} is the last one a LlamaFineTune may use", "TooManyAttempts"
    return None


def _failed_attempt(obs: Observed, seen: Observation, attempt: int, d: Decision, failure: Failure) -> Decision:
    st, now, policy, c = obs.status, iso(obs.now), obs.spec.run_policy, d.change
    used, budget = st.retries_used, policy.retry_budget
    c.failures = [*st.failures, _record(failure, attempt, now)][-MAX_FAILURE_HISTORY:]
    excluded = list(st.excluded_nodes)
    if failure.node and failure.node not in excluded:
        c.excluded_nodes = (excluded + [failure.node])[-MAX_EXCLUDED_NODES:]
        d.events.append(Event("Warning", "NodeExcluded", f"later attempts avoid node {failure.node}: {failure.reason}"))
    c.progress = _overlay(_with_step_of_total(st.progress), seen.live)
    verdict = _verdict(obs, attempt, failure)
    if verdict is not None:
        why, event_reason = verdict
        message = f"attempt {attempt} failed ({failure.reason}): {failure.message}; not retrying: {why}"
        c.phase, c.message, c.completion_time, c.retry_after = Phase.FAILED, message[:2000], now, None
        c.set_conditions(st.conditions, [("Running", False, "NotRunning", ""), ("Failed", True, failure.reason, message[:2000])],
                         obs.generation, now)
        if not _job_failed(obs.job) and not _failing_with_a_pod(obs):
            # Nothing will end the job (a stall, an XID, evidence on pods still running or being
            # deleted, a backend that replaces a failed pod): its pods may still hold GPUs, so the
            # job goes. A job the training operator failed, or is about to fail for a pod that
            # failed (whose termination report can come first), stays: its failed pods keep their
            # logs for `kubectl logs`, and cleanPodPolicy Running removes the pods still running.
            d.delete_jobs.append(obs.job_name)
        d.events.append(Event("Warning", event_reason, message[:1000]))
        return d
    delay = backoff(used, obs.retry_backoff_s)
    nxt = attempt + 1
    d.retry = failure
    d.delete_jobs.append(obs.job_name)
    c.attempt, c.retries_used, c.last_progress_time, c.leader_pod, c.phase = nxt, used + 1, None, None, Phase.RESTARTING
    c.set_conditions(st.conditions, [("Running", False, failure.reason, failure.message[:2000])], obs.generation, now)
    when = "now" if delay == 0 else f"in {delay:.0f}s"
    c.message = (f"attempt {attempt} failed ({failure.reason}): {failure.message[:600]}; restarting from the newest "
                 f"checkpoint as attempt {nxt} {when} ({used + 1}/{budget} retries)")
    d.events.append(Event("Warning", failure.reason, c.message))
    if delay == 0:
        d.start_attempt = nxt
        _size_attempt(obs, d)
        c.retry_after, c.attempt_start_time = None, now
    else:
        c.retry_after = iso(obs.now + timedelta(seconds=delay))
        d.requeue_after = delay
    return d


def refused(obs: Observed, reason: str, message: str) -> Decision:
    """The attempt cannot be created at all (the capacity planner refuses it, or the API server
    rejects a child as invalid): Failed with the reason, never an endless retry loop."""
    now = iso(obs.now)
    d = Decision(delete_jobs=list(obs.stale_jobs))
    c = d.change
    c.phase, c.message, c.completion_time, c.retry_after = Phase.FAILED, message[:2000], now, None
    c.set_conditions(obs.status.conditions, [("Failed", True, reason, message[:2000])], obs.generation, now)
    if obs.status.phase is not Phase.FAILED:
        d.events.append(Event("Warning", reason, message[:1000]))
    return d


def will_not_fit(obs: Observed, message: str) -> Decision:
    """The capacity planner refuses the attempt (spec.preflight Enforce): Failed before any job."""
    return refused(obs, "WillNotFit", f"refused before creating anything (spec.preflight Enforce): {message}")
