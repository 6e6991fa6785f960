"""The LlamaFineTune status, written only by the operator.

Conditions follow the Kubernetes API conventions (type, status, reason, message,
lastTransitionTime, observedGeneration). The CRD's status schema is generated from these classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from pydantic import Field, ValidationError

from llamaft.api.base import ApiModel


class Phase(StrEnum):
    PENDING = "Pending"
    QUEUED = "Queued"
    CREATING = "Creating"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(ApiModel):
    """One observation of the run, per Kubernetes API conventions."""

    type: str = Field(max_length=316)
    """Condition type: Valid, Ready, Running, Succeeded, Failed, Suspended, RendezvousReady, GPUHealthy."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: str = Field(max_length=1024)
    """CamelCase machine-readable reason (grep-able in events too)."""
    message: str = Field(default="", max_length=32768)
    """Human-readable detail, with the fix when there is one."""
    last_transition_time: str
    """When status last changed (RFC 3339)."""
    observed_generation: int | None = None
    """metadata.generation this condition was computed from."""


class WorkerCounts(ApiModel):
    """Worker pods of the current attempt (from the job's replicaStatuses), and the number of
    workers the run asks for now, which an elastic run changes (cluster.elastic)."""

    active: int = 0
    """Running worker pods."""
    succeeded: int = 0
    """Worker pods that finished successfully."""
    failed: int = 0
    """Worker pods that failed."""
    current: int | None = None
    """Workers the current attempt's job asks for: spec.cluster.workers, unless the operator
    shrank an elastic run because pods found no room (`reason`)."""
    desired: int | None = None
    """spec.cluster.workers: the size a shrunk run grows back to."""
    reason: str | None = Field(default=None, max_length=128)
    """Why `current` is what it is: AsSpecified, Shrunk, NoSmallerSizeFits (pods wait: no size
    down to minWorkers is placed and fits), GrowingBack."""
    message: str | None = Field(default=None, max_length=2048)
    """The last resize (or refusal to resize), in words."""
    last_resize_time: str | None = None
    """When `current` last changed (RFC 3339): the clock of elastic.growBackAfterSeconds."""
    last_resize_step: int | None = None
    """The optimizer step the run had reached at that change: it grows back at a later checkpoint."""


class Progress(ApiModel):
    """Training progress, from the trainer's progress contract (rank 0)."""

    epoch: int | None = None
    """Current epoch (0-based)."""
    step: int | None = None
    """Optimizer steps done."""
    total_steps: int | None = None
    """Optimizer steps planned."""
    step_of_total: str | None = None
    """`step/totalSteps`, for `kubectl get`."""
    loss: float | None = None
    """Latest training loss."""
    eval_loss: float | None = None
    """Latest eval loss."""
    tokens_per_second: float | None = None
    """Training throughput of the whole job."""
    mfu: float | None = None
    """Model FLOPs utilisation (0-1)."""
    eta_seconds: int | None = None
    """Estimated seconds to the last step."""
    reward_accuracy: float | None = None
    """DPO (training.method dpo): the share of the last logged step's pairs whose chosen
    completion's reward exceeds the rejected one's (0-1, TRL's rewards/accuracies)."""
    reward_margin: float | None = None
    """DPO: the last logged step's mean chosen minus rejected reward (TRL's rewards/margins)."""
    eval_reward_accuracy: float | None = None
    """DPO: reward accuracy over the held-out pairs at the last eval (eval_rewards/accuracies)."""
    eval_reward_margin: float | None = None
    """DPO: mean reward margin over the held-out pairs at the last eval (eval_rewards/margins)."""
    updated_at: str | None = None
    """When the trainer reported this (RFC 3339)."""


class FailureRecord(ApiModel):
    """One attempt that ended in failure, and what the operator made of it."""

    attempt: int
    """The attempt that failed."""
    reason: str = Field(max_length=128)
    """Classified cause: ConfigError, Evicted, Preempted, NodeLost, OOMKilled, Killed, TrainerError,
    CollectiveTimeout, RendezvousClosed, RendezvousLost, GPUXid, Stalled, DeadlineExceeded, JobFailed."""
    retryable: bool
    """Whether the policy treats this cause as retryable."""
    message: str = Field(default="", max_length=2048)
    """The evidence: the trainer's error, the pod's reason, the XID's meaning."""
    node: str | None = Field(default=None, max_length=253)
    """Node the evidence points at, when it names one."""
    pod: str | None = Field(default=None, max_length=253)
    """Pod the evidence came from."""
    exit_code: int | None = None
    """Exit code of the failed container, when it exited."""
    step: int | None = None
    """Last optimizer step the run reported before the failure."""
    time: str
    """When the operator observed the failure (RFC 3339)."""


class TrackingStatus(ApiModel):
    """Where the run's experiment trackers keep it (one tracker run per fine-tune: every attempt
    continues it)."""

    mlflow_run_id: str | None = None
    """The MLflow run."""
    mlflow_experiment_id: str | None = None
    """The MLflow experiment the run is in."""
    wandb_run_id: str | None = None
    """The W&B run id."""
    wandb_url: str | None = None
    """The W&B run's page (online mode)."""
    tensorboard_directory: str | None = None
    """The TensorBoard event files (`tensorboard --logdir` on it)."""
    warning: str | None = None
    """The last change of a tracker's health (down, or reachable again); training never waits."""


class EvaluationStatus(ApiModel):
    """The last task scores of the generations (spec.evaluation), from the trainer's rank 0."""

    step: int | None = None
    """The optimizer step they were measured at."""
    samples: int | None = None
    """How many held-out prompts were generated."""
    rouge1: float | None = None
    """ROUGE-1 F1 (0-1), averaged over the samples."""
    rouge2: float | None = None
    """ROUGE-2 F1 (0-1)."""
    rouge_l: float | None = None
    """ROUGE-L F1 (0-1)."""


class PerformanceStatus(ApiModel):
    """What the finished run sustained, from the trainer's final report: the figures `llamaft
    sweep` compares across sizes. Over the last attempt's optimizer steps after its first (which
    pays one-time costs); checkpoint saves and evals are not step time; padding is not a token."""

    steps: int | None = None
    """Optimizer steps the figures are over."""
    world_size: int | None = None
    """Ranks (GPUs, or CPU processes) that trained."""
    tokens_per_second: float | None = None
    """Tokens of all ranks per second of step time."""
    tokens_per_second_per_device: float | None = None
    """tokensPerSecond / worldSize."""
    step_seconds: float | None = None
    """Mean optimizer step time."""
    mfu: float | None = None
    """Model FLOPs utilisation (0-1; absent where the device's peak is unknown, e.g. CPU)."""
    peak_memory_bytes: int | None = None
    """The largest peak memory of any rank (GPU memory allocated; resident memory on CPU)."""


class LlamaFineTuneStatus(ApiModel):
    """What the operator observed."""

    phase: Phase = Phase.PENDING
    """Pending, Creating, Running, Restarting, Succeeded, Failed or Suspended."""
    message: str | None = None
    """Short summary of the current phase."""
    conditions: list[Condition] = Field(default_factory=list)
    """Detailed conditions."""
    observed_generation: int | None = None
    """metadata.generation the operator last reconciled."""
    backend: str | None = None
    """The Kubeflow job kind this run uses (PyTorchJob or TrainJob; what `backend: auto` resolved to)."""
    queue: str | None = None
    """The Kueue LocalQueue the job waits in or was admitted from."""
    job_name: str | None = None
    """Name of the child job (PyTorchJob or TrainJob, see `backend`) of the current attempt."""
    rendezvous_id: str | None = None
    """torchrun rendezvous id of the current attempt (unique per attempt)."""
    attempt: int = 0
    """Run attempt (increments on every resubmission)."""
    retries_used: int = 0
    """Resubmissions spent out of runPolicy.retryBudget."""
    retry_after: str | None = None
    """When the pending resubmission happens (RFC 3339), while the run is Restarting."""
    total_gpus: int | None = None
    """workers x gpusPerWorker, for `kubectl get`."""
    workers: WorkerCounts = Field(default_factory=WorkerCounts)
    """Worker pod counts."""
    progress: Progress = Field(default_factory=Progress)
    """Training progress."""
    start_time: str | None = None
    """When the current attempt started running."""
    completion_time: str | None = None
    """When the run finished."""
    restarts: int = 0
    """Worker-group restarts observed (PyTorchJob Restarting transitions)."""
    leader_pod: str | None = None
    """Pod running global rank 0: read its logs for progress."""
    export_path: str | None = None
    """Where the final Hugging Face export was written."""
    tracking: TrackingStatus | None = None
    """Where the experiment trackers keep the run (spec.tracking)."""
    evaluation: EvaluationStatus | None = None
    """The last task scores of the generations (spec.evaluation)."""
    performance: PerformanceStatus | None = None
    """Throughput, step time and memory the finished run sustained (its final report)."""
    failures: list[FailureRecord] = Field(default_factory=list, max_length=20)
    """The most recent failed attempts (at most 20), oldest first."""
    excluded_nodes: list[str] = Field(default_factory=list, max_length=16)
    """Nodes later attempts avoid (node affinity) because evidence named them (node lost, eviction,
    GPU XID); at most 16, oldest dropped first. The operator never cordons nodes."""
    last_progress_time: str | None = None
    """When the operator last saw the step advance (RFC 3339): the clock of the progress deadline."""
    attempt_start_time: str | None = None
    """When the operator created the current attempt's job (RFC 3339)."""


def _list_bounds() -> dict[str, int]:
    """The lists of the status with a max_length (the CRD's maxItems): alias -> bound."""
    bounds = {}
    for name, info in LlamaFineTuneStatus.model_fields.items():
        for constraint in info.metadata:
            if getattr(constraint, "max_length", None) is not None:
                bounds[str(info.alias or name)] = int(constraint.max_length)
    return bounds


_BOUNDED_LISTS = _list_bounds()


def read_status(raw: LlamaFineTuneStatus | Mapping[str, Any] | None) -> LlamaFineTuneStatus:
    """The operator's typed view of a stored status.

    A status is only ever written by the operator, but what is stored may come from another
    version of it, or have been edited by hand: read it leniently rather than stop the run's
    reconciliation. Unknown keys are ignored; bounded lists keep their newest entries (the bound the
    operator writes them with); a top-level field that still does not validate is read as unset.
    `as_written` gives any part back exactly as it was stored."""
    if isinstance(raw, LlamaFineTuneStatus):
        return raw
    data = dict(raw or {})
    for key, bound in _BOUNDED_LISTS.items():
        if isinstance(data.get(key), list):
            data[key] = data[key][-bound:]
    for _ in range(len(data) + 1):
        try:
            return LlamaFineTuneStatus.model_validate(data, extra="ignore")
        except ValidationError as exc:
            bad = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
            if not bad & data.keys():
                break
            data = {k: v for k, v in data.items() if k not in bad}
    return LlamaFineTuneStatus()


def as_written(model: ApiModel) -> dict[str, Any]:
    """A status part (progress, a condition, a failure record) as a merge patch carries it: the
    camelCase keys it was read or built with, and no defaults it was not given."""
    return model.model_dump(by_alias=True, exclude_unset=True, mode="python")
