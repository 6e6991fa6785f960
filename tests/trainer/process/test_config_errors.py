"""Bad configuration fails before any training step, with a message naming the field."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from llamaft.api.spec import TrainingJobConfig
from llamaft_trainer.main import load_config, setup
from llamaft_trainer.process.errors import EXIT_CONFIG_ERROR, ConfigError
from llamaft_trainer.process.runtime import Runtime

from tests.conftest import REPO
from tests.trainer.conftest import base_config, trainer_env

# No process group is needed: every check below runs before the first collective.
SOLO = Runtime(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))


def _cfg(model: Path, tmp: Path, **overrides: Any) -> TrainingJobConfig:
    return TrainingJobConfig.model_validate(base_config(model, tmp / "ck", **overrides))


def test_unknown_dataset_field(tiny_model: Path, tmp_path: Path) -> None:
    cfg = _cfg(tiny_model, tmp_path, dataset={"format": "jsonl", "promptTemplate": "{question}\n"})
    with pytest.raises(ConfigError, match=r"no field\(s\) \['question', 'output'\]"):
        setup(cfg, SOLO)


def test_sequence_length_over_the_model_limit(tiny_model: Path, tmp_path: Path) -> None:
    cfg = _cfg(tiny_model, tmp_path, dataset={"maxSeqLength": 1024})
    with pytest.raises(ConfigError, match="spec.dataset.maxSeqLength: 1024 exceeds .* 512"):
        setup(cfg, SOLO)


def test_missing_tokenizer(tiny_model: Path, tmp_path: Path) -> None:
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model / name, bare / name)
    with pytest.raises(ConfigError, match="(?s)no usable tokenizer .* set spec.model.tokenizer"):
        setup(_cfg(bare, tmp_path), SOLO)


def test_unreadable_model_path(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="spec.model.source: .*absent does not exist"):
        setup(_cfg(tmp_path / "absent", tmp_path), SOLO)


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": {"source": "x"}}))
    with pytest.raises(ConfigError, match="dataset"):
        load_config(bad)


def test_main_exits_with_the_permanent_config_code(tiny_model: Path, tmp_path: Path) -> None:
    """The entry point turns a ConfigError into exit 2 (permanent under the ExitCode restart
    policy), one JSON error line, and a termination message for the operator."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(base_config(tiny_model, tmp_path / "ck", dataset={"maxSeqLength": 1024})))
    termination = tmp_path / "termination.json"
    proc = subprocess.run(
        [sys.executable, "-m", "llamaft_trainer", "--config", str(config)],
        env=trainer_env(LLAMAFT_TERMINATION_LOG=str(termination), MASTER_PORT="0"),
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == EXIT_CONFIG_ERROR, proc.stderr[-2000:]
    assert "configuration error: spec.dataset.maxSeqLength" in proc.stderr
    doc = json.loads(termination.read_text())
    assert doc["phase"] == "Failed" and doc["reason"] == "ConfigError"


def test_model_from_an_fsspec_uri_is_staged_once_and_loads(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """s3://-style sources go through fsspec into a node-local cache (file:// here, same code)."""
    from llamaft_trainer.model import model as model_step
    from llamaft_trainer.sources import downloads

    monkeypatch.setattr(downloads, "CACHE_ROOT", tmp_path / "cache")
    cfg = _cfg(tiny_model, tmp_path)
    cfg.model.source = f"file://{tiny_model}"
    where = downloads.resolve(cfg.model.source, SOLO, "spec.model.source")
    assert Path(where, "config.json").exists() and Path(where, ".complete").exists()
    assert model_step.load_model_config(cfg.model, SOLO).num_hidden_layers == 4
    assert model_step.load_tokenizer(cfg.model, SOLO).eos_token == "</s>"
    with pytest.raises(ConfigError, match="cannot read file:///nowhere"):
        downloads.resolve("file:///nowhere", SOLO, "spec.model.source")
