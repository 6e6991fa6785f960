"""spec.fsdp.float8 (llamaft_trainer/parallel/float8.py) on CPU, through torchao's emulation.

Which linears become Float8Linear (names) for the tiny Llama, full and LoRA; the device refusal as
a pure function of the compute capability; and real 2-rank torchrun runs (gloo) of tensorwise +
float8 all-gather and rowwise whose losses stay close to the bf16 run's over the same steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from llamaft.api.spec import FsdpSpec, LoraSpec
from llamaft_trainer.model import model as model_step
from llamaft_trainer.parallel import float8
from llamaft_trainer.process.errors import ConfigError
from torch import nn

from tests.trainer.conftest import base_config, run_harness

pytest.importorskip("torchao.float8")

LAYERS = 4
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _meta_model(tiny_model: Path) -> nn.Module:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model)
    spec = base_config(tiny_model, tiny_model)["model"]
    from llamaft.api.spec import ModelSpec

    return model_step.build_meta_model(config, ModelSpec.model_validate(spec), torch.float32)


def _fsdp(**float8_spec: Any) -> FsdpSpec:
    return FsdpSpec.model_validate({"float8": {"enabled": True, **float8_spec}})


def test_converts_every_decoder_linear_but_not_lm_head(tiny_model: Path) -> None:
    """hidden 64, intermediate 176, head_dim 16 with 2 kv heads (k/v: 32): every projection's
    dimensions divide 16, so all 7 per layer are converted; lm_head never is."""
    model = _meta_model(tiny_model)
    converted = float8.convert(model, _fsdp(), torch.device("cpu"))
    assert converted == [f"model.layers.{i}.{p}" for i in range(LAYERS) for p in PROJECTIONS]
    from torchao.float8.float8_linear import Float8Linear

    assert not isinstance(model.get_submodule("lm_head"), Float8Linear)
    assert model.get_submodule("model.layers.0.mlp.up_proj").config.emulate is True


def test_skips_linears_whose_dimensions_do_not_divide_16() -> None:
    model = nn.Sequential()
    model.add_module("ok", nn.Linear(32, 48))
    model.add_module("odd_in", nn.Linear(24, 32))
    model.add_module("odd_out", nn.Linear(32, 40))
    model.add_module("lm_head", nn.Linear(32, 32))
    assert float8.convert(model, _fsdp(), torch.device("cpu")) == ["ok"]


def test_disabled_converts_nothing(tiny_model: Path) -> None:
    model = _meta_model(tiny_model)
    assert float8.convert(model, FsdpSpec(), torch.device("cpu")) == []


def test_lora_converts_the_frozen_base_linears_only(tiny_model: Path) -> None:
    lora = LoraSpec.model_validate({"r": 16, "alpha": 32, "targetModules": ["q_proj", "v_proj"]})
    model = model_step.apply_lora(_meta_model(tiny_model), lora)
    converted = float8.convert(model, _fsdp(), torch.device("cpu"))
    adapted = [c for c in converted if ".base_layer" in c]
    assert len(adapted) == 2 * LAYERS and all(c.endswith(("q_proj.base_layer", "v_proj.base_layer")) for c in adapted)
    assert not [c for c in converted if "lora_" in c], "rank-16 adapters divide 16 but stay in high precision"
    assert len(converted) == 7 * LAYERS


def test_configs_per_recipe() -> None:
    cpu = torch.device("cpu")
    tensorwise = float8.linear_config(_fsdp(), cpu)
    assert tensorwise.enable_fsdp_float8_all_gather and tensorwise.emulate
    assert float8.precomputes_scales(_fsdp())
    rowwise = float8.linear_config(_fsdp(recipe="rowwise", allGather=False), cpu)
    assert not rowwise.enable_fsdp_float8_all_gather and rowwise.emulate
    assert rowwise.cast_config_weight.scaling_granularity.value == "axiswise"
    assert not float8.precomputes_scales(_fsdp(recipe="rowwise", allGather=False))
    assert not float8.precomputes_scales(_fsdp(allGather=False))


@pytest.mark.parametrize(("major", "minor", "ok"), [(7, 0, False), (8, 0, False), (8, 6, False),
                                                     (8, 9, True), (9, 0, True), (10, 0, True)])
def test_capability(major: int, minor: int, ok: bool) -> None:
    assert float8.supports_float8(major, minor) is ok


def test_device_message_names_the_field() -> None:
    message = float8.device_message("NVIDIA A100-SXM4-80GB", 8, 0)
    assert message.startswith("spec.fsdp.float8.enabled:") and "8.9" in message and "H100" in message


def test_cpu_is_allowed_and_disabled_is_never_checked() -> None:
    float8.check_device(_fsdp(), torch.device("cpu"))  # emulation
    float8.check_device(FsdpSpec(), torch.device("cuda", 0))  # off: no CUDA call at all


def test_cuda_below_8_9_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"spec\.fsdp\.float8\.enabled: NVIDIA A100"):
        float8.check_device(_fsdp(), torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    float8.check_device(_fsdp(), torch.device("cuda", 0))


STEPS = 6
LOSS_TOLERANCE = 0.05
"""|float8 loss - bf16 loss| at each step, relative to the bf16 loss. e4m3 keeps 3 mantissa bits
(relative rounding error up to 2^-4 per element) against bf16's 7; over a matmul's sum the errors
mostly cancel, and torchao reports float8 training curves within about 1% of bf16's on Llama.
The tiny model's first steps move fast (learning rate 2e-3), so 5% leaves room for the few
steps' drift while a broken conversion (wrong scales: losses off by orders of magnitude, or NaN)
or one that did nothing is still caught (the latter by the `differs` check)."""


EVERY, STOP = 3, 5
LORA = {"r": 16, "alpha": 32, "dropout": 0.1, "targetModules": ["q_proj", "v_proj"]}


def _case(tiny_model: Path, tmp: Path, name: str, directory: str, *, steps: int = STEPS, resume: bool = False,
          lora: bool = False, **float8_spec: Any) -> dict[str, Any]:
    fsdp: dict[str, Any] = {"mixedPrecision": "bf16"}
    if float8_spec:
        fsdp["float8"] = {"enabled": True, **float8_spec}
    training: dict[str, Any] = {"maxSteps": STEPS, **({"lora": LORA} if lora else {})}
    config = base_config(tiny_model, tmp / directory, fsdp=fsdp, training=training,
                         checkpointing={"everyNSteps": EVERY, "keepLast": 2, "resume": resume})
    return {"name": name, "config": config, "steps": steps}


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One torchrun launch (2 ranks, gloo): bf16; tensorwise + float8 all-gather and rowwise, each
    straight; tensorwise and LoRA + tensorwise also stopped after step 5 and resumed from step 3."""
    tmp = tmp_path_factory.mktemp("float8")
    tensorwise = {"recipe": "tensorwise", "allGather": True}
    cases = [
        _case(tiny_model, tmp, "bf16", "bf16"),
        _case(tiny_model, tmp, "tensorwise", "tensorwise", **tensorwise),
        _case(tiny_model, tmp, "tensorwise/stopped", "tensorwise-stopped", steps=STOP, **tensorwise),
        _case(tiny_model, tmp, "tensorwise/resumed", "tensorwise-stopped", resume=True, **tensorwise),
        _case(tiny_model, tmp, "rowwise", "rowwise", recipe="rowwise", allGather=False),
        _case(tiny_model, tmp, "lora-bf16", "lora-bf16", lora=True),
        _case(tiny_model, tmp, "lora-tensorwise", "lora", lora=True, **tensorwise),
        _case(tiny_model, tmp, "lora-tensorwise/stopped", "lora-stopped", steps=STOP, lora=True, **tensorwise),
        _case(tiny_model, tmp, "lora-tensorwise/resumed", "lora-stopped", resume=True, lora=True, **tensorwise),
    ]
    return run_harness(tmp, 2, cases)


@pytest.mark.parametrize(("name", "reference"), [("tensorwise", "bf16"), ("rowwise", "bf16"),
                                                 ("lora-tensorwise", "lora-bf16")])
def test_float8_trains_close_to_bf16_on_two_ranks(runs: dict[str, Any], name: str, reference: str) -> None:
    want, got = runs[reference]["losses"], runs[name]["losses"]
    assert len(got) == len(want) == STEPS
    assert got == pytest.approx(want, rel=LOSS_TOLERANCE), name
    assert got != want, f"{name}: identical to bf16, so nothing ran in float8"
    assert got[-1] < got[0], f"{name}: the loss should fall"
    ranks = runs[name]["param_sums"]
    assert ranks[0] == ranks[1], "both ranks see the same full parameters"


@pytest.mark.parametrize("name", ["tensorwise", "lora-tensorwise"])
def test_float8_resumes_bit_identically(runs: dict[str, Any], name: str) -> None:
    """DCP saves and loads the Float8Linear modules' parameters (plain DTensors with float8
    all-gather's wrapper subclass underneath) and the optimizer state; resumed from step 3, steps
    4-6 replay the straight run's losses, grad norms and final parameters bit for bit."""
    straight, stopped, resumed = (runs[n] for n in (name, f"{name}/stopped", f"{name}/resumed"))
    assert len(stopped["losses"]) == STOP
    assert len(resumed["losses"]) == STEPS - EVERY, "resumed from the step-3 checkpoint"
    assert resumed["losses"] == straight["losses"][EVERY:]
    assert resumed["grad_norms"] == straight["grad_norms"][EVERY:]
    assert resumed["checksum"] == straight["checksum"]
