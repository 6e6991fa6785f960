"""Streaming weight loading (loading.py) gives bit-identical parameters to `from_pretrained` and to
the previous path (rank 0 from_pretrained + broadcast), for a single-file fp32 checkpoint, LoRA on
top of it, and a multi-file bf16 checkpoint with tied embeddings (loaded into fp32 master weights;
with LoRA in pure bf16), under every sharding strategy on 4 ranks (FSDP2 FULL_SHARD, SHARD_GRAD_OP,
NO_SHARD, HYBRID_SHARD 2x2; FSDP1 FULL_SHARD and HYBRID_SHARD 2x2), both reading methods, in one
torchrun launch. A checkpoint that does not match the model is a ConfigError naming
spec.model.source; a .bin-only checkpoint falls back to from_pretrained.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from llamaft_trainer.report.logline import read_events

from tests.trainer.conftest import base_config
from tests.trainer.load_worker import digest, launch

pytestmark = pytest.mark.slow

RANKS = 4
METHODS = ["sliced", "broadcast"]
HYBRID = {"shardingStrategy": "HYBRID_SHARD", "hybridShard": {"shardGroupSize": 2, "replicaGroupSize": 2}}
STRATEGIES: dict[str, dict[str, Any]] = {
    "FULL_SHARD": {},
    "SHARD_GRAD_OP": {"shardingStrategy": "SHARD_GRAD_OP"},
    "NO_SHARD": {"shardingStrategy": "NO_SHARD"},
    "HYBRID_SHARD": HYBRID,
    "fsdp1-FULL_SHARD": {"implementation": "fsdp1"},
    "fsdp1-HYBRID_SHARD": {"implementation": "fsdp1", **HYBRID},
}
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "targetModules": ["q_proj", "v_proj", "down_proj"]}
CONTENTS: dict[str, dict[str, Any]] = {
    # checkpoint, and the config overrides that load it
    "single": {"checkpoint": "single"},
    "lora": {"checkpoint": "single", "training": {"lora": LORA}},
    "multi": {"checkpoint": "multi"},
}
EXTRA: dict[str, dict[str, Any]] = {
    # LoRA on the bf16 multi-file checkpoint with bf16 master weights (no dtype conversion but
    # adapters cast by peft), and wrapper prefixes (activation checkpointing, torch.compile).
    "multi-lora-pure-bf16": {"checkpoint": "multi", "training": {"lora": LORA}, "fsdp": {"mixedPrecision": "pure-bf16"}},
    "multi-ac-compile": {"checkpoint": "multi", "fsdp": {"activationCheckpointing": {"mode": "full"}, "compile": True}},
    "fsdp1-lora-ac": {"checkpoint": "single", "training": {"lora": LORA},
                      "fsdp": {"implementation": "fsdp1", "activationCheckpointing": {"mode": "full"}}},
    "bare": {"checkpoint": "bare"},
}


def _tiny_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    values: dict[str, Any] = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 4,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
    return LlamaConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def checkpoints(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """single: the fp32 tiny Llama (one file). multi: bf16, tied embeddings, uneven sizes, several files and an
    index. bare: multi's LlamaModel alone (keys without `model.`). bin: single as a .bin.
    missing / unexpected: single less one tensor / plus one."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(1)
    # Uneven sizes (509 rows, 170 rows): the last of 4 shards is shorter than the others.
    multi = LlamaForCausalLM(_tiny_config(tie_word_embeddings=True, vocab_size=509, intermediate_size=170)).to(torch.bfloat16)
    multi.save_pretrained(tmp / "multi", max_shard_size="100KB")
    multi.model.save_pretrained(tmp / "bare")
    assert len(list((tmp / "multi").glob("*.safetensors"))) > 2 and (tmp / "multi" / "model.safetensors.index.json").exists()
    tensors = load_file(tiny_model / "model.safetensors")
    for name, change in {"missing": lambda t: t.pop("model.norm.weight"),
                         "unexpected": lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}),
                         "bin": None}.items():
        folder = tmp / name
        folder.mkdir()
        shutil.copy(tiny_model / "config.json", folder / "config.json")
        edited = dict(tensors)
        if change is None:
            torch.save(edited, folder / "pytorch_model.bin")
            continue
        change(edited)
        save_file(edited, folder / "model.safetensors", metadata={"format": "pt"})
    return {"single": tiny_model, "multi": tmp / "multi", "bare": tmp / "bare", "bin": tmp / "bin",
            "missing": tmp / "missing", "unexpected": tmp / "unexpected"}


def _config(checkpoints: dict[str, Path], tmp: Path, spec: dict[str, Any], fsdp: dict[str, Any]) -> dict[str, Any]:
    return base_config(checkpoints[spec["checkpoint"]], tmp / "ck", training=spec.get("training", {}),
                       fsdp={**spec.get("fsdp", {}), **fsdp})


def _cases(checkpoints: dict[str, Path], tmp: Path) -> list[dict[str, Any]]:
    cases = []
    for (content, spec), (strategy, fsdp), method in itertools.product(CONTENTS.items(), STRATEGIES.items(), METHODS):
        cases.append({"name": f"{content}/{strategy}/{method}", "method": method,
                      "config": _config(checkpoints, tmp, spec, fsdp)})
    for content, spec in CONTENTS.items():  # the previous path, for comparison
        for strategy in ("FULL_SHARD", "fsdp1-FULL_SHARD"):
            cases.append({"name": f"{content}/{strategy}/full", "method": "full",
                          "config": _config(checkpoints, tmp, spec, STRATEGIES[strategy])})
    for (content, spec), method in itertools.product(EXTRA.items(), METHODS):
        cases.append({"name": f"{content}/FULL_SHARD/{method}", "method": method, "config": _config(checkpoints, tmp, spec, {})})
    cases.append({"name": "multi-lora-pure-bf16/FULL_SHARD/full", "method": "full",
                  "config": _config(checkpoints, tmp, EXTRA["multi-lora-pure-bf16"], {})})
    for bad, method in itertools.product(("missing", "unexpected", "bin"), METHODS):
        cases.append({"name": f"{bad}/FULL_SHARD/{method}", "method": method,
                      "config": _config(checkpoints, tmp, {"checkpoint": bad}, {})})
    return cases


@pytest.fixture(scope="module")
def results(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("streaming")
    cases = _cases(checkpoints, tmp)
    out, stdout = launch(tmp, RANKS, cases)
    return {"cases": {c["name"]: c for c in cases}, "out": out, "log": stdout}


def reference(case: dict[str, Any]) -> dict[str, str]:
    """Digests of `from_pretrained` (+ torch.manual_seed(seed) and apply_lora, as the previous
    path), in this process."""
    from llamaft.api.spec import TrainingJobConfig
    from llamaft_trainer.model import model as model_step
    from transformers import AutoModelForCausalLM

    cfg = TrainingJobConfig.model_validate(case["config"])
    dtype = model_step.master_dtype(cfg.fsdp.mixed_precision)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.source, dtype=dtype)
    if cfg.training.lora is not None:
        torch.manual_seed(cfg.training.seed)
        model = model_step.apply_lora(model, cfg.training.lora)
    return {k: digest(v) for k, v in model.state_dict().items()}


_REFERENCES: dict[str, dict[str, str]] = {}


def _reference(case: dict[str, Any]) -> dict[str, str]:
    key = json.dumps([case["config"]["model"], case["config"]["training"].get("lora"), case["config"]["fsdp"].get("mixedPrecision")])
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(case)
    return _REFERENCES[key]


GOOD = [name for name in [
    *(f"{c}/{s}/{m}" for c, s, m in itertools.product(CONTENTS, STRATEGIES, METHODS)),
    *(f"{c}/{s}/full" for c, s in itertools.product(CONTENTS, ("FULL_SHARD", "fsdp1-FULL_SHARD"))),
    *(f"{c}/FULL_SHARD/{m}" for c, m in itertools.product(EXTRA, METHODS)),
    "multi-lora-pure-bf16/FULL_SHARD/full", "bin/FULL_SHARD/sliced", "bin/FULL_SHARD/broadcast",
]]


@pytest.mark.parametrize("name", GOOD)
def test_bit_identical_to_from_pretrained(results: dict[str, Any], name: str) -> None:
    got = results["out"][name]
    assert "error" not in got, got.get("error")
    want = _reference(results["cases"][name])
    assert got["digests"].keys() == want.keys()
    differ = [k for k in want if got["digests"][k] != want[k]]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


@pytest.mark.parametrize("content", [*CONTENTS, "multi-lora-pure-bf16"])
def test_random_state_after_loading_is_the_previous_paths(results: dict[str, Any], content: str) -> None:
    """LoRA reseeds and draws the adapters as the previous path did on rank 0: every rank ends in
    that state, whichever the method, so dropout masks stay those of the previous path."""
    out = results["out"]
    previous = out[f"{content}/FULL_SHARD/full"]["rng"][0]
    for method in METHODS:
        assert set(out[f"{content}/FULL_SHARD/{method}"]["rng"]) == {previous}


@pytest.mark.parametrize(("bad", "method"), list(itertools.product(("missing", "unexpected"), METHODS)))
def test_a_checkpoint_that_does_not_match_is_a_config_error(results: dict[str, Any], bad: str, method: str) -> None:
    error = results["out"][f"{bad}/FULL_SHARD/{method}"].get("error", "")
    assert error.startswith("spec.model.source: ") and str(results["cases"][f"{bad}/FULL_SHARD/{method}"]["config"]["model"]["source"]) in error
    assert ("1 missing tensor(s) ['model.norm.weight']" if bad == "missing" else "1 unexpected ['model.layers.9.mlp.up_proj.weight']") in error


def test_bin_checkpoint_falls_back_to_from_pretrained_with_a_log_line(results: dict[str, Any]) -> None:
    fallbacks = [e for e in read_events(results["log"], "weights") if "fallback" in e]
    assert len(fallbacks) == 2 and all("no model.safetensors or model.safetensors.index.json" in e["fallback"] for e in fallbacks)


def test_each_method_logs_what_it_did(results: dict[str, Any]) -> None:
    events = read_events(results["log"], "weights")
    assert {e["method"] for e in events if "method" in e} == {"sliced", "broadcast", "full"}
