"""`llamaft run --local`: torchrun "nodes" on this machine rendezvous through a real etcd (Debian
etcd-server, v2 API on) or c10d, and train."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from llamaft.cli import main as cli
from llamaft.local import STOP_MARGIN_S
from llamaft_trainer.checkpoint.dcp import Checkpointer
from llamaft_trainer.report.logline import read_events

from tests.conftest import REPO, need_etcd
from tests.trackers import tensorboard_scalars
from tests.trainer.conftest import DATASET, trainer_env

pytestmark = pytest.mark.slow


def finetune(model: Path, tmp: Path, name: str, **spec: Any) -> Path:
    body = {
        "apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune", "metadata": {"name": name},
        "spec": {
            "model": {"source": str(model), "dtype": "float32"},
            "dataset": {"format": "samsum", "source": str(DATASET), "maxSeqLength": 64, "packing": True},
            "training": {"maxSteps": 4, "perDeviceBatchSize": 2, "learningRate": 2e-3, "evalInterval": 0},
            "fsdp": {"mixedPrecision": "fp32", "activationCheckpointing": {"mode": "none"}},
            "checkpointing": {"directory": str(tmp / name / "checkpoints"), "exportHuggingFace": False},
            "cluster": {"workers": 2, "gpusPerWorker": 0},
            **spec,
        },
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def events(run_dir: Path) -> list[dict[str, Any]]:
    """Rank 0's events, from whichever worker's log holds them (the rendezvous assigns ranks)."""
    return [e for log in sorted(run_dir.glob("worker-*.log")) for e in read_events(log)]


def test_two_nodes_rendezvous_through_etcd_v2_and_train_hybrid(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    need_etcd()
    path = finetune(tiny_model, tmp_path, "etcd-v2-hsdp", fsdp={"shardingStrategy": "HYBRID_SHARD", "mixedPrecision": "fp32"},
                    rendezvous={"backend": "etcd-v2"})
    run_dir = tmp_path / "run-v2"
    assert cli(["run", "--local", str(path), "--nproc-per-worker", "2", "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "started a local etcd at 127.0.0.1:" in out and "2 worker(s) x 2 process(es)" in out
    setup = [e for e in events(run_dir) if e["event"] == "setup"][0]
    assert setup["world_size"] == 4 and setup["strategy"] == "HYBRID_SHARD"
    losses = [e["loss"] for e in events(run_dir) if e["event"] == "step"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert "step     4/4" in out
    # TensorBoard by default, with the line that shows it; what its reader sees is what was logged.
    board = tmp_path / "etcd-v2-hsdp" / "checkpoints" / "tensorboard"
    assert f"llamaft: TensorBoard: tensorboard --logdir {board}" in out
    assert [v for _, v in tensorboard_scalars(board)["train/loss"]] == pytest.approx(losses, rel=1e-5)


def test_legacy_etcd_backend(tiny_model: Path, tmp_path: Path) -> None:
    need_etcd()
    path = finetune(tiny_model, tmp_path, "etcd-legacy", rendezvous={"backend": "etcd"})
    run_dir = tmp_path / "run-legacy"
    assert cli(["run", "--local", str(path), "--run-dir", str(run_dir)]) == 0
    assert [e["world_size"] for e in events(run_dir) if e["event"] == "setup"] == [2]


def test_a_local_dpo_run_ends_with_its_reward_figures(tiny_model: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """examples/tiny-dpo.yaml, shortened (6 steps on its first 64 pairs, this test's model and
    folder): the step lines show the reward accuracy, and the last line says the final figures as
    the operator's Succeeded condition words them (the last step's reward accuracy and margin, the
    last eval's on the held-out pairs)."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join((REPO / "examples" / "data" / "preference-tiny.jsonl").read_text().splitlines(True)[:64]))
    body = yaml.safe_load((REPO / "examples" / "tiny-dpo.yaml").read_text())
    spec = body["spec"]
    spec["model"]["source"] = str(tiny_model)
    spec["dataset"]["source"] = str(pairs)
    spec["training"].update({"maxSteps": 6, "evalInterval": 6, "logInterval": 3})
    spec["checkpointing"].update({"directory": str(tmp_path / "dpo" / "checkpoints"), "exportHuggingFace": False})
    path = tmp_path / "tiny-dpo.yaml"
    path.write_text(yaml.safe_dump(body))
    run_dir = tmp_path / "run-dpo"
    assert cli(["run", "--local", str(path), "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    steps = [e for e in events(run_dir) if e["event"] == "step"]
    last, held = steps[-1], [e for e in events(run_dir) if e["event"] == "eval"][-1]
    assert f"| reward acc {last['rewards/accuracies']:.3f} |" in out
    assert (f"llamaft: done: loss {steps[0]['loss']:.4f} -> {last['loss']:.4f}, reward accuracy "
            f"{last['rewards/accuracies']:.3f} (margin {last['rewards/margins']:.3f}); held out: loss "
            f"{held['eval_loss']:.4f}, reward accuracy {held['eval_rewards/accuracies']:.3f} "
            f"(margin {held['eval_rewards/margins']:.3f})\n") in out


def test_missing_model_points_at_make_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = finetune(tmp_path / "nowhere", tmp_path, "missing", rendezvous={"backend": "c10d"})
    assert cli(["run", "--local", str(path)]) == 2
    assert "llamaft make-tiny-model" in capsys.readouterr().err


def test_run_without_local_explains_the_cluster_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["run", str(tmp_path / "x.yaml")]) == 2
    assert "kubectl apply -f" in capsys.readouterr().err


def test_failed_run_reports_and_returns_nonzero(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = finetune(tiny_model, tmp_path, "bad-data", dataset={"format": "jsonl", "source": str(DATASET), "promptTemplate": "{question}\n", "maxSeqLength": 64},
                    rendezvous={"backend": "c10d", "maxRestarts": 0}, cluster={"workers": 1, "gpusPerWorker": 0})
    assert cli(["run", "--local", str(path), "--run-dir", str(tmp_path / "bad")]) == 2  # the trainer's code
    captured = capsys.readouterr()
    assert f"error: spec.dataset: {DATASET} line 1 has no field(s) ['question', 'output']" in captured.out
    assert "the run failed (exit 2)" in captured.err
    assert captured.err.strip().splitlines()[-1].startswith("llamaft: error: ConfigError: spec.dataset: ")


# ------------------------------------------------------------------ interrupts leave nothing behind
KILL_SEED = int(os.environ.get("LLAMAFT_KILL_SEED", "15"))  # fixed in CI; set it to explore other moments
TRIALS = [(signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM"), (signal.SIGKILL, "killed outright")]
GRACE_S = 5


def _tree_of(marker: str) -> list[psutil.Process]:
    """Agents and trainers of one run: their command lines carry its config path."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            pass
    return found


@pytest.mark.parametrize("trial", range(len(TRIALS)))
def test_an_interrupt_at_a_random_point_leaves_no_process(tiny_model: Path, tmp_path: Path, trial: int) -> None:
    """`llamaft run --local` (2 agents, 2 trainers) gets Ctrl-C, SIGTERM or SIGKILL at a random
    moment (start-up, rendezvous, model loading, training, a save): afterwards no agent or trainer
    is left, and an interrupted run names the step a rerun resumes from (the newest complete
    checkpoint, or none)."""
    signum, what = TRIALS[trial]
    delay = random.Random(KILL_SEED * 100 + trial).uniform(0.5, 14.0)
    path = finetune(tiny_model, tmp_path, f"interrupt-{trial}", training={"maxSteps": 100_000, "perDeviceBatchSize": 2,
                    "learningRate": 2e-3, "evalInterval": 0}, rendezvous={"backend": "c10d"},
                    checkpointing={"directory": str(tmp_path / "ck"), "everyNSteps": 20, "exportHuggingFace": False},
                    # The grace period is the agents' TORCH_ELASTIC_SHUTDOWN_TIMEOUT, as in the pod (the
                    # launch sets it from the spec: an environment variable of this process does not
                    # reach them), and the runner's SIGKILL comes STOP_MARGIN_S after it.
                    cluster={"workers": 2, "gpusPerWorker": 0, "terminationGracePeriodSeconds": GRACE_S})
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("llamaft")), "run", "--local", str(path), "--run-dir", str(run_dir)],
        env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
    )
    marker = str(run_dir / "config.json")
    try:
        time.sleep(delay)
        assert proc.poll() is None, "the run ended before the signal"
        started = time.monotonic()
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - started
        deadline = time.monotonic() + (15 if signum == signal.SIGKILL else 0)
        while _tree_of(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _tree_of(marker)
    finally:
        for leftover in _tree_of(marker):
            with contextlib.suppress(psutil.Error):
                leftover.kill()
        if proc.poll() is None:
            proc.kill()
    context = f"{what} after {delay:.1f} s (seed {KILL_SEED}): {err[-2000:]}"
    assert not left, f"left running after {context}: {[p.pid for p in left]}"
    if signum == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        return
    assert proc.returncode == 128 + signum, context
    assert took < GRACE_S + STOP_MARGIN_S + 10, context  # torchrun's shutdown timeout + the runner's margin + slack
    note = err.strip().splitlines()[-1]
    latest = Checkpointer(str(tmp_path / "ck"), 1, 0).latest()
    if "before the run started" in note:
        assert latest is None, context
    elif latest is None:
        assert "no complete checkpoint" in note and "starts from step 0" in note, context
    else:
        assert f"resumes from step {latest} ({tmp_path / 'ck'}/step-{latest:08d})" in note, context


def test_ctrl_c_is_reported_as_interrupted_and_says_what_a_second_one_does(tiny_model: Path, tmp_path: Path) -> None:
    """A user's Ctrl-C reaches the trainers as SIGINT (not the kubelet's SIGTERM): they stop after
    their step and save, and the run is reported Interrupted (exit 130), not Preempted; the line
    printed at the Ctrl-C says what a second one does. Before the first step the phase of the
    start-up is shown with its seconds."""
    path = finetune(tiny_model, tmp_path, "ctrl-c", training={"maxSteps": 100_000, "perDeviceBatchSize": 2,
                    "learningRate": 2e-3, "evalInterval": 0, "logInterval": 1}, rendezvous={"backend": "c10d"},
                    checkpointing={"directory": str(tmp_path / "ck"), "exportHuggingFace": False},
                    cluster={"workers": 1, "gpusPerWorker": 0})
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("llamaft")), "run", "--local", str(path), "--run-dir", str(run_dir)],
        env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
    )
    # One reader per pipe, and nothing else reads them (communicate() would take lines from under
    # the stdout reader and the checks below would miss them).
    lines: list[str] = []
    errors: list[str] = []
    assert proc.stdout is not None and proc.stderr is not None
    readers = [threading.Thread(target=lambda pipe=pipe, into=into: into.extend(iter(pipe.readline, "")), daemon=True)
               for pipe, into in ((proc.stdout, lines), (proc.stderr, errors))]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith("step ") for line in lines) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert any(line.startswith("step ") for line in lines), "".join(lines)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
        for reader in readers:
            reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    out, err = "".join(lines), "".join(errors)
    assert proc.returncode == 130, err
    assert "press Ctrl-C again to kill them at once" in err, err
    assert "SIGINT: stopping after step" in out and "interrupted at step" in out, out
    assert "Preempted" not in out + err, out + err
    report = json.loads((run_dir / "termination-0.json").read_text())
    assert (report["reason"], report["exitCode"], report["retryable"]) == ("Interrupted", 130, True)
    assert report["message"].startswith("SIGINT: stopped after step")
    shown = [line for line in out.splitlines() if line.startswith("llamaft: ") and line.endswith(" s")]
    assert [line.rsplit(" ", 2)[0] for line in shown] == [
        "llamaft: starting workers", "llamaft: loading the tokenizer and preparing the data", "llamaft: loading the model",
        "llamaft: training: the first steps"], out
