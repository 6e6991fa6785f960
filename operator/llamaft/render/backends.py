"""One seam per job backend: what differs between a Kubeflow PyTorchJob and a Trainer v2 TrainJob.

The operator picks a backend once per run (`status.backend`, `auto` resolved by
`trainjob.preferred_backend` and what the cluster serves) and from then on asks the
`JobBackend` it gets from `backend_for(kind)`: how to render the attempt's job, which API
resource it lives in, which label selector finds its pods, how suspend is read and patched, how
the job reads as the lifecycle's common view, its phase, whether workers can be scaled in place.
Everything here is pure (objects in, objects out), so it sits in the render layer under the
operator, and each backend's differences live in one class instead of an if/elif per call site.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from llamaft.api.spec import Backend, LlamaFineTuneSpec
from llamaft.api.status import Phase
from llamaft.render import desired, trainjob
from llamaft.render.naming import Owner

Obj = dict[str, Any]

PYTORCHJOB_PHASE_PRIORITY = (
    ("Failed", Phase.FAILED),
    ("Succeeded", Phase.SUCCEEDED),
    ("Suspended", Phase.SUSPENDED),
    ("Restarting", Phase.RESTARTING),
    ("Running", Phase.RUNNING),
    ("Created", Phase.CREATING),
)
"""A PyTorchJob's condition types, most decisive first (several can be true at once)."""


@dataclass(frozen=True)
class Resource:
    """Where a kind lives in the Kubernetes API (the custom-objects client's arguments)."""

    group: str
    version: str
    plural: str


class JobBackend(Protocol):
    """What the operator needs from a job kind; PyTorchJobBackend and TrainJobBackend implement it."""

    kind: str
    resource: Resource
    install_hint: str
    """What to install when the cluster does not serve the kind (it goes into the status message)."""
    trainer_container: str
    """The trainer container's name in the kind's pods (their containerStatuses, and the
    `container` label kube-state-metrics and dcgm-exporter put on its series)."""
    fails_with_a_pod: bool
    """Whether the job's controller fails the job as soon as one of its pods has failed, removing
    the pods still running and keeping the failed ones (a PyTorchJob: restartPolicy Never and
    cleanPodPolicy Running); False where it replaces a failed pod instead (a TrainJob's Jobs, up
    to their backoffLimit)."""

    def render(self, owner: Owner, spec: LlamaFineTuneSpec, attempt: int, excluded_nodes: Sequence[str] = ()) -> Obj:
        """The attempt's job object."""
        ...

    def pod_selector(self, job_name: str) -> str:
        """The label selector of the job's trainer pods."""
        ...

    def suspended(self, job: Mapping[str, Any]) -> bool:
        """Whether the job is suspended as its spec says."""
        ...

    def suspend_patch(self, suspend: bool) -> Obj:
        """The merge patch that suspends (True) or resumes (False) the job."""
        ...

    def view(self, job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
        """The job as the lifecycle reads it (a PyTorchJob's conditions and replicaStatuses)."""
        ...

    def phase(self, job: Mapping[str, Any]) -> tuple[Phase, str, str]:
        """(phase, reason, message) from the job's own status."""
        ...

    def scalable(self, spec: LlamaFineTuneSpec) -> bool:
        """Whether cluster.workers can change in place (an elastic job), not by a new attempt."""
        ...

    def scale_patch(self, workers: int) -> Obj:
        """The merge patch that sets the worker count of a scalable job."""
        ...


class PyTorchJobBackend:
    """kubeflow.org/v1 PyTorchJob (the Kubeflow training operator v1.9, the legacy line)."""

    kind = Backend.PYTORCH_JOB.value
    resource = Resource("kubeflow.org", "v1", "pytorchjobs")
    install_hint = "kubeflow.org/v1 PyTorchJobs (install the Kubeflow training operator v1.9)"
    trainer_container = trainjob.TEMPLATE_CONTAINER  # desired.pod_template's, kept as is
    fails_with_a_pod = True  # desired.pytorch_job: restartPolicy Never, cleanPodPolicy Running

    def render(self, owner: Owner, spec: LlamaFineTuneSpec, attempt: int, excluded_nodes: Sequence[str] = ()) -> Obj:
        return desired.pytorch_job(owner, spec, attempt, excluded_nodes)

    def pod_selector(self, job_name: str) -> str:
        return f"training.kubeflow.org/job-name={job_name}"

    def suspended(self, job: Mapping[str, Any]) -> bool:
        return bool(((job.get("spec") or {}).get("runPolicy") or {}).get("suspend"))

    def suspend_patch(self, suspend: bool) -> Obj:
        return {"spec": {"runPolicy": {"suspend": suspend}}}

    def view(self, job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
        return job

    def phase(self, job: Mapping[str, Any]) -> tuple[Phase, str, str]:
        conditions = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
        by_type = {c.get("type"): c for c in conditions}
        for type_, phase in PYTORCHJOB_PHASE_PRIORITY:
            if type_ in by_type:
                c = by_type[type_]
                return phase, str(c.get("reason") or type_), str(c.get("message") or "")
        return Phase.CREATING, "JobCreated", "waiting for the training operator"

    def scalable(self, spec: LlamaFineTuneSpec) -> bool:
        return spec.cluster.elastic is not None

    def scale_patch(self, workers: int) -> Obj:
        return {"spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": workers}}}}


class TrainJobBackend:
    """trainer.kubeflow.org/v1alpha1 TrainJob (Kubeflow Trainer v2, the maintained line)."""

    kind = Backend.TRAIN_JOB.value
    resource = Resource("trainer.kubeflow.org", "v1alpha1", "trainjobs")
    install_hint = ("trainer.kubeflow.org/v1alpha1 TrainJobs (install Kubeflow Trainer v2.3 and its "
                    "torch-distributed runtime)")
    trainer_container = trainjob.NODE  # the torch runtime's container, which our runtimePatches patch
    fails_with_a_pod = False  # JobSet's restartPolicy OnFailure, the Job's backoffLimit 6: the pod is replaced

    def render(self, owner: Owner, spec: LlamaFineTuneSpec, attempt: int, excluded_nodes: Sequence[str] = ()) -> Obj:
        return trainjob.train_job(owner, spec, attempt, excluded_nodes)

    def pod_selector(self, job_name: str) -> str:
        return trainjob.pod_selector(job_name)

    def suspended(self, job: Mapping[str, Any]) -> bool:
        return bool((job.get("spec") or {}).get("suspend"))

    def suspend_patch(self, suspend: bool) -> Obj:
        return {"spec": {"suspend": suspend}}

    def view(self, job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
        return trainjob.job_view(job, pods)

    def phase(self, job: Mapping[str, Any]) -> tuple[Phase, str, str]:
        return trainjob.job_phase(job)

    def scalable(self, spec: LlamaFineTuneSpec) -> bool:
        return False  # a TrainJob's node count is immutable (Trainer v2 has no elastic mode): a new attempt

    def scale_patch(self, workers: int) -> Obj:
        raise ValueError("a TrainJob's numNodes cannot change in place; the operator starts a new attempt")


BACKENDS: dict[str, JobBackend] = {b.kind: b for b in (PyTorchJobBackend(), TrainJobBackend())}
"""Every job kind the operator can run, by kind (status.backend's values)."""
TRAINER_CONTAINERS = tuple(b.trainer_container for b in BACKENDS.values())
"""The trainer container's name on each backend."""


def backend_for(kind: str | Backend | None) -> JobBackend:
    """The backend of a job kind; None (a status written before backends existed) is a PyTorchJob."""
    name = kind.value if isinstance(kind, Backend) else (kind or Backend.PYTORCH_JOB.value)
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"no job backend {name!r}: one of {', '.join(BACKENDS)}") from None


def phase_of_job(job: Mapping[str, Any] | None) -> tuple[Phase, str, str]:
    """(phase, reason, message) of any job, by its kind."""
    if job is None:
        return Phase.CREATING, "JobPending", "the job is being created"
    return backend_for(str(job.get("kind") or Backend.PYTORCH_JOB.value)).phase(job)
