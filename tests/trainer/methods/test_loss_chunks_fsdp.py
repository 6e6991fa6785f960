"""training.lossChunks and activationCheckpointing selective-op in real trainer runs: 1 process and
2 processes under FSDP2 (and FSDP1), against the same configuration without them.

lossChunks runs the head and loss as the forward of the root's call (methods/sft.py), so the root FSDP
unit's all-gather of the LM head / final norm and the reduce-scatter of their gradients happen as
without chunks; a chunked loss computed outside the root's forward would meet sharded parameters.
5 chunks do not divide the 63 target positions of the 64-token packed sequences.

Tolerances (per-step loss, absolute): fp32 1e-5 (the sum of per-slice sums; the FSDP matrix
allows 1e-4 for reduction order), bf16 3e-2 (test_fsdp_matrix's); eval loss the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.conftest import base_config, run_harness

STEPS = 3
LORA_HEAD = {"lora": {"r": 4, "alpha": 8, "dropout": 0.0, "targetModules": ["q_proj", "v_proj", "lm_head"]}}


def _case(name: str, model: Path, tmp: Path, **overrides: Any) -> dict[str, Any]:
    return {"name": name, "steps": STEPS, "config": base_config(model, tmp / name, **overrides)}


def tied_copy(model: Path, out: Path) -> Path:
    """The tiny Llama with its LM head tied to the embedding (one parameter in the root unit)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(model)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(model).save_pretrained(out)
    return out


def pairs(model: Path, tied: Path, tmp: Path) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(reference, variant) cases: the variant adds lossChunks 5 or selective-op."""
    out = []
    for label, src, extra in [
        ("fsdp2-fp32", model, {}),
        ("fsdp2-bf16", model, {"fsdp": {"mixedPrecision": "bf16", "activationCheckpointing": {"mode": "none"}}}),
        ("fsdp2-tied", tied, {}),
        ("fsdp2-lora-head", model, {"training": LORA_HEAD}),
        ("fsdp1", model, {"fsdp": {"implementation": "fsdp1", "mixedPrecision": "fp32",
                                    "activationCheckpointing": {"mode": "none"}}}),
    ]:
        training = {"evalInterval": 2, **extra.get("training", {})}
        fsdp = extra.get("fsdp", {})
        ref = _case(f"{label}-ref", src, tmp, training=training, fsdp=fsdp)
        chunked = _case(f"{label}-chunks", src, tmp, training={**training, "lossChunks": 5}, fsdp=fsdp)
        out.append((ref, chunked))
    sac = _case("fsdp2-selective-op", model, tmp, training={"evalInterval": 2},
                fsdp={"activationCheckpointing": {"mode": "selective-op"}})
    out.append((out[0][0], sac))
    both = _case("fsdp2-selective-op-chunks", model, tmp, training={"evalInterval": 2, "lossChunks": 5},
                 fsdp={"activationCheckpointing": {"mode": "selective-op"}})
    out.append((out[0][0], both))
    return out


@pytest.mark.parametrize("nproc", [1, 2])
def test_same_training_with_chunks_and_selective_op(tiny_model: Path, tmp_path: Path, nproc: int) -> None:
    cases = pairs(tiny_model, tied_copy(tiny_model, tmp_path / "tied"), tmp_path)
    unique = {c["name"]: c for pair in cases for c in pair}
    results = run_harness(tmp_path, nproc, list(unique.values()))
    (tmp_path / "results.json").write_text(json.dumps(results))
    for ref, variant in cases:
        want, got = results[ref["name"]], results[variant["name"]]
        tolerance = 3e-2 if "bf16" in ref["name"] else 1e-5
        assert len(got["losses"]) == len(want["losses"]) == STEPS, variant["name"]
        assert got["losses"] == pytest.approx(want["losses"], abs=tolerance), variant["name"]
        assert got["eval_losses"] and got["eval_losses"] == pytest.approx(want["eval_losses"], abs=tolerance)
        if tolerance < 1e-3:
            ranks_want, ranks_got = want["param_sums"], got["param_sums"]
            for rank_want, rank_got in zip(ranks_want, ranks_got, strict=True):
                assert rank_got.keys() == rank_want.keys()
                for key in rank_want:
                    assert rank_got[key] == pytest.approx(rank_want[key], rel=1e-4, abs=1e-4), (variant["name"], key)
    # the LoRA head really trained through the chunks
    sums = results["fsdp2-lora-head-chunks"]["param_sums"][0]
    assert any("lm_head.lora_B" in key for key in sums)
