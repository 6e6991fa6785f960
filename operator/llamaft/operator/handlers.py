"""kopf handlers: thin glue between the Kubernetes API and the pure functions.

    kopf run --standalone -m llamaft.operator.handlers --all-namespaces   (or: llamaft operator)

- A daemon per LlamaFineTune runs its lifecycle: read what is true (the CR, the current attempt's
  job (a PyTorchJob or a TrainJob, status.backend) and pods, the leader's /progress, GPU health),
  ask `lifecycle.decide`, carry the decision out (delete jobs, server-side apply the children,
  reset the rendezvous and create the next attempt's job, write status, post events). It wakes on
  events of its children (the job, the trainer pods and the applied children, mapped to their
  owner by the `llamaft.io/finetune` label), on a spec change and, while a run is active, every
  sync interval to refresh progress. A finished run is not polled.
- update of .spec: suspend/resume, elastic worker changes and DCGM monitoring are applied in place;
  any other change restarts the run from its latest checkpoint as a new attempt; immutable fields
  are refused.
- delete (finalizer): the garbage collector removes the children (all owned by the CR); the handler
  resets what it cannot reach (an external etcd's rendezvous state); checkpoints stay.

State lives where kopf keeps it: settings, the API and HTTP clients and the registries (lifecycle
wake-ups, applied children, drift) in the operator's memo (set at startup, shared by every
object's memo), the per-object lock, validation and apply caches in the object's own memo (it goes
with the object).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import copy
import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, cast

import kopf
from kubernetes.client.exceptions import ApiException

from llamaft.api import resource
from llamaft.api.contracts import ProgressDocument, read_progress
from llamaft.api.spec import Backend, LlamaFineTuneSpec, PreflightMode, RendezvousBackend
from llamaft.api.status import TERMINAL_PHASES, Phase
from llamaft.api.validation import SpecInvalid, validate_spec
from llamaft.operator import failures, gpu_health, lifecycle, observe, rendezvous
from llamaft.operator.http import HttpClient, HttpError
from llamaft.operator.kube import ForeignObject, Kube, MonitoringUnavailable, owned_by
from llamaft.operator.metrics import FINETUNES, RECONCILE_SECONDS, RECONCILES, RENDEZVOUS_RESETS, RETRIES
from llamaft.operator.settings import OperatorSettings
from llamaft.planner import Admission, admission
from llamaft.render import desired, trainjob
from llamaft.render.admission import PLACEHOLDER_UID, checked_children
from llamaft.render.backends import BACKENDS, JobBackend, backend_for
from llamaft.render.naming import LABEL_FINETUNE, Owner

RESOURCE = (resource.GROUP, resource.VERSION, resource.PLURAL)
PRUNABLE = ("ConfigMap", "Deployment", "Service", "PrometheusRule")
"""Kinds of the children the spec can stop wanting: the dashboard ConfigMap and the alerts
(monitoring.dcgm off), the managed etcd (rendezvous changed). The trainer's PodMonitor is always
wanted; the attempts' jobs are the lifecycle's to delete."""
TERMINAL = {p.value for p in TERMINAL_PHASES}
Obj = dict[str, Any]
CHILD_SELECTORS = {
    ("kubeflow.org", "v1", "pytorchjobs"): LABEL_FINETUNE,
    ("trainer.kubeflow.org", "v1alpha1", "trainjobs"): LABEL_FINETUNE,
    ("", "v1", "pods"): f"{LABEL_FINETUNE},app.kubernetes.io/component=trainer",
    ("", "v1", "configmaps"): LABEL_FINETUNE,
    ("", "v1", "services"): LABEL_FINETUNE,
    ("apps", "v1", "deployments"): LABEL_FINETUNE,
    ("monitoring.coreos.com", "v1", "podmonitors"): LABEL_FINETUNE,
    ("monitoring.coreos.com", "v1", "prometheusrules"): LABEL_FINETUNE,
}
"""Server-side label selectors of the children's watches (the handlers' `labels=` filters below
say the same, but kopf applies those in this process)."""
WARM_UP_SPEC = {"model": {"source": "meta-llama/Llama-2-7b-hf"}, "dataset": {"format": "samsum", "source": "knkarthick/samsum"}}


def now() -> datetime:
    return datetime.now(UTC)


@contextmanager
def measured(handler: str) -> Iterator[None]:
    started = time.perf_counter()
    result = "ok"
    try:
        yield
    except kopf.TemporaryError:
        result = "retry"
        raise
    except Exception:
        result = "error"
        raise
    finally:
        RECONCILES.labels(handler, result).inc()
        RECONCILE_SECONDS.labels(handler).observe(time.perf_counter() - started)


# ------------------------------------------------------------------------------- memo access
def settings_of(memo: kopf.Memo) -> OperatorSettings:
    return memo["settings"]  # type: ignore[no-any-return]


def kube_of(memo: kopf.Memo) -> Kube:
    return memo["kube"]  # type: ignore[no-any-return]


def object_lock(memo: kopf.Memo) -> threading.Lock:
    """The daemon and the update handler of one object never interleave (dict.setdefault is atomic)."""
    return memo.setdefault("lock", threading.Lock())  # type: ignore[no-any-return]


def wake(memo: kopf.Memo, namespace: str, name: str) -> None:
    """Make the object's lifecycle daemon look now (safe from any thread)."""
    entry = memo["wakers"].get((namespace, name))
    if entry is not None:
        loop, event = entry
        loop.call_soon_threadsafe(event.set)


PHASES = {p.value for p in Phase}


def record_phase(memo: kopf.Memo, namespace: str, name: str, phase: str | None) -> None:
    """The per-phase gauge, from the phases the objects have (pruned on delete): moved by one
    object's change, not recounted over every object on every event."""
    phases: dict[tuple[str, str], str] = memo["phases"]
    before = phases.pop((namespace, name), None) if phase is None else phases.get((namespace, name))
    if phase is not None:
        phases[(namespace, name)] = phase
    if before == phase:
        return
    if before in PHASES:
        FINETUNES.labels(before).dec()
    if phase in PHASES:
        FINETUNES.labels(phase).inc()


# ------------------------------------------------------------------------------- startup
@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    logger = kwargs["logger"]
    settings.persistence.finalizer = "llamaft.io/finalizer"
    # The CRD's status schema is structural: kopf's own status fields would be pruned, so its
    # bookkeeping lives in annotations.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="llamaft.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="llamaft.io", key="last-handled-spec")
    settings.posting.level = logging.INFO
    # cel-python logs every evaluation step at DEBUG: far too costly (and noisy) for an operator.
    logging.getLogger("celpy").setLevel(logging.WARNING)
    settings.execution.max_workers = 16
    operator_settings = OperatorSettings.from_env()
    memo["settings"] = operator_settings
    memo["http"] = HttpClient()  # etcd, Prometheus and /progress: one pool, timeouts and retries
    memo["wakers"] = {}
    memo["phases"] = {}
    for phase in Phase:
        FINETUNES.labels(phase.value).set(0)
    memo["applied"] = {}  # (namespace, name) -> {(kind, child name): resourceVersion llamaft applied}
    memo["drifted"] = set()  # (namespace, name) whose children were edited or deleted by someone else
    memo["created_jobs"] = {}  # (namespace, job name) -> resourceVersion of the job as llamaft created it
    # Lifecycle steps block on API round trips: a pool of their own, sized by the settings (the
    # loop's default executor has min(32, cores + 4) threads: 6 on 2 cores, which queued bursts).
    memo["executor"] = concurrent.futures.ThreadPoolExecutor(operator_settings.workers, thread_name_prefix="lifecycle")
    # The handlers' `labels=` filters are client-side: without these, kopf would stream every pod
    # (cluster-wide) and every ConfigMap, Service and Deployment to this process only to drop them.
    # settings.watching.label_selectors is passed to the API as the watch's labelSelector.
    for child, selector in CHILD_SELECTORS.items():
        settings.watching.label_selectors[child] = selector
    warm_up(logger)
    from prometheus_client import start_http_server

    try:
        start_http_server(operator_settings.metrics_port)
        logger.info(f"operator metrics on :{operator_settings.metrics_port}/metrics")
    except OSError as exc:
        logger.warning(f"metrics port {operator_settings.metrics_port} unavailable: {exc}")


def warm_up(logger: Any) -> None:
    """Load now what the first validation would load (the CRD schema and its CEL programs, the
    Kubernetes and Kubeflow schemas the children are checked against, about 2 s of CPU), so that
    the first LlamaFineTunes after a start do not all wait for it."""
    started = time.perf_counter()
    try:
        spec = cached_spec(WARM_UP_SPEC)
        if isinstance(spec, LlamaFineTuneSpec):
            checked_children(Owner("warm-up", "default", PLACEHOLDER_UID), spec)
            admission(spec)
    except Exception as exc:  # only a cost moved earlier: never a reason not to start
        logger.warning(f"warm-up failed (the first validation pays for it): {exc}")
    logger.info(f"validation warmed up in {time.perf_counter() - started:.1f} s")


@kopf.on.cleanup()
def shutdown(memo: kopf.Memo, **_: Any) -> None:
    executor = memo.get("executor")
    if executor is not None:
        executor.shutdown(wait=False, cancel_futures=True)


@kopf.on.login()
def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf and the kubernetes client read the same credentials (in-cluster or KUBECONFIG); the
    client the handlers use is made here, once the credentials are loaded."""
    from kubernetes import config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    memo["kube"] = Kube()
    return kopf.login_with_kubeconfig(**kwargs) or kopf.login_with_service_account(**kwargs)


# ---------------------------------------------------------------------------- validation
SPEC_CACHE_SIZE = 256
_specs: collections.OrderedDict[str, concurrent.futures.Future[LlamaFineTuneSpec | SpecInvalid]] = collections.OrderedDict()
_specs_lock = threading.Lock()


def cached_spec(spec: Mapping[str, Any]) -> LlamaFineTuneSpec | SpecInvalid:
    """validate_spec (pydantic strict, then the CRD's CEL rules: ~20 ms of CPU) once per distinct
    spec content, shared by every object and step: LlamaFineTunes made from one template cost one
    evaluation, not one each, and concurrent steps with the same spec wait for the one running.
    Keyed by a hash of the canonical JSON; the last SPEC_CACHE_SIZE distinct specs are kept."""
    key = hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":"), default=repr).encode()).hexdigest()
    with _specs_lock:
        future = _specs.get(key)
        mine = future is None
        if future is None:
            future = _specs[key] = concurrent.futures.Future()
            while len(_specs) > SPEC_CACHE_SIZE:
                _specs.popitem(last=False)
        else:
            _specs.move_to_end(key)
    if mine:
        try:
            future.set_result(validate_spec(dict(spec)))
        except SpecInvalid as exc:
            future.set_result(exc)
        except BaseException as exc:
            with _specs_lock:
                if _specs.get(key) is future:
                    del _specs[key]
            future.set_exception(exc)
    return future.result()


def validated(memo: kopf.Memo, obj: Mapping[str, Any], old: Any = None,
              backend: str = "PyTorchJob") -> LlamaFineTuneSpec | SpecInvalid:
    """The parsed spec, or why it is invalid; cached per generation (the children's checks) and
    per spec content (`cached_spec`). With `old` (an update: transition rules) nothing is cached.
    `backend`: the job kind the children are checked as (status.backend once resolved).
    The children are rendered here, once per generation, with the operator's settings, and the
    objects checked are the ones the generation's first apply uses (memo["rendered"],
    Step._rendered_children)."""
    generation = obj.get("metadata", {}).get("generation")
    cached = memo.get("validated")
    if old is None and cached is not None and cached[0] == generation:
        return cached[1]  # type: ignore[no-any-return]
    result: LlamaFineTuneSpec | SpecInvalid
    parsed: LlamaFineTuneSpec | SpecInvalid
    if old is None:
        parsed = cached_spec(dict(obj.get("spec") or {}))
    else:
        try:
            parsed = validate_spec(dict(obj.get("spec") or {}), old=old)
        except SpecInvalid as exc:
            parsed = exc
    if isinstance(parsed, SpecInvalid):
        result = parsed
    else:
        # What admission cannot see: every child the spec renders, against the schemas the API
        # server and the training operator will apply, before anything is created.
        meta = obj.get("metadata", {})
        settings = memo.get("settings") or OperatorSettings()
        owner = Owner(str(meta.get("name")), str(meta.get("namespace")), str(meta.get("uid") or PLACEHOLDER_UID))
        checked = checked_children(owner, parsed, backend=Backend(backend), etcd_image=settings.etcd_image,
                                   dashboard_labels=dict(settings.dashboard_labels))
        result = SpecInvalid(checked.errors) if checked.errors else parsed
        if old is None and not checked.errors:
            memo["rendered"] = ((meta.get("uid", ""), generation), checked.children)
    if old is None:
        memo["validated"] = (generation, result)
    return result


def invalid_message(exc: SpecInvalid) -> str:
    return "; ".join(str(e) for e in exc.errors)


# ------------------------------------------------------------------------------ lifecycle
class Step:
    """One look at one LlamaFineTune: observe, decide, act. Runs in a worker thread."""

    def __init__(self, memo: kopf.Memo, namespace: str, name: str, logger: Any) -> None:
        self.memo, self.namespace, self.name, self.logger = memo, namespace, name, logger
        self.kube = kube_of(memo)
        self.settings = settings_of(memo)
        self.http: HttpClient = memo["http"]
        self.job_kind = "PyTorchJob"
        self.backend: JobBackend = backend_for(self.job_kind)
        """The run's job backend (status.backend), set with job_kind once the step resolves it."""
        self.children_index: Mapping[tuple[str, str], Any] | None = None
        """kopf's index of the labelled children (`children_by_owner`); None: list them."""
        self.created: Obj | None = None
        """The object as its creation event showed it, for the first step (instead of a read)."""

    def event(self, obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        kopf.event(cast(kopf.Body, dict(obj)), type=type_, reason=reason, message=message)

    def run(self) -> float | None:
        """Returns when to look again (None: only on an event)."""
        with measured("lifecycle"), object_lock(self.memo):
            # A fresh read (a step never decides on a status older than its last write), but for
            # the first step of an object just created: its creation event is as fresh.
            obj, self.created = self.created or self.kube.get_finetune(self.namespace, self.name), None
            if obj is None or obj.get("metadata", {}).get("deletionTimestamp"):
                return None
            return self._run(obj)

    def _run(self, obj: Obj) -> float | None:
        meta, status = obj["metadata"], dict(obj.get("status") or {})
        generation = meta.get("generation")
        owner = Owner(self.name, self.namespace, meta.get("uid", ""))
        attempt = int(status.get("attempt") or 0)
        if status.get("phase") in TERMINAL and attempt > 0:
            return None  # finished runs are final and not polled
        backend = status.get("backend") or self._resolve_backend(obj, status, generation)
        if backend is None:
            return 30.0
        self.job_kind = status["backend"] = str(backend)
        self.backend = backend_for(self.job_kind)
        parsed = validated(self.memo, obj, backend=self.job_kind)
        if isinstance(parsed, SpecInvalid):
            self._invalid(obj, status, parsed, generation)
            return None
        patch: Obj = {}
        if not _condition_is(status, "Valid", "True", generation):
            status["conditions"] = observe.set_condition(
                list(status.get("conditions", [])), "Valid", "True", "SpecValid", "the spec passed schema and CEL validation",
                generation, lifecycle.iso(now()))
        capacity = self._capacity(obj, parsed, status, generation)
        status["conditions"] = observe.set_condition(
            list(status.get("conditions", [])), "SharedCache", *desired.cache_condition(parsed), generation, lifecycle.iso(now()))
        try:
            obs = self._observe(obj, owner, parsed, status, max(attempt, 1), generation)
        except ApiException as exc:
            if exc.status != 404:
                raise
            # No job API: the Kubeflow training operator (or Trainer) is not installed (yet).
            self._missing(obj, status, generation, f"the cluster does not serve {self.backend.install_hint}; the run starts "
                          "once it is there")
            return 30.0
        decision = lifecycle.decide(obs)
        if decision.start_attempt is not None and capacity is not None and capacity.refuse:
            decision = lifecycle.will_not_fit(obs, capacity.message)
        for job_name in decision.delete_jobs:
            if self.kube.delete_job(self.namespace, job_name, self.job_kind):
                self.logger.info(f"deleted {self.job_kind} {job_name}")
        patch.update(decision.status)
        if patch.get("attempt") and not status.get("rendezvousId") and decision.start_attempt is None:
            # An attempt recorded after the fact (lifecycle.decide): the rest of what _start_attempt writes.
            patch.update(rendezvousId=owner.rendezvous_id(int(patch["attempt"])),
                         totalGpus=parsed.cluster.workers * parsed.cluster.gpus_per_worker)
        if obs.job is not None and decision.start_attempt is None and patch.get("phase", status.get("phase")) not in TERMINAL:
            self._suspend_as_specified(obj, owner, parsed, obs.job, max(attempt, int(patch.get("attempt") or 0)))
        if decision.status.get("phase") == Phase.QUEUED.value and status.get("phase") != Phase.QUEUED.value and attempt:
            # Kueue suspended the job (at creation, or to preempt it): when it admits it again the
            # training operator recreates the pods, which must not meet a closed rendezvous.
            try:
                self._reset(obj, owner, parsed, [attempt])
            except rendezvous.RendezvousResetError as exc:
                self.logger.warning(f"rendezvous reset while queued failed: {exc}")
        # Conditions this step set before deciding (Valid, GPUHealthy) live in `status`.
        patch.setdefault("conditions", status.get("conditions", []))
        patch["backend"] = self.job_kind
        requeue = decision.requeue_after
        if decision.start_attempt is None and attempt > 0 and patch.get("phase", status.get("phase")) not in TERMINAL:
            requeue = min(filter(None, (requeue, self._reconcile_children(obj, owner, parsed, patch))), default=None)
        if decision.start_attempt is not None:
            try:
                requeue = self._start_attempt(obj, owner, parsed, decision.start_attempt, status, patch) or requeue
            except ApiException as exc:
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
        if patch.get("phase", status.get("phase")) in TERMINAL:
            return None
        interval = self.settings.sync_interval_s
        return min(requeue, interval) if requeue is not None else interval

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

    def _resolve_backend(self, obj: Obj, status: Obj, generation: int | None) -> str | None:
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

    def _missing(self, obj: Obj, status: Obj, generation: int | None, message: str) -> None:
        if status.get("message") != message:
            self.kube.patch_finetune_status(self.namespace, self.name, {"message": message, "observedGeneration": generation})
            self.event(obj, "Warning", "TrainingOperatorMissing", message)

    def _capacity(self, obj: Obj, spec: LlamaFineTuneSpec, status: Obj, generation: int | None) -> Admission | None:
        """The capacity planner's verdict (once per generation): the CapacityFits condition, a
        Warning event when it will not fit, and, with spec.preflight Enforce, no job at all."""
        if spec.preflight is PreflightMode.OFF:
            return None
        cached = self.memo.get("capacity")
        if cached is not None and cached[0] == generation:
            verdict: Admission = cached[1]
        else:
            verdict = admission(spec)
            self.memo["capacity"] = (generation, verdict)
        # The condition goes into every status written (a step that failed before writing must
        # not lose it); the event only when the verdict is new.
        value = {True: "True", False: "False", None: "Unknown"}[verdict.fits]
        before = next((c for c in status.get("conditions", []) if c.get("type") == "CapacityFits"), None)
        status["conditions"] = observe.set_condition(list(status.get("conditions", [])), "CapacityFits", value, verdict.reason,
                                                     verdict.message[:2000], generation, lifecycle.iso(now()))
        if verdict.fits is False and (before is None or before.get("message") != verdict.message[:2000]):
            self.event(obj, "Warning", verdict.reason, verdict.message[:1000])
        return verdict

    def _invalid(self, obj: Obj, status: Obj, exc: SpecInvalid, generation: int | None) -> None:
        if _condition_is(status, "Valid", "False", generation):
            return  # already reported for this generation
        message = invalid_message(exc)
        conditions = observe.set_condition(list(status.get("conditions", [])), "Valid", "False", "InvalidSpec", message,
                                           generation, lifecycle.iso(now()))
        patch: Obj = {"conditions": conditions, "observedGeneration": generation}
        if int(status.get("attempt") or 0) == 0:
            # Never started: nothing runs, so the run is Failed until a valid spec arrives.
            patch.update(phase=Phase.FAILED.value, message="invalid spec: see the Valid condition and events")
        self.kube.patch_finetune_status(self.namespace, self.name, patch)
        for error in exc.errors:
            self.event(obj, "Warning", "InvalidSpec", str(error))

    def _observe(self, obj: Obj, owner: Owner, spec: LlamaFineTuneSpec, status: Obj, attempt: int,
                 generation: int | None) -> lifecycle.Observed:
        job_name = owner.job_name(attempt)
        kind = self.job_kind
        jobs = self.kube.list_jobs(self.namespace, f"{LABEL_FINETUNE}={self.name}", kind)
        current = next((j for j in jobs if j["metadata"]["name"] == job_name), None)
        if current is None and status.get("jobName") == job_name:
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
        pods = self.kube.list_pods(self.namespace, backend.pod_selector(job_name)) if job else []
        if job is not None:
            job = dict(backend.view(job, pods))
        job_phase, _, _ = observe.job_phase(job)
        progress = self._leader_progress(pods, spec, status) if job_phase in (Phase.RUNNING, Phase.RESTARTING) else None
        gpu = self._gpu(obj, owner, job_name, status, job_phase is Phase.RUNNING, progress)
        return lifecycle.Observed(
            spec=spec, status=status, now=now(), job_name=job_name, job=job, job_kind=kind, job_deleting=deleting,
            stale_jobs=stale, pods=pods, progress=progress, gpu=gpu, retry_backoff_s=self.settings.retry_backoff_s,
            generation=generation,
        )

    def _leader_progress(self, pods: list[Obj], spec: LlamaFineTuneSpec, status: Obj) -> ProgressDocument | None:
        """The leader's /progress in at most PROGRESS_REQUESTS_PER_SYNC requests, whatever the
        number of pods: the pod known to run global rank 0 (status.leaderPod) is asked; while it is
        not known (or no longer says rank 0) the other running pods are asked in turn, replica 0
        first, each sync going on from where the last one stopped. One request per sync in the
        steady state; the leader of an N-pod job is found within N/2 syncs at worst."""
        leader = status.get("leaderPod")
        running = [p for p in pods if p.get("status", {}).get("phase") == "Running" and p.get("status", {}).get("podIP")]
        known = [p for p in running if p["metadata"]["name"] == leader]
        others = sorted((p for p in running if p["metadata"]["name"] != leader), key=_replica_order)
        cursor = int(self.memo.get("progress_cursor", 0))
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
            self.memo["progress_cursor"] = cursor

    def _gpu(self, obj: Obj, owner: Owner, job_name: str, status: Obj, running: bool,
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
        before = next((c for c in status.get("conditions", []) if c.get("type") == "GPUHealthy"), None)
        status["conditions"] = observe.set_condition(
            list(status.get("conditions", [])), "GPUHealthy", "True" if health.healthy else "False", health.reason,
            health.message, obj["metadata"].get("generation"), lifecycle.iso(now()))
        if not health.healthy and (before is None or before.get("status") != "False" or before.get("reason") != health.reason):
            self.event(obj, "Warning", health.reason, health.message)
        return failures.gpu_failure(None if health.healthy else health.reason, health.message, health.nodes,
                                    progress.step if progress is not None else None)

    # ---------------------------------------------------------------------- starting an attempt
    def _start_attempt(self, obj: Obj, owner: Owner, spec: LlamaFineTuneSpec, attempt: int, status: Obj,
                       patch: Obj) -> float | None:
        """Ensure the attempt's children exist and its rendezvous is clean, then create its job.
        Returns a requeue delay when something it needs is not ready yet."""
        k, ns = self.kube, self.namespace
        job_name = owner.job_name(attempt)
        waiting = self._reconcile_children(obj, owner, spec, patch, force=True)
        if waiting is not None:
            return waiting
        if desired.uses_managed_etcd(spec) and not k.deployment_ready(ns, owner.etcd):
            self._condition(obj, patch, "RendezvousReady", False, "WaitingForEtcd", f"etcd {owner.etcd} is not ready yet")
            patch["message"] = "waiting for the managed etcd"
            return 2.0
        previous = attempt - 1 if attempt > 1 else None
        try:
            self._reset(obj, owner, spec, [a for a in (previous, attempt) if a is not None])
        except rendezvous.RendezvousResetError as exc:
            self._condition(obj, patch, "RendezvousReady", False, "RendezvousResetFailed", str(exc))
            return 5.0
        excluded = patch.get("excludedNodes", status.get("excludedNodes")) or []
        rendered = self.backend.render(owner, spec, attempt, excluded)
        job = adopted(rendered, obj)
        created = k.create_job(ns, job)
        if created is not None:
            # The job's creation event is this write's echo: it need not wake this lifecycle.
            self.memo["created_jobs"][(ns, job_name)] = str(created["metadata"].get("resourceVersion"))
            self.event(obj, "Normal", "JobCreated", f"created {self.job_kind} {job_name} (attempt {attempt}, "
                       f"rendezvous {owner.rendezvous_id(attempt)})" + (f", avoiding {', '.join(excluded)}" if excluded else ""))
        self._condition(obj, patch, "RendezvousReady", True, "RendezvousReady",
                        f"{spec.rendezvous.backend.value} rendezvous {owner.rendezvous_id(attempt)}")
        patch.update(attempt=attempt, jobName=job_name, rendezvousId=owner.rendezvous_id(attempt),
                     totalGpus=spec.cluster.workers * spec.cluster.gpus_per_worker)
        return None

    def _condition(self, obj: Obj, patch: Obj, type_: str, ok: bool, reason: str, message: str) -> None:
        patch["conditions"] = observe.set_condition(
            list(patch.get("conditions") or obj.get("status", {}).get("conditions") or []), type_, "True" if ok else "False",
            reason, message, obj["metadata"].get("generation"), lifecycle.iso(now()))

    def _reconcile_children(self, obj: Obj, owner: Owner, spec: LlamaFineTuneSpec, patch: Obj,
                            force: bool = False) -> float | None:
        """Server-side apply the children the spec describes (config, managed etcd, monitoring) and
        prune the ones it no longer wants. Skipped when nothing changed since the last apply: the
        rendered children are the same and no child event reported a hand edit or deletion (see
        `child_drifted`). Returns a requeue delay while the previous incarnation's objects go."""
        key = (self.namespace, self.name)
        drifted = key in self.memo["drifted"]
        # The children derive from the spec (its generation), the incarnation and the settings only:
        # a step of an unchanged generation does not render them (the dashboard alone is a large JSON).
        source = (owner.uid, obj["metadata"].get("generation"))
        if not force and not drifted and self.memo.get("children_source") == source:
            return None
        wanted = [adopted(child, obj) for child in self._rendered_children(owner, spec, source)]
        digest = hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()
        if not force and not drifted and self.memo.get("children_digest") == digest:
            self.memo["children_source"] = source
            return None
        self.memo["drifted"].discard(key)
        # The first apply for this incarnation (in this process) looks at what carries its label:
        # the previous incarnation's objects to wait for, and what an earlier process applied for
        # it that the spec no longer wants. Later applies know what they applied (memo["applied"]).
        listed: dict[str, list[Obj]] | None = None
        if self.memo.get("owner_checked") != owner.uid:
            listed = self._labelled_children()
            try:
                self._check_owners(wanted, listed, owner)
            except ForeignObject as exc:
                self._condition(obj, patch, "RendezvousReady", False, "PreviousIncarnation", str(exc))
                patch["message"] = f"waiting for the previous incarnation's objects to go: {exc}"
                return 1.0
            self.memo["owner_checked"] = owner.uid
        applied: dict[tuple[str, str], str] = {}
        previous = self.memo["applied"].get(key, {})
        # The versions each child is known to have had before this apply: what this process applied
        # last, and the live object's (kopf's index, or the listing), either possibly the older.
        seen = live_versions(self._indexed_children() if listed is None else listed)
        monitoring_missing: MonitoringUnavailable | None = None
        for child in wanted:
            kind, name = child["kind"], child["metadata"]["name"]
            try:
                live = self.kube.apply(self.namespace, child)
            except MonitoringUnavailable as exc:
                monitoring_missing = exc
                continue
            applied[(kind, name)] = str(live.get("metadata", {}).get("resourceVersion", ""))
        changed = changed_children(applied, previous, seen)
        pruned = self._prune(owner, set(applied) | {(c["kind"], c["metadata"]["name"]) for c in wanted}, listed, previous)
        self.memo["applied"][key] = applied
        self.memo["children_digest"] = digest
        self.memo["children_source"] = source
        if changed or pruned:
            what = (f"applied {', '.join(changed)}" if changed else "") + ("; " if changed and pruned else "") + \
                   (f"pruned {', '.join(pruned)}" if pruned else "")
            reason = "DriftRepaired" if drifted and not force else "ChildrenApplied"
            self.event(obj, "Normal", reason, what)
        if monitoring_missing is not None:
            if not any(c.get("type") == "MonitoringReady" for c in obj.get("status", {}).get("conditions", [])):
                self.event(obj, "Warning", "MonitoringUnavailable",
                           f"{monitoring_missing}: install the Prometheus Operator for metrics and alerts")
            self._condition(obj, patch, "MonitoringReady", False, "PrometheusOperatorMissing", str(monitoring_missing))
        else:
            self._condition(obj, patch, "MonitoringReady", True, "MonitoringApplied",
                            "PodMonitor, alerts and dashboard are as the spec asks")
        return None

    def _rendered_children(self, owner: Owner, spec: LlamaFineTuneSpec, source: tuple[str, Any]) -> list[Obj]:
        """The children to apply: the ones this generation's validation rendered and checked
        (`validated`), handed over once (the memo does not keep them); rendered again only for a
        later apply of the same generation (a repair, the next attempt's start) or when there are
        none (a step that did not validate, e.g. in tests). Copies: adoption must not change them."""
        handed = self.memo.pop("rendered", None)
        if handed is not None and handed[0] == source:
            return copy.deepcopy(handed[1])  # type: ignore[no-any-return]
        return desired.children(owner, spec, self.settings.etcd_image, dict(self.settings.dashboard_labels))

    def _indexed_children(self) -> dict[str, list[Obj]]:
        """This LlamaFineTune's labelled children as kopf's index has them ({} without the index)."""
        if self.children_index is None:
            return {}
        entries = list(self.children_index.get((self.namespace, self.name), ()))
        return {kind: [e for e in entries if e["kind"] == kind] for kind in CHILD_KINDS}

    def _labelled_children(self) -> dict[str, list[Obj]]:
        """The objects of the child kinds that carry this LlamaFineTune's label, by kind: from kopf's
        index when the step has it (no request: kopf listed these kinds before any daemon ran and
        follows their watches), else listed (the kinds that can be pruned)."""
        if self.children_index is not None:
            # list() of the index's store copies it in one C call: safe beside the loop's updates.
            entries = list(self.children_index.get((self.namespace, self.name), ()))
            return {kind: [e for e in entries if e["kind"] == kind] for kind in CHILD_KINDS}
        return {kind: self.kube.list_children(self.namespace, kind, f"{LABEL_FINETUNE}={self.name}") for kind in PRUNABLE}

    def _check_owners(self, wanted: list[Obj], listed: Mapping[str, list[Obj]], owner: Owner) -> None:
        """ForeignObject when a child's name is taken by an object of another owner or one being
        deleted: the previous incarnation's, after a delete and re-apply (its objects carry the
        same label, so the kinds listed for pruning are checked from those lists; others by name)."""
        live = {(kind, o["metadata"]["name"]): o for kind, objs in listed.items() for o in objs}
        for child in wanted:
            kind, name = child["kind"], child["metadata"]["name"]
            if kind not in listed:
                self.kube.check_owner(self.namespace, child)
                continue
            current = live.get((kind, name))
            meta = (current or {}).get("metadata", {})
            if meta.get("ownerReferences") and not owned_by(current or {}, owner.uid):
                raise ForeignObject(f"{kind} {name} still belongs to {meta['ownerReferences'][0].get('uid')} (being deleted)")
            if meta.get("deletionTimestamp"):
                raise ForeignObject(f"{kind} {name} is being deleted")

    def _prune(self, owner: Owner, keep: set[tuple[str, str]], listed: Mapping[str, list[Obj]] | None,
               previous: Mapping[tuple[str, str], str]) -> list[str]:
        """Delete this incarnation's children that the spec no longer describes: monitoring turned
        off, the managed etcd after a switch to an external endpoint. Candidates: the listed objects
        with its label and owner uid, or (without a listing) what this process applied before."""
        if listed is not None:
            candidates = [(kind, live["metadata"]["name"]) for kind, objs in listed.items() if kind in PRUNABLE for live in objs
                          if owned_by(live, owner.uid) and not live["metadata"].get("deletionTimestamp")]
        else:
            candidates = [(kind, name) for kind, name in previous if kind in PRUNABLE]
        pruned = []
        for kind, name in candidates:
            if (kind, name) not in keep and self.kube.delete(self.namespace, kind, name):
                pruned.append(f"{kind} {name}")
        return pruned

    def _reset(self, obj: Obj, owner: Owner, spec: LlamaFineTuneSpec, attempts: list[int]) -> None:
        reset_rendezvous(self.settings, self.http, owner, spec, attempts,
                         lambda reason, message: self.event(obj, "Normal", reason, message))


def reset_rendezvous(settings: OperatorSettings, http: HttpClient, owner: Owner, spec: LlamaFineTuneSpec, attempts: list[int],
                     announce: Any) -> None:
    """Remove the rendezvous state of the given attempts' ids (never by restarting etcd)."""
    if spec.rendezvous.backend is RendezvousBackend.C10D or not attempts:
        return
    host, port = desired.rendezvous_endpoint(owner, spec, attempts[-1])
    address = settings.rendezvous_address_override or f"{host}:{port}"
    for attempt in attempts:
        rdzv_id = owner.rendezvous_id(attempt)
        try:
            deleted = rendezvous.reset(address, spec.rendezvous.backend, rdzv_id, http)
        except rendezvous.RendezvousResetError:
            RENDEZVOUS_RESETS.labels("error").inc()
            raise
        RENDEZVOUS_RESETS.labels("deleted" if deleted else "clean").inc()
        if deleted:
            announce("RendezvousReset", f"removed stale state of rendezvous {rdzv_id}: {len(deleted)} key(s)")


def api_message(exc: ApiException) -> str:
    """The API server's own message (e.g. the field a 422 names), not the client's dump."""
    try:
        body = json.loads(exc.body or "{}")
    except ValueError:
        body = {}
    return str(body.get("message") or exc.reason or exc)[:1500]


def adopted(child: Obj, owner: Mapping[str, Any]) -> Obj:
    """The child with the LlamaFineTune as its controller owner (kopf.adopt mutates in place)."""
    kopf.adopt(child, owner=cast(kopf.Body, dict(owner)))
    return child


PROGRESS_REQUESTS_PER_SYNC = 2
"""Most /progress requests one sync of a running job makes (Step._leader_progress)."""


def _replica_order(pod: Mapping[str, Any]) -> tuple[int, str]:
    """Replica index 0 first (with a static rendezvous, where rank 0 runs), then by index and name."""
    index = str((pod.get("metadata", {}).get("labels") or {}).get("training.kubeflow.org/replica-index", ""))
    return (int(index) if index.isdigit() else 1 << 30, str(pod.get("metadata", {}).get("name")))


def _condition_is(status: Mapping[str, Any], type_: str, value: str, generation: int | None) -> bool:
    return any(c.get("type") == type_ and c.get("status") == value and c.get("observedGeneration") == generation
               for c in status.get("conditions", []) or [])


@kopf.daemon(*RESOURCE, cancellation_timeout=5.0)
async def run_lifecycle(name: str | None, namespace: str | None, memo: kopf.Memo, stopped: kopf.DaemonStopped,
                        logger: Any, children_by_owner: Any = None, **_: Any) -> None:
    """The object's lifecycle loop: one step now (or the one the creation event started, see
    `finetune_seen`), then one per wake-up or requeue."""
    assert name is not None and namespace is not None
    loop = asyncio.get_running_loop()
    woken = _waker(memo, namespace, name)
    step = Step(memo, namespace, name, logger)
    step.children_index = children_by_owner
    executor = memo.get("executor")  # None: the loop's default executor
    first: asyncio.Future[tuple[bool, float | None]] | None = memo.pop("first_step", None)
    delay: float | None = None
    looked = False
    if first is not None:
        # Wake-ups since the creation event are on `woken` (registered before that step ran).
        looked, delay = await first
    try:
        while not stopped:
            if not looked:
                woken.clear()
                try:
                    # As asyncio.to_thread, in the operator's own pool: the context goes along (kopf.event needs it).
                    delay = await loop.run_in_executor(executor, contextvars.copy_context().run, step.run)
                except kopf.TemporaryError as exc:
                    delay = exc.delay or 5.0
                except Exception as exc:  # an API hiccup must not end the object's lifecycle
                    logger.exception(f"lifecycle step failed: {exc}")
                    delay = 5.0
            looked = False
            waits = [asyncio.ensure_future(woken.wait()), asyncio.ensure_future(stopped.wait())]
            try:
                await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
    finally:
        if memo["wakers"].get((namespace, name), (None, None))[1] is woken:
            del memo["wakers"][(namespace, name)]


def _waker(memo: kopf.Memo, namespace: str, name: str) -> asyncio.Event:
    """The object's wake-up event on this loop (registered once: by the first of the creation
    event's step and the daemon)."""
    loop = asyncio.get_running_loop()
    entry = memo["wakers"].get((namespace, name))
    if entry is None or entry[0] is not loop:
        entry = memo["wakers"][(namespace, name)] = (loop, asyncio.Event())
    return entry[1]  # type: ignore[no-any-return]


# ----------------------------------------------------------------------- children -> owner
@kopf.on.event("kubeflow.org", "v1", "pytorchjobs", labels={LABEL_FINETUNE: kopf.PRESENT})
@kopf.on.event("trainer.kubeflow.org", "v1alpha1", "trainjobs", labels={LABEL_FINETUNE: kopf.PRESENT})
@kopf.on.event("", "v1", "pods", labels={LABEL_FINETUNE: kopf.PRESENT, "app.kubernetes.io/component": "trainer"})
async def child_changed(type: str | None, body: kopf.Body, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    """A job or trainer pod changed: its owner's lifecycle looks now, not at the next sync. Not
    for the creation event of a job the lifecycle itself just created (what it wrote is what it
    knows; the training operator's first status update wakes it). (This and the other event
    handlers are async: they only look at dicts, so they run on the loop instead of taking a trip
    through kopf's thread pool for every watch event.)"""
    owner, namespace = (meta.get("labels") or {}).get(LABEL_FINETUNE), meta.get("namespace")
    if not owner or not namespace:
        return
    if body.get("kind") in BACKENDS:
        ours = memo["created_jobs"].pop((namespace, meta.get("name")), None)
        if type == "ADDED" and ours is not None and ours == str(meta.get("resourceVersion")):
            return
    wake(memo, str(namespace), str(owner))


CHILD_LABELS = {LABEL_FINETUNE: kopf.PRESENT}


@kopf.on.event("", "v1", "configmaps", labels=CHILD_LABELS)
@kopf.on.event("", "v1", "services", labels=CHILD_LABELS)
@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
@kopf.on.event("monitoring.coreos.com", "v1", "podmonitors", labels=CHILD_LABELS)
@kopf.on.event("monitoring.coreos.com", "v1", "prometheusrules", labels=CHILD_LABELS)
async def child_drifted(type: str | None, body: kopf.Body, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    """A child llamaft applied changed in a way llamaft did not (a hand edit, a deletion): its
    owner's lifecycle applies the children again now. Our own applies are recognised by the
    resourceVersion they returned; the Deployment's status updates cost one no-op apply (which
    posts no event: changed_children)."""
    owner, namespace = (meta.get("labels") or {}).get(LABEL_FINETUNE), meta.get("namespace")
    if not owner or not namespace:
        return
    applied = memo["applied"].get((namespace, owner))
    child = (str(body.get("kind")), str(meta.get("name")))
    if applied is None or child not in applied:
        return  # not (yet) applied by this operator: the owner's next apply covers it
    if type == "DELETED" or str(meta.get("resourceVersion")) != applied[child]:
        memo["drifted"].add((namespace, owner))
        wake(memo, namespace, owner)


CHILD_KINDS = ("ConfigMap", "Deployment", "Service", "PodMonitor", "PrometheusRule")


def live_versions(listed: Mapping[str, Sequence[Obj]]) -> dict[tuple[str, str], str]:
    """(kind, name) -> resourceVersion of the listed children (those that have one)."""
    return {(kind, str(o["metadata"]["name"])): str(o["metadata"]["resourceVersion"])
            for kind, objs in listed.items() for o in objs if (o.get("metadata") or {}).get("resourceVersion")}


def changed_children(after: Mapping[tuple[str, str], str], *before: Mapping[tuple[str, str], str]) -> list[str]:
    """The children a round of server-side applies changed, as "Kind name", in apply order.

    `after`: the resourceVersion each apply returned; `before`: versions each child was known to
    have had before it (what this process applied last, what the watch last showed). A server-side
    apply that changes nothing is not written and returns the version it found, one already seen;
    a write makes a new one. So an operator restarted mid-run, or a Deployment whose status alone
    moved its version, reports no "applied" (issue 24: events that say something happened when
    nothing did teach users to ignore events)."""
    return [f"{kind} {name}" for (kind, name), version in after.items()
            if not any(known.get((kind, name)) == version for known in before)]


@kopf.index("", "v1", "configmaps", labels=CHILD_LABELS)
@kopf.index("", "v1", "services", labels=CHILD_LABELS)
@kopf.index("apps", "v1", "deployments", labels=CHILD_LABELS)
@kopf.index("monitoring.coreos.com", "v1", "podmonitors", labels=CHILD_LABELS)
@kopf.index("monitoring.coreos.com", "v1", "prometheusrules", labels=CHILD_LABELS)
async def children_by_owner(resource: kopf.Resource, meta: kopf.Meta, **_: Any) -> dict[tuple[str, str], Obj]:
    """Every labelled child, by (namespace, owner name), as much of it as the first apply of an
    incarnation looks at: its name, owners and deletion (the previous incarnation's objects to wait
    for, this one's to prune), and its resourceVersion (whether an apply changed it). kopf lists the indexed kinds before it runs any other handler or
    daemon (kopf/_core/reactor/processing.py: operator_indexed), so the index is complete at start;
    after that it follows the watches. It replaces five LISTs per new LlamaFineTune."""
    owner, namespace = (meta.get("labels") or {}).get(LABEL_FINETUNE), meta.get("namespace")
    if not owner or not namespace:
        return {}
    return {(str(namespace), str(owner)): {"kind": resource.kind, "metadata": {
        "name": meta.get("name"), "deletionTimestamp": meta.get("deletionTimestamp"),
        # the version the watch last showed: an apply that returns it changed nothing (changed_children)
        **({"resourceVersion": meta["resourceVersion"]} if meta.get("resourceVersion") else {}),
        "ownerReferences": [{"uid": ref.get("uid")} for ref in meta.get("ownerReferences") or []]}}}


@kopf.on.event(*RESOURCE)
async def finetune_seen(type: str | None, name: str | None, namespace: str | None, memo: kopf.Memo,
                        logger: Any, body: kopf.Body, children_by_owner: Any = None, **_: Any) -> None:
    """The per-phase gauge, from the phases the API server holds (every object is listed at
    startup, so the gauge is right after a restart too).

    A LlamaFineTune just created gets its first lifecycle step from here, at once: kopf starts the
    daemon only after a round trip to add its finalizer (a PATCH and the watch event it causes),
    which under a burst of creates queues behind every other object's events. The step is the
    daemon's own (same lock, same memo), idempotent, and the daemon waits for it before its first
    look. Nothing is lost without the finalizer yet: every child is owned by the CR."""
    if not (name and namespace):
        return
    # The plain dict under kopf's view: each lookup through the view re-resolves its path (a
    # measurable share of the loop's time under a burst, for one field).
    raw_status = body.get("status") or {}
    record_phase(memo, namespace, name, None if type == "DELETED" else str(raw_status.get("phase") or Phase.PENDING.value))
    if type == "DELETED" and "first_step" in memo:  # gone before its daemon started
        memo["wakers"].pop((namespace, name), None)
    if type == "ADDED" and not raw_status.get("attempt") and "first_step" not in memo:
        _waker(memo, namespace, name).clear()  # wake-ups from here on reach the daemon
        step = Step(memo, namespace, name, logger)
        step.children_index = children_by_owner
        step.created = copy.deepcopy(dict(body))
        memo["first_step"] = asyncio.get_running_loop().run_in_executor(
            memo.get("executor"), contextvars.copy_context().run, _first_step, step, logger)


def _first_step(step: Step, logger: Any) -> tuple[bool, float | None]:
    """(whether the step ran, when to look again); a failure is logged and the daemon looks itself."""
    try:
        return True, step.run()
    except Exception as exc:
        logger.warning(f"first lifecycle step failed (the daemon looks again): {exc}")
        return False, None


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


@kopf.on.update(*RESOURCE, field="spec")
def spec_changed(body: kopf.Body, old: Any, new: Any, meta: kopf.Meta, memo: kopf.Memo, **_: Any) -> None:
    namespace, name = str(meta["namespace"]), str(meta["name"])
    k, settings = kube_of(memo), settings_of(memo)
    with measured("update"), object_lock(memo):
        obj = k.get_finetune(namespace, name)
        if obj is None:
            return
        status = dict(obj.get("status") or {})
        generation = obj["metadata"].get("generation")
        attempt = int(status.get("attempt") or 0)
        kind = str(status.get("backend") or "PyTorchJob")
        parsed = validated(memo, obj, old=old, backend=kind)
        memo.pop("validated", None)
        if isinstance(parsed, SpecInvalid):
            for error in parsed.errors:
                kopf.warn(body, reason="InvalidSpec", message=str(error))
            conditions = observe.set_condition(list(status.get("conditions", [])), "Valid", "False", "InvalidSpec",
                                               invalid_message(parsed), generation, lifecycle.iso(now()))
            k.patch_finetune_status(namespace, name, {"conditions": conditions})
            return  # the running attempt continues with the last valid spec
        owner = Owner(name, namespace, obj["metadata"].get("uid", ""))
        if attempt == 0:
            first = k.get_job(namespace, owner.job_name(1), kind)
            if first is None or not owned_by(first, owner.uid):
                wake(memo, namespace, name)  # never started (its spec was invalid): the lifecycle starts it
                return
            attempt = 1  # started, but the step that created the job never wrote the status
        if status.get("phase") in TERMINAL:
            kopf.info(body, reason="Finished", message=f"the run has {str(status['phase']).lower()}: spec changes do not "
                      "start it again; create a new LlamaFineTune (or delete and re-apply this one)")
            k.patch_finetune_status(namespace, name, {"observedGeneration": generation})
            return
        job_name = owner.job_name(attempt)
        changed = changed_fields(old, parsed)
        if not changed:
            # e.g. a default written out explicitly: nothing the run sees differs, so nothing restarts.
            k.patch_finetune_status(namespace, name, {"observedGeneration": generation})
            return
        backend = backend_for(kind)
        scalable = backend.scalable(parsed)
        if all(in_place(path) for path in changed) and (("cluster", "workers") not in changed or scalable):
            if ("runPolicy", "suspend") in changed:
                if not parsed.run_policy.suspend:
                    # resumed pods must not meet a closed rendezvous
                    reset_rendezvous(settings, memo["http"], owner, parsed, [attempt],
                                     lambda r, m: kopf.info(body, reason=r, message=m))
                suspend = parsed.run_policy.suspend
                k.patch_job(namespace, job_name, backend.suspend_patch(suspend), kind)
                kopf.info(body, reason="Suspended" if parsed.run_policy.suspend else "Resumed",
                          message=f"{kind} {job_name} {'suspended' if parsed.run_policy.suspend else 'resumed'}")
            if ("cluster", "workers") in changed:
                k.patch_job(namespace, job_name, backend.scale_patch(parsed.cluster.workers), kind)
                kopf.info(body, reason="Scaled", message=f"elastic workers -> {parsed.cluster.workers}")
            if any(path[:2] == ("monitoring", "dcgm") for path in changed):
                kopf.info(body, reason="MonitoringChanged", message="monitoring applied in place; training continues")
            k.patch_finetune_status(namespace, name, {"observedGeneration": generation})
            wake(memo, namespace, name)
            return
        fields = ", ".join(".".join(c) for c in sorted(changed)) or "spec"
        k.patch_finetune_status(namespace, name, {
            "attempt": attempt + 1, "phase": Phase.RESTARTING.value, "retryAfter": None, "lastProgressTime": None,
            "message": f"{fields} changed: restarting from the latest checkpoint as attempt {attempt + 1}",
            "observedGeneration": generation,
        })
        k.delete_job(namespace, job_name, kind)
        kopf.info(body, reason="SpecChanged", message=f"{fields} changed: restarting from the latest checkpoint as attempt {attempt + 1}")
    wake(memo, namespace, name)


# ---------------------------------------------------------------------------------- delete
@kopf.on.delete(*RESOURCE)
def cleanup(body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, memo: kopf.Memo, **_: Any) -> None:
    """Every child (jobs and their pods, config, etcd, monitoring) has this LlamaFineTune as its
    controller owner, so the garbage collector removes them once it is gone. What garbage
    collection cannot reach is done here: the rendezvous state in an external etcd
    (spec.rendezvous.endpoint), and this operator's own bookkeeping. A re-applied CR of the same
    name meets its predecessor's children only while the collector works; it waits for them
    (ForeignObject) and never adopts them. Checkpoints stay."""
    namespace, name = str(meta["namespace"]), str(meta["name"])
    settings = settings_of(memo)
    with measured("delete"), object_lock(memo):
        owner = Owner(name, namespace, meta.get("uid", ""))
        try:
            parsed: LlamaFineTuneSpec | None = LlamaFineTuneSpec.model_validate(dict(spec))
        except ValueError:
            parsed = None
        attempt = int(status.get("attempt") or 0)
        if parsed is not None and parsed.rendezvous.endpoint is not None and attempt:
            try:
                reset_rendezvous(settings, memo["http"], owner, parsed, [attempt], lambda r, m: None)
            except rendezvous.RendezvousResetError as exc:
                kopf.warn(body, reason="RendezvousResetFailed", message=f"left rendezvous state behind: {exc}")
        memo["applied"].pop((namespace, name), None)
        memo["drifted"].discard((namespace, name))
        kopf.info(body, reason="Deleted", message="the garbage collector removes the jobs, etcd, config and monitoring "
                  "(all owned by this LlamaFineTune); checkpoints are kept")
