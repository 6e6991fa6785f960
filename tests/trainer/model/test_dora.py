"""DoRA (`training.lora.useDora`), with the real trainer under torchrun on 2 CPU ranks (gloo).

1. Loading: the magnitudes each rank computes from the rows it filled are bit for bit peft's own
   DoRA init on the fully loaded model in one process (from_pretrained + manual_seed + apply_lora),
   for FSDP2 FULL_SHARD / NO_SHARD / HYBRID_SHARD and FSDP1, the sliced, broadcast and full
   methods, an fp32 checkpoint and a bf16 one with uneven shards (into fp32 and bf16 master
   weights), lm_head included; the random state after loading is the previous path's.
2. Exact resume: a DoRA run stopped after a checkpoint and resumed equals the straight run (losses,
   grad norms, every parameter), and the magnitudes are trained.
3. Export `both`: the adapter (peft's files, magnitudes included) reproduces the trainer's final
   eval loss through PeftModel.from_pretrained; the merged model's logits equal base + adapter.
4. DoRA on a layer that is not Linear (embed_tokens) is a ConfigError naming useDora.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from llamaft_trainer.report.logline import read_events

from tests.trainer.conftest import base_config, launch_trainer, run_harness
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
    from llamaft_trainer.model import model as model_step
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
    from llamaft_trainer.model import model as model_step
    from llamaft_trainer.process.errors import ConfigError
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))
    lora = LoraSpec.model_validate({"useDora": True, "targetModules": ["embed_tokens", "q_proj"]})
    with pytest.raises(ConfigError, match=r"^spec\.training\.lora\.useDora: .*model\.embed_tokens \(Embedding\)"):
        model_step.apply_lora(model, lora)


# ------------------------------------------------------------------ exact resume
STEPS, EVERY, STOP = 8, 3, 5
MODES: dict[str, dict[str, Any]] = {
    # dropout draws from the RNG every step (DoRA then recomputes the base output of the dropped input)
    "dora-bf16-dropout": {"fsdp": {"mixedPrecision": "bf16"},
                          "training": {"lora": {**DORA, "dropout": 0.1, "targetModules": ["q_proj", "v_proj", "down_proj"]}}},
    "dora-shard-grad-op-ac-full": {"fsdp": {"shardingStrategy": "SHARD_GRAD_OP", "activationCheckpointing": {"mode": "full"}},
                                   "training": {"lora": DORA}},
}


def _mode_config(model: Path, directory: Path, mode: dict[str, Any], *, resume: bool) -> dict[str, Any]:
    training = {"maxSteps": STEPS, "learningRate": 1e-2, "evalInterval": 0, **mode["training"]}
    return base_config(model, directory, training=training, fsdp=mode["fsdp"],
                       checkpointing={"everyNSteps": EVERY, "keepLast": 3, "resume": resume})


@pytest.fixture(scope="module")
def modes(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("dora-modes")
    cases: list[dict[str, Any]] = []
    for name, mode in MODES.items():
        cases += [
            {"name": f"{name}/straight", "config": _mode_config(tiny_model, tmp / name / "straight", mode, resume=False)},
            {"name": f"{name}/stopped", "steps": STOP, "config": _mode_config(tiny_model, tmp / name / "stopped", mode, resume=False)},
            {"name": f"{name}/resumed", "config": _mode_config(tiny_model, tmp / name / "stopped", mode, resume=True)},
        ]
    return run_harness(tmp, 2, cases)


@pytest.mark.parametrize("name", list(MODES))
def test_dora_resumes_bit_identically(modes: dict[str, Any], name: str) -> None:
    straight, stopped, resumed = (modes[f"{name}/{part}"] for part in ("straight", "stopped", "resumed"))
    assert len(stopped["losses"]) == STOP and len(straight["losses"]) == STEPS
    start = STEPS - len(resumed["losses"])
    assert start == EVERY, "resumed from the checkpoint before the stop"
    assert resumed["losses"] == straight["losses"][start:]
    assert resumed["grad_norms"] == straight["grad_norms"][start:]
    assert resumed["checksum"] == straight["checksum"]
    # The magnitudes are trained (in the optimizer): they moved between step 5 and step 8.
    sums = [{k: v for k, v in run["param_sums"][0].items() if "lora_magnitude_vector" in k} for run in (stopped, straight)]
    assert sums[0] and sums[0].keys() == sums[1].keys()
    assert all(sums[0][k] != sums[1][k] for k in sums[0])


# ------------------------------------------------------------------ export
def test_dora_exports_an_adapter_and_a_merged_model(tiny_model: Path, tmp_path: Path) -> None:
    from llamaft.api.spec import TrainingJobConfig
    from llamaft_trainer.data import batching, prepare
    from llamaft_trainer.train import token_loss_sum
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    targets = ["q_proj", "v_proj", "down_proj"]
    config = base_config(
        tiny_model, tmp_path / "dora",
        training={"maxSteps": 6, "learningRate": 1e-2, "lora": {**DORA, "targetModules": targets, "export": "both"}},
        checkpointing={"exportHuggingFace": True, "everyNSteps": 100},
    )
    proc = launch_trainer(config, tmp_path, "dora")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-5000:]
    events = read_events(out)
    export = tmp_path / "dora" / "export"
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    layers = base.config.num_hidden_layers

    # The adapter: peft's files with the trained magnitudes, no longer the base weights' norms.
    adapter = load_file(export / "adapter" / "adapter_model.safetensors")
    magnitudes = {k: v for k, v in adapter.items() if "lora_magnitude_vector" in k}
    assert len(magnitudes) == layers * len(targets)
    weights = base.state_dict()
    for key, value in magnitudes.items():
        weight = weights[key.removeprefix("base_model.model.").replace("lora_magnitude_vector", "weight")]
        assert not torch.equal(value, torch.linalg.norm(weight, dim=1)), f"{key} was not trained"
    assert json.loads((export / "adapter" / "adapter_config.json").read_text())["use_dora"] is True

    # ... which reproduces the trainer's own final eval loss on the same sequences.
    adapted = PeftModel.from_pretrained(base, export / "adapter").eval()
    tok = AutoTokenizer.from_pretrained(export)
    cfg = TrainingJobConfig.model_validate(config)
    store = prepare.build_store(cfg.dataset, tok, cfg.training.seed, tmp_path / "dora" / "data")  # the run's own store
    val = batching.packed_dataset(store.validation, cfg.dataset, validation=True)
    used = len(val)  # the eval evaluates every sequence once (data.ValidationShare)
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(used):
            loss, n = token_loss_sum(adapted, {k: v.unsqueeze(0) for k, v in val[i].items()}, torch.device("cpu"))
            loss_sum, tokens = loss_sum + float(loss), tokens + n
    logged = [e["eval_loss"] for e in events if e["event"] == "eval"][-1]
    assert loss_sum / tokens == pytest.approx(logged, abs=1e-4)

    # The merged model: a plain model, only the targeted layers changed, logits = base + adapter.
    merged: Any = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    merged.eval()
    assert not any("lora" in k for k in merged.state_dict())
    base_weights = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    changed = {k for k, v in merged.state_dict().items() if not torch.equal(v, base_weights[k])}
    assert len(changed) == layers * len(targets) and all(any(t in k for t in targets) for k in changed)
    ids = torch.randint(3, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    # fp32 throughout; the merge folds magnitude / norm into the weight, a reordering of the same
    # products: measured 4e-7 of the largest logit, where resetting the trained magnitudes to the
    # base norms moves the logits by 0.24 of it.
    assert (want - got).abs().max() < 1e-4 * want.abs().max()
