"""spec -> the Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1) for one run attempt, its
pods' selector, and its status read as a phase. Pure functions: no API calls, no clock.

The TrainJob is the same worker pod as the PyTorchJob's (`desired.pod_template`, overrides merged),
re-expressed in the two places Kubeflow Trainer v2.3 takes it (upstream v2.3.0, vendored in
tests/fixtures/upstream/kubeflow-trainer-v2.3/):
- `spec.trainer`: image, command, args, env, `resourcesPerNode`, `numNodes`, `numProcPerNode` of the
  runtime's trainer container (the `node` container of the `node` replicated job of the
  `torch-distributed` runtime). Env cannot go anywhere else: the JobSet plugin's webhook rejects
  env for the `node` container in runtimePatches.
- `spec.runtimePatches` (v2.2+): one entry owned by manager `llamaft.io/operator`, patching the
  `node` replicated job's pod template: labels and annotations, volumes, the `node` container's
  volumeMounts and securityContext, nodeSelector, tolerations, affinity (excluded nodes),
  terminationGracePeriodSeconds and whatever else podTemplateOverrides set. Trainer merges it
  into the runtime's JobSet template with a strategic merge.

What Trainer v2.3 cannot express is refused on the spec field (`unsupported`) instead of being
dropped: a pod priorityClassName, imagePullPolicy, runPolicy.ttlSecondsAfterFinished and
backoffLimit have no place in a TrainJob or its runtimePatches, and c10d under Trainer is torchrun's
static rendezvous, which is not elastic. The container port and terminationMessagePolicy are not
expressible either; the trainer still serves its metrics port and writes its termination message.

Rendezvous. Trainer's torch plugin injects PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
PET_MASTER_ADDR and PET_MASTER_PORT (and its webhook rejects those names in trainer.env). With the
etcd backends the command passes torchrun's --nnodes min:max, --max-restarts, --rdzv-backend,
--rdzv-endpoint, --rdzv-id (the per-attempt id, so the operator's rendezvous reset works exactly as
with PyTorchJob) and --rdzv-conf explicitly; command-line flags win over the PET_* defaults. With
c10d no rendezvous flag is passed: torchrun rendezvouses on the injected master address
(`<job>-node-0-0.<job>:29500`), the way Trainer runs every torch job.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from llamaft.api.spec import Backend, LlamaFineTuneSpec, PullPolicy, RendezvousBackend
from llamaft.api.status import Phase
from llamaft.render.desired import kueue_labels, pod_template, rendezvous_endpoint
from llamaft.render.naming import LABEL_ATTEMPT, Owner

API_GROUP = "trainer.kubeflow.org"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "TrainJob"
PLURAL = "trainjobs"
NODE = "node"
"""The trainer's replicated job and container in Trainer's torch runtimes (constants.Node)."""
TEMPLATE_CONTAINER = "pytorch"
"""The trainer container's name in desired.pod_template (and in users' podTemplateOverrides)."""
PATCH_MANAGER = "llamaft.io/operator"
"""Our runtimePatches entry's owner: a domain-prefixed path, as the JobSet plugin's webhook requires."""
MASTER_PORT = 29500
"""constants.ContainerTrainerPort: PET_MASTER_PORT, the torch plugin's rendezvous port."""
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
TORCHRUN_RESERVED_ENV = frozenset({"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"})
"""constants.TorchRunReservedEnvNames: the torch plugin's webhook rejects these in trainer.env."""

POD_PATCH_FIELDS = frozenset({
    "affinity", "containers", "imagePullSecrets", "initContainers", "nodeSelector", "schedulingGates",
    "securityContext", "serviceAccountName", "terminationGracePeriodSeconds", "tolerations", "volumes",
})
"""The pod spec fields a v2.3 runtimePatch may set (the vendored TrainJob CRD's PodSpecPatch)."""
CONTAINER_PATCH_FIELDS = frozenset({"name", "env", "securityContext", "volumeMounts"})
"""The container fields a v2.3 runtimePatch may set (ContainerPatch)."""
TRAINER_FIELDS = {"image": "image", "command": "command", "args": "args", "env": "env", "resources": "resourcesPerNode"}
"""Trainer-container fields that spec.trainer carries instead (container field -> trainer field)."""
POD_METADATA_FIELDS = ("labels", "annotations")
POD_PATCH_PATH: tuple[str | int, ...] = (
    "spec", "runtimePatches", 0, "trainingRuntimeSpec", "template", "spec", "replicatedJobs", 0, "template", "spec", "template")
"""Where the pod template patch is in a TrainJob rendered here."""

Obj = dict[str, Any]


class TrainJobSpecError(ValueError):
    """A spec the TrainJob backend cannot render; `problems` are (spec field, problem and fix)."""

    def __init__(self, problems: Sequence[tuple[str, str]]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(f"{path}: {message}" for path, message in self.problems))


# -------------------------------------------------------------------------------- what cannot be
def preferred_backend(spec: LlamaFineTuneSpec) -> Backend:
    """The job kind the spec becomes on a cluster that serves both: its backend, or for `auto`
    TrainJob (Kubeflow Trainer v2, the maintained line) unless the spec needs something only a
    PyTorchJob carries out (`unsupported`)."""
    if spec.backend is not Backend.AUTO:
        return spec.backend
    return Backend.PYTORCH_JOB if unsupported(spec) else Backend.TRAIN_JOB


def unsupported(spec: LlamaFineTuneSpec) -> list[tuple[str, str]]:
    """(spec field, problem and fix) for every setting Kubeflow Trainer v2.3 cannot carry out."""
    out: list[tuple[str, str]] = []
    for index, env in enumerate(spec.cluster.env):
        if env.name in TORCHRUN_RESERVED_ENV or env.name.startswith("PET_"):
            out.append((f"spec.cluster.env[{index}].name",
                        f"{env.name} is reserved under the TrainJob backend: Kubeflow Trainer's torch plugin sets "
                        f"{', '.join(sorted(TORCHRUN_RESERVED_ENV))} and its webhook rejects them in trainer.env, and "
                        "torchrun reads every PET_* variable as a flag default: remove it"))
    cluster, run_policy = spec.cluster, spec.run_policy
    if cluster.priority_class_name:
        out.append(("spec.cluster.priorityClassName",
                    "the TrainJob backend cannot set the pods' priorityClassName (Kubeflow Trainer v2.3's "
                    "runtimePatches have no such field): set it in the (Cluster)TrainingRuntime's pod template, use "
                    "Kueue (scheduling.queueName, scheduling.priorityClass), or use backend: PyTorchJob"))
    if cluster.image_pull_policy is not PullPolicy.IF_NOT_PRESENT:
        out.append(("spec.cluster.imagePullPolicy",
                    "the TrainJob backend cannot set imagePullPolicy (a TrainJob's trainer has only an image): "
                    "remove it (Kubernetes pulls a tagged image IfNotPresent), set it in the runtime, or use "
                    "backend: PyTorchJob"))
    if run_policy.ttl_seconds_after_finished is not None:
        out.append(("spec.runPolicy.ttlSecondsAfterFinished",
                    "a TrainJob has no ttlSecondsAfterFinished (runtimePatches cannot set the JobSet's): remove it, "
                    "set it in the (Cluster)TrainingRuntime, or use backend: PyTorchJob"))
    if run_policy.backoff_limit is not None:
        out.append(("spec.runPolicy.backoffLimit",
                    "a TrainJob has no backoffLimit (runtimePatches cannot set the Job's): remove it (runPolicy."
                    "retryBudget is the operator's own retry policy), or use backend: PyTorchJob"))
    if spec.scheduling.gang is not None:
        out.append(("spec.scheduling.gang",
                    "Kubeflow Trainer takes gang scheduling from the runtime's podGroupPolicy (coscheduling or "
                    "volcano), not from the TrainJob: use a (Cluster)TrainingRuntime with podGroupPolicy and remove "
                    "scheduling.gang, or queue with scheduling.queueName (Kueue), or use backend: PyTorchJob"))
    if spec.rendezvous.backend is RendezvousBackend.C10D and cluster.elastic is not None:
        out.append(("spec.cluster.elastic",
                    "with rendezvous.backend c10d a TrainJob runs torchrun's static rendezvous on the master address "
                    "Kubeflow Trainer injects, which admits exactly cluster.workers nodes: use rendezvous.backend "
                    "etcd-v2 for an elastic range, or remove cluster.elastic"))
    return out


# ---------------------------------------------------------------------------------- the command
def launch_flags(owner: Owner, spec: LlamaFineTuneSpec, attempt: int) -> list[str]:
    """torchrun flags the TrainJob passes on top of the PET_* variables Trainer injects."""
    flags = ["--max-restarts", str(spec.rendezvous.max_restarts)]
    if spec.rendezvous.backend is RendezvousBackend.C10D:
        return flags  # static rendezvous on PET_MASTER_ADDR:PET_MASTER_PORT, PET_NNODES nodes
    cluster = spec.cluster
    low = cluster.elastic.min_workers if cluster.elastic else cluster.workers
    high = cluster.elastic.max_workers if cluster.elastic else cluster.workers
    host, port = rendezvous_endpoint(owner, spec, attempt)
    return [
        "--nnodes", f"{low}:{high}", *flags,
        "--rdzv-backend", spec.rendezvous.backend.value,
        "--rdzv-endpoint", f"{host}:{port}",
        "--rdzv-id", owner.rendezvous_id(attempt),
        "--rdzv-conf", "protocol=http",  # the PyTorchJob's rdzvConf for the etcd backends
    ]


def _with_flags(command: list[str], flags: list[str]) -> list[str]:
    """`command` (torchrun ...) with `flags` after `torchrun`, except those it already passes."""
    launcher = command[1:command.index("-m")] if "-m" in command else command[1:]  # not the trainer's own flags
    present = {arg.split("=", 1)[0].replace("_", "-") for arg in launcher if arg.startswith("--")}
    extra: list[str] = []
    for index in range(0, len(flags), 2):
        if flags[index] not in present:
            extra += flags[index:index + 2]
    return [command[0], *extra, *command[1:]]


def _unique_env(env: Sequence[Obj]) -> list[Obj]:
    """trainer.env is a list map keyed by name (the API server refuses a duplicate name); a later
    definition wins, as it would in a pod."""
    out: list[Obj] = []
    index: dict[str, int] = {}
    for item in env:
        name = item.get("name")
        if isinstance(name, str) and name in index:
            out[index[name]] = copy.deepcopy(item)
            continue
        if isinstance(name, str):
            index[name] = len(out)
        out.append(copy.deepcopy(item))
    return out


# -------------------------------------------------------------------------------- the TrainJob
def train_job(owner: Owner, spec: LlamaFineTuneSpec, attempt: int, excluded_nodes: Sequence[str] = ()) -> Obj:
    """The TrainJob for one run attempt; raises TrainJobSpecError for what Trainer cannot do."""
    problems = unsupported(spec)
    merged = pod_template(owner, spec, attempt, excluded_nodes)
    if spec.cluster.pod_template_overrides:
        plain_spec = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"pod_template_overrides": None})})
        plain = pod_template(owner, plain_spec, attempt, excluded_nodes)
    else:
        plain = merged
    merged_pod, plain_pod = merged.get("spec") or {}, plain.get("spec") or {}
    containers = [c for c in merged_pod.get("containers") or [] if isinstance(c, Mapping)]
    trainer_container = next((c for c in containers if c.get("name") == TEMPLATE_CONTAINER), None)
    if trainer_container is None:
        problems.append(("spec.cluster.podTemplateOverrides.spec.containers",
                         f"deletes the trainer container {TEMPLATE_CONTAINER!r}: keep it (overrides patch it by name)"))
    if problems:
        raise TrainJobSpecError(problems)
    assert trainer_container is not None
    plain_container = next(c for c in plain_pod["containers"] if c.get("name") == TEMPLATE_CONTAINER)

    cluster = spec.cluster
    trainer: Obj = {"numNodes": cluster.workers, "numProcPerNode": max(cluster.gpus_per_worker, 1)}
    for field, target in TRAINER_FIELDS.items():
        if field in trainer_container:
            trainer[target] = copy.deepcopy(trainer_container[field])
    if trainer.get("command") == plain_container.get("command") and trainer.get("command"):
        trainer["command"] = _with_flags(list(trainer["command"]), launch_flags(owner, spec, attempt))
    if "env" in trainer:
        trainer["env"] = _unique_env(trainer["env"])
    if trainer.get("resourcesPerNode") == {}:
        del trainer["resourcesPerNode"]

    pod_patch: Obj = {}
    for key, value in merged_pod.items():
        if key == "containers":
            pod_patch[key] = [_container_patch(c, plain_container) if c is trainer_container else copy.deepcopy(c)
                              for c in value]
        elif key in POD_PATCH_FIELDS or plain_pod.get(key) != value:
            pod_patch[key] = copy.deepcopy(value)  # what Trainer cannot take fails the schema check, where it is
        # else: a field of the spec's own template that Trainer cannot take; `unsupported` refused it
    template_patch: Obj = {"spec": pod_patch}
    metadata = merged.get("metadata") or {}
    pod_metadata = {k: copy.deepcopy(v) for k, v in metadata.items()
                    if k in POD_METADATA_FIELDS or (plain.get("metadata") or {}).get(k) != v}
    if pod_metadata:
        template_patch = {"metadata": pod_metadata, **template_patch}

    job_spec: Obj = {
        "runtimeRef": {"apiGroup": API_GROUP, "kind": spec.train_job.runtime_ref.kind, "name": spec.train_job.runtime_ref.name},
        "suspend": spec.run_policy.suspend,
    }
    if spec.run_policy.active_deadline_seconds is not None:
        job_spec["activeDeadlineSeconds"] = spec.run_policy.active_deadline_seconds
    job_spec["trainer"] = trainer
    job_spec["runtimePatches"] = [{
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
            {"name": NODE, "template": {"spec": {"template": template_patch}}},
        ]}}},
    }]
    labels = {**owner.labels("trainer"), LABEL_ATTEMPT: str(attempt), **kueue_labels(spec)}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": owner.job_name(attempt), "namespace": owner.namespace, "labels": labels},
        "spec": job_spec,
    }


def _container_patch(container: Mapping[str, Any], plain: Mapping[str, Any]) -> Obj:
    """The trainer container's part of the runtimePatch: renamed to the runtime's `node`, without
    what spec.trainer carries; a field Trainer cannot take stays only when overrides set it."""
    out: Obj = {"name": NODE}
    for key, value in container.items():
        if key == "name" or key in TRAINER_FIELDS:
            continue
        if key in CONTAINER_PATCH_FIELDS or plain.get(key) != value:
            out[key] = copy.deepcopy(value)
    return out


def pod_selector(job_name: str) -> str:
    """Label selector for the trainer pods of a TrainJob: JobSet labels every pod with its JobSet's
    name (the TrainJob's) and its replicated job's (`node` for the trainer)."""
    return f"{JOBSET_NAME_LABEL}={job_name},{REPLICATED_JOB_LABEL}={NODE}"


# ------------------------------------------------------------------------------------- status
TERMINAL_CONDITIONS = (("Failed", Phase.FAILED), ("Complete", Phase.SUCCEEDED), ("Suspended", Phase.SUSPENDED))
"""TrainJob condition types (v2.3: Suspended, Complete, Failed; Complete and Failed are copied
from the JobSet's Completed and Failed), most decisive first."""


def job_phase(job: Mapping[str, Any]) -> tuple[Phase, str, str]:
    """(phase, reason, message) of a TrainJob, as backends.phase_of_job reads a PyTorchJob.

    Trainer v2.3 sets no Created or Running condition: a TrainJob runs while one of its child
    Jobs is active (a pod pending or running) or ready (status.jobsStatus), and no condition
    means it is being created. It has no Restarting state either."""
    status = job.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if isinstance(c, Mapping) and c.get("status") == "True"}
    for type_, phase in TERMINAL_CONDITIONS:
        if type_ in conditions:
            c = conditions[type_]
            return phase, str(c.get("reason") or type_), str(c.get("message") or "")
    jobs = [j for j in status.get("jobsStatus") or [] if isinstance(j, Mapping)]
    trainer_jobs = [j for j in jobs if j.get("name") == NODE] or jobs
    active = sum(int(j.get("active") or 0) for j in trainer_jobs)
    ready = sum(int(j.get("ready") or 0) for j in trainer_jobs)
    name = (job.get("metadata") or {}).get("name")
    if active or ready:
        detail = "ready" if ready else "started (pods pending or running)"
        return Phase.RUNNING, "JobsActive", f"TrainJob {name}: the trainer's Job is {detail}"
    if trainer_jobs:
        return Phase.CREATING, "JobsCreated", f"TrainJob {name}: waiting for the trainer's pods"
    return Phase.CREATING, "TrainJobCreated", "waiting for Kubeflow Trainer"


def job_view(job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> Obj:
    """The TrainJob as the lifecycle reads a PyTorchJob, so that one code path decides for both
    backends: `Complete` is also `Succeeded` (with its transition time), `Failed` stays, and the
    worker counts come from the pods (jobsStatus counts Jobs, not pods). The kind stays TrainJob,
    so backends.phase_of_job still reads the TrainJob's own conditions."""
    view = copy.deepcopy(dict(job))
    status = view.setdefault("status", {})
    conditions = list(status.get("conditions") or [])
    complete = next((c for c in conditions if c.get("type") == "Complete" and c.get("status") == "True"), None)
    if complete is not None and not any(c.get("type") == "Succeeded" for c in conditions):
        conditions.append({**complete, "type": "Succeeded"})
    status["conditions"] = conditions
    phases = [str((p.get("status") or {}).get("phase")) for p in pods]
    status["replicaStatuses"] = {"Worker": {
        "active": sum(ph in ("Pending", "Running") for ph in phases),
        "succeeded": phases.count("Succeeded"), "failed": phases.count("Failed")}}
    return view
