"""The trainer-operator contract: the /progress document, the termination report, the failure reasons.

The trainer (`llamaft_trainer.report.metrics`, `llamaft_trainer.process.termination`) writes these models and the
operator (`failures`, `observe`, `lifecycle`, `step`) reads them; docs/progress-contract.md
describes them in prose. Both sides import this module, so it depends on pydantic, the standard
library and the api layer only (the trainer's image has neither kopf nor the kubernetes client).

Two ways in:
- writing (the trainer): `model_validate` / construction as for any `ApiModel`: an unknown key or
  a wrong type is an error, so a key added on one side only fails tests/test_contracts.py;
- reading (the operator, `read_progress`, `read_termination`): tolerant of an older or newer
  trainer. Unknown keys are ignored, a top-level field that does not validate is treated as
  absent (a nested object, e.g. `performance`, as a whole), and a document that is not one at all
  is None. The operator never crashes on what a trainer wrote.

Field order is wire order: `model_dump(by_alias=True)` writes the keys as the trainer always has.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self

from pydantic import (
    Field,
    ModelWrapValidatorHandler,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from llamaft.api.base import ApiEnum, ApiModel
from llamaft.api.status import EvaluationStatus, PerformanceStatus, Progress


class FailureReason(ApiEnum):
    """Why an attempt died: the operator's causes (`status.failures[].reason`) and the reasons the
    trainer names in its termination report. Declared most specific first: that order is
    `PRIORITY` (the operator's choice among several pods' evidence) and `PRECEDENCE` (which
    report a trainer rank may overwrite in its pod's shared termination log)."""

    CONFIG_ERROR = "ConfigError"
    NODE_LOST = "NodeLost"
    EVICTED = "Evicted"
    RENDEZVOUS_LOST = "RendezvousLost"
    INTERRUPTED = "Interrupted"
    """The user stopped the run (Ctrl-C of `llamaft run --local`: SIGINT, which the kubelet never
    sends): placed before Preempted, as a deliberate stop says more than a SIGTERM would."""
    PREEMPTED = "Preempted"
    OOM_KILLED = "OOMKilled"
    GPU_XID = "GPUXid"
    RENDEZVOUS_CLOSED = "RendezvousClosed"
    TRAINER_ERROR = "TrainerError"
    """Any other exception in the trainer (its report names the exception's type)."""
    KILLED = "Killed"
    COLLECTIVE_TIMEOUT = "CollectiveTimeout"
    PEER_LOST = "PeerLost"
    STALLED = "Stalled"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    JOB_FAILED = "JobFailed"


PRIORITY: tuple[FailureReason, ...] = tuple(FailureReason)
"""Every cause, most specific first (failures.PRIORITY)."""

TRAINER_REASONS: frozenset[FailureReason] = frozenset({
    FailureReason.CONFIG_ERROR, FailureReason.RENDEZVOUS_LOST, FailureReason.INTERRUPTED, FailureReason.PREEMPTED,
    FailureReason.COLLECTIVE_TIMEOUT, FailureReason.PEER_LOST,
})
"""The reasons the trainer reports by name; for any other exception it reports the exception's
type name, which the operator classifies as TrainerError."""

_TRAINER_ORDER = [r for r in PRIORITY if r in TRAINER_REASONS or r is FailureReason.TRAINER_ERROR]
PRECEDENCE: dict[str, int] = {r: len(_TRAINER_ORDER) - 1 - i for i, r in enumerate(_TRAINER_ORDER)
                              if r is not FailureReason.TRAINER_ERROR}
"""Which failure report a trainer rank may overwrite in the shared file: a higher (or equal) rank
wins. PRIORITY's order over the trainer's reasons."""
OTHER_ERROR_PRECEDENCE: int = len(_TRAINER_ORDER) - 1 - _TRAINER_ORDER.index(FailureReason.TRAINER_ERROR)
"""The rank of any other exception (TrainerError's place in PRIORITY)."""


def trainer_reason(reported: str | None) -> FailureReason:
    """The operator's cause for the reason a trainer reported."""
    return FailureReason(reported) if reported in TRAINER_REASONS else FailureReason.TRAINER_ERROR


_LENIENT = "llamaft.contracts.lenient"


class _Document(ApiModel):
    """A top-level document: read leniently (`read_progress`, `read_termination`), a key whose value
    does not validate is dropped (its field absent) instead of failing the whole document."""

    @model_validator(mode="wrap")
    @classmethod
    def _absent_when_invalid(cls, data: Any, handler: ModelWrapValidatorHandler[Self], info: ValidationInfo) -> Self:
        try:
            return handler(data)
        except ValidationError as exc:
            if not (isinstance(info.context, Mapping) and info.context.get(_LENIENT)) or not isinstance(data, Mapping):
                raise
            bad = {error["loc"][0] for error in exc.errors() if error["loc"]}
            if not bad:
                raise
            return handler({k: v for k, v in data.items() if k not in bad})


# ------------------------------------------------------------------------------ /progress
class ProgressPhase(ApiEnum):
    STARTING = "Starting"
    TRAINING = "Training"
    SUCCEEDED = "Succeeded"
    PREEMPTED = "Preempted"


class TrackingInfo(ApiModel):
    """Where rank 0's experiment trackers keep the run (llamaft_trainer.report.tracking)."""

    mlflow_run_id: str | None = None
    mlflow_experiment_id: str | None = None
    wandb_run_id: str | None = None
    wandb_url: str | None = None
    tensorboard_directory: str | None = None


class ProgressDocument(_Document):
    """`GET /progress` of local rank 0 of every worker (docs/progress-contract.md section 2). The
    trainer sends only the keys it has set so far (`model_dump(by_alias=True, exclude_unset=True)`):
    a key set to None is sent as null, a key never set is not sent."""

    rank: int | None = None
    """Global rank of this worker's local rank 0: the operator takes rank 0's document."""
    pod: str | None = None
    """The pod's name (HOSTNAME): status.leaderPod."""
    phase: ProgressPhase | None = None
    step: int | None = None
    total_steps: int | None = None
    epoch: int | None = None
    loss: float | None = None
    eval_loss: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    eta_seconds: int | None = None
    reward_accuracy: float | None = None
    """DPO only (absent for SFT): the last logged step's rewards/accuracies (status.progress)."""
    reward_margin: float | None = None
    """DPO only: the last logged step's rewards/margins."""
    reward_chosen: float | None = None
    """DPO only: the last logged step's rewards/chosen. This and the next three are TRL's other
    step metrics, for whoever reads /progress; status.progress leaves them out (accuracy and
    margin say how the run is doing, and the trackers and /metrics have them all)."""
    reward_rejected: float | None = None
    """DPO only: the last logged step's rewards/rejected."""
    logps_chosen: float | None = None
    """DPO only: the last logged step's logps/chosen (the policy's, summed over each completion)."""
    logps_rejected: float | None = None
    """DPO only: the last logged step's logps/rejected."""
    eval_reward_accuracy: float | None = None
    """DPO only: the last eval's eval_rewards/accuracies over the held-out pairs."""
    eval_reward_margin: float | None = None
    """DPO only: the last eval's eval_rewards/margins."""
    export_path: str | None = None
    tracking: TrackingInfo | None = None
    tracking_warning: str | None = None
    """The last change of a tracker's health (status.tracking.warning, a Tracking event)."""
    evaluation: EvaluationStatus | None = None
    """The last generations' task scores (status.evaluation)."""
    updated_at: str | None = None

    def status_progress(self) -> Progress:
        """status.progress from this document: the fields it has (the others None), and
        `stepOfTotal` when it has both the step and the total."""
        return Progress(
            epoch=self.epoch, step=self.step, total_steps=self.total_steps,
            step_of_total=f"{self.step}/{self.total_steps}" if self.step is not None and self.total_steps is not None else None,
            loss=self.loss, eval_loss=self.eval_loss, tokens_per_second=self.tokens_per_second, mfu=self.mfu,
            eta_seconds=self.eta_seconds, reward_accuracy=self.reward_accuracy, reward_margin=self.reward_margin,
            eval_reward_accuracy=self.eval_reward_accuracy, eval_reward_margin=self.eval_reward_margin,
            updated_at=self.updated_at,
        )


# ------------------------------------------------------------------------------ termination report
class SucceededReport(_Document):
    """Global rank 0's termination message after a finished run."""

    phase: Literal["Succeeded"] = "Succeeded"
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    """The last step's (None when a resumed run had no step left to train)."""
    eval_loss: float | None = None
    tokens_per_second: float | None = None
    export_path: str | None = None
    performance: PerformanceStatus | None = None
    """What the run sustained (status.performance)."""
    restart_count: int | None = None
    """TORCHELASTIC_RESTART_COUNT (termination.write adds it)."""
    reward_accuracy: float | None = None
    """DPO only (absent for SFT): the last step's rewards/accuracies, as ProgressDocument's."""
    reward_margin: float | None = None
    """DPO only: the last step's rewards/margins."""
    eval_reward_accuracy: float | None = None
    """DPO only: the last eval's eval_rewards/accuracies over the held-out pairs."""
    eval_reward_margin: float | None = None
    """DPO only: the last eval's eval_rewards/margins."""

    def status_progress(self, now: str) -> Progress:
        """status.progress's fields this report has, updated `now`."""
        return Progress(step=self.step, total_steps=self.total_steps, loss=self.loss, eval_loss=self.eval_loss,
                        tokens_per_second=self.tokens_per_second, reward_accuracy=self.reward_accuracy,
                        reward_margin=self.reward_margin, eval_reward_accuracy=self.eval_reward_accuracy,
                        eval_reward_margin=self.eval_reward_margin, updated_at=now)

    def figures(self) -> str:
        """The run's final figures in words, for the Succeeded condition and event: the last loss
        and eval loss, and DPO's reward accuracy and margin (training and held out); only those
        the report has ("" with none)."""
        return final_figures(self.loss, self.eval_loss, self.reward_accuracy, self.reward_margin,
                             self.eval_reward_accuracy, self.eval_reward_margin)


def final_figures(loss: float | None, eval_loss: float | None, reward_accuracy: float | None = None,
                  reward_margin: float | None = None, eval_reward_accuracy: float | None = None,
                  eval_reward_margin: float | None = None) -> str:
    """One wording of a finished run's figures for the operator's status and `llamaft run
    --local`'s last line, e.g. "loss 0.4210, reward accuracy 0.875 (margin 0.912); held out:
    loss 0.5012, reward accuracy 0.833 (margin 0.701)"."""

    def part(loss_value: float | None, accuracy: float | None, margin: float | None) -> str:
        words = [f"loss {loss_value:.4f}"] if loss_value is not None else []
        if accuracy is not None:
            words.append(f"reward accuracy {accuracy:.3f}" + (f" (margin {margin:.3f})" if margin is not None else ""))
        return ", ".join(words)

    train, held_out = part(loss, reward_accuracy, reward_margin), part(eval_loss, eval_reward_accuracy, eval_reward_margin)
    return "; ".join([train] * bool(train) + [f"held out: {held_out}"] * bool(held_out))


class FailedReport(_Document):
    """The termination message of every rank that fails or stops."""

    phase: Literal["Failed"] = "Failed"
    reason: str | None = None
    """A FailureReason of TRAINER_REASONS, or the exception's type name."""
    message: str | None = None
    step: int | None = None
    checkpoint_step: int | None = None
    retryable: bool | None = None
    exit_code: int | None = None
    restart_count: int | None = None
    """TORCHELASTIC_RESTART_COUNT (termination.write adds it)."""


TerminationReport = Annotated[SucceededReport | FailedReport, Field(discriminator="phase")]
TERMINATION_REPORT: TypeAdapter[SucceededReport | FailedReport] = TypeAdapter(TerminationReport)


# ------------------------------------------------------------------------------ reading
def read_progress(doc: Any) -> ProgressDocument | None:
    """The operator's view of a /progress document (None: not a document)."""
    if isinstance(doc, ProgressDocument):
        return doc
    if not isinstance(doc, Mapping):
        return None
    try:
        return ProgressDocument.model_validate(doc, extra="ignore", context={_LENIENT: True})
    except ValidationError:
        return None


def read_termination(doc: Any) -> SucceededReport | FailedReport | None:
    """The operator's view of a termination report (None: not a Succeeded or Failed report)."""
    if isinstance(doc, SucceededReport | FailedReport):
        return doc
    if not isinstance(doc, Mapping):
        return None
    try:
        return TERMINATION_REPORT.validate_python(doc, extra="ignore", context={_LENIENT: True}, by_name=False)
    except ValidationError:
        return None
