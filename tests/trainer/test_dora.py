"""DoRA (`training.lora.useDora`), with the real trainer under torchrun on 2 CPU ranks (gloo).

1. Loading: the magnitudes each rank computes from the rows it filled are bit for bit peft's own
   DoRA init on the fully loaded model in one process (from_pretrained + manual_seed + apply_lora),
   for FSDP2 FULL_SHARD / NO_SHARD / HYBRID_SHARD and FSDP1, the sliced, broadcast and full
   methods, an fp32 checkpoint and a bf16 one with uneven shards (into fp32 and bf16 master
   weights), lm_head included; the random state after loading is the previous path's.
2. DoRA on a layer that is not Linear (embed_tokens) is a ConfigError naming useDora.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.conftest import base_config
from tests.trainer.load_worker import digest, launch

pytestmark = pytest.mark.slow

TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj", "lm_head"]
DORA = {"r": 4, "alpha": 8, "dropout": 0.0, "targetModules": TARGETS, "useDora": True}
HYBRID = {"shardingStrategy": "HYBRID_SHARD", "hybridShard": {"shardGroupSize": 1, "replicaGroupSize": 2}}
LOADS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (checkpoint, method, fsdp)
    "single/FULL_SHARD/sliced": ("single", "sliced", {}),
    "single/FULL_SHARD/broadcast": ("single", "broadcast", {}),
    "single/FULL_SHARD/full": ("single", "full", {}),
    "single/NO_SHARD/sliced": ("single", "sliced", {"shardingStrategy": "NO_SHARD"}),
    "single/HYBRID_SHARD/sliced": ("single", "sliced", HYBRID),
    "single/fsdp1-ac/sliced": ("single", "sliced", {"implementation": "fsdp1", "activationCheckpointing": {"mode": "full"}}),
    # bf16 file, uneven rows on 2 ranks (up_proj 171, lm_head 509), into fp32 master weights
    "uneven/FULL_SHARD/sliced": ("uneven", "sliced", {}),
    "uneven/FULL_SHARD/broadcast": ("uneven", "broadcast", {}),
    "uneven/FULL_SHARD/full": ("uneven", "full", {}),
    # ... and into bf16 master weights (peft computes the norm in bf16)
    "uneven-pure-bf16/FULL_SHARD/sliced": ("uneven", "sliced", {"mixedPrecision": "pure-bf16"}),
    "uneven-pure-bf16/FULL_SHARD/full": ("uneven", "full", {"mixedPrecision": "pure-bf16"}),
}


@pytest.fixture(scope="module")
def checkpoints(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("dora-checkpoints")
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=509, hidden_size=64, intermediate_size=171, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model: Any = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(tmp / "uneven", max_shard_size="100KB")
    return {"single": tiny_model, "uneven": tmp / "uneven"}


def _load_config(checkpoints: dict[str, Path], tmp: Path, checkpoint: str, fsdp: dict[str, Any],
                 lora: dict[str, Any] = DORA) -> dict[str, Any]:
    return base_config(checkpoints[checkpoint], tmp / "ck", training={"lora": lora}, fsdp=fsdp)


@pytest.fixture(scope="module")
def loads(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("dora-loads")
    cases = [{"name": name, "method": method, "config": _load_config(checkpoints, tmp, checkpoint, fsdp)}
             for name, (checkpoint, method, fsdp) in LOADS.items()]
    cases.append({"name": "embed_tokens", "method": "sliced",
                  "config": _load_config(checkpoints, tmp, "single", {}, {**DORA, "targetModules": ["q_proj", "embed_tokens"]})})
    out, _ = launch(tmp, 2, cases)
    return {"cases": {c["name"]: c for c in cases}, "out": out}


def _peft_on_the_loaded_model(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """peft's DoRA init where it is meant to run: on the whole pretrained model, in one process."""
    from llamaft.api.spec import TrainingJobConfig
    from llamaft_trainer import model as model_step
    from transformers import AutoModelForCausalLM

    cfg = TrainingJobConfig.model_validate(config)
    assert cfg.training.lora is not None
    model = AutoModelForCausalLM.from_pretrained(cfg.model.source, dtype=model_step.master_dtype(cfg.fsdp.mixed_precision))
    torch.manual_seed(cfg.training.seed)
    return dict(model_step.apply_lora(model, cfg.training.lora).state_dict())


@pytest.mark.parametrize("name", list(LOADS))
def test_loaded_magnitudes_are_peft_dora_init_on_the_loaded_model(loads: dict[str, Any], name: str) -> None:
    got = loads["out"][name]
    assert "error" not in got, got.get("error")
    want = _peft_on_the_loaded_model(loads["cases"][name]["config"])
    magnitudes = sorted(k for k in want if "lora_magnitude_vector" in k)
    layers = 2 if name.startswith("uneven") else 4
    assert len(magnitudes) == layers * (len(TARGETS) - 1) + 1  # lm_head once
    assert got["digests"].keys() == want.keys()
    differ = [k for k in want if got["digests"][k] != digest(want[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"
    # Not a placeholder: peft's magnitude is the norm of each base weight row (B starts at 0).
    for key in magnitudes:
        weight = want[key.replace("lora_magnitude_vector.default.weight", "base_layer.weight")]
        assert torch.equal(want[key], torch.linalg.norm(weight, dim=1).to(want[key].dtype))


def test_random_state_after_loading_is_the_previous_paths(loads: dict[str, Any]) -> None:
    out = loads["out"]
    for checkpoint in ("single", "uneven"):
        previous = out[f"{checkpoint}/FULL_SHARD/full"]["rng"][0]
        for method in ("sliced", "broadcast"):
            assert set(out[f"{checkpoint}/FULL_SHARD/{method}"]["rng"]) == {previous}


def test_dora_on_an_embedding_is_a_config_error_naming_use_dora(loads: dict[str, Any]) -> None:
    error = loads["out"]["embed_tokens"].get("error", "")
    assert error.startswith("spec.training.lora.useDora: DoRA applies to linear layers only"), error
    assert "model.embed_tokens (Embedding)" in error and "remove it from targetModules or set useDora: false" in error


def test_dora_refusal_happens_when_the_model_is_wrapped() -> None:
    """apply_lora refuses on every rank alike, on the meta model, before any collective."""
    from llamaft.api.spec import LoraSpec
    from llamaft_trainer import model as model_step
    from llamaft_trainer.errors import ConfigError
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))
    lora = LoraSpec.model_validate({"useDora": True, "targetModules": ["embed_tokens", "q_proj"]})
    with pytest.raises(ConfigError, match=r"^spec\.training\.lora\.useDora: .*model\.embed_tokens \(Embedding\)"):
        model_step.apply_lora(model, lora)
