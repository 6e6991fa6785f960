"""A resumed run is bit-identical to an uninterrupted one, in every mode.

1. The case of issue 15, under real torchrun: LoRA with dropout 0.1 (dropout draws from the RNG on
   every step), SIGKILLed after step 25, resumed from its step-20 checkpoint: the loss and grad-norm
   trace of steps 21-30, the eval losses and the exported adapter's sha256 equal the straight run's.
2. The same guarantee across strategies, precisions, packing/padding, activation checkpointing,
   accumulation and an epoch boundary inside the resumed part: in one torchrun launch (harness.py),
   each configuration runs straight, stops after a checkpoint, and resumes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from llamaft_trainer.report.logline import parse_event, read_events

from tests.trainer.conftest import (
    DATASET,
    base_config,
    kill_tree,
    launch_trainer,
    run_harness,
)

STEPS, EVERY, KILL_AT = 30, 10, 25
LORA = {"r": 4, "alpha": 8, "dropout": 0.1, "targetModules": ["q_proj", "v_proj"]}


def _config(model: Path, directory: Path) -> dict[str, Any]:
    return base_config(
        model, directory,
        training={"maxSteps": STEPS, "learningRate": 1e-2, "evalInterval": EVERY, "lora": LORA},
        checkpointing={"everyNSteps": EVERY, "keepLast": 3, "resume": True, "exportHuggingFace": True},
    )


def _run(config: dict[str, Any], tmp: Path, name: str) -> list[dict[str, Any]]:
    proc = launch_trainer(config, tmp, name)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, out[-5000:]
    return read_events(out)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def lora_runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("exact")
    straight = _run(_config(tiny_model, tmp / "straight"), tmp, "straight")
    killed_dir = tmp / "killed"
    proc = launch_trainer(_config(tiny_model, killed_dir), tmp, "killed")
    killed: list[dict[str, Any]] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            event = parse_event(line)
            if event is not None:
                killed.append(event)
                # Checkpoints are written in the background (checkpointing.async): kill once step-20
                # is complete (its `checkpoint` line), at step 25 or the first step after it.
                saved = any(e["event"] == "checkpoint" and e["step"] == 2 * EVERY for e in killed)
                if saved and killed[-1]["event"] == "step" and killed[-1]["step"] >= KILL_AT:
                    break
    finally:
        kill_tree(proc)  # like a node loss: no clean-up of any kind
    resumed = _run(_config(tiny_model, killed_dir), tmp, "resumed")
    return {"straight": straight, "killed": killed, "resumed": resumed, "tmp": tmp}


def _trace(events: list[dict[str, Any]], kind: str, *keys: str) -> dict[int, tuple[Any, ...]]:
    return {e["step"]: tuple(e[k] for k in keys) for e in events if e["event"] == kind}


def test_lora_with_dropout_resumes_bit_identically(lora_runs: dict[str, Any]) -> None:
    killed = _trace(lora_runs["killed"], "step", "loss")
    assert KILL_AT <= max(killed) < STEPS
    resume = [e for e in lora_runs["resumed"] if e["event"] == "resume"]
    assert [e["step"] for e in resume] == [20], "resumed from the newest complete checkpoint before the kill"
    straight = _trace(lora_runs["straight"], "step", "loss", "grad_norm")
    again = _trace(lora_runs["resumed"], "step", "loss", "grad_norm")
    assert sorted(again) == list(range(21, STEPS + 1))
    # Logged values (6 decimals) are compared exactly; the adapter below compares every bit.
    assert {s: straight[s] for s in again} == again
    # Steps the killed run made after its checkpoint replay exactly too.
    assert all(killed[s] == straight[s][:1] for s in range(21, max(killed) + 1))
    evals = _trace(lora_runs["straight"], "eval", "eval_loss")
    assert {s: v for s, v in evals.items() if s > 20} == _trace(lora_runs["resumed"], "eval", "eval_loss")


def test_the_resumed_adapter_has_the_same_sha256(lora_runs: dict[str, Any]) -> None:
    tmp = lora_runs["tmp"]
    a = tmp / "straight" / "export" / "adapter_model.safetensors"
    b = tmp / "killed" / "export" / "adapter_model.safetensors"
    assert a.exists() and b.exists()
    assert _sha256(a) == _sha256(b)


# ------------------------------------------------------------------ every mode, one launch
SMALL_STEPS, SMALL_EVERY, SMALL_STOP = 8, 3, 5
MODES: dict[str, dict[str, Any]] = {
    # LoRA dropout, bf16, padding instead of packing
    "lora-bf16-padding": {"fsdp": {"mixedPrecision": "bf16"}, "dataset": {"packing": False},
                          "training": {"lora": LORA}},
    # a real replicate dimension (set_requires_all_reduce between micro-steps), an epoch boundary
    # after the checkpoint (a 40-record file: 4 steps per epoch), dropout
    "lora-hsdp-accumulation-epochs": {
        "fsdp": {"shardingStrategy": "HYBRID_SHARD", "hybridShard": {"shardGroupSize": 1, "replicaGroupSize": 2}},
        "dataset": {"packing": False, "source": "SMALL"},
        "training": {"lora": LORA, "perDeviceBatchSize": 2, "gradientAccumulationSteps": 2}},
    "lora-shard-grad-op-ac-full": {"fsdp": {"shardingStrategy": "SHARD_GRAD_OP", "mixedPrecision": "bf16",
                                            "activationCheckpointing": {"mode": "full", "everyNLayers": 1}},
                                   "training": {"lora": {**LORA, "dropout": 0.2}}},
    "full-no-shard-selective-ac": {"fsdp": {"shardingStrategy": "NO_SHARD",
                                            "activationCheckpointing": {"mode": "selective", "everyNLayers": 2}}},
    "full-fsdp1-accumulation": {"fsdp": {"implementation": "fsdp1"}, "training": {"gradientAccumulationSteps": 2}},
    # dataset.streaming: the position is (epoch, micro-batch) of one global stream; packing, and an
    # epoch boundary after the checkpoint with padding (the 40-record file)
    "streaming-packing": {"dataset": {"streaming": True}},
    "streaming-padding-epochs": {"dataset": {"streaming": True, "packing": False, "source": "SMALL"},
                                 "training": {"lora": LORA, "perDeviceBatchSize": 4}},
}


def _mode_config(model: Path, directory: Path, mode: dict[str, Any], small: Path, *, resume: bool) -> dict[str, Any]:
    overrides = json.loads(json.dumps(mode).replace('"SMALL"', json.dumps(str(small))))
    training = {"maxSteps": SMALL_STEPS, "evalInterval": 0, **overrides.pop("training", {})}
    return base_config(
        model, directory, training=training,
        checkpointing={"everyNSteps": SMALL_EVERY, "keepLast": 3, "resume": resume}, **overrides,
    )


@pytest.fixture(scope="module")
def modes(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("modes")
    small = tmp / "small.jsonl"
    small.write_text("".join(DATASET.read_text().splitlines(keepends=True)[:40]))
    cases = []
    for name, mode in MODES.items():
        cases += [
            {"name": f"{name}/straight", "config": _mode_config(tiny_model, tmp / name / "straight", mode, small, resume=False)},
            {"name": f"{name}/stopped", "steps": SMALL_STOP,
             "config": _mode_config(tiny_model, tmp / name / "stopped", mode, small, resume=False)},
            {"name": f"{name}/resumed", "config": _mode_config(tiny_model, tmp / name / "stopped", mode, small, resume=True)},
        ]
    return run_harness(tmp, 2, cases)


@pytest.mark.parametrize("name", list(MODES))
def test_every_mode_resumes_bit_identically(modes: dict[str, Any], name: str) -> None:
    straight, stopped, resumed = (modes[f"{name}/{part}"] for part in ("straight", "stopped", "resumed"))
    assert len(stopped["losses"]) == SMALL_STOP and len(straight["losses"]) == SMALL_STEPS
    start = SMALL_STEPS - len(resumed["losses"])
    assert start == SMALL_EVERY, "resumed from the checkpoint before the stop"
    assert resumed["losses"] == straight["losses"][start:]
    assert resumed["grad_norms"] == straight["grad_norms"][start:]
    assert resumed["checksum"] == straight["checksum"]
