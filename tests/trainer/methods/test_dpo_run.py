"""training.method dpo end to end through the trainer (torchrun, FSDP on CPU with gloo): preference
accuracy rises on a learnable set, 2 ranks equal 1, LoRA's reference is the adapter-disabled base, a
resumed run continues with the same losses (the precomputed reference read back), and a bad record
is a configuration error naming its file and line. Each mode's per-step equality with TRL's
DPOTrainer on the same batches is tests/trainer/methods/test_dpo_trl.py's.

The data is examples/data/preference-tiny.jsonl (generate_preference_tiny.py: chosen = the
dialogue's own summary, rejected = another dialogue's)."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.trainer.conftest import launch_trainer

PAIRS = REPO / "examples" / "data" / "preference-tiny.jsonl"
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


def dpo_config(model: Path, directory: Path, source: Path = PAIRS, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": {"source": str(model), "dtype": "float32"},
        "dataset": {"format": "preference", "source": str(source), "maxSeqLength": 128, "packing": False,
                    "validationSplit": 0.1},
        "training": {"method": "dpo", "dpo": {"beta": 0.1}, "maxSteps": 4, "perDeviceBatchSize": 8,
                     "learningRate": 1e-3, "scheduler": "constant", "evalInterval": 0, "logInterval": 1, "seed": 7},
        "fsdp": {"mixedPrecision": "fp32", "activationCheckpointing": {"mode": "none"}},
        "checkpointing": {"directory": str(directory), "everyNSteps": 1000, "exportHuggingFace": False, "resume": False},
    }
    for key, value in overrides.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def train(config: dict[str, Any], tmp: Path, name: str, nproc: int = 1) -> tuple[int, list[dict[str, Any]], str]:
    """(exit code, JSON events of rank 0, the whole output)."""
    proc = launch_trainer(config, tmp, name, nproc)
    out, _ = proc.communicate(timeout=600)
    (tmp / f"{name}.log").write_text(out)
    events = []
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    return proc.returncode, events, out


def of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == kind]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def head(n: int, tmp: Path) -> Path:
    path = tmp / f"pairs-{n}.jsonl"
    path.write_text("".join(PAIRS.read_text().splitlines(keepends=True)[:n]))
    return path


def test_preference_accuracy_rises_on_a_learnable_set(tiny_model: Path, tmp_path: Path) -> None:
    cfg = dpo_config(tiny_model, tmp_path / "ck", training={"maxSteps": 60, "learningRate": 5e-4, "evalInterval": 30,
                                                            "logInterval": 5})
    rc, events, out = train(cfg, tmp_path, "learn")
    assert rc == 0, out[-3000:]
    steps, evals = of(events, "step"), of(events, "eval")
    assert [s["step"] for s in steps] == list(range(5, 65, 5))
    for s in steps:
        assert set(METRICS) <= set(s), s
    assert steps[-1]["loss"] < 0.3 < steps[0]["loss"]
    for e in evals:  # TRL's metrics on the held-out pairs, under TRL's eval_ names
        assert {f"eval_{m}" for m in METRICS} <= set(e), e
        assert e["eval_rewards/margins"] == pytest.approx(e["eval_rewards/chosen"] - e["eval_rewards/rejected"], abs=2e-6)
        assert e["eval_logps/chosen"] < 0 and e["eval_logps/rejected"] < 0
    assert evals[-1]["step"] == 60 and evals[-1]["eval_rewards/accuracies"] > 0.9
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] < math.log(2)
    reference = of(events, "reference")
    assert reference and reference[0]["reused"] is False and reference[0]["pairs"] == 320


def test_lora_trains_against_the_base_model_with_adapters_disabled(tiny_model: Path, tmp_path: Path) -> None:
    cfg = dpo_config(tiny_model, tmp_path / "ck", head(40, tmp_path),
                     training={"maxSteps": 6, "learningRate": 5e-3, "lora": {"enabled": True, "r": 8, "alpha": 16,
                                                                             "targetModules": ["q_proj", "v_proj"]}})
    rc, events, out = train(cfg, tmp_path, "lora")
    assert rc == 0, out[-3000:]
    assert not of(events, "reference")  # nothing precomputed, nothing stored: the base is the reference
    steps = of(events, "step")
    # LoRA's B starts at 0: at step 1 the policy IS the adapter-disabled base, so the rewards are 0.
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert steps[0]["rewards/chosen"] == steps[0]["rewards/rejected"] == 0.0
    assert any(abs(s["rewards/margins"]) > 1e-4 for s in steps[1:])
    assert min(s["loss"] for s in steps[1:]) < math.log(2)


LORA = {"enabled": True, "r": 8, "alpha": 16, "targetModules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_continues_with_the_losses_of_an_uninterrupted_run(tiny_model: Path, tmp_path: Path, lora: bool) -> None:
    """Bit for bit: full fine-tuning reads its precomputed reference back; LoRA's reference is the
    adapter-disabled base, so only the adapters and their optimizer state come from the checkpoint.
    The logged figures (6 decimals) agree exactly, and the exported weights (the whole model, or the
    adapter) have the same sha256."""
    source = head(48, tmp_path)
    training: dict[str, Any] = {"maxSteps": 6, "perDeviceBatchSize": 4, **({"lora": LORA} if lora else {})}
    checkpointing = {"everyNSteps": 3, "keepLast": 5, "exportHuggingFace": True}
    whole = dpo_config(tiny_model, tmp_path / "whole", source, training=training, checkpointing=checkpointing)
    rc, events, out = train(whole, tmp_path, "whole")
    assert rc == 0, out[-3000:]
    expected = {s["step"]: s for s in of(events, "step")}
    # The same run, stopped after its step-3 checkpoint: its directory without step 6 and the export.
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "step-00000006")
    shutil.rmtree(tmp_path / "resumed" / "export")
    resumed = dpo_config(tiny_model, tmp_path / "resumed", source, training=training,
                         checkpointing={**checkpointing, "resume": True})
    rc, events, out = train(resumed, tmp_path, "resumed")
    assert rc == 0, out[-3000:]
    assert of(events, "resume")[0]["step"] == 3
    if lora:
        assert not of(events, "reference")  # the base is the reference: nothing stored, nothing read
    else:
        assert of(events, "reference")[0]["reused"] is True  # read back, not scored again
    got = of(events, "step")
    assert [s["step"] for s in got] == [4, 5, 6]
    for s in got:
        assert s["loss"] == expected[s["step"]]["loss"]
        assert {k: s[k] for k in METRICS} == {k: expected[s["step"]][k] for k in METRICS}
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    assert _sha256(tmp_path / "resumed" / "export" / weights) == _sha256(tmp_path / "whole" / "export" / weights)


REFERENCES: dict[str, dict[str, Any]] = {"precomputed": {}, "live": {"dpo": {"beta": 0.1, "reference": "live"}}}
"""training overrides per dpo.reference (precomputed: the default)."""


@pytest.mark.parametrize("reference", list(REFERENCES))
def test_two_ranks_equal_one_on_the_same_global_batch(tiny_model: Path, tmp_path: Path, reference: str) -> None:
    source = head(8, tmp_path)
    one = dpo_config(tiny_model, tmp_path / "one", source, dataset={"validationSplit": 0},
                     training={**REFERENCES[reference], "maxSteps": 3})
    two = dpo_config(tiny_model, tmp_path / "two", source, dataset={"validationSplit": 0},
                     training={**REFERENCES[reference], "maxSteps": 3, "perDeviceBatchSize": 4})
    rc1, events1, out1 = train(one, tmp_path, "one", nproc=1)
    assert rc1 == 0, out1[-3000:]
    rc2, events2, out2 = train(two, tmp_path, "two", nproc=2)
    assert rc2 == 0, out2[-3000:]
    assert [s["step"] for s in of(events1, "step")] == [1, 2, 3]
    for a, b in zip(of(events1, "step"), of(events2, "step"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        for name in METRICS:
            assert b[name] == pytest.approx(a[name], rel=1e-5, abs=1e-5), name


def test_a_bad_preference_record_is_a_config_error_naming_file_and_line(tiny_model: Path, tmp_path: Path) -> None:
    lines = PAIRS.read_text().splitlines()[:20]
    bad = json.loads(lines[2])
    del bad["rejected"]
    lines[2] = json.dumps(bad)
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(lines) + "\n")
    rc, events, out = train(dpo_config(tiny_model, tmp_path / "ck", source), tmp_path, "bad")
    assert rc == 1, out[-3000:]  # torchrun's own code; the worker's is 2, and no restart follows
    assert "exits with code 2" in out and "exits with code 1" not in out, out[-3000:]
    assert of(events, "done")[0]["exitCode"] == 2
    error = of(events, "error")[0]
    assert error["kind"] == "ConfigError"
    assert f"{source} line 3" in error["message"] and "'rejected'" in error["message"]
