"""Trainer test helpers: a torchrun launcher, the multi-config harness runner and a base config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from llamaft_trainer.data import streaming
from llamaft_trainer.process.local_etcd import free_port
from llamaft_trainer.process.runtime import Runtime
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.conftest import REPO
from tests.tiers import starts_processes

DATASET = REPO / "examples" / "data" / "samsum-tiny.jsonl"
HARNESS = Path(__file__).with_name("harness.py")


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> PreTrainedTokenizerBase:
    """The tiny model's tokenizer, as the trainer loads it."""
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(tiny_model)
    return tokenizer


@pytest.fixture
def small_stream_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Streaming shuffle windows of 50 records: the tiny sets (320 records) span several windows
    and end in a partial one."""
    monkeypatch.setattr(streaming, "WINDOW", 50)


def cpu_runtime(rank: int, world: int = 2) -> Runtime:
    """Rank `rank` of `world` as the data code sees it, without a process group."""
    return Runtime(rank=rank, local_rank=rank, world_size=world, local_world_size=world, device=torch.device("cpu"))



def trainer_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "operator"), str(REPO / "trainer")])
    # Never the machine's /dev/termination-log: each launch gets its own file unless a test names one.
    env["LLAMAFT_TERMINATION_LOG"] = tempfile.mkstemp(prefix="termination-", suffix=".log")[1]
    env.update(extra)
    return env


@starts_processes
def torchrun_cmd(nproc: int, *args: str, port: int | None = None) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port or free_port()}", *args,
    ]


@starts_processes
def run_harness(tmp: Path, nproc: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    cases_file, out_file = tmp / f"cases-{nproc}.json", tmp / f"out-{nproc}.json"
    cases_file.write_text(json.dumps(cases))
    proc = subprocess.run(
        torchrun_cmd(nproc, str(HARNESS), str(cases_file), str(out_file)),
        env=trainer_env(), capture_output=True, text=True, timeout=900, cwd=REPO,
    )
    (tmp / f"log-{nproc}.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"torchrun failed, full log: {tmp}/log-{nproc}.txt\n" + proc.stderr[-3000:]
    return dict(json.loads(out_file.read_text()))


def base_config(model: Path, checkpoint_dir: Path, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": {"source": str(model), "dtype": "float32"},
        "dataset": {"format": "samsum", "source": str(DATASET), "maxSeqLength": 64, "packing": True, "validationSplit": 0.1},
        "training": {"maxSteps": 4, "perDeviceBatchSize": 2, "learningRate": 2e-3, "evalInterval": 0, "seed": 7},
        "fsdp": {"mixedPrecision": "fp32", "activationCheckpointing": {"mode": "none"}},
        "checkpointing": {"directory": str(checkpoint_dir), "everyNSteps": 1000, "exportHuggingFace": False, "resume": False},
    }
    for key, value in overrides.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


@starts_processes
def launch_trainer(config: dict[str, Any], tmp: Path, name: str, nproc: int = 2) -> subprocess.Popen[str]:
    """`torchrun -m llamaft_trainer` on a config written to tmp/<name>.json, output on stdout."""
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(config))
    return subprocess.Popen(
        torchrun_cmd(nproc, "-m", "llamaft_trainer", "--config", str(path)), env=trainer_env(), cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )


def kill_tree(proc: subprocess.Popen[str]) -> None:
    """SIGKILL torchrun and its workers (each in its own session: a process-group kill misses them)."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.wait(30)
