"""Experiment tracking against the real trackers: a real `mlflow server` on loopback (read back
through its REST API), TensorBoard files read with TensorBoard's event reader, W&B in offline
mode read with W&B's record reader. One tracker run per fine-tune across attempts, no point twice
for a step trained again, secrets nowhere, and a tracker that disappears never stops training."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llamaft.api.spec import TrainingJobConfig
from llamaft_trainer.report import tracking
from llamaft_trainer.report.logline import parse_event, read_events

from tests.conftest import REPO
from tests.trackers import Gate, MlflowServer, tensorboard_scalars, wandb_offline_runs
from tests.trainer.conftest import DATASET, torchrun_cmd, trainer_env

pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")
pytest.importorskip("wandb")

SECRETS = {"MLFLOW_TRACKING_TOKEN": "mlflow-secret-token-4711", "WANDB_API_KEY": "wandb-secret-key-0815" + "0" * 19}


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    server = MlflowServer(tmp_path_factory.mktemp("mlflow")).start()
    yield server
    server.stop()


def config(tmp: Path, mlflow_url: str, experiment: str, **training: Any) -> TrainingJobConfig:
    return TrainingJobConfig.model_validate({
        "model": {"source": str(tmp / "model")},
        "dataset": {"format": "samsum", "source": str(DATASET), "maxSeqLength": 128},
        "training": {"maxSteps": 8, "learningRate": 1e-3, **training},
        "checkpointing": {"directory": str(tmp / "ckpt")},
        "tracking": {"tensorboard": {}, "mlflow": {"trackingUri": mlflow_url, "experiment": experiment},
                     "wandb": {"project": "llamaft-tests", "mode": "offline"}},
    })


def step_metrics(step: int, loss: float) -> dict[str, Any]:
    return {"step": step, "epoch": 0, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_second": 100.0,
            "tokens_per_second_per_device": 100.0, "mfu": None, "peak_memory_bytes": 2**20, "step_seconds": 0.1}


def attempt(cfg: TrainingJobConfig, resumed_at: int, steps: range, base: float) -> dict[str, str]:
    """One attempt's tracking as the trainer's rank 0 does it: start at the resumed step, a
    point per step, an eval every 4th, close."""
    infos: list[dict[str, str]] = []
    tracker = tracking.start(cfg, 2, resumed_at, lambda message: None, infos.append)
    assert tracker is not None
    for step in steps:
        tracker.step(step_metrics(step, base + step))
        if step % 4 == 0:
            tracker.eval(step, base + step + 0.5, 2.0)
    tracker.close("FINISHED")
    return infos[-1]


def test_one_run_per_fine_tune_across_attempts_and_no_point_twice(
    tmp_path: Path, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LLAMAFT_RUN_NAME", "llama-chat")
    monkeypatch.setenv("LLAMAFT_RUN_NAMESPACE", "team-a")
    monkeypatch.setenv("LLAMAFT_RUN_UID", "0c9a-uid-1")
    monkeypatch.setenv("LLAMAFT_IMAGE", "ghcr.io/llamaft/trainer:test")
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    cfg = config(tmp_path, mlflow_server.url, "attempts")
    first = attempt(cfg, 0, range(1, 7), 10.0)  # steps 1-6; the checkpoint was at step 4
    second = attempt(cfg, 4, range(5, 9), 20.0)  # resumed at 4: steps 5 and 6 trained again

    # MLflow: one run, its id the same for both attempts, each step once.
    [run] = mlflow_server.runs("attempts")
    assert first["mlflowRunId"] == second["mlflowRunId"] == run["info"]["run_id"]
    assert run["info"]["status"] == "FINISHED"
    losses = mlflow_server.history(run["info"]["run_id"], "train/loss")
    assert losses == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 14.0), (5, 15.0), (6, 16.0), (7, 27.0), (8, 28.0)]
    assert mlflow_server.history(run["info"]["run_id"], "eval/loss") == [(4, 14.5), (8, 28.5)]
    assert [s for s, _ in mlflow_server.history(run["info"]["run_id"], "train/learning_rate")] == list(range(1, 9))
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["training.learningRate"] == "0.001" and params["worldSize"] == "2"
    assert params["image"] == "ghcr.io/llamaft/trainer:test" and "versions.torch" in params
    assert params["tracking.mlflow.experiment"] == "attempts"

    # TensorBoard: its reader drops the first attempt's steps after the checkpoint (purge_step).
    scalars = tensorboard_scalars(Path(first["tensorboardDirectory"]))
    assert scalars["train/loss"] == [(1, 11.0), (2, 12.0), (3, 13.0), (4, 14.0), (5, 25.0), (6, 26.0), (7, 27.0), (8, 28.0)]
    assert scalars["eval/perplexity"] == [(4, 2.0), (8, 2.0)]

    # W&B offline: one run id for both attempts; steps 5 and 6 only from the first.
    runs = wandb_offline_runs(tmp_path / "ckpt" / "wandb")
    assert len(runs) == 2 and {r["id"] for r in runs} == {first["wandbRunId"]} == {second["wandbRunId"]}
    history = {step: row["train/loss"] for r in runs for step, row in r["history"].items() if "train/loss" in row}
    assert history == {1: 11.0, 2: 12.0, 3: 13.0, 4: 14.0, 5: 15.0, 6: 16.0, 7: 27.0, 8: 28.0}
    assert runs[0]["config"]["training.learningRate"] == "0.001"

    # Secrets: in no parameter, no config, nothing the trackers or the trainer wrote.
    written = json.dumps(run) + json.dumps([r["config"] for r in runs]) + json.dumps(first) + json.dumps(second)
    written += "".join(p.read_bytes().decode(errors="replace") for p in (tmp_path / "ckpt").rglob("*") if p.is_file())
    for value in SECRETS.values():
        assert value not in written


def test_a_tracker_that_disappears_mid_run_never_stops_training(
    tmp_path: Path, tiny_model: Path, mlflow_server: MlflowServer,
) -> None:
    """A real trainer run (torchrun, 2 ranks) whose MLflow server goes away (every connection
    cut and refused) once it holds a few points: the run trains every step and warns in its log;
    the server holds a prefix of the steps, each once."""
    gate = Gate(mlflow_server.port)
    steps = 200
    cfg = {
        "model": {"source": str(tiny_model), "dtype": "float32"},
        "dataset": {"format": "samsum", "source": str(DATASET), "maxSeqLength": 64, "validationSplit": 0.1},
        "training": {"maxSteps": steps, "learningRate": 1e-3, "evalInterval": 0},
        "fsdp": {"mixedPrecision": "fp32", "activationCheckpointing": {"mode": "none"}},
        "checkpointing": {"directory": str(tmp_path / "ckpt"), "everyNSteps": 1000, "async": False,
                          "exportHuggingFace": False},
        "tracking": {"mlflow": {"trackingUri": gate.url, "experiment": "dying"}},
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.Popen(
        torchrun_cmd(2, "-m", "llamaft_trainer", "--config", str(path)), cwd=REPO,
        env=trainer_env(LLAMAFT_RUN_NAME="dying", LLAMAFT_RUN_UID="uid-dying", **SECRETS),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    gone_at: int | None = None
    try:
        for line in proc.stdout:
            lines.append(line)
            event = parse_event(line)
            if gone_at is None and event is not None and event["event"] == "step" and _points(mlflow_server, "dying") >= 3:
                gone_at = event["step"]
                gate.close()  # the tracker disappears; the trainer is mid-run
        assert proc.wait(600) == 0, "".join(lines[-40:])
    finally:
        gate.close()
        if proc.poll() is None:
            proc.kill()
    assert gone_at is not None and gone_at < steps, "the server went away before the run ended"
    events = read_events(lines)
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, steps + 1)), "every step ran"
    warnings = [e["warning"] for e in events if e["event"] == "tracking" and "warning" in e]
    assert warnings and warnings[0].startswith("mlflow: "), warnings
    [run] = mlflow_server.runs("dying")
    logged = [s for s, _ in mlflow_server.history(run["info"]["run_id"], "train/loss")]
    assert len(logged) >= 3 and logged == list(range(1, len(logged) + 1)) and len(logged) < steps
    output = "".join(lines)
    for value in SECRETS.values():
        assert value not in output


def _points(server: MlflowServer, experiment: str) -> int:
    """How many train/loss points the server holds for the experiment's run (0 before it has one)."""
    try:
        runs = server.runs(experiment)
    except OSError:  # urllib's HTTPError (no such experiment yet) is an OSError
        return 0
    return len(server.history(runs[0]["info"]["run_id"], "train/loss")) if runs else 0


def test_params_are_the_whole_spec_when_the_operator_mounts_it(tmp_path: Path) -> None:
    """The pod's /etc/llamaft/spec.json (LLAMAFT_SPEC): cluster fields the trainer's config leaves
    out (a sweep's runs differ in cluster.workers) are parameters too; a missing or unreadable file
    falls back to the trainer's part, never an error."""
    from llamaft.api.validation import validate_spec
    from llamaft.render import desired
    from llamaft.render.naming import Owner

    spec = validate_spec({"model": {"source": "meta-llama/Llama-2-7b-hf", "hfTokenSecret": {"name": "hf", "key": "token"}},
                          "dataset": {"source": "Samsung/samsum", "format": "samsum"}, "training": {"maxSteps": 5},
                          "cluster": {"workers": 16, "gpusPerWorker": 8, "instanceType": "p5.48xlarge"}})
    mounted = tmp_path / "spec.json"
    mounted.write_text(desired.config_map(Owner("blog", "ns", "u"), spec)["data"]["spec.json"])
    whole = tracking.params(spec.training_config(), 128, tracking.whole_spec(str(mounted)))
    assert whole["cluster.workers"] == "16" and whole["cluster.instanceType"] == "p5.48xlarge"
    assert whole["training.maxSteps"] == "5" and whole["worldSize"] == "128"
    assert whole["model.hfTokenSecret.name"] == "hf", "a Secret by its name, never its value"
    part = tracking.params(spec.training_config(), 128, tracking.whole_spec(str(tmp_path / "absent.json")))
    assert "cluster.workers" not in part and part["training.maxSteps"] == "5"
    (tmp_path / "bad.json").write_text("{not json")
    assert tracking.whole_spec(str(tmp_path / "bad.json")) is None


DPO_STEP = {"rewards/chosen": 0.5, "rewards/rejected": -0.25, "rewards/accuracies": 0.75, "rewards/margins": 0.75,
            "logps/chosen": -12.0, "logps/rejected": -20.0}
DPO_EVAL = {"eval_loss": 0.5, "eval_rewards/chosen": 0.25, "eval_rewards/rejected": -0.5, "eval_rewards/accuracies": 0.875,
            "eval_rewards/margins": 0.75, "eval_logps/chosen": -11.0, "eval_logps/rejected": -21.0}


def test_dpo_rewards_and_logps_reach_every_tracker_under_trls_names(
    tmp_path: Path, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DPO run's step and eval events (train.py's figures, dpo_step.evaluate's report) through
    the trainer's own path (metrics.ProgressPublisher -> Tracker): TRL's names under train/ and eval/, as
    transformers' trackers log DPOTrainer's; an SFT step logs no reward."""
    from llamaft_trainer.report.metrics import ProgressPublisher

    monkeypatch.setenv("LLAMAFT_RUN_NAME", "dpo-run")
    cfg = config(tmp_path, mlflow_server.url, "dpo")
    infos: list[dict[str, str]] = []
    tracker = tracking.start(cfg, 1, 0, lambda message: None, infos.append)
    assert tracker is not None
    progress = ProgressPublisher()
    progress.trackers.append(tracker)
    progress.record_step({**step_metrics(1, 0.69), "tokens": 64})  # an SFT-shaped step: no reward keys
    progress.record_step({**step_metrics(2, 0.6), "tokens": 64, **DPO_STEP})
    progress.record_dpo_eval(2, DPO_EVAL)
    tracker.close("FINISHED")
    info = infos[-1]
    train = {f"train/{k}": v for k, v in DPO_STEP.items()}
    evals = {f"eval/{k.removeprefix('eval_')}": v for k, v in DPO_EVAL.items()}
    assert "eval/rewards/accuracies" in evals and "eval/perplexity" not in evals

    [run] = mlflow_server.runs("dpo")
    for name, value in {**train, **evals}.items():
        assert mlflow_server.history(run["info"]["run_id"], name) == [(2, value)], name
    assert mlflow_server.history(run["info"]["run_id"], "train/loss") == [(1, 0.69), (2, 0.6)]

    scalars = tensorboard_scalars(Path(info["tensorboardDirectory"]))
    for name, value in {**train, **evals}.items():
        assert scalars[name] == [(2, value)], name
    assert "eval/perplexity" not in scalars

    [wandb_run] = wandb_offline_runs(tmp_path / "ckpt" / "wandb")
    history = wandb_run["history"]
    assert not any(k.startswith("train/rewards") for k in history[1])
    # W&B keeps a name with slashes as nested keys: "train/rewards/chosen" reads back joined by "/".
    assert {k: v for k, v in history[2].items() if k in train or k in evals} == {**train, **evals}
