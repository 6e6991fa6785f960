"""kopf handlers: thin glue between the Kubernetes API and the pure functions.

    kopf run --standalone -m llamaft.operator.handlers --all-namespaces   (or: llamaft operator)

- create/resume: validate, then ensure ConfigMap -> managed etcd (ready) -> rendezvous reset ->
  PyTorchJob of the current attempt. Everything is found by name first, so an operator restarted
  mid-reconcile never creates duplicates.
- update of .spec: suspend/resume and elastic worker changes are applied in place; any other change
  restarts the run from its latest checkpoint as a new attempt; immutable fields are refused.
- timer: status from the PyTorchJob, its pods and the trainer's /progress; a run that died of a
  closed rendezvous is reset and resubmitted with backoff within runPolicy.retryBudget.
- delete (finalizer): PyTorchJobs, etcd, ConfigMap and rendezvous state go; checkpoints stay.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import kopf

from llamaft.api import resource
from llamaft.api.spec import LlamaFineTuneSpec, RendezvousBackend
from llamaft.api.status import TERMINAL_PHASES, Phase
from llamaft.api.validation import SpecInvalid, validate_spec
from llamaft.operator import desired, gpu_health, monitoring, observe, rendezvous
from llamaft.operator.kube import Kube, MonitoringUnavailable
from llamaft.operator.metrics import FINETUNES, RECONCILE_SECONDS, RECONCILES, RENDEZVOUS_RESETS, RETRIES
from llamaft.operator.naming import LABEL_FINETUNE, Owner
from llamaft.operator.settings import OperatorSettings

RESOURCE = (resource.GROUP, resource.VERSION, resource.PLURAL)
SETTINGS = OperatorSettings.from_env()
_KUBE: Kube | None = None
_PHASES: dict[str, str] = {}
_LOCKS: dict[str, threading.Lock] = {}


def kube() -> Kube:
    global _KUBE
    if _KUBE is None:
        _KUBE = Kube()
    return _KUBE


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


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


def _lock(namespace: str, name: str) -> threading.Lock:
    """Timers run beside change handlers: one lock per object keeps them from interleaving."""
    return _LOCKS.setdefault(f"{namespace}/{name}", threading.Lock())


def _set_phase(patch: kopf.Patch, namespace: str, name: str, phase: Phase, message: str) -> None:
    patch.status["phase"] = phase.value
    patch.status["message"] = message
    _PHASES[f"{namespace}/{name}"] = phase.value
    for p in Phase:
        FINETUNES.labels(p.value).set(sum(1 for v in _PHASES.values() if v == p.value))


def _condition(patch: kopf.Patch, status: dict[str, Any], type_: str, ok: bool, reason: str, message: str, generation: int | None) -> None:
    current = patch.status.get("conditions") or status.get("conditions") or []
    patch.status["conditions"] = observe.set_condition(
        list(current), type_, "True" if ok else "False", reason, message, generation, now()
    )


def adopted(obj: dict[str, Any], body: kopf.Body) -> dict[str, Any]:
    """The object with the LlamaFineTune as its controller owner (kopf.adopt mutates in place)."""
    kopf.adopt(obj, owner=body)
    return obj


# ------------------------------------------------------------------------------- startup
@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **kwargs: Any) -> None:
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
    from prometheus_client import start_http_server

    try:
        start_http_server(SETTINGS.metrics_port)
        logger.info(f"operator metrics on :{SETTINGS.metrics_port}/metrics")
    except OSError as exc:
        logger.warning(f"metrics port {SETTINGS.metrics_port} unavailable: {exc}")


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf and the kubernetes client read the same credentials (in-cluster or KUBECONFIG)."""
    from kubernetes import config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    return kopf.login_with_kubeconfig(**kwargs) or kopf.login_with_service_account(**kwargs)


# ---------------------------------------------------------------------------- validation
def _validated(body: kopf.Body, spec: Any, patch: kopf.Patch, status: dict[str, Any], generation: int | None,
               old: Any = None) -> LlamaFineTuneSpec | None:
    try:
        parsed = validate_spec(dict(spec), old=old)
    except SpecInvalid as exc:
        message = "; ".join(str(e) for e in exc.errors)
        for error in exc.errors:
            kopf.warn(body, reason="InvalidSpec", message=str(error))
        _condition(patch, status, "Valid", False, "InvalidSpec", message, generation)
        return None
    _condition(patch, status, "Valid", True, "SpecValid", "the spec passed schema and CEL validation", generation)
    return parsed


# ------------------------------------------------------------------------- reconciliation
def _rendezvous_address(owner: Owner, spec: LlamaFineTuneSpec, attempt: int) -> str:
    host, port = desired.rendezvous_endpoint(owner, spec, attempt)
    return SETTINGS.rendezvous_address_override or f"{host}:{port}"


def _reset(body: kopf.Body, owner: Owner, spec: LlamaFineTuneSpec, attempts: list[int]) -> None:
    """Remove the rendezvous state of the given attempts' ids; TemporaryError when etcd is down."""
    if spec.rendezvous.backend is RendezvousBackend.C10D:
        return
    address = _rendezvous_address(owner, spec, attempts[-1])
    for attempt in attempts:
        rdzv_id = owner.rendezvous_id(attempt)
        try:
            deleted = rendezvous.reset(address, spec.rendezvous.backend, rdzv_id)
        except rendezvous.RendezvousResetError as exc:
            RENDEZVOUS_RESETS.labels("error").inc()
            kopf.warn(body, reason="RendezvousResetFailed", message=str(exc))
            raise kopf.TemporaryError(f"rendezvous reset failed: {exc}", delay=10) from exc
        RENDEZVOUS_RESETS.labels("deleted" if deleted else "clean").inc()
        if deleted:
            kopf.info(body, reason="RendezvousReset", message=f"removed stale state of rendezvous {rdzv_id}: {len(deleted)} key(s)")


def _start_attempt(body: kopf.Body, owner: Owner, spec: LlamaFineTuneSpec, attempt: int, patch: kopf.Patch,
                   status: dict[str, Any], generation: int | None, previous_attempt: int | None = None) -> None:
    """Ensure every object of `attempt` exists and its rendezvous starts clean."""
    k = kube()
    k.apply_config_map(owner.namespace, adopted(desired.config_map(owner, spec), body))
    if desired.uses_managed_etcd(spec):
        for obj in desired.etcd_objects(owner, SETTINGS.etcd_image):
            if k.ensure(owner.namespace, adopted(obj, body)):
                kopf.info(body, reason="EtcdCreated", message=f"created managed etcd {obj['kind']} {owner.etcd}")
        if not k.deployment_ready(owner.namespace, owner.etcd):
            _condition(patch, status, "RendezvousReady", False, "WaitingForEtcd", f"etcd {owner.etcd} is not ready yet", generation)
            _set_phase(patch, owner.namespace, owner.name, Phase.CREATING, "waiting for the managed etcd")
            raise kopf.TemporaryError("waiting for the managed etcd to be ready", delay=5)
    _ensure_monitoring(body, owner, spec, patch, status, generation)
    job_name = owner.job_name(attempt)
    if k.get_job(owner.namespace, job_name) is None:
        attempts = [a for a in (previous_attempt, attempt) if a is not None]
        _reset(body, owner, spec, attempts)
        created = k.create_job(owner.namespace, adopted(desired.pytorch_job(owner, spec, attempt), body))
        if created:
            kopf.info(body, reason="JobCreated", message=f"created PyTorchJob {job_name} (attempt {attempt}, rendezvous {owner.rendezvous_id(attempt)})")
    _condition(patch, status, "RendezvousReady", True, "RendezvousReady",
               f"{spec.rendezvous.backend.value} rendezvous {owner.rendezvous_id(attempt)}", generation)
    patch.status["attempt"] = attempt
    patch.status["jobName"] = job_name
    patch.status["rendezvousId"] = owner.rendezvous_id(attempt)
    patch.status["totalGpus"] = spec.cluster.workers * spec.cluster.gpus_per_worker
    patch.status["observedGeneration"] = generation
    if status.get("phase") in (None, Phase.PENDING.value, Phase.CREATING.value) or previous_attempt is not None:
        _set_phase(patch, owner.namespace, owner.name, Phase.CREATING, f"PyTorchJob {job_name} created")


def _ensure_monitoring(body: kopf.Body, owner: Owner, spec: LlamaFineTuneSpec, patch: kopf.Patch,
                       status: dict[str, Any], generation: int | None) -> None:
    """PodMonitor, alerts and dashboard; a cluster without the Prometheus Operator gets a warning,
    never a blocked run."""
    k = kube()
    try:
        for obj in monitoring.monitoring_objects(owner, spec, dict(SETTINGS.dashboard_labels)):
            if obj["kind"] == "ConfigMap":
                k.apply_config_map(owner.namespace, adopted(obj, body))
            else:
                k.ensure(owner.namespace, adopted(obj, body))
    except MonitoringUnavailable as exc:
        if not any(c.get("type") == "MonitoringReady" for c in status.get("conditions", [])):
            kopf.warn(body, reason="MonitoringUnavailable", message=f"{exc}: install the Prometheus Operator for metrics and alerts")
        _condition(patch, status, "MonitoringReady", False, "PrometheusOperatorMissing", str(exc), generation)
        return
    _condition(patch, status, "MonitoringReady", True, "MonitoringCreated", "PodMonitor, alerts and dashboard are in place", generation)


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
def reconcile(body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, patch: kopf.Patch, **_: Any) -> None:
    with measured("reconcile"), _lock(meta["namespace"], meta["name"]):
        generation = meta.get("generation")
        st = dict(status)
        if st.get("phase") in {p.value for p in TERMINAL_PHASES} and st.get("jobName"):
            return  # a finished run is not started again on operator restart
        parsed = _validated(body, spec, patch, st, generation)
        if parsed is None:
            _set_phase(patch, meta["namespace"], meta["name"], Phase.FAILED, "invalid spec: see the Valid condition and events")
            return
        owner = Owner(meta["name"], meta["namespace"], meta.get("uid", ""))
        _start_attempt(body, owner, parsed, int(st.get("attempt") or 1), patch, st, generation)


IN_PLACE_FIELDS = {("runPolicy", "suspend"), ("cluster", "workers")}


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
def spec_changed(body: kopf.Body, old: Any, new: Any, meta: kopf.Meta, status: kopf.Status,
                 patch: kopf.Patch, **_: Any) -> None:
    with measured("update"), _lock(meta["namespace"], meta["name"]):
        generation = meta.get("generation")
        st = dict(status)
        parsed = _validated(body, new, patch, st, generation, old=old)
        if parsed is None:
            return  # the running attempt continues with the last valid spec
        owner = Owner(meta["name"], meta["namespace"], meta.get("uid", ""))
        attempt = int(st.get("attempt") or 1)
        changed = changed_fields(old, parsed)
        job_name = owner.job_name(attempt)
        k = kube()
        if not changed:
            # e.g. a default written out explicitly: nothing the run sees differs, so nothing restarts.
            patch.status["observedGeneration"] = generation
            return
        if changed <= IN_PLACE_FIELDS and (("cluster", "workers") not in changed or parsed.cluster.elastic):
            if ("runPolicy", "suspend") in changed:
                if not parsed.run_policy.suspend:
                    _reset(body, owner, parsed, [attempt])  # resumed pods must not meet a closed rendezvous
                k.patch_job(owner.namespace, job_name, {"spec": {"runPolicy": {"suspend": parsed.run_policy.suspend}}})
                kopf.info(body, reason="Suspended" if parsed.run_policy.suspend else "Resumed",
                          message=f"PyTorchJob {job_name} {'suspended' if parsed.run_policy.suspend else 'resumed'}")
            if ("cluster", "workers") in changed:
                k.patch_job(owner.namespace, job_name, {"spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": parsed.cluster.workers}}}})
                kopf.info(body, reason="Scaled", message=f"elastic workers -> {parsed.cluster.workers}")
            patch.status["observedGeneration"] = generation
            return
        fields = ", ".join(".".join(c) for c in sorted(changed)) or "spec"
        k.delete_job(owner.namespace, job_name)
        kopf.info(body, reason="SpecChanged", message=f"{fields} changed: restarting from the latest checkpoint as attempt {attempt + 1}")
        _start_attempt(body, owner, parsed, attempt + 1, patch, st, generation, previous_attempt=attempt)


@kopf.on.delete(*RESOURCE)
def cleanup(body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, **_: Any) -> None:
    with measured("delete"):
        owner = Owner(meta["name"], meta["namespace"], meta.get("uid", ""))
        k = kube()
        jobs = k.list_jobs(owner.namespace, f"{LABEL_FINETUNE}={owner.name}")
        for job in jobs:
            k.delete_job(owner.namespace, job["metadata"]["name"])
        try:
            parsed: LlamaFineTuneSpec | None = LlamaFineTuneSpec.model_validate(dict(spec))
        except ValueError:
            parsed = None
        if parsed is not None and parsed.rendezvous.endpoint is not None and status.get("attempt"):
            try:
                rendezvous.reset(_rendezvous_address(owner, parsed, int(status["attempt"])), parsed.rendezvous.backend,
                                 owner.rendezvous_id(int(status["attempt"])))
            except rendezvous.RendezvousResetError as exc:
                kopf.warn(body, reason="RendezvousResetFailed", message=f"left rendezvous state behind: {exc}")
        for kind, name in (("Deployment", owner.etcd), ("Service", owner.etcd), ("ConfigMap", owner.config_map),
                           ("ConfigMap", f"{owner.name}-dashboard"), ("PodMonitor", f"{owner.name}-trainer"),
                           ("PrometheusRule", f"{owner.name}-alerts")):
            k.delete(owner.namespace, kind, name)
        _PHASES.pop(f"{owner.namespace}/{owner.name}", None)
        kopf.info(body, reason="Deleted", message=f"removed {len(jobs)} PyTorchJob(s), etcd and config; checkpoints are kept")


# ------------------------------------------------------------------------------ status sync
def _progress_docs(pods: list[dict[str, Any]], port: int) -> list[dict[str, Any]]:
    docs = []
    for pod in pods:
        ip = pod.get("status", {}).get("podIP")
        if not ip or pod.get("status", {}).get("phase") != "Running":
            continue
        try:
            with urllib.request.urlopen(f"http://{ip}:{port}/progress", timeout=SETTINGS.progress_timeout_s) as resp:
                docs.append(json.loads(resp.read()))
        except (OSError, ValueError):
            continue
    return docs


@kopf.timer(*RESOURCE, interval=SETTINGS.sync_interval_s, initial_delay=SETTINGS.sync_interval_s / 2)
def sync(body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, patch: kopf.Patch, **_: Any) -> None:
    st = dict(status)
    if not st.get("jobName") or meta.get("deletionTimestamp"):
        return
    with measured("sync"), _lock(meta["namespace"], meta["name"]):
        try:
            parsed = LlamaFineTuneSpec.model_validate(dict(spec))
        except ValueError:
            return
        owner = Owner(meta["name"], meta["namespace"], meta.get("uid", ""))
        k = kube()
        attempt = int(st.get("attempt") or 1)
        job = k.get_job(owner.namespace, owner.job_name(attempt))
        pods = k.list_pods(owner.namespace, f"training.kubeflow.org/job-name={owner.job_name(attempt)}")
        docs = _progress_docs(pods, parsed.monitoring.metrics_port)
        obs = observe.observe(job, pods, docs, st, generation=meta.get("generation"), now=now())
        phase = Phase(obs.status["phase"])
        evidence = observe.closed_rendezvous(job, pods) if phase is Phase.FAILED else None
        if evidence is not None:
            _recover(body, owner, parsed, st, patch, obs, evidence, attempt)
            return
        for key, value in obs.status.items():
            if key not in ("phase", "message"):
                patch.status[key] = value
        _set_phase(patch, owner.namespace, owner.name, phase, obs.status["message"])
        if phase is Phase.FAILED and st.get("phase") != Phase.FAILED.value:
            patch.status["completionTime"] = obs.status.get("completionTime") or now()
        for event in obs.events:
            kopf.event(body, type=event.type, reason=event.reason, message=event.message)
        if SETTINGS.prometheus_url and phase in (Phase.RUNNING, Phase.RESTARTING):
            _gpu_health(body, owner, patch, obs.status, st, phase is Phase.RUNNING)


def _gpu_health(body: kopf.Body, owner: Owner, patch: kopf.Patch, status: dict[str, Any], previous: dict[str, Any], running: bool) -> None:
    assert SETTINGS.prometheus_url is not None
    xid_query, util_query = gpu_health.queries(owner)
    try:
        health = gpu_health.assess(
            gpu_health.query(SETTINGS.prometheus_url, xid_query), gpu_health.query(SETTINGS.prometheus_url, util_query), running
        )
    except (OSError, RuntimeError, ValueError) as exc:
        health = gpu_health.Health(True, "MetricsUnavailable", f"cannot query {SETTINGS.prometheus_url}: {exc}")
    before = next((c for c in previous.get("conditions", []) if c.get("type") == "GPUHealthy"), None)
    _condition(patch, status, "GPUHealthy", health.healthy, health.reason, health.message, status.get("observedGeneration"))
    if not health.healthy and (before is None or before.get("status") != "False" or before.get("reason") != health.reason):
        kopf.warn(body, reason=health.reason, message=health.message)


def _recover(body: kopf.Body, owner: Owner, spec: LlamaFineTuneSpec, st: dict[str, Any], patch: kopf.Patch,
             obs: observe.Observation, evidence: str, attempt: int) -> None:
    """A run that died of a closed rendezvous: reset and resubmit with backoff, within budget."""
    used = int(st.get("retriesUsed") or 0)
    budget = spec.run_policy.retry_budget
    if used >= budget:
        _set_phase(patch, owner.namespace, owner.name, Phase.FAILED,
                   f"RendezvousClosedError and the retry budget ({budget}) is used up")
        if st.get("phase") != Phase.FAILED.value:
            kopf.warn(body, reason="RetryBudgetExhausted", message=f"not resubmitting: {used}/{budget} retries used; last error: {evidence}")
        return
    delay = SETTINGS.retry_backoff_s * (2**used)
    retry_at = st.get("retryAfter")
    if retry_at is None:
        when = (datetime.now(UTC) + timedelta(seconds=delay)).isoformat(timespec="seconds").replace("+00:00", "Z")
        patch.status["retryAfter"] = when
        _set_phase(patch, owner.namespace, owner.name, Phase.RESTARTING, f"closed rendezvous; resubmitting at {when}")
        kopf.warn(body, reason="RendezvousClosed", message=f"attempt {attempt} failed: {evidence[:300]}; resubmitting in {delay:.0f}s ({used + 1}/{budget})")
        if delay > 0:
            return
    elif datetime.fromisoformat(str(retry_at).replace("Z", "+00:00")) > datetime.now(UTC):
        return
    kube().delete_job(owner.namespace, owner.job_name(attempt))
    RETRIES.labels("RendezvousClosedError").inc()
    patch.status["retriesUsed"] = used + 1
    patch.status["retryAfter"] = None
    patch.status["workers"] = obs.status["workers"]
    kopf.info(body, reason="Resubmitted", message=f"resubmitting as attempt {attempt + 1} after resetting the rendezvous ({used + 1}/{budget})")
    _start_attempt(body, owner, spec, attempt + 1, patch, st, None, previous_attempt=attempt)
    _set_phase(patch, owner.namespace, owner.name, Phase.RESTARTING, f"resubmitted as attempt {attempt + 1}")

