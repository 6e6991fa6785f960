"""training.dpo.reference: live (dpo_step.frozen, main.build_model(reference=True)) through the
trainer: the frozen copy is the initial policy in the compute dtype under FSDP2 and FSDP1, and a
resumed run continues bit for bit with the copy loaded again (checkpoints never hold it). 2 ranks
(each holding its shard of the copy) equal 1: test_dpo_run.py, for either reference. Its per-step equality with TRL's DPOTrainer is
tests/trainer/methods/test_dpo_trl.py's."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.methods.test_dpo_run import METRICS, REFERENCES, dpo_config, head, of, train

LIVE = REFERENCES["live"]


def checkpoint_keys(step_dir: Path) -> list[str]:
    """The tensors a distributed checkpoint holds (its .metadata)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return sorted(FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)


def test_resume_continues_bit_for_bit_and_loads_the_copy_again(tiny_model: Path, tmp_path: Path) -> None:
    source = head(48, tmp_path)
    training = {**LIVE, "maxSteps": 6, "perDeviceBatchSize": 4}
    whole = dpo_config(tiny_model, tmp_path / "whole", source, training=training,
                       checkpointing={"everyNSteps": 3, "keepLast": 5})
    rc, events, out = train(whole, tmp_path, "whole")
    assert rc == 0, out[-3000:]
    assert not of(events, "reference")  # no precomputed pass, nothing stored beside the token store
    assert '"loading the reference model"' in out
    expected = {s["step"]: s for s in of(events, "step")}
    evals = of(events, "eval")
    # the checkpoint holds the policy and its optimizer only: no second model's tensors
    keys = checkpoint_keys(tmp_path / "whole" / "step-00000003")
    weights = [k for k in keys if k.startswith("model.")]
    assert weights and all("reference" not in k for k in keys)
    precomputed = dpo_config(tiny_model, tmp_path / "pre", source, training={"maxSteps": 3, "perDeviceBatchSize": 4},
                             checkpointing={"everyNSteps": 3})
    rc, _, out = train(precomputed, tmp_path, "pre")
    assert rc == 0, out[-3000:]
    assert checkpoint_keys(tmp_path / "pre" / "step-00000003") == keys
    # The same run stopped after its step-3 checkpoint.
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "step-00000006")
    resumed = dpo_config(tiny_model, tmp_path / "resumed", source, training=training,
                         checkpointing={"everyNSteps": 3, "keepLast": 5, "resume": True})
    rc, events, out = train(resumed, tmp_path, "resumed")
    assert rc == 0, out[-3000:]
    assert of(events, "resume")[0]["step"] == 3
    got = of(events, "step")
    assert [s["step"] for s in got] == [4, 5, 6]
    for s in got:
        assert s["loss"] == expected[s["step"]]["loss"]
        assert {k: s[k] for k in METRICS} == {k: expected[s["step"]][k] for k in METRICS}
    final = [{k: v for k, v in e.items() if k != "ts"} for e in of(events, "eval") if e["step"] == 6]
    assert final and final == [{k: v for k, v in e.items() if k != "ts"} for e in evals if e["step"] == 6]


@pytest.mark.parametrize("fsdp", [
    {"implementation": "fsdp2", "mixedPrecision": "bf16"},
    {"implementation": "fsdp1", "mixedPrecision": "fp16", "activationCheckpointing": {"mode": "full"}},
], ids=["fsdp2-bf16", "fsdp1-fp16-ac"])
def test_the_copy_is_the_initial_policy_in_the_compute_dtype(tiny_model: Path, tmp_path: Path, fsdp: dict[str, Any]) -> None:
    """2 ranks, each with its shard of both models: at step 1 the policy (fp32 master weights cast
    to the compute dtype) and the copy (loaded in it) score the same batch bit for bit, so every
    reward is exactly 0 and the loss exactly log 2; then the policy learns away from it."""
    cfg = dpo_config(tiny_model, tmp_path / "ck", head(8, tmp_path), dataset={"validationSplit": 0},
                     training={**LIVE, "maxSteps": 4, "perDeviceBatchSize": 4}, fsdp=fsdp)
    rc, events, out = train(cfg, tmp_path, "run", nproc=2)
    assert rc == 0, out[-3000:]
    steps = of(events, "step")
    assert steps[0]["rewards/chosen"] == steps[0]["rewards/rejected"] == steps[0]["rewards/margins"] == 0.0
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert steps[-1]["loss"] < steps[0]["loss"] and steps[-1]["rewards/margins"] > 0
