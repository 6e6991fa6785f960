"""training.method dpo with the trainer's other features (issue 38): FSDP2 and FSDP1, every
precision, each activation-checkpointing mode, lossChunks, float8 (torchao's CPU emulation: the
same casts, scales and FSDP2 float8 all-gather, matmuls in high precision), LoRA and DoRA with the
merged export. Real torchrun runs of the tiny model on 2 ranks (FSDP shards nothing on 1).

Every run trains on the same 8 pairs with 2 ranks x 4 pairs per step, so each step's batch is the
whole set (order cannot matter) and the loss must fall step after step. A run covers several
features at once to keep the launches few: `fp32` is the plain FSDP2 run, and the other fp32 runs
change only what cannot change the maths (the FSDP implementation, activation recomputation, the
slicing of the fp32 log-softmax), so their losses and rewards must equal its own (see EXACT)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.methods.test_dpo_run import METRICS, dpo_config, head, of, train

LORA: dict[str, Any] = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "targetModules": ["q_proj", "v_proj", "down_proj"],
        "export": "both"}

RUNS: dict[str, dict[str, Any]] = {
    "fp32": {"fsdp": {"implementation": "fsdp2"}},
    "fp32-fsdp1-full-chunks": {"fsdp": {"implementation": "fsdp1", "activationCheckpointing": {"mode": "full"}},
                               "training": {"lossChunks": 4}},
    "fp32-selective-op-chunks": {"fsdp": {"activationCheckpointing": {"mode": "selective-op"}},
                                 "training": {"lossChunks": 3}},
    "bf16-selective-float8": {"fsdp": {"mixedPrecision": "bf16",
                                       "activationCheckpointing": {"mode": "selective", "everyNLayers": 2},
                                       "float8": {"enabled": True, "recipe": "tensorwise", "allGather": True}}},
    "fp16-fsdp1-full": {"fsdp": {"implementation": "fsdp1", "mixedPrecision": "fp16",
                                 "activationCheckpointing": {"mode": "full"}}},
    "pure-bf16-chunks": {"fsdp": {"mixedPrecision": "pure-bf16"}, "training": {"lossChunks": 2}},
    "lora-bf16-full-chunks": {"fsdp": {"mixedPrecision": "bf16", "activationCheckpointing": {"mode": "full"}},
                              "training": {"lossChunks": 2, "lora": LORA}},
    "dora-fp32-selective-op-float8": {"fsdp": {"activationCheckpointing": {"mode": "selective-op"},
                                               "float8": {"enabled": True, "recipe": "rowwise", "allGather": False}},
                                      "training": {"lora": {**LORA, "useDora": True}}},
}
EXACT = ("fp32-fsdp1-full-chunks", "fp32-selective-op-chunks")
"""Runs whose every step equals `fp32`'s to REL and ABS: FSDP1 and FSDP2 reduce the same fp32
gradients over the same 2 ranks, recomputed activations are the same operations on the same inputs,
and lossChunks only reorders the fp32 sum of a row's token log-probabilities (a rounding of about
1e-7 relative, which AdamW's 4 steps carry forward). The step events round every figure to 6
decimals, so two equal runs may log values 1e-6 apart: ABS is two such roundings."""
REL, ABS = 1e-6, 2e-6
MIXED = ("bf16-selective-float8", "fp16-fsdp1-full", "pure-bf16-chunks")
"""Full fine-tunes in a lower precision: the same maths rounded to 8 or 11 mantissa bits (and
float8's scaled casts), so each step's loss stays within MIXED_LOSS of fp32's on these 4 steps."""
MIXED_LOSS = 1e-2
EXPORTS = ("lora-bf16-full-chunks", "dora-fp32-selective-op-float8")
STEPS = 4


def _merge(into: dict[str, Any], fragment: dict[str, Any]) -> dict[str, Any]:
    for key, value in fragment.items():
        into[key] = _merge(dict(into.get(key, {})), value) if isinstance(value, dict) else value
    return into


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return head(8, tmp_path_factory.mktemp("pairs"))


@pytest.fixture(scope="module")
def runs(tiny_model: Path, pairs: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """name -> (rank 0's events, the run's directory), each run launched on first use."""
    done: dict[str, Any] = {}
    root = tmp_path_factory.mktemp("dpo-combinations")

    def get(name: str) -> tuple[list[dict[str, Any]], Path]:
        if name not in done:
            directory = root / name
            exporting = "lora" in RUNS[name].get("training", {})
            cfg = dpo_config(tiny_model, directory, pairs, dataset={"validationSplit": 0},
                             training={"maxSteps": STEPS, "perDeviceBatchSize": 4},
                             checkpointing={"exportHuggingFace": exporting})
            cfg = _merge(cfg, RUNS[name])
            rc, events, out = train(cfg, root, name, nproc=2)
            assert rc == 0, out[-4000:]
            done[name] = (events, directory)
        return done[name]  # type: ignore[no-any-return]

    return get  # type: ignore[return-value]


@pytest.mark.parametrize("name", list(RUNS))
def test_each_combination_trains_with_a_falling_loss(runs: Any, name: str) -> None:
    events, _ = runs(name)
    steps = of(events, "step")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        assert all(math.isfinite(s[k]) for k in ("loss", "grad_norm", *METRICS)), s
    losses = [s["loss"] for s in steps]
    # At step 1 the policy is the reference (the precomputed pass of the same model in the same
    # precision, or LoRA/DoRA's adapter-disabled base with B = 0): the loss is log 2. Up to 2e-3
    # under float8 tensorwise, whose scale is the amax of the whole activation: the reference pass
    # batches the pairs otherwise (PairShare), so its casts round differently.
    assert losses[0] == pytest.approx(math.log(2), abs=2e-3), losses
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert steps[-1]["rewards/accuracies"] > 0.5, steps[-1]


@pytest.mark.parametrize("name", EXACT)
def test_what_cannot_change_the_maths_gives_the_fp32_runs_steps(runs: Any, name: str) -> None:
    base, _ = runs("fp32")
    got, _ = runs(name)
    for mine, want in zip(of(got, "step"), of(base, "step"), strict=True):
        assert mine["loss"] == pytest.approx(want["loss"], rel=REL, abs=ABS), (name, mine, want)
        for metric in METRICS:
            assert mine[metric] == pytest.approx(want[metric], rel=REL, abs=ABS), (metric, mine, want)


@pytest.mark.parametrize("name", MIXED)
def test_a_lower_precision_follows_the_fp32_losses(runs: Any, name: str) -> None:
    base, _ = runs("fp32")
    got, _ = runs(name)
    for mine, want in zip(of(got, "step"), of(base, "step"), strict=True):
        assert abs(mine["loss"] - want["loss"]) < MIXED_LOSS, (name, mine["loss"], want["loss"])


@pytest.mark.parametrize("name", EXPORTS)
def test_the_merged_export_is_the_base_with_the_trained_adapters(runs: Any, name: str, tiny_model: Path) -> None:
    """export both: the root is the merged model (a plain transformers model), adapter/ the peft
    adapter; the merged model's logits equal the base's with the adapter applied (fp32 master
    weights: the merge differs only by fp32 summation order)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    events, directory = runs(name)
    export = directory / "export"
    assert [e["path"] for e in of(events, "export")] == [str(export)]
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train(False)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    merged = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).train(False)
    assert not any("lora" in k for k in merged.state_dict())
    changed = [k for k, v in merged.state_dict().items() if not torch.equal(v, base_state[k])]
    assert changed and all(any(m in k for m in LORA["targetModules"]) for k in changed), changed
    adapted = PeftModel.from_pretrained(base, export / "adapter").train(False)
    ids = torch.randint(3, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (want - got).abs().max() < 1e-4 * want.abs().max()
