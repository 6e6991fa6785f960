"""One lifecycle step of one LlamaFineTune: read what is true (the CR, the current attempt's job
and pods, the leader's /progress, GPU health), ask `lifecycle.decide`, carry the decision out
(delete jobs, apply the children, reset the rendezvous, create the next attempt's job, write the
status, post events)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from llamaft.api.contracts import ProgressDocument, read_progress
from llamaft.api.spec import Backend, LlamaFineTuneSpec, PreflightMode
from llamaft.api.status import TERMINAL_PHASES, Condition, LlamaFineTuneStatus, Phase, read_status
from llamaft.api.validation import SpecInvalid, validate_spec
from llamaft.operator import elastic, failures, gpu_health, lifecycle, observe, rendezvous, timestamps
from llamaft.operator.children import ChildReconciler, adopted
from llamaft.operator.http import HttpClient, HttpError
from llamaft.operator.kube import owned_by
from llamaft.operator.observe import StatusChange
from llamaft.operator.operator_metrics import RETRIES
from llamaft.operator.specs import invalid_message, validated
from llamaft.operator.state import (
    TERMINAL,
    Obj,
    condition_is,
    kube_of,
    measured,
    now,
    object_lock,
    object_state,
    operator_state,
    settings_of,
)
from llamaft.planner import Admission, admission
from llamaft.render import desired, trainjob
from llamaft.render.backends import BACKENDS, JobBackend, backend_for, phase_of_job
from llamaft.render.naming import LABEL_FINETUNE, Owner

PROGRESS_REQUESTS_PER_SYNC = 2
"""Most /progress requests one sync of a running job makes (Step._leader_progress)."""


def _replica_order(pod: Mapping[str, Any]) -> tuple[int, str]:
    """Replica index 0 first (with a static rendezvous, where rank 0 runs), then by index and name."""
    index = str((pod.get("metadata", {}).get("labels") or {}).get("training.kubeflow.org/replica-index", ""))
    return (int(index) if index.isdigit() else 1 << 30, str(pod.get("metadata", {}).get("name")))

class Step(ChildReconciler):
    """One look at one LlamaFineTune: observe, decide, act. Runs in a worker thread."""

    def __init__(self, memo: kopf.Memo, namespace: str, name: str, logger: Any) -> None:
        self.memo, self.namespace, self.name, self.logger = memo, namespace, name, logger
        self.kube = kube_of(memo)
        self.settings = settings_of(memo)
        self.shared = operator_state(memo)
        self.own = object_state(memo)
        self.http: HttpClient = self.shared.http  # type: ignore[assignment]
        self.job_kind = "PyTorchJob"
        self.backend: JobBackend = backend_for(self.job_kind)
        """The run's job backend (status.backend), set with job_kind once the step resolves it."""
        self.children_index: Mapping[tuple[str, str], Any] | None = None
        """kopf's index of the labelled children (`children_by_owner`); None: list them."""
        self.created: Obj | None = None
        """The object as its creation event showed it, for the first step (instead of a read)."""

    def run(self) -> float | None:
        """Returns when to look again (None: only on an event)."""
        with measured("lifecycle"), object_lock(self.memo):
            # A fresh read (a step never decides on a status older than its last write), but for
            # the first step of an object just created: its creation event is as fresh.
            created, self.created = self.created, None
            obj = created or self.kube.get_finetune(self.namespace, self.name)
            if obj is None or obj.get("metadata", {}).get("deletionTimestamp"):
                return None
            return self._run(obj, new=created is not None)

    def _run(self, obj: Obj, new: bool = False) -> float | None:
        """`new`: the object as its creation event showed it (the first step of a new object)."""
        meta = obj["metadata"]
        status = read_status(obj.get("status"))  # the one read of the stored status; a step works on this copy
        generation = meta.get("generation")
        owner = Owner(self.name, self.namespace, meta.get("uid", ""))
        attempt = status.attempt
        if status.phase in TERMINAL_PHASES and attempt > 0:
            return None  # finished runs are final and not polled
        backend = status.backend or self._resolve_backend(obj, status, generation)
        if backend is None:
            return 30.0
        self.job_kind = str(backend)
        self.backend = backend_for(self.job_kind)
        parsed = validated(self.memo, obj, backend=self.job_kind)
        if isinstance(parsed, SpecInvalid):
            self._invalid(obj, status, parsed, generation)
            return None
        if not condition_is(status, "Valid", "True", generation):
            _set_condition(status, "Valid", "True", "SpecValid", "the spec passed schema and CEL validation", generation)
        capacity = self._capacity(obj, parsed, status, generation)
        _set_condition(status, "SharedCache", *desired.cache_condition(parsed), generation)
        try:
            obs = self._observe(obj, owner, parsed, status, max(attempt, 1), generation,
                                capacity.message if capacity is not None and capacity.refuse else None, new=new)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return self._no_job_api(obj, status, generation)
        decision = lifecycle.decide(obs)
        for job_name in decision.delete_jobs:
            if self.kube.delete_job(self.namespace, job_name, self.job_kind):
                self.logger.info(f"deleted {self.job_kind} {job_name}")
        if decision.scale_to is not None and obs.job is not None:
            self.kube.patch_job(self.namespace, obs.job_name, self.backend.scale_patch(decision.scale_to), self.job_kind)
        patch = self._patch(decision, status, owner, parsed)
        if obs.job is not None and decision.start_attempt is None and _phase_after(patch, status) not in TERMINAL:
            self._suspend_as_specified(obj, owner, parsed, obs.job, max(attempt, int(patch.get("attempt") or 0)))
        if decision.reset_rendezvous:
            try:
                self._reset(obj, owner, parsed, decision.reset_rendezvous)
            except rendezvous.RendezvousResetError as exc:
                self.logger.warning(f"rendezvous reset while queued failed: {exc}")
        requeue = decision.requeue_after
        if decision.start_attempt is None and attempt > 0 and _phase_after(patch, status) not in TERMINAL:
            requeue = min(filter(None, (requeue, self._reconcile_children(obj, owner, parsed, patch))), default=None)
        if decision.start_attempt is not None:
            try:
                requeue = self._start_attempt(obj, owner, parsed, decision.start_attempt, status, patch,
                                              decision.workers or parsed.cluster.workers) or requeue
            except ApiException as exc:
                if exc.status == 404:  # a new object's first step meets a missing job API here (no list before)
                    return self._no_job_api(obj, status, generation)
                if exc.status not in (400, 422):
                    raise  # transient: the daemon looks again
                # The API server rejects what the spec renders: retrying cannot help.
                rejection = lifecycle.refused(obs, "ChildRejected", f"the API server rejected a child object: {api_message(exc)}")
                patch.update(rejection.status)
                decision.events += rejection.events
                requeue = None
        if decision.retry is not None:
            RETRIES.labels(decision.retry.reason).inc()
        patch["observedGeneration"] = generation
        changes = {key: value for key, value in patch.items() if obj.get("status", {}).get(key) != value}
        if changes:  # an unchanged status is not written: no watch event, no write load
            self.kube.patch_finetune_status(self.namespace, self.name, changes)
        for event in decision.events:
            self.event(obj, event.type, event.reason, event.message)
        if _phase_after(patch, status) in TERMINAL:
            return None
        interval = self.settings.sync_interval_s
        return min(requeue, interval) if requeue is not None else interval

    def _patch(self, decision: lifecycle.Decision, status: LlamaFineTuneStatus, owner: Owner,
               spec: LlamaFineTuneSpec) -> Obj:
        """The decision's status change, with what this step adds, as the merge patch the acting
        below completes (children's conditions, the created attempt) and writes."""
        change = decision.change
        if change.attempt and not status.rendezvous_id and decision.start_attempt is None:
            # An attempt recorded after the fact (lifecycle.decide): the rest of what _start_attempt writes.
            change.rendezvous_id = owner.rendezvous_id(change.attempt)
            change.total_gpus = spec.cluster.workers * spec.cluster.gpus_per_worker
        if change.conditions is None:
            change.conditions = status.conditions  # those this step set before deciding (Valid, GPUHealthy, ...)
        change.backend = self.job_kind
        return change.merge_patch()

    def _suspend_as_specified(self, obj: Obj, owner: Owner, spec: LlamaFineTuneSpec, job: Mapping[str, Any],
                              attempt: int) -> None:
        """Level-based suspend: the job is suspended exactly when spec.runPolicy.suspend says so (the
        update handler applies a change at once; this repairs one it missed, e.g. made while the
        operator was down or changing leaders). A job Kueue manages is unsuspended by Kueue only."""
        wanted = spec.run_policy.suspend
        actual = self.backend.suspended(job)
        if wanted == actual or (actual and spec.scheduling.queue_name):
            return
        if not wanted:
            self._reset(obj, owner, spec, [attempt])  # resumed pods must not meet a closed rendezvous
        name = job["metadata"]["name"]
        self.kube.patch_job(self.namespace, name, self.backend.suspend_patch(wanted), self.job_kind)
        self.event(obj, "Normal", "Suspended" if wanted else "Resumed",
                   f"{self.job_kind} {name} {'suspended' if wanted else 'resumed'} (as spec.runPolicy.suspend says)")

    def _resolve_backend(self, obj: Obj, status: LlamaFineTuneStatus, generation: int | None) -> str | None:
        """spec.backend, with `auto` resolved to the job kind the cluster serves: TrainJob (Kubeflow
        Trainer v2, the maintained line) when it is served and the spec is one a TrainJob can carry
        out (trainjob.unsupported is empty), else PyTorchJob (the legacy training operator v1.9)
        when served; recorded in status.backend and fixed for the object's life (backend is
        immutable). None when the cluster serves neither yet."""
        wanted = str((obj.get("spec") or {}).get("backend") or Backend.PYTORCH_JOB.value)
        if wanted != Backend.AUTO.value:
            return wanted if wanted in BACKENDS else Backend.PYTORCH_JOB.value  # an invalid value fails validation
        try:
            first = trainjob.preferred_backend(validate_spec(obj.get("spec"))).value
        except SpecInvalid:
            first = Backend.TRAIN_JOB.value  # the validation step reports it, whichever backend is chosen
        for kind in (first, *(k for k in ("TrainJob", "PyTorchJob") if k != first)):
            if self.kube.serves(self.namespace, kind):
                self.event(obj, "Normal", "BackendSelected", f"backend auto: this cluster serves {BACKENDS[kind].install_hint}: using {kind}")
                return kind
        self._missing(obj, status, generation, f"backend auto: the cluster serves neither {BACKENDS['PyTorchJob'].install_hint} nor "
                      f"{BACKENDS['TrainJob'].install_hint}; the run starts once one of them is there")
        return None

    def _no_job_api(self, obj: Obj, status: LlamaFineTuneStatus, generation: int | None) -> float:
        """The cluster does not serve the job kind (404): the Kubeflow training operator (or
        Trainer) is not installed (yet). Look again in 30 s."""
        self._missing(obj, status, generation, f"the cluster does not serve {self.backend.install_hint}; the run starts "
                      "once it is there")
        return 30.0

    def _missing(self, obj: Obj, status: LlamaFineTuneStatus, generation: int | None, message: str) -> None:
        if status.message != message:
            change = StatusChange(message=message, observed_generation=generation)
            self.kube.patch_finetune_status(self.namespace, self.name, change.merge_patch())
            self.event(obj, "Warning", "TrainingOperatorMissing", message)

    def _capacity(self, obj: Obj, spec: LlamaFineTuneSpec, status: LlamaFineTuneStatus,
                  generation: int | None) -> Admission | None:
        """The capacity planner's verdict (once per generation, and once per spec content in the
        operator: OperatorState.capacities): the CapacityFits condition, a Warning event when it
        will not fit, and, with spec.preflight Enforce, no job at all."""
        if spec.preflight is PreflightMode.OFF:
            return None
        cached = self.own.capacity
        if cached is not None and cached[0] == generation:
            verdict: Admission = cached[1]
        else:
            verdict = self.shared.capacities.get(obj.get("spec") or {}, lambda _: admission(spec))
            self.own.capacity = (generation, verdict)
        # The condition goes into every status written (a step that failed before writing must
        # not lose it); the event only when the verdict is new.
        value = {True: "True", False: "False", None: "Unknown"}[verdict.fits]
        before = _condition(status, "CapacityFits")
        _set_condition(status, "CapacityFits", value, verdict.reason, verdict.message[:2000], generation)
        if verdict.fits is False and (before is None or before.message != verdict.message[:2000]):
            self.event(obj, "Warning", verdict.reason, verdict.message[:1000])
        return verdict

    def _invalid(self, obj: Obj, status: LlamaFineTuneStatus, exc: SpecInvalid, generation: int | None) -> None:
        if condition_is(status, "Valid", "False", generation):
            return  # already reported for this generation
        _set_condition(status, "Valid", "False", "InvalidSpec", invalid_message(exc), generation)
        change = StatusChange(conditions=status.conditions, observed_generation=generation)
        if status.attempt == 0:
            # Never started: nothing runs, so the run is Failed until a valid spec arrives.
            change.phase, change.message = Phase.FAILED, "invalid spec: see the Valid condition and events"
        self.kube.patch_finetune_status(self.namespace, self.name, change.merge_patch())
        for error in exc.errors:
            self.event(obj, "Warning", "InvalidSpec", str(error))

    def _observe(self, obj: Obj, owner: Owner, spec: LlamaFineTuneSpec, status: LlamaFineTuneStatus, attempt: int,
                 generation: int | None, capacity_refusal: str | None = None, new: bool = False) -> lifecycle.Observed:
        """What is true of the current attempt. `new`: the object's first step, from its creation
        event; with no attempt recorded it lists no jobs: a job's name carries the object's uid,
        so none can exist but one this operator made, and before this step it made none (an
        operator that takes over lists the objects, which makes no creation step). Were one there
        all the same, creating it meets it (409, kube.create_job) and the attempt is recorded."""
        job_name = owner.job_name(attempt)
        kind = self.job_kind
        fresh = new and status.attempt == 0 and not status.job_name
        jobs = [] if fresh else self.kube.list_jobs(self.namespace, f"{LABEL_FINETUNE}={self.name}", kind)
        current = next((j for j in jobs if j["metadata"]["name"] == job_name), None)
        if current is None and status.job_name == job_name:
            # Recorded as created but not among the labelled ones (its labels edited away): by
            # name. A job not recorded yet is found by the list (a predecessor's carries our label
            # too, under its own name), so creating an attempt costs no extra GET.
            current = self.kube.get_job(self.namespace, job_name, kind)
        deleting = current is not None and (
            bool(current["metadata"].get("deletionTimestamp")) or not owned_by(current, owner.uid))
        stale = [j["metadata"]["name"] for j in jobs
                 if j["metadata"]["name"] != job_name and owned_by(j, owner.uid) and not j["metadata"].get("deletionTimestamp")]
        job = None if deleting else current
        backend = backend_for(kind)
        selector = backend.pod_selector(job_name)
        listed = self.kube.list_pods(self.namespace, selector) if job else []
        pods = listed
        if job is not None:
            if not backend.suspended(job):  # a suspension's deletions are not failures (lifecycle._queued)
                pods = operator_state(self.memo).evidence.recall((self.namespace, self.name), selector, job, listed)
            job = dict(backend.view(job, listed))
        quota = None
        if job is not None and current is not None and spec.cluster.elastic is not None and spec.scheduling.queue_name \
                and backend.suspended(job) and not spec.run_policy.suspend:
            uid = current["metadata"].get("uid", "")
            quota = elastic.quota_wait(self.kube.list_workloads(self.namespace, f"{elastic.WORKLOAD_JOB_UID}={uid}"))
        job_phase, _, _ = phase_of_job(job)
        progress = self._leader_progress(listed, spec, status.leader_pod) if job_phase in (Phase.RUNNING, Phase.RESTARTING) else None
        gpu = self._gpu(obj, owner, job_name, status, job_phase is Phase.RUNNING, progress)
        return lifecycle.Observed(
            spec=spec, status=status, now=now(), job_name=job_name, job=job, job_kind=kind, job_deleting=deleting,
            stale_jobs=stale, pods=pods, progress=progress, gpu=gpu, retry_backoff_s=self.settings.retry_backoff_s,
            generation=generation, capacity_refusal=capacity_refusal, fits=lambda n: self._fits(spec, generation, n),
            scalable=backend.scalable(spec), quota=quota,
        )

    def _fits(self, spec: LlamaFineTuneSpec, generation: int | None, workers: int) -> str | None:
        """The capacity planner on `workers` workers (an elastic shrink's check, whatever
        spec.preflight says: the operator's own resize must not make a fitting run run out of
        memory): None when it fits or cannot tell, else its verdict. Once per generation and size."""
        key = (generation, workers)
        if key not in self.own.sized_capacity:
            verdict = admission(elastic.sized(spec, workers))
            self.own.sized_capacity[key] = verdict.message if verdict.fits is False else None
        return self.own.sized_capacity[key]

    def _leader_progress(self, pods: list[Obj], spec: LlamaFineTuneSpec, leader: str | None) -> ProgressDocument | None:
        """The leader's /progress in at most PROGRESS_REQUESTS_PER_SYNC requests, whatever the
        number of pods: the pod known to run global rank 0 (`leader`, status.leaderPod) is asked; while it is
        not known (or no longer says rank 0) the other running pods are asked in turn, replica 0
        first, each sync going on from where the last one stopped. One request per sync in the
        steady state; the leader of an N-pod job is found within N/2 syncs at worst."""
        running = [p for p in pods if p.get("status", {}).get("phase") == "Running" and p.get("status", {}).get("podIP")]
        known = [p for p in running if p["metadata"]["name"] == leader]
        others = sorted((p for p in running if p["metadata"]["name"] != leader), key=_replica_order)
        cursor = self.own.progress_cursor
        if others:
            turn = cursor % len(others)
            others = others[turn:] + others[:turn]
        try:
            for pod in (known + others)[:PROGRESS_REQUESTS_PER_SYNC]:
                cursor += pod not in known
                url = f"http://{pod['status']['podIP']}:{spec.monitoring.metrics_port}/progress"
                try:
                    # No retries: a pod that does not answer now is asked again at a later sync.
                    doc = self.http.get_json(url, timeout_s=self.settings.progress_timeout_s, retries=0)
                except HttpError:
                    continue
                parsed = read_progress(doc)  # the one place the operator reads a /progress document
                if parsed is not None and parsed.rank == 0:
                    return parsed
            return None
        finally:
            self.own.progress_cursor = cursor

    def _gpu(self, obj: Obj, owner: Owner, job_name: str, status: LlamaFineTuneStatus, running: bool,
             progress: ProgressDocument | None) -> failures.Failure | None:
        """GPUHealthy from Prometheus (when configured); a hardware XID on one of the current
        attempt's GPUs is a failure of the attempt."""
        url = self.settings.prometheus_url
        if not url or not running:
            return None
        xid_query, util_query = gpu_health.queries(owner, job_name)
        try:
            health = gpu_health.assess(gpu_health.query(url, xid_query, self.http), gpu_health.query(url, util_query, self.http),
                                       running)
        except RuntimeError as exc:  # HttpError, or Prometheus refused the query
            health = gpu_health.Health(True, "MetricsUnavailable", f"cannot query {url}: {exc}")
        before = _condition(status, "GPUHealthy")
        _set_condition(status, "GPUHealthy", "True" if health.healthy else "False", health.reason, health.message,
                       obj["metadata"].get("generation"))
        if not health.healthy and (before is None or before.status != "False" or before.reason != health.reason):
            self.event(obj, "Warning", health.reason, health.message)
        return failures.gpu_failure(None if health.healthy else health.reason, health.message, health.nodes,
                                    progress.step if progress is not None else None)

    # ---------------------------------------------------------------------- starting an attempt
    def _start_attempt(self, obj: Obj, owner: Owner, spec: LlamaFineTuneSpec, attempt: int, status: LlamaFineTuneStatus,
                       patch: Obj, workers: int) -> float | None:
        """Ensure the attempt's children exist and its rendezvous is clean, then create its job
        with `workers` workers (spec.cluster.workers, or an elastic run's size: the children are
        the spec's, whatever the size). Returns a requeue delay when something it needs is not
        ready yet. What the children's apply did is said once: in the JobCreated event when the job
        is created now, else in its own ChildrenApplied event."""
        said: list[str] = []
        waiting = self._reconcile_children(obj, owner, spec, patch, force=True, say=said.append)
        applied = said[0] if said else None
        created = False
        try:
            if waiting is not None:
                return waiting
            waiting, created = self._create_job(obj, owner, spec, attempt, status, patch, workers, applied)
            return waiting
        finally:
            if applied is not None and not created:
                self.event(obj, "Normal", "ChildrenApplied", applied)

    def _create_job(self, obj: Obj, owner: Owner, spec: LlamaFineTuneSpec, attempt: int, status: LlamaFineTuneStatus,
                    patch: Obj, workers: int, applied: str | None) -> tuple[float | None, bool]:
        """The attempt's job, once its managed etcd is ready and its rendezvous is clean: (a
        requeue delay or None, whether this created the job)."""
        k, ns = self.kube, self.namespace
        job_name = owner.job_name(attempt)
        if desired.uses_managed_etcd(spec) and not k.deployment_ready(ns, owner.etcd):
            self._condition(obj, patch, "RendezvousReady", False, "WaitingForEtcd", f"etcd {owner.etcd} is not ready yet")
            patch["message"] = "waiting for the managed etcd"
            return 2.0, False
        previous = attempt - 1 if attempt > 1 else None
        try:
            self._reset(obj, owner, spec, [a for a in (previous, attempt) if a is not None])
        except rendezvous.RendezvousResetError as exc:
            self._condition(obj, patch, "RendezvousReady", False, "RendezvousResetFailed", str(exc))
            return 5.0, False
        excluded = patch.get("excludedNodes", status.excluded_nodes) or []
        rendered = self.backend.render(owner, elastic.sized(spec, workers), attempt, excluded)
        job = adopted(rendered, obj)
        created = k.create_job(ns, job)
        if created is not None:
            # The job's creation event is this write's echo: it need not wake this lifecycle.
            self.shared.created_jobs[(ns, job_name)] = str(created["metadata"].get("resourceVersion"))
            self.event(obj, "Normal", "JobCreated", f"created {self.job_kind} {job_name} (attempt {attempt}, "
                       f"{workers} worker(s), rendezvous {owner.rendezvous_id(attempt)})"
                       + (f", avoiding {', '.join(excluded)}" if excluded else "")
                       + (f"; {applied}" if applied is not None else ""))
        self._condition(obj, patch, "RendezvousReady", True, "RendezvousReady",
                        f"{spec.rendezvous.backend.value} rendezvous {owner.rendezvous_id(attempt)}")
        patch.update(attempt=attempt, jobName=job_name, rendezvousId=owner.rendezvous_id(attempt),
                     totalGpus=workers * spec.cluster.gpus_per_worker)
        return None, created is not None

    def _reset(self, obj: Obj, owner: Owner, spec: LlamaFineTuneSpec, attempts: list[int]) -> None:
        rendezvous.reset_attempts(self.settings, self.http, owner, spec, attempts,
                         lambda reason, message: self.event(obj, "Normal", reason, message))

def _condition(status: LlamaFineTuneStatus, type_: str) -> Condition | None:
    return next((c for c in status.conditions if c.type == type_), None)


def _set_condition(status: LlamaFineTuneStatus, type_: str, value: str, reason: str, message: str,
                   generation: int | None) -> None:
    """A condition this step decides itself (before the lifecycle decides), on its copy of the
    status: the lifecycle builds on it, and the patch carries it."""
    status.conditions = observe.with_condition(status.conditions, type_, value, reason, message, generation,
                                               timestamps.iso(now()))


def _phase_after(patch: Obj, status: LlamaFineTuneStatus) -> str:
    """The phase once the patch is written."""
    return str(patch.get("phase", status.phase.value))


def api_message(exc: ApiException) -> str:
    """The API server's own message (e.g. the field a 422 names), not the client's dump."""
    try:
        body = json.loads(exc.body or "{}")
    except ValueError:
        body = {}
    return str(body.get("message") or exc.reason or exc)[:1500]
