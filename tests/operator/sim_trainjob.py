"""Kubeflow Trainer v2.3 on the simulated cluster (tests/operator/sim.py): the TrainJob controller,
the JobSet controller (v0.12, the version Trainer v2.3.0's go.mod pins) and the Kubernetes Job
controller, ported as far as a TrainJob on the `torch-distributed` ClusterTrainingRuntime needs them,
plus the Trainer webhook's admission rules for the emulator. SimCluster's control loop calls
`TrainerController.reconcile` for every TrainJob; its kubelets run the pods like any other.

What upstream does, and where (kubeflow/trainer v2.3.0, kubernetes-sigs/jobset v0.12.0,
kubernetes/kubernetes pkg/controller/job/job_controller.go):
- runtime: `spec.runtimeRef` names a ClusterTrainingRuntime (cluster-scoped) or a TrainingRuntime
  (the TrainJob's namespace); the first reconcile snapshots it (pkg/runtime/core/trainingruntime.go
  NewObjects); a missing runtime is a reconcile error (an event, no status change), an unknown
  kind a Failed condition (TrainingRuntimeNotSupported, pkg/controller/trainjob_controller.go).
- JobSet spec: the runtime's `template.spec` with every `runtimePatches[].trainingRuntimeSpec.
  template.spec` strategic-merged in turn (trainingruntime.go mergeRuntimePatches: replicatedJobs by
  name, containers/volumes/env by name, volumeMounts by mountPath; `strategic_merge` here); the
  trainer's replicated job (label trainer.kubeflow.org/trainjob-ancestor-step: trainer) runs
  `trainer.numNodes` pods (else mlPolicy.numNodes) and its `node` container gets the trainer's image,
  command, args, env and resourcesPerNode (jobset/builder.go Trainer, trainingruntime.go
  newRuntimeInfo) and, from the torch plugin (torch/torch.go, vendored as torch_plugin.go.txt),
  PET_NNODES, PET_NPROC_PER_NODE (numProcPerNode, else "auto", which becomes the CPU count when
  no GPU is requested), PET_NODE_RANK (fieldRef metadata.annotations['batch.kubernetes.io/
  job-completion-index']), PET_MASTER_ADDR `<job>-node-0-0.<job>`, PET_MASTER_PORT 29500 and
  containerPort 29500.
- JobSet defaults (jobset webhooks/jobset_webhook.go Default): completionMode Indexed, pod
  restartPolicy OnFailure, DNS hostnames on (subdomain = the JobSet's name, a headless Service of
  that name selecting jobset.sigs.k8s.io/jobset-name, publishNotReadyAddresses), successPolicy All,
  no failurePolicy. One Job `<jobset>-<replicatedJob>-<jobIndex>` per replica, labelled and
  annotated with the jobset.sigs.k8s.io/* keys (jobset_controller.go constructJob,
  labelAndAnnotateObject). The Job gets the API server's default backoffLimit, 6.
- Job controller (syncJob, manageJob): one pod per completion index, generateName
  `<job>-<index>-` (so `<jobset>-<rj>-<jobIndex>-<index>-<suffix>`), hostname `<job>-<index>`,
  annotation and label batch.kubernetes.io/job-completion-index, env JOB_COMPLETION_INDEX; a pod
  that failed or is being deleted (unless the controller itself deleted it for suspension) counts
  in status.failed, and a replacement is created after the pod failure back-off; the Job fails
  (BackoffLimitExceeded) when failed > backoffLimit or, with restartPolicy OnFailure, when the
  container restarts of its running/pending pods add up to backoffLimit (> 0 for a limit of 0),
  and then deletes its active pods; it completes when every index succeeded; suspended, it deletes
  its pods (uncounted).
- So under torch-distributed a failing container is restarted in place by the kubelet and the
  TrainJob fails only after 6 restarts in total (or 7 failed pods): nothing ends the job on the
  first failure. A runtime whose replicated job sets `backoffLimit: 0` fails on the first restart.
  Where: jobset pkg/webhooks/jobset_webhook.go:124 (restartPolicy OnFailure); the runtime sets no
  backoffLimit (torch_distributed_runtime.yaml) and no runtimePatch can (the CRD's JobSpec patch has
  only `template`); kubernetes job_controller.go syncJob (`exceedsBackoffLimit := jobCtx.failed >
  *job.Spec.BackoffLimit`, pastBackoffLimitOnFailure) and manageJob/deleteJobPods (suspension
  removes the tracking finalizer first: uncounted); jobset pkg/controllers/jobset_controller.go:189
  and failure_policy.go:52 (no failurePolicy: FailedJobs); trainer pkg/runtime/framework/plugins/
  jobset/jobset.go:438 Status (JobSet Failed -> TrainJob Failed).
- JobSet controller: a failed Job fails the JobSet (no failurePolicy: reason FailedJobs, "jobset
  failed due to one or more job failures (first failed job: <job>)"), all Jobs succeeded completes
  it (AllJobsCompleted, "jobset completed successfully"); suspend/resume flips the Jobs' suspend and
  on resume copies labels, annotations, nodeSelector, tolerations and schedulingGates of the
  (possibly re-patched) template into the Jobs (resumeJob). `jobsStatus` (from the JobSet's
  replicatedJobsStatus) counts Jobs, not pods: active = Jobs with an active pod, ready = Jobs whose
  succeeded+ready pods reach their parallelism, suspended, succeeded, failed.
- TrainJob status (trainjob_controller.go Reconcile, jobset/jobset.go Status): condition Suspended
  True (reason Suspended, "TrainJob is suspended") while spec.suspend, False (Resumed, "TrainJob is
  resumed") after; Complete and Failed copied from the JobSet's Completed and Failed; Trainer v2.3
  sets no Created/Running condition; activeDeadlineSeconds fails it with DeadlineExceeded and
  deletes the JobSet; the JobSet is re-applied only while either is suspended (jobset.go Build).

The shortcuts: JobSet and Job objects are not materialized (their state lives here, keyed by the
TrainJob's uid); pods and the headless Service are owned directly by the TrainJob (controller,
blockOwnerDeletion), so deleting it collects them through the emulator's garbage collector exactly
as the TrainJob -> JobSet -> Job -> Pod chain would (Foreground waits for the pods); no Job
tracking finalizer; Trainer's progress server env (trainjobstatus plugin), JobSet failurePolicy,
dependsOn/startupPolicy, TTLs, coordinator, exclusive placement, the runtime snapshot ConfigMap,
Kueue and events are not emulated.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jsonschema

from tests.operator.emulator import GENERATED_NAME_BASE, merge_diff, now_rfc3339, upstream_crd_schemas
from tests.operator.sim import ApiError, _parse_time, pod_path, service_path

if TYPE_CHECKING:
    from tests.operator.sim import SimCluster

Obj = dict[str, Any]

GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
TRAINJOBS = f"/apis/{API_VERSION}/trainjobs"
RESOURCE_KEY = f"{API_VERSION}/trainjobs"
CONTROLLER = "trainer.kubeflow.org/trainjob-controller"
"""spec.managedBy of the TrainJobs the built-in controller reconciles (the CRD's default)."""
ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
NODE = "node"
MASTER_PORT = 29500
TORCHRUN_RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JOBSET_UID = "jobset.sigs.k8s.io/jobset-uid"
REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
JOB_NAME = "batch.kubernetes.io/job-name"
JOB_CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
DEFAULT_BACKOFF_LIMIT = 6
"""batch/v1 Job defaulting when neither backoffLimit nor backoffLimitPerIndex is set."""
POD_FAILURE_BACKOFF = 10.0
"""Job controller: DefaultJobPodFailureBackOff, doubled per failure up to 10 minutes."""
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DOMAIN_PREFIXED_PATH = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/\S+$")

MERGE_KEYS = {
    "replicatedJobs": "name", "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "volumes": "name", "env": "name", "volumeMounts": "mountPath", "ports": "containerPort",
    "imagePullSecrets": "name", "schedulingGates": "name", "hostAliases": "ip", "resourceClaims": "name",
}
"""Strategic-merge keys of the list fields a JobSetSpec patch can reach (the Go types' patchMergeKey
tags: jobset ReplicatedJobs by name, core/v1 as in k8s.io/api); other lists are replaced."""
RETAIN_KEYS = frozenset({"volumes"})
"""Lists with patchStrategy "merge,retainKeys": a patched item keeps only the keys the patch names."""


def trainjob_path(namespace: str, name: str = "", sub: str = "") -> str:
    return f"/apis/{API_VERSION}/namespaces/{namespace}/trainjobs" + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


def runtime_path(kind: str, namespace: str, name: str = "") -> str:
    """A ClusterTrainingRuntime (cluster-scoped) or TrainingRuntime (namespaced)."""
    if kind == "ClusterTrainingRuntime":
        return f"/apis/{API_VERSION}/clustertrainingruntimes" + (f"/{name}" if name else "")
    return f"/apis/{API_VERSION}/namespaces/{namespace}/trainingruntimes" + (f"/{name}" if name else "")


# ------------------------------------------------------------------------------ admission
@functools.lru_cache(maxsize=1)
def trainjob_schema() -> Obj:
    """The vendored TrainJob CRD's schema as JSON schema (unknown fields are errors, as in
    kubeflow_rules for PyTorchJobs)."""
    from tests.operator.kubeflow_rules import _to_jsonschema

    schema: Obj = _to_jsonschema(upstream_crd_schemas()[RESOURCE_KEY])
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def admission_errors(job: Obj) -> list[str]:
    """What the API server and Trainer's validating webhook reject in a new TrainJob: the CRD schema,
    its root CEL rules on the name, the torch plugin's reserved env names (torch.go Validate) and the
    JobSet plugin's runtimePatches rules that need no runtime (jobset.go Validate: a domain-prefixed
    manager; no env for the node and initializer containers). Rules that look the runtime up
    (replicated job and container names, envInjection targets) are not applied."""
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft7Validator(trainjob_schema()).iter_errors(job)]
    name = str(job.get("metadata", {}).get("name", ""))
    if not DNS1035.match(name):
        errors.append("metadata.name: metadata.name must match RFC 1035 DNS label format")
    if len(name) > 63:
        errors.append("metadata.name: metadata.name must be no more than 63 characters")
    spec = job.get("spec") or {}
    env = ((spec.get("trainer") or {}).get("env") or [])
    reserved = sorted({str(e.get("name")) for e in env if isinstance(e, dict)} & set(TORCHRUN_RESERVED_ENV))
    if reserved:
        errors.append(f"spec.trainer.env: Invalid value: must not have reserved envs, invalid envs configured: [{' '.join(reserved)}]")
    for patch in spec.get("runtimePatches") or []:
        if not DOMAIN_PREFIXED_PATH.match(str(patch.get("manager", ""))):
            errors.append(f"spec.runtimePatches.manager: Invalid value: {patch.get('manager')!r}: must be a domain-prefixed path")
        template = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}
        for rjob in template.get("replicatedJobs") or []:
            pod = (((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
            for container in pod.get("containers") or []:
                if container.get("env") and container.get("name") in ("dataset-initializer", "model-initializer", NODE):
                    errors.append("spec.runtimePatches: Invalid value: must not have envs for the dataset-initializer, "
                                  "model-initializer, node containers")
    return errors


# ------------------------------------------------------------------------ strategic merge
def strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    """k8s.io/apimachinery's StrategicMergePatch for the shapes a runtime patch has: maps merge
    recursively (a null deletes), lists of MERGE_KEYS merge item by item (new items appended),
    every other value or list is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = _without_nulls(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        merge_key = MERGE_KEYS[key]
        merged = [copy.deepcopy(item) for item in base]
        for item in patch:
            at = next((i for i, old in enumerate(merged) if isinstance(old, dict) and isinstance(item, dict)
                       and old.get(merge_key) == item.get(merge_key)), None)
            if at is None:
                merged.append(_without_nulls(item))
                continue
            old = merged[at]
            if key in RETAIN_KEYS:
                old = {k: v for k, v in old.items() if k in item or k == merge_key}
            merged[at] = strategic_merge(old, item)
        return merged
    return _without_nulls(patch)


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _upsert(items: list[Obj], new: Obj, key: str = "name") -> None:
    """apply.UpsertEnvVars / UpsertPort: replace the item with the same key in place, else append."""
    for i, item in enumerate(items):
        if item.get(key) == new.get(key):
            items[i] = copy.deepcopy(new)
            return
    items.append(copy.deepcopy(new))


def _quantity(value: Any) -> int:
    """resource.Quantity.Value() for the CPU and GPU counts the torch plugin reads (rounded up)."""
    text = str(value)
    if text.endswith("m"):
        return -(-int(text[:-1]) // 1000)
    try:
        return int(-(-float(text) // 1))
    except ValueError:
        return 0


def _gpus(resources: Obj) -> int:
    """runtime.GetNumGPUPerNode: the first resource whose name contains "gpu", requests before limits."""
    def count(values: Obj) -> int:
        return next((_quantity(q) for name, q in (values or {}).items() if "gpu" in name.lower()), 0)
    return count(resources.get("requests") or {}) or count(resources.get("limits") or {})


def _cpus(resources: Obj) -> int:
    """torch.go getNumCPUPerNode: requests.cpu, else limits.cpu, else 0."""
    request = (resources.get("requests") or {}).get("cpu")
    if request is not None and _quantity(request):
        return _quantity(request)
    return _quantity((resources.get("limits") or {}).get("cpu") or 0)


# -------------------------------------------------------------------------- the JobSet spec
def jobset_spec(trainjob: Obj, runtime: Obj) -> Obj:
    """The JobSet spec Trainer applies for `trainjob` on `runtime` (a (Cluster)TrainingRuntime),
    JobSet's defaults included; each replicated job carries `count` (its pods per Job)."""
    spec = trainjob.get("spec") or {}
    name = trainjob["metadata"]["name"]
    runtime_spec = runtime.get("spec") or {}
    ml_policy = runtime_spec.get("mlPolicy")
    template_spec = copy.deepcopy((runtime_spec.get("template") or {}).get("spec") or {})
    order = [r.get("name") for r in template_spec.get("replicatedJobs") or []]
    for patch in spec.get("runtimePatches") or []:
        patch_spec = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec")
        if patch_spec:
            template_spec = strategic_merge(template_spec, patch_spec)
    template_spec["replicatedJobs"] = sorted(template_spec.get("replicatedJobs") or [],
                                             key=lambda r: order.index(r.get("name")) if r.get("name") in order else len(order))
    trainer = spec.get("trainer") or {}
    for rjob in template_spec["replicatedJobs"]:
        job_template = rjob.setdefault("template", {})
        job_spec = job_template.setdefault("spec", {})
        pod_template = job_spec.setdefault("template", {})
        pod_spec = pod_template.setdefault("spec", {})
        count = int(job_spec.get("parallelism") or 1)
        is_trainer = ((job_template.get("metadata") or {}).get("labels") or {}).get(ANCESTOR) == "trainer"
        if is_trainer and ml_policy is not None:
            count = int(ml_policy.get("numNodes") or 1)
            if trainer.get("numNodes") is not None and ml_policy.get("torch") is not None:
                count = int(trainer["numNodes"])  # torch EnforceMLPolicy
            for container in pod_spec.get("containers") or []:
                if container.get("name") != NODE:
                    continue
                if trainer.get("resourcesPerNode") is not None:
                    container["resources"] = strategic_merge(container.get("resources") or {}, trainer["resourcesPerNode"])
                if trainer.get("image") is not None:
                    container["image"] = trainer["image"]
                if trainer.get("command") is not None:
                    container["command"] = list(trainer["command"])
                if trainer.get("args") is not None:
                    container["args"] = list(trainer["args"])
                env = container.setdefault("env", [])
                for var in trainer.get("env") or []:
                    _upsert(env, var)
                if ml_policy.get("torch") is not None:
                    for var in _torch_env(name, trainer, container, count):
                        _upsert(env, var)
                    # The only port Trainer adds, unnamed, keyed by number (torch.go EnforceMLPolicy:
                    # apply.UpsertPort(..., ContainerPort().WithContainerPort(constants.ContainerTrainerPort)),
                    # tests/fixtures/upstream/kubeflow-trainer-v2.3/torch_plugin.go.txt:203).
                    _upsert(container.setdefault("ports", []), {"containerPort": MASTER_PORT}, key="containerPort")
        job_spec["parallelism"] = job_spec["completions"] = count  # SyncParallelCount
        job_spec.setdefault("completionMode", "Indexed")  # JobSet webhook defaults
        pod_spec.setdefault("restartPolicy", "OnFailure")
        job_spec.setdefault("backoffLimit", DEFAULT_BACKOFF_LIMIT if job_spec.get("backoffLimitPerIndex") is None else 2**31 - 1)
        rjob.setdefault("replicas", 1)
        rjob.setdefault("groupName", "default")
        rjob["count"] = count
    network = template_spec.setdefault("network", {})
    network.setdefault("enableDNSHostnames", True)
    network.setdefault("publishNotReadyAddresses", True)
    template_spec.setdefault("successPolicy", {"operator": "All"})
    template_spec["suspend"] = bool(spec.get("suspend"))
    return template_spec


def _torch_env(name: str, trainer: Obj, container: Obj, count: int) -> list[Obj]:
    """torch.go EnforceMLPolicy: the PET_* variables of the trainer container."""
    nproc = trainer.get("numProcPerNode")
    if nproc is not None:
        procs = str(int(nproc))
    else:
        resources = trainer.get("resourcesPerNode") or container.get("resources") or {}
        procs = "auto" if _gpus(resources) else str(max(1, _cpus(resources)))
    return [
        {"name": "PET_NNODES", "value": str(count)},
        {"name": "PET_NPROC_PER_NODE", "value": procs},
        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}},
        {"name": "PET_MASTER_ADDR", "value": f"{name}-{NODE}-0-0.{name}"},
        {"name": "PET_MASTER_PORT", "value": str(MASTER_PORT)},
    ]


# ---------------------------------------------------------------------------------- state
@dataclass
class _Job:
    """A child Job of the JobSet (batch/v1, Indexed) and what its controller keeps in its status."""

    name: str
    uid: str
    replicated_job: str
    job_index: int
    template: Obj
    completions: int
    backoff_limit: int
    suspend: bool
    failed: set[str] = field(default_factory=set)
    """uids of pods counted in status.failed."""
    removed: set[str] = field(default_factory=set)
    """uids of pods the controller deleted for suspension (tracking finalizer removed first: uncounted)."""
    succeeded: set[int] = field(default_factory=set)
    last_failure: float = 0.0
    target: tuple[str, str, str] | None = None
    """The interim FailureTarget / SuccessCriteriaMet: (Failed|Complete, reason, message)."""
    condition: tuple[str, str, str, str] | None = None
    """The terminal condition: (Failed|Complete, reason, message, lastTransitionTime)."""
    active: int = 0
    ready: int = 0

    @property
    def finished(self) -> bool:
        return self.condition is not None


@dataclass
class _JobSet:
    """A JobSet as its controller sees it; the TrainJob's uid doubles as the JobSet's."""

    uid: str
    spec: Obj
    jobs: list[_Job] = field(default_factory=list)
    condition: Obj | None = None
    """Completed or Failed (metav1.Condition)."""
    service: bool = False


@dataclass
class _TrainJob:
    runtime: Obj | None = None
    """The runtime snapshot taken at the first reconcile."""
    jobset: _JobSet | None = None


# ----------------------------------------------------------------------------- controller
class TrainerController:
    """The TrainJob, JobSet and Job controllers for one SimCluster (see the module docstring)."""

    def __init__(self, sim: SimCluster, *, pod_failure_backoff: float | None = None) -> None:
        """`pod_failure_backoff`: seconds before a failed pod is replaced (upstream 10 s, doubling);
        the sim's restart_backoff by default, as the kubelets' in-place restarts."""
        self.sim, self.api = sim, sim.api
        self.pod_failure_backoff = sim.restart_backoff if pod_failure_backoff is None else pod_failure_backoff
        self._served: bool | None = None
        self._state: dict[str, _TrainJob] = {}

    def _log(self, message: str) -> None:
        self.sim._log(f"trainer: {message}")

    # -------------------------------------------------------------------------------- reads
    def trainjobs(self) -> list[Obj]:
        """Every TrainJob, or none when the cluster does not serve the resource."""
        if self._served is False:
            return []
        try:
            items = self.api.list(TRAINJOBS)
        except ApiError as exc:
            if exc.status == 404:
                self._served = False
                return []
            raise
        self._served = True
        return items

    def job(self, name: str, namespace: str = "default") -> Obj | None:
        return self.api.get(trainjob_path(namespace, name))

    def pods(self, name: str, namespace: str = "default") -> list[Obj]:
        """The live pods of a TrainJob's trainer (`node`), by completion index."""
        pods = self.api.list(pod_path(namespace), label_selector=f"{JOBSET_NAME}={name},{REPLICATED_JOB}={NODE}")
        return sorted(pods, key=lambda p: (int(p["metadata"].get("labels", {}).get(COMPLETION_INDEX, "0")), p["metadata"]["name"]))

    def wait_condition(self, name: str, kind: str, namespace: str = "default", timeout: float = 120.0,
                       status: str = "True") -> Obj:
        """Until the TrainJob has condition `kind` with `status`; returns the TrainJob."""
        def has() -> Obj | None:
            job = self.job(name, namespace)
            conditions = ((job or {}).get("status") or {}).get("conditions") or []
            return job if any(c.get("type") == kind and c.get("status") == status for c in conditions) else None
        return self.sim.wait(f"TrainJob {name} {kind}={status}", has, timeout)

    # ---------------------------------------------------------------------------- reconcile
    def reconcile_all(self, trainjobs: list[Obj], pods: list[Obj], services: list[Obj]) -> None:
        live = {j["metadata"]["uid"] for j in trainjobs}
        for uid in [u for u in self._state if u not in live]:
            del self._state[uid]  # gone: the garbage collector takes its pods and Service
        for job in trainjobs:
            if job["metadata"].get("deletionTimestamp"):
                continue  # Job controller: no manageJob for a Job being deleted
            try:
                self.reconcile(job, pods, services)
            except ApiError as exc:
                self._log(f"{job['metadata']['name']}: {exc}")

    def reconcile(self, trainjob: Obj, all_pods: list[Obj], all_services: list[Obj]) -> None:
        """trainjob_controller.go Reconcile, then the JobSet and Job controllers on its children."""
        meta, spec = trainjob["metadata"], trainjob.get("spec") or {}
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        if spec.get("managedBy") not in (None, "", CONTROLLER):
            return
        state = self._state.setdefault(uid, _TrainJob())
        old = copy.deepcopy(trainjob.get("status") or {})
        status = copy.deepcopy(old)
        conditions: list[Obj] = status.get("conditions") or []
        failed = _find(conditions, "Failed")
        if failed is not None and failed.get("reason") != "DeadlineExceeded":
            conditions.remove(failed)  # removeFailedCondition; the JobSet's Failed comes back below
        pods = [p for p in all_pods if p["metadata"].get("namespace") == ns and _owner_uid(p) == uid]
        ref = spec.get("runtimeRef") or {}
        kind = ref.get("kind") or "ClusterTrainingRuntime"
        if (ref.get("apiGroup") or GROUP) != GROUP or kind not in ("ClusterTrainingRuntime", "TrainingRuntime"):
            message = f"unsupported runtime: {kind}.{ref.get('apiGroup') or GROUP}"
            _set_condition(conditions, "Failed", "True", "TrainingRuntimeNotSupported", message)
        elif not _true(conditions, "Complete") and not _true(conditions, "Failed"):
            if state.runtime is None:
                state.runtime = self.api.get(runtime_path(kind, ns, ref.get("name", "")))
                if state.runtime is None:
                    self._log(f"{name}: TrainingRuntime specified in TrainJob is not found: {kind} {ref.get('name')}")
            if state.runtime is not None:
                self._build(trainjob, state)
        _suspended_condition(conditions, bool(spec.get("suspend")))
        js = state.jobset
        if js is not None:
            self._jobset_controller(trainjob, js, pods, all_services)
            if js.condition is not None:
                _set_condition(conditions, "Complete" if js.condition["type"] == "Completed" else "Failed", "True",
                               js.condition["reason"], js.condition["message"], js.condition["lastTransitionTime"])
            status["jobsStatus"] = self._jobs_status(js)
        self._deadline(trainjob, state, conditions, pods)
        status["conditions"] = conditions
        if not conditions:
            status.pop("conditions")
        if status != old:
            changed = [f"{c['type']}={c['status']}" for c in conditions if c not in (old.get("conditions") or [])]
            if changed:
                self._log(f"{name}: conditions {changed} {status.get('jobsStatus')}")
            self.api.patch(trainjob_path(ns, name, "status"), {"status": merge_diff(old, status)})

    def _build(self, trainjob: Obj, state: _TrainJob) -> None:
        """jobset.go Build: apply the JobSet when it does not exist or either side is suspended."""
        assert state.runtime is not None
        suspend = bool((trainjob.get("spec") or {}).get("suspend"))
        js = state.jobset
        if js is not None and not suspend and not js.spec.get("suspend"):
            return
        spec = jobset_spec(trainjob, state.runtime)
        if js is None:
            state.jobset = _JobSet(trainjob["metadata"]["uid"], spec)
            self._log(f"{trainjob['metadata']['name']}: JobSet created (suspend={suspend})")
        elif js.spec != spec:
            js.spec = spec

    # ------------------------------------------------------------------------------- JobSet
    def _jobset_controller(self, trainjob: Obj, js: _JobSet, pods: list[Obj], services: list[Obj]) -> None:
        """jobset_controller.go reconcile, then the Job controller's syncJob for each child Job."""
        name = trainjob["metadata"]["name"]
        for job in js.jobs:
            self._job_controller(trainjob, js, job, pods)
        if js.condition is not None:
            for job in js.jobs:  # deleteJobs(ownedJobs.active): Foreground, so their pods go too
                if not job.finished:
                    self._delete_pods(job, pods, counted=True)
            return
        failed = sorted((j for j in js.jobs if j.condition and j.condition[0] == "Failed"), key=lambda j: j.condition[3])  # type: ignore[index]
        if failed:
            js.condition = {"type": "Failed", "status": "True", "reason": "FailedJobs", "lastTransitionTime": now_rfc3339(),
                            "message": f"jobset failed due to one or more job failures (first failed job: {failed[0].name})"}
            self._log(f"{name}: JobSet failed ({failed[0].name})")
            return
        total = sum(int(r.get("replicas", 1)) for r in js.spec["replicatedJobs"])
        if js.jobs and sum(1 for j in js.jobs if j.condition and j.condition[0] == "Complete") == total:
            js.condition = {"type": "Completed", "status": "True", "reason": "AllJobsCompleted",
                            "message": "jobset completed successfully", "lastTransitionTime": now_rfc3339()}
            self._log(f"{name}: JobSet completed")
            return
        if js.spec["network"].get("enableDNSHostnames") and not js.service:
            self._headless_service(trainjob, js, services)
        if not js.jobs:
            for rjob in js.spec["replicatedJobs"]:
                for index in range(int(rjob.get("replicas", 1))):
                    js.jobs.append(self._construct_job(trainjob, js, rjob, index))
        suspend = bool(js.spec.get("suspend"))
        templates = {r["name"]: r["template"]["spec"]["template"] for r in js.spec["replicatedJobs"]}
        for job in js.jobs:
            if job.finished:
                continue
            if suspend:
                job.suspend = True
            elif job.suspend:  # resumeJob
                fresh = templates.get(job.replicated_job) or {}
                meta, fresh_meta = job.template.setdefault("metadata", {}), fresh.get("metadata") or {}
                for key in ("labels", "annotations"):
                    meta[key] = {**(meta.get(key) or {}), **(fresh_meta.get(key) or {})}
                pod, fresh_pod = job.template.setdefault("spec", {}), fresh.get("spec") or {}
                pod["nodeSelector"] = {**(pod.get("nodeSelector") or {}), **(fresh_pod.get("nodeSelector") or {})}
                for key in ("tolerations", "schedulingGates"):
                    pod[key] = list(pod.get(key) or []) + [t for t in fresh_pod.get(key) or [] if t not in (pod.get(key) or [])]
                for key in ("nodeSelector", "tolerations", "schedulingGates"):
                    if not pod[key]:
                        del pod[key]
                job.suspend = False
                self._log(f"{name}: Job {job.name} resumed")

    def _headless_service(self, trainjob: Obj, js: _JobSet, services: list[Obj]) -> None:
        meta = trainjob["metadata"]
        subdomain = js.spec["network"].get("subdomain") or meta["name"]
        if not any(s["metadata"].get("namespace") == meta["namespace"] and s["metadata"]["name"] == subdomain for s in services):
            self.api.create(service_path(meta["namespace"]), {
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": subdomain, "namespace": meta["namespace"], "ownerReferences": [_owner_ref(trainjob)]},
                "spec": {"clusterIP": "None", "selector": {JOBSET_NAME: meta["name"]},
                         "publishNotReadyAddresses": bool(js.spec["network"].get("publishNotReadyAddresses", True))},
            })
        js.service = True

    def _construct_job(self, trainjob: Obj, js: _JobSet, rjob: Obj, index: int) -> _Job:
        """constructJob + labelAndAnnotateObject (pod template part) + the Job's API defaulting."""
        meta = trainjob["metadata"]
        name = f"{meta['name']}-{rjob['name']}-{index}"
        template = copy.deepcopy(rjob["template"]["spec"]["template"])
        replicas = [int(r.get("replicas", 1)) for r in js.spec["replicatedJobs"]]
        position = [r["name"] for r in js.spec["replicatedJobs"]].index(rjob["name"])
        group = [r for r in js.spec["replicatedJobs"] if r.get("groupName") == rjob.get("groupName")]
        jobset_keys = {
            JOBSET_NAME: meta["name"], JOBSET_UID: js.uid, REPLICATED_JOB: rjob["name"],
            "jobset.sigs.k8s.io/restart-attempt": "0", "jobset.sigs.k8s.io/replicatedjob-replicas": str(rjob.get("replicas", 1)),
            "jobset.sigs.k8s.io/global-replicas": str(sum(replicas)), JOB_INDEX: str(index),
            "jobset.sigs.k8s.io/job-key": hashlib.sha1(f"{meta['namespace']}/{name}".encode()).hexdigest(),  # noqa: S324 (upstream's)
            "jobset.sigs.k8s.io/job-global-index": str(sum(replicas[:position]) + index),
            "jobset.sigs.k8s.io/group-name": str(rjob.get("groupName", "default")),
            "jobset.sigs.k8s.io/group-replicas": str(sum(int(r.get("replicas", 1)) for r in group)),
            "jobset.sigs.k8s.io/job-group-index": str(sum(int(r.get("replicas", 1)) for r in group[:group.index(rjob)]) + index),
        }
        job_uid = str(uuid.uuid4())
        tmeta = template.setdefault("metadata", {})
        tmeta["labels"] = {**(tmeta.get("labels") or {}), **jobset_keys,
                           JOB_CONTROLLER_UID: job_uid, JOB_NAME: name, "controller-uid": job_uid, "job-name": name}
        tmeta["annotations"] = {**(tmeta.get("annotations") or {}), **jobset_keys}
        pod_spec = template.setdefault("spec", {})
        if js.spec["network"].get("enableDNSHostnames"):
            pod_spec["subdomain"] = js.spec["network"].get("subdomain") or meta["name"]
        job_spec = rjob["template"]["spec"]
        return _Job(name=name, uid=job_uid, replicated_job=rjob["name"], job_index=index, template=template,
                    completions=int(job_spec["completions"]), backoff_limit=int(job_spec["backoffLimit"]),
                    suspend=bool(js.spec.get("suspend")))

    def _jobs_status(self, js: _JobSet) -> list[Obj]:
        """calculateReplicatedJobStatuses: per replicated job, counts of its Jobs."""
        out = []
        for rjob in js.spec["replicatedJobs"]:
            counts = dict.fromkeys(("active", "failed", "ready", "succeeded", "suspended"), 0)
            for job in (j for j in js.jobs if j.replicated_job == rjob["name"]):
                if job.condition is not None:
                    counts["succeeded" if job.condition[0] == "Complete" else "failed"] += 1
                    continue
                if len(job.succeeded) + job.ready >= min(int(rjob["count"]), job.completions):
                    counts["ready"] += 1
                if job.active > 0:
                    counts["active"] += 1
                if job.suspend:
                    counts["suspended"] += 1
            out.append({"name": rjob["name"], **counts})
        return out

    # ---------------------------------------------------------------------------------- Job
    def _job_controller(self, trainjob: Obj, js: _JobSet, job: _Job, all_pods: list[Obj]) -> None:
        """syncJob for one Indexed Job (see the module docstring)."""
        pods = [p for p in all_pods if p["metadata"].get("labels", {}).get(JOB_CONTROLLER_UID) == job.uid]
        if job.finished:
            return
        now = time.monotonic()
        for pod in pods:
            uid, phase = pod["metadata"]["uid"], pod.get("status", {}).get("phase")
            index = _completion_index(pod)
            if phase == "Succeeded" and index is not None and index < job.completions:
                job.succeeded.add(index)
            elif (phase == "Failed" or pod["metadata"].get("deletionTimestamp")) and uid not in job.removed and uid not in job.failed:
                job.failed.add(uid)  # isPodFailed: failed, or deleted before it succeeded
                job.last_failure = now
                self._log(f"Job {job.name}: pod {pod['metadata']['name']} failed ({len(job.failed)} of backoffLimit {job.backoff_limit})")
        active = [p for p in pods if _active(p)]
        terminating = [p for p in pods if p["metadata"].get("deletionTimestamp") and p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]
        if job.target is None:
            restart_policy = job.template.get("spec", {}).get("restartPolicy")
            restarts = sum(int(c.get("restartCount", 0)) for p in pods if p.get("status", {}).get("phase") in ("Running", "Pending")
                           for c in (p["status"].get("initContainerStatuses") or []) + (p["status"].get("containerStatuses") or []))
            past_on_failure = restart_policy == "OnFailure" and (restarts > 0 if job.backoff_limit == 0 else restarts >= job.backoff_limit)
            if len(job.failed) > job.backoff_limit or past_on_failure:
                job.target = ("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
                self._log(f"Job {job.name}: backoff limit reached (failed pods {len(job.failed)}, restarts {restarts})")
            elif len(job.succeeded) >= job.completions and not active:
                job.target = ("Complete", "", "")
        if job.target is not None:
            if job.target[0] == "Failed":
                terminating += self._delete_pods(job, active, counted=True)
                active = []
            if not active and not terminating:  # delayTerminalCondition: after the pods have terminated
                job.condition = (*job.target, now_rfc3339())
                self._log(f"Job {job.name}: {job.target[0]} {job.target[1]}")
        elif job.suspend:
            self._delete_pods(job, active, counted=False)
            active = []
        else:
            self._create_pods(trainjob, job, active, now)
        job.active = len(active)
        job.ready = sum(1 for p in active if _ready(p))

    def _create_pods(self, trainjob: Obj, job: _Job, active: list[Obj], now: float) -> None:
        """manageJob: a pod for every index that neither succeeded nor has an active pod."""
        have = {_completion_index(p) for p in active}
        missing = [i for i in range(job.completions) if i not in job.succeeded and i not in have]
        if not missing:
            return
        if job.failed:
            delay = min(self.pod_failure_backoff * 2 ** (len(job.failed) - 1), 600.0)
            if now < job.last_failure + delay:
                return
        meta = trainjob["metadata"]
        for index in missing:
            template = copy.deepcopy(job.template)
            pod_meta = template.setdefault("metadata", {})
            pod_meta["annotations"] = {**(pod_meta.get("annotations") or {}), COMPLETION_INDEX: str(index)}
            pod_meta["labels"] = {**(pod_meta.get("labels") or {}), COMPLETION_INDEX: str(index)}
            spec = template.setdefault("spec", {})
            for container in (spec.get("containers") or []) + (spec.get("initContainers") or []):
                env = container.setdefault("env", [])
                if not any(e.get("name") == "JOB_COMPLETION_INDEX" for e in env):
                    env.append({"name": "JOB_COMPLETION_INDEX",
                                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}})
            spec["hostname"] = f"{job.name}-{index}"
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
                **pod_meta, "generateName": pod_generate_name(job.name, index), "namespace": meta["namespace"],
                "ownerReferences": [_owner_ref(trainjob)]}, "spec": spec}
            created = self.api.create(pod_path(meta["namespace"]), pod)
            self._log(f"Job {job.name}: create pod {(created or {}).get('metadata', {}).get('name')} (index {index})")

    def _delete_pods(self, job: _Job, pods: list[Obj], *, counted: bool) -> list[Obj]:
        """deleteActivePods (counted: they become failures) or deleteJobPods (suspension: not);
        returns the pods it deleted (terminating now)."""
        deleted = []
        for pod in pods:
            if pod["metadata"].get("deletionTimestamp") or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                continue
            if not counted:
                job.removed.add(pod["metadata"]["uid"])
            self._log(f"Job {job.name}: delete pod {pod['metadata']['name']}")
            if self.api.delete(pod_path(pod["metadata"]["namespace"], pod["metadata"]["name"])):
                deleted.append(pod)
        return deleted

    # ----------------------------------------------------------------------------- deadline
    def _deadline(self, trainjob: Obj, state: _TrainJob, conditions: list[Obj], pods: list[Obj]) -> None:
        """reconcileDeadline: activeDeadlineSeconds from creation or the last resume; then Failed
        (DeadlineExceeded) and the JobSet deleted (here: its pods, Service and state)."""
        spec, meta = trainjob.get("spec") or {}, trainjob["metadata"]
        deadline = spec.get("activeDeadlineSeconds")
        if not deadline or spec.get("suspend") or _true(conditions, "Complete") or _true(conditions, "Failed"):
            return
        resumed = _find(conditions, "Suspended")
        start = _parse_time(resumed["lastTransitionTime"] if resumed and resumed["status"] == "False" else meta.get("creationTimestamp"))
        if start is None or time.time() < start + int(deadline):
            return
        _set_condition(conditions, "Failed", "True", "DeadlineExceeded", "TrainJob exceeded its active deadline")
        self._log(f"{meta['name']}: deadline exceeded: deleting the JobSet")
        for pod in pods:
            if not pod["metadata"].get("deletionTimestamp"):
                self.api.delete(pod_path(meta["namespace"], pod["metadata"]["name"]))
        if state.jobset is not None and state.jobset.service:
            self.api.delete(service_path(meta["namespace"], state.jobset.spec["network"].get("subdomain") or meta["name"]))
        state.jobset = None


# -------------------------------------------------------------------------------- helpers
def pod_generate_name(job: str, index: int) -> str:
    """An Indexed Job's pod generateName, `<job>-<index>-` with the job name cut so that the whole
    fits the API server's 58-character base (kubernetes pkg/controller/job/indexed_job_utils.go
    podGenerateNameWithIndex, v1.30); the API server appends 5 random characters, so a JobSet's pod
    is `<jobset>-<replicatedJob>-<jobIndex>-<completionIndex>-<random 5>`."""
    append = f"-{index}-"
    prefix = job + append
    return prefix if len(prefix) <= GENERATED_NAME_BASE else prefix[:GENERATED_NAME_BASE - len(append)] + append


def _owner_ref(trainjob: Obj) -> Obj:
    return {"apiVersion": API_VERSION, "kind": "TrainJob", "name": trainjob["metadata"]["name"],
            "uid": trainjob["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def _owner_uid(obj: Obj) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def _completion_index(pod: Obj) -> int | None:
    value = (pod["metadata"].get("annotations") or {}).get(COMPLETION_INDEX)
    return int(value) if value is not None and str(value).isdigit() else None


def _active(pod: Obj) -> bool:
    """controller.FilterActivePods: not finished and not being deleted."""
    return pod.get("status", {}).get("phase") not in ("Succeeded", "Failed") and not pod["metadata"].get("deletionTimestamp")


def _ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in pod.get("status", {}).get("conditions") or [])


def _find(conditions: list[Obj], kind: str) -> Obj | None:
    return next((c for c in conditions if c.get("type") == kind), None)


def _true(conditions: list[Obj], kind: str) -> bool:
    found = _find(conditions, kind)
    return found is not None and found.get("status") == "True"


def _set_condition(conditions: list[Obj], kind: str, status: str, reason: str, message: str, transition: str | None = None) -> None:
    """apimachinery meta.SetStatusCondition: lastTransitionTime changes only with the status."""
    current = _find(conditions, kind)
    if current is None:
        conditions.append({"type": kind, "status": status, "reason": reason, "message": message,
                           "lastTransitionTime": transition or now_rfc3339()})
        return
    if current["status"] != status:
        current["status"] = status
        current["lastTransitionTime"] = transition or now_rfc3339()
    current["reason"], current["message"] = reason, message


def _suspended_condition(conditions: list[Obj], suspend: bool) -> None:
    """trainjob_controller.go setSuspendedCondition."""
    if suspend:
        _set_condition(conditions, "Suspended", "True", "Suspended", "TrainJob is suspended")
    elif _true(conditions, "Suspended"):
        _set_condition(conditions, "Suspended", "False", "Resumed", "TrainJob is resumed")
