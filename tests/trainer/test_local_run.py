"""`llamaft run --local`: torchrun "nodes" on this machine rendezvous through a real etcd (Debian
etcd-server, v2 API on) or c10d, and train."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from llamaft.cli import main as cli

from tests.conftest import need_etcd
from tests.trainer.conftest import DATASET

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
    lines = [line for log in sorted(run_dir.glob("worker-*.log")) for line in log.read_text().splitlines()]
    return [json.loads(line) for line in lines if line.startswith("{")]


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


def test_legacy_etcd_backend(tiny_model: Path, tmp_path: Path) -> None:
    need_etcd()
    path = finetune(tiny_model, tmp_path, "etcd-legacy", rendezvous={"backend": "etcd"})
    run_dir = tmp_path / "run-legacy"
    assert cli(["run", "--local", str(path), "--run-dir", str(run_dir)]) == 0
    assert [e["world_size"] for e in events(run_dir) if e["event"] == "setup"] == [2]


def test_missing_model_points_at_make_tiny_model(tmp_path: Path) -> None:
    path = finetune(tmp_path / "nowhere", tmp_path, "missing", rendezvous={"backend": "c10d"})
    with pytest.raises(SystemExit, match="llamaft make-tiny-model"):
        cli(["run", "--local", str(path)])


def test_run_without_local_explains_the_cluster_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["run", str(tmp_path / "x.yaml")]) == 2
    assert "kubectl apply -f" in capsys.readouterr().err


def test_failed_run_reports_and_returns_nonzero(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = finetune(tiny_model, tmp_path, "bad-data", dataset={"format": "jsonl", "source": str(DATASET), "promptTemplate": "{question}\n", "maxSeqLength": 64},
                    rendezvous={"backend": "c10d", "maxRestarts": 0}, cluster={"workers": 1, "gpusPerWorker": 0})
    assert cli(["run", "--local", str(path), "--run-dir", str(tmp_path / "bad")]) != 0
    captured = capsys.readouterr()
    assert "error: spec.dataset: record 0" in captured.out
    assert "the run failed" in captured.err
