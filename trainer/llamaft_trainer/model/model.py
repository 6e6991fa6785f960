"""Model step: tokenizer, config and a meta-device model (the files come through downloads.py).

Every rank builds the model on the meta device (no memory). After `parallelize` shards it, each
rank allocates only its shards and `loading.load_weights` streams the pretrained tensors into them
(loading.py). The previous path (global rank 0 reads the whole model with `from_pretrained` and
broadcasts it with `set_model_state_dict(..., broadcast_from_rank0=True)`) stays for checkpoints
that are not safetensors and as `LLAMAFT_WEIGHT_LOADING=full`: `read_full_state_dict`.
"""

from __future__ import annotations

from typing import Any

import torch
from llamaft.api.spec import AttentionImplementation, LoraSpec, MixedPrecision, ModelSpec
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from llamaft_trainer.model.attention import DOCUMENT_SDPA
from llamaft_trainer.process.errors import ConfigError
from llamaft_trainer.process.runtime import Runtime
from llamaft_trainer.sources.downloads import hf_token, raise_hub_error, resolve

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_tokenizer(spec: ModelSpec, rt: Runtime) -> PreTrainedTokenizerBase:
    what = "spec.model.tokenizer" if spec.tokenizer else "spec.model.source"
    where = resolve(spec.tokenizer or spec.source, rt, what, revision=spec.revision, weights=False)
    try:
        tok = AutoTokenizer.from_pretrained(where, revision=spec.revision, token=hf_token())
    except Exception as exc:
        raise_hub_error(exc, what, spec.tokenizer or spec.source, spec.revision)
        raise ConfigError(
            f"spec.model: no usable tokenizer at {where} ({type(exc).__name__}: {exc}); "
            "set spec.model.tokenizer to a location holding tokenizer files"
        ) from exc
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model_config(spec: ModelSpec, rt: Runtime) -> PretrainedConfig:
    where = resolve(spec.source, rt, "spec.model.source", revision=spec.revision, weights=False)
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(where, revision=spec.revision, token=hf_token())
        return config
    except Exception as exc:
        raise_hub_error(exc, "spec.model.source", spec.source, spec.revision)
        raise ConfigError(f"spec.model.source: cannot read a model config at {where}: {exc}") from exc
def master_dtype(precision: MixedPrecision) -> torch.dtype:
    """dtype of the sharded parameters the optimizer updates."""
    return torch.bfloat16 if precision is MixedPrecision.PURE_BF16 else torch.float32


def attention_function(spec: ModelSpec) -> str:
    """transformers' attention implementation for the spec's: `sdpa` runs as attention.DOCUMENT_SDPA,
    which is transformers' SDPA except that packed CPU batches attend per example."""
    if spec.attn_implementation is AttentionImplementation.SDPA:
        return DOCUMENT_SDPA
    return spec.attn_implementation.value


def build_meta_model(config: PretrainedConfig, spec: ModelSpec, dtype: torch.dtype) -> nn.Module:
    config._attn_implementation = attention_function(spec)
    with torch.device("meta"):
        model: nn.Module = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def apply_lora(model: nn.Module, lora: LoraSpec) -> nn.Module:
    """Wrap with peft LoRA adapters (DoRA with `useDora`); only adapter weights (and DoRA's
    magnitudes) stay trainable. On a meta model DoRA's magnitudes are placeholders: the loader
    computes them from the real base weights (loading.Magnitude)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules), task_type="CAUSAL_LM", use_dora=lora.use_dora,
    )
    try:
        peft_model: nn.Module = get_peft_model(model, config)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ConfigError(f"spec.training.lora.targetModules: {exc}") from exc
    if lora.use_dora:
        check_dora_layers(peft_model)
    return peft_model


def check_dora_layers(model: nn.Module) -> None:
    """DoRA only on plain Linear layers (weight [out, in], no fan_in_fan_out): their magnitude is
    the norm of each weight row, and a rank holds whole rows of its shard (dim 0), so every rank
    computes its own magnitudes (loading.Magnitude). An embedding's magnitude is a norm over every
    row, a Conv1D's over its columns: refused on every rank, before any collective."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    for name, module in model.named_modules():
        magnitudes = getattr(module, "lora_magnitude_vector", None)
        if not isinstance(magnitudes, nn.ModuleDict) or len(magnitudes) == 0:
            continue
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        if not isinstance(module, LoraLinear) or not isinstance(base, nn.Linear) or getattr(module, "fan_in_fan_out", False):
            short = name.removeprefix("base_model.model.")
            raise ConfigError(
                f"spec.training.lora.useDora: DoRA applies to linear layers only, and targetModules adapts "
                f"{short} ({type(base).__name__}): remove it from targetModules or set useDora: false"
            )


def read_full_state_dict(spec: ModelSpec, rt: Runtime, dtype: torch.dtype, lora: LoraSpec | None, seed: int) -> dict[str, Any]:
    """The previous path, global rank 0 only: the whole pretrained model (plus freshly initialised
    adapters) on CPU. Kept for checkpoints that are not safetensors and LLAMAFT_WEIGHT_LOADING=full."""
    where = resolve(spec.source, rt, "spec.model.source", revision=spec.revision)
    try:
        model: nn.Module = AutoModelForCausalLM.from_pretrained(
            where, revision=spec.revision, token=hf_token(), dtype=dtype,
            attn_implementation=spec.attn_implementation.value,
        )
    except Exception as exc:
        raise_hub_error(exc, "spec.model.source", spec.source, spec.revision)
        raise ConfigError(f"spec.model.source: cannot load weights from {where}: {exc}") from exc
    if lora is not None and lora.enabled:
        torch.manual_seed(seed)
        model = apply_lora(model, lora)
    return {k: v for k, v in model.state_dict().items()}


def rebuild_rotary_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (RoPE inverse frequencies) are not in any state dict: after the
    meta model is materialised with `to_empty` they hold garbage and must be recomputed."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf.to(device))

