"""The trainer-operator contract (llamaft.api.contracts): what the trainer's real writers produce is
what the operator's readers take, key for key.

- The writers (termination.write, metrics.ProgressPublisher over HTTP) are run for real, their output checked
  against the models strictly (an unknown key or a wrong type fails: a key the trainer writes that
  the model lacks) and read back with the operator's own functions.
- Every field of the models is written by the trainer (a field the model has that the trainer never
  writes fails), found in the trainer's source for the progress document.
- Every reason the trainer names is one the operator classifies as itself, and the trainer's
  PRECEDENCE follows the operator's PRIORITY (both come from FailureReason's order).
"""

from __future__ import annotations

import ast
import json
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from llamaft.api import contracts
from llamaft.api.contracts import (
    TERMINATION_REPORT,
    FailedReport,
    FailureReason,
    ProgressDocument,
    SucceededReport,
    read_progress,
    read_termination,
)
from llamaft.api.status import read_status
from llamaft.operator import failures, lifecycle, observe
from llamaft_trainer.process import termination

from tests.conftest import REPO

TRAINER = REPO / "trainer" / "llamaft_trainer"


def aliases(model: type[Any]) -> set[str]:
    return {str(f.alias) for f in model.model_fields.values()}


FULL_RECORD = termination.RunRecord(
    step=10, total_steps=10, checkpoint_step=8, loss=1.25, eval_loss=1.5, tokens=4000, train_seconds=2.0,
    export_path="/ckpt/export", steady_steps=9, steady_tokens=3600, steady_seconds=1.8, world_size=2,
    flops_per_token=1e6, peak_flops=1e12, peak_memory_bytes=2**30,
    reward_accuracy=0.875, reward_margin=0.5, eval_reward_accuracy=0.75, eval_reward_margin=0.25,
)
"""A run record that knows everything a report can say (a DPO run's: its reward figures too)."""


def written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, doc: dict[str, Any], restart: int = 0) -> str:
    """The termination log's text after termination.write(doc)."""
    path = tmp_path / f"termination-{restart}.log"
    monkeypatch.setenv("LLAMAFT_TERMINATION_LOG", str(path))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
    assert termination.write(doc)
    return path.read_text(encoding="utf-8")


def container_message(index: int, text: str, exit_code: int, phase: str) -> dict[str, Any]:
    """A trainer pod whose container ended with `text` as its termination message."""
    return {"metadata": {"name": f"ft-worker-{index}"}, "spec": {"nodeName": f"node-{index}"}, "status": {
        "phase": phase, "containerStatuses": [{"name": "pytorch", "state": {"terminated": {
            "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error", "message": text}}}]}}


# ------------------------------------------------------------------------------ termination report
def test_the_success_report_is_the_model_and_the_operator_takes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = written(tmp_path, monkeypatch, termination.succeeded(FULL_RECORD), restart=3)
    strict = TERMINATION_REPORT.validate_json(text, strict=True, by_name=False)  # a key the model lacks fails here
    assert isinstance(strict, SucceededReport) and strict.restart_count == 3
    raw = json.loads(text)
    assert set(raw) == aliases(SucceededReport), "every field is written, none other"
    assert [k for k, v in raw.items() if v is None] == [] and None not in raw["performance"].values(), \
        "a record that knows everything fills every field: a field no writer sets fails here"
    assert set(raw["performance"]) == aliases(contracts.PerformanceStatus)

    report = failures.trainer_report(text)  # the operator's reader of a container's message
    assert report == strict
    d = lifecycle.decide(lifecycle.Observed(
        spec=spec(), status=read_status({"phase": "Running", "attempt": 1, "jobName": "ft-1"}), now=NOW, job_name="ft-1",
        job={"metadata": {"name": "ft-1"}, "status": {"conditions": [{"type": "Succeeded", "status": "True"}]}},
        pods=[container_message(0, text, 0, "Succeeded")]))
    assert d.status["phase"] == "Succeeded" and d.status["exportPath"] == "/ckpt/export"
    assert {k: d.status["progress"][k] for k in ("step", "totalSteps", "loss", "evalLoss", "tokensPerSecond", "stepOfTotal")} == {
        "step": 10, "totalSteps": 10, "loss": 1.25, "evalLoss": 1.5, "tokensPerSecond": 2000.0, "stepOfTotal": "10/10"}
    assert d.status["performance"] == raw["performance"]


@pytest.mark.parametrize("reason", sorted(r.value for r in contracts.TRAINER_REASONS) + ["RuntimeError", "OutOfMemoryError"])
def test_every_failure_report_is_the_model_and_the_operator_classifies_it(
    reason: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    retryable = reason != FailureReason.CONFIG_ERROR
    text = written(tmp_path, monkeypatch, termination.failed(reason, f"{reason}: what happened", FULL_RECORD, retryable=retryable))
    strict = TERMINATION_REPORT.validate_json(text, strict=True, by_name=False)
    assert isinstance(strict, FailedReport) and strict.reason == reason
    raw = json.loads(text)
    assert set(raw) == aliases(FailedReport) and [k for k, v in raw.items() if v is None] == []
    assert failures.trainer_report(text) == strict

    found = failures.pod_failure(container_message(1, text, 1, "Failed"), last_step=None)
    assert found is not None
    expected = reason if reason in contracts.TRAINER_REASONS else FailureReason.TRAINER_ERROR
    assert (found.reason, found.retryable, found.step) == (expected, retryable, FULL_RECORD.step)
    assert found.reason in failures.PRIORITY


def test_the_trainer_names_exactly_the_reasons_the_operator_knows_it_for() -> None:
    """Every FailureReason the trainer can emit (termination's constants: classify_exception's and main's
    reasons) is one the operator maps to itself, and every such reason has a trainer constant."""
    named = {v for v in vars(termination).values() if isinstance(v, FailureReason)}
    assert named == set(contracts.TRAINER_REASONS) == set(failures.TRAINER_REASONS)
    for reason in named:
        assert contracts.trainer_reason(reason) is reason
    assert contracts.trainer_reason("ValueError") is contracts.trainer_reason(None) is FailureReason.TRAINER_ERROR


def test_precedence_and_priority_are_one_order() -> None:
    """termination.PRECEDENCE ranks the trainer's reasons as failures.PRIORITY does (TrainerError
    standing for any other exception), with the values they always had."""
    assert failures.PRIORITY == [
        "ConfigError", "NodeLost", "Evicted", "RendezvousLost", "Interrupted", "Preempted", "OOMKilled", "GPUXid",
        "RendezvousClosed", "TrainerError", "Killed", "CollectiveTimeout", "PeerLost", "Stalled", "DeadlineExceeded",
        "JobFailed",
    ] == list(FailureReason)
    assert termination.PRECEDENCE == {"ConfigError": 6, "RendezvousLost": 5, "Interrupted": 4, "Preempted": 3,
                                      "CollectiveTimeout": 1, "PeerLost": 0}
    assert termination.OTHER_ERROR_PRECEDENCE == 2
    ranks = {**termination.PRECEDENCE, FailureReason.TRAINER_ERROR: termination.OTHER_ERROR_PRECEDENCE}
    assert sorted(ranks, key=lambda r: -ranks[r]) == sorted(ranks, key=failures.PRIORITY.index)


def test_a_report_the_operator_cannot_read_is_no_report() -> None:
    for text in (None, "", "Traceback ...", "{not json", "[1]", '{"phase": "Running"}', '{"reason": "PeerLost"}'):
        assert failures.trainer_report(text) is None, text
    # A newer trainer's key is ignored; a field that does not validate is absent, the report stays.
    newer = read_termination({"phase": "Succeeded", "step": 5, "newerKey": 1, "loss": "nan?", "performance": {"steps": "many"}})
    assert newer == SucceededReport(step=5)
    with pytest.raises(ValueError, match="newerKey"):
        TERMINATION_REPORT.validate_python({"phase": "Succeeded", "newerKey": 1})  # the writer's side: strict


# ------------------------------------------------------------------------------ /progress
DPO_STEP = {"rewards/chosen": 0.375, "rewards/rejected": 0.125, "rewards/accuracies": 0.75, "rewards/margins": 0.25,
            "logps/chosen": -12.0, "logps/rejected": -20.0}
"""A DPO step event's TRL metrics (train.py adds them to the step's figures)."""
DPO_EVAL = {"eval_loss": 0.5, "eval_rewards/chosen": 0.75, "eval_rewards/rejected": 0.25, "eval_rewards/accuracies": 0.875,
            "eval_rewards/margins": 0.5, "eval_logps/chosen": -11.0, "eval_logps/rejected": -21.0}
"""dpo_step.evaluate's report."""


def fetch(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 (a local test server)
        return json.loads(response.read())


def test_the_progress_document_is_the_model_and_the_operator_reads_it(served_progress: tuple[Any, str]) -> None:
    progress, base = served_progress
    url = f"{base}/progress"
    # What main.py, train.py and tracking write, through the same methods.
    progress.update(rank=0, pod="ft-1-worker-0")
    progress.update(phase="Training", totalSteps=20)
    progress.record_step({"step": 10, "epoch": 1, "loss": 1.5, "lr": 1e-5, "grad_norm": 1.0, "tokens_per_second": 900.0,
                          "tokens_per_second_per_device": 450.0, "mfu": 0.4, "peak_memory_bytes": 1, "tokens": 64,
                          "eta_seconds": 30, **DPO_STEP})
    progress.record_eval(10, 1.75, 5.75)
    progress.record_dpo_eval(10, DPO_EVAL)
    progress.record_generations({"step": 10, "samples": 2, "rouge1": 0.5, "rouge2": 0.25, "rougeL": 0.4,
                                 "generations": [{"prompt": "p", "reference": "r", "generated": "g"}]})
    progress.update(tracking={"mlflowRunId": "r1", "mlflowExperimentId": "7", "wandbRunId": "w1",
                              "wandbUrl": "https://wandb/w1", "tensorboardDirectory": "/ckpt/tensorboard"})
    progress.update(trackingWarning="mlflow: reachable again")
    progress.update(exportPath="/ckpt/export")
    doc = fetch(url)

    strict = ProgressDocument.model_validate(doc, strict=True)  # a key the model lacks fails here
    assert set(doc) == aliases(ProgressDocument), "every field written (here), none other"
    assert [k for k, v in doc.items() if v is None] == []
    assert set(doc["tracking"]) == aliases(contracts.TrackingInfo) and set(doc["evaluation"]) == aliases(contracts.EvaluationStatus)
    assert read_progress(doc) == strict

    status = observe.observe({"metadata": {"name": "ft-1"}, "status": {"conditions": [{"type": "Running", "status": "True"}]}},
                             [], read_progress(doc), read_status({"phase": "Creating"}), generation=1,
                             now="2026-01-01T00:00:00Z").status
    assert status["progress"] == {"epoch": 1, "step": 10, "totalSteps": 20, "stepOfTotal": "10/20", "loss": 1.5,
                                  "evalLoss": 0.5, "tokensPerSecond": 900.0, "mfu": 0.4, "etaSeconds": 30,
                                  "rewardAccuracy": 0.75, "rewardMargin": 0.25, "evalRewardAccuracy": 0.875,
                                  "evalRewardMargin": 0.5, "updatedAt": doc["updatedAt"]}
    assert status["leaderPod"] == "ft-1-worker-0" and status["exportPath"] == "/ckpt/export"
    assert status["tracking"] == {**doc["tracking"], "warning": "mlflow: reachable again"}
    assert status["evaluation"] == doc["evaluation"]


def test_an_sft_run_sends_no_dpo_key_and_documents_with_and_without_them_round_trip(served_progress: tuple[Any, str]) -> None:
    """The DPO fields (each of TRL's step metrics: rewardAccuracy, rewardMargin, rewardChosen,
    rewardRejected, logpsChosen, logpsRejected; the eval's evalRewardAccuracy, evalRewardMargin) are
    optional: an SFT run's document has none of them (an older trainer's neither) and still reads
    back, into a status without them; a DPO run's reads back with them."""
    progress, base = served_progress
    url = f"{base}/progress"
    progress.record_step({"step": 3, "epoch": 0, "loss": 2.0, "lr": 1e-5, "grad_norm": 1.0, "tokens_per_second": 9.0,
                          "tokens_per_second_per_device": 9.0, "mfu": None, "peak_memory_bytes": 1, "tokens": 8,
                          "eta_seconds": 3})
    progress.record_eval(3, 2.5, 12.2)
    sft = fetch(url)
    dpo_keys = {"rewardAccuracy", "rewardMargin", "rewardChosen", "rewardRejected", "logpsChosen", "logpsRejected",
                "evalRewardAccuracy", "evalRewardMargin"}
    assert not dpo_keys & set(sft)
    parsed = read_progress(sft)
    assert parsed == ProgressDocument.model_validate(sft, strict=True) and parsed.reward_accuracy is None
    assert ProgressDocument.model_validate(parsed.model_dump(by_alias=True, exclude_unset=True)) == parsed
    assert not dpo_keys & set(parsed.status_progress().to_k8s())

    progress.record_step({"step": 4, "epoch": 0, "loss": 0.6, "lr": 1e-5, "grad_norm": 1.0, "tokens_per_second": 9.0,
                          "tokens_per_second_per_device": 9.0, "mfu": None, "peak_memory_bytes": 1, "tokens": 8,
                          "eta_seconds": 2, **DPO_STEP})
    progress.record_dpo_eval(4, DPO_EVAL)
    dpo = fetch(url)
    assert {k: dpo[k] for k in dpo_keys} == {"rewardAccuracy": 0.75, "rewardMargin": 0.25, "rewardChosen": 0.375,
                                             "rewardRejected": 0.125, "logpsChosen": -12.0, "logpsRejected": -20.0,
                                             "evalRewardAccuracy": 0.875, "evalRewardMargin": 0.5}
    parsed = read_progress(dpo)
    assert parsed is not None and parsed == ProgressDocument.model_validate(dpo, strict=True)
    assert ProgressDocument.model_validate(parsed.model_dump(by_alias=True, exclude_unset=True)) == parsed
    assert parsed.status_progress().reward_accuracy == 0.75 and parsed.status_progress().eval_reward_margin == 0.5
    # A garbled value of a new field is that field absent, the rest of the document kept.
    garbled = read_progress({**dpo, "rewardAccuracy": "most"})
    assert garbled is not None and garbled.reward_accuracy is None and garbled.reward_margin == 0.25


def test_the_progress_writer_refuses_a_key_the_model_lacks(served_progress: tuple[Any, str]) -> None:
    progress, base = served_progress
    url = f"{base}/progress"
    before = fetch(url)
    with pytest.raises(ValueError, match="newKey"):
        progress.update(newKey=1)
    with pytest.raises(ValueError, match="step"):
        progress.update(step="ten")
    assert fetch(url) == before


def trainer_progress_keys() -> set[str]:
    """The keys the trainer's source passes to ProgressPublisher.update (`progress.update(...)` anywhere,
    `self.update(...)` in metrics.py), by wire name, and updatedAt (update sets it)."""
    wire = {name: str(f.alias) for name, f in ProgressDocument.model_fields.items()}
    keys = {"updatedAt"}
    for path in sorted(TRAINER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"):
                continue
            owner = node.func.value
            if isinstance(owner, ast.Name) and (owner.id == "progress" or (owner.id == "self" and path.name == "metrics.py")):
                keys |= {wire.get(str(k.arg), str(k.arg)) for k in node.keywords}
    return keys


def test_every_field_of_the_progress_document_is_written_by_the_trainer() -> None:
    """Adding a field to ProgressDocument that no trainer code writes fails here; a key the
    trainer writes that the model lacks fails here and at run time (extra forbidden)."""
    assert trainer_progress_keys() == aliases(ProgressDocument)


def test_the_operator_reads_an_older_or_newer_or_garbled_document_without_failing() -> None:
    assert read_progress(None) is None and read_progress("step 3") is None and read_progress([{"rank": 0}]) is None
    newer = read_progress({"rank": 0, "step": 4, "phase": "Exporting", "newKey": {"x": 1}, "loss": "high",
                           "tracking": {"mlflowRunId": "r", "newTracker": "t"}, "evaluation": {"step": 4, "bleu": 0.1}})
    assert newer is not None and (newer.rank, newer.step, newer.phase, newer.loss) == (0, 4, None, None)
    assert newer.tracking == contracts.TrackingInfo(mlflow_run_id="r") and newer.evaluation is not None
    assert observe.progress_status(read_progress({"rank": 0, "step": "x"}), {"step": 3}) == {"step": 3}


# ------------------------------------------------------------------------------ helpers
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def spec() -> Any:
    from llamaft.api.spec import LlamaFineTuneSpec

    return LlamaFineTuneSpec.model_validate({
        "model": {"source": "/models/tiny"}, "dataset": {"format": "samsum", "source": "/data/x.jsonl"},
        "cluster": {"workers": 1, "gpusPerWorker": 0},
    })


def test_the_contract_needs_only_pydantic_and_the_api_layer() -> None:
    """The trainer imports it: no operator code, no kopf, no kubernetes client (tests/test_architecture.py
    checks the layers; this, that the module stays that small)."""
    source = (REPO / "operator" / "llamaft" / "api" / "contracts.py").read_text(encoding="utf-8")
    imported = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import) for a in n.names}
    assert {m.split(".")[0] for m in imported if m} <= {"__future__", "collections", "typing", "pydantic", "llamaft"}
    assert {m for m in imported if m and m.startswith("llamaft")} <= {"llamaft.api.base", "llamaft.api.status"}
