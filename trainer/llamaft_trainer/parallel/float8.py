"""float8 training of the decoder layers' linears with torchao (spec.fsdp.float8), as torchtitan
does it (torchtitan/components/quantization/float8.py, docs/float8.md):

- every `nn.Linear` of the model except `lm_head`, and only those whose in and out features are
  divisible by 16 (float8 matmuls, torch._scaled_mm, need it), becomes a torchao `Float8Linear`
  (`torchao.float8.convert_to_float8_training`), before activation checkpointing, torch.compile
  and FSDP wrap the layers (parallelize.py), so compile fuses the casts and FSDP2 shards the
  converted weights;
- `tensorwise` + `allGather`: `Float8LinearConfig(enable_fsdp_float8_all_gather=True)`: FSDP2
  all-gathers float8 weights (half the bytes of bf16), and after each optimizer step
  `precompute_float8_dynamic_scale_for_fsdp` computes all weights' scales in one all-reduce
  (train.optimizer_step calls `after_optimizer_step`);
- `rowwise`: `Float8LinearConfig.from_recipe_name("rowwise")` (no float8 all-gather: torchao
  supports it for tensorwise scaling only, the API refuses the combination).

LoRA: peft wraps each adapted linear as `lora.Linear` with its frozen `base_layer` (an nn.Linear)
and the small trainable `lora_A` / `lora_B`; the frozen base linears are converted (their matmuls
are the expensive ones), the adapters are not (rank-r matmuls, too small for float8 to pay off).

Hardware: float8 matmuls need compute capability 8.9 or newer (Ada, Hopper, Blackwell: L4, L40S,
H100, H200, B200); the trainer refuses older CUDA GPUs at start (`check_device`). On CPU the
trainer uses torchao's emulation (`Float8LinearConfig(emulate=True)`: the same casts and scales,
matmuls in high precision): for tests and smoke runs only, it is slower than bf16, not faster.
torchao is imported only when float8 is on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from llamaft.api.spec import Float8Recipe, FsdpSpec
from torch import nn

from llamaft_trainer.process.errors import ConfigError

MIN_CAPABILITY = (8, 9)
"""The oldest CUDA compute capability with FP8 tensor cores (Ada Lovelace, sm_89)."""
SKIPPED_MODULES = ("lm_head",)
"""Linears kept in high precision: the output projection (torchtitan's default filter_fqns:
["output"]; its logits feed the loss directly and its vocabulary dimension need not divide 16)."""
DIVISOR = 16
"""in_features and out_features must both be multiples of this for float8 matmuls (torch._scaled_mm)."""


def supports_float8(major: int, minor: int) -> bool:
    """Whether a CUDA device of compute capability major.minor has FP8 tensor cores."""
    return (major, minor) >= MIN_CAPABILITY


def check_device(fsdp: FsdpSpec, device: torch.device) -> None:
    """Refuse float8 on a CUDA GPU without FP8 (on every rank, before any collective: each rank
    checks its own device, so a mixed node cannot leave one rank waiting for another). CPU runs
    are allowed: they use torchao's emulation."""
    if not fsdp.float8.enabled or device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if not supports_float8(major, minor):
        raise ConfigError(device_message(torch.cuda.get_device_name(device), major, minor))


def device_message(name: str, major: int, minor: int) -> str:
    return (
        f"spec.fsdp.float8.enabled: {name} (compute capability {major}.{minor}) has no FP8 tensor cores; "
        f"float8 training needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer "
        "(L4, L40S, H100, H200, B200): set fsdp.float8.enabled to false or run on such GPUs"
    )


def module_filter(module: nn.Module, fqn: str) -> bool:
    """torchtitan's filter: convert a linear unless it is the output projection or a LoRA
    adapter, or one of its dimensions is not a multiple of 16."""
    if not isinstance(module, nn.Linear):
        return False
    parts = fqn.split(".")
    if any(part in SKIPPED_MODULES for part in parts):
        return False
    if any(part.startswith("lora_") for part in parts):
        return False
    return module.in_features % DIVISOR == 0 and module.out_features % DIVISOR == 0


def linear_config(fsdp: FsdpSpec, device: torch.device) -> Any:
    """The torchao Float8LinearConfig for the spec: emulated on CPU."""
    from torchao.float8 import Float8LinearConfig

    spec = fsdp.float8
    emulate = device.type != "cuda"
    if spec.recipe is Float8Recipe.ROWWISE:
        return dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=emulate)
    return Float8LinearConfig(enable_fsdp_float8_all_gather=spec.all_gather, emulate=emulate)


def convert(model: nn.Module, fsdp: FsdpSpec, device: torch.device) -> list[str]:
    """Swap the chosen linears for Float8Linear in place (works on the meta-device model:
    parameters keep their names, so checkpoints and weight loading are unchanged); the converted
    modules' names, in model order."""
    if not fsdp.float8.enabled:
        return []
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    convert_to_float8_training(model, config=linear_config(fsdp, device), module_filter_fn=module_filter)
    return [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]


def precomputes_scales(fsdp: FsdpSpec) -> bool:
    """Whether FSDP2 all-gathers float8 weights, whose scales are then computed once per step."""
    return fsdp.float8.enabled and fsdp.float8.recipe is Float8Recipe.TENSORWISE and fsdp.float8.all_gather


def after_optimizer_step(model: nn.Module, fsdp: FsdpSpec) -> None:
    """With float8 all-gather: compute every float8 weight's scale from the updated shards in one
    all-reduce of amaxes (instead of one per weight in the next forward), as torchtitan does after
    optimizer.step()."""
    if not precomputes_scales(fsdp):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def plain_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with torchao's float8 all-gather weights (`WeightWithDynamicFloat8CastTensor`, which
    holds the high-precision weight as `_tensor`) replaced by that plain tensor. FSDP2's full state
    dict unwraps them as it all-gathers; on one rank nothing is gathered and the subclass stays,
    which safetensors (the export) cannot save (found by tests/trainer/test_feature_matrix.py)."""
    import sys

    module = sys.modules.get("torchao.float8.fsdp_utils")  # loaded only when float8 is on
    if module is None:
        return state
    wrapper = module.WeightWithDynamicFloat8CastTensor
    return {key: (value._tensor if isinstance(value, wrapper) else value) for key, value in state.items()}
