"""Model step: tokenizer, config and a meta-device model, then weights read once.

Every rank builds the model on the meta device (no memory). After `parallelize` shards it, each
rank allocates only its shards and global rank 0 alone reads the pretrained weights from disk and
broadcasts them (`set_model_state_dict(..., broadcast_from_rank0=True)`), so host RAM does not
grow with the number of ranks per node. The reading itself is transformers' `from_pretrained`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from llamaft.api.sources import SourceKind, parse_source
from llamaft.api.spec import LoraSpec, MixedPrecision, ModelSpec
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from llamaft_trainer.errors import ConfigError
from llamaft_trainer.runtime import Runtime

CACHE_ROOT = Path(os.environ.get("LLAMAFT_CACHE", "/tmp/llamaft-cache"))
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _hf_token() -> str | None:
    return os.environ.get("HF_TOKEN") or None


def resolve(text: str, rt: Runtime, what: str) -> str:
    """A location `from_pretrained` can read: hub ids stay ids; fsspec URIs are copied to a
    node-local cache by the local leader (the other ranks of the node wait at a barrier)."""
    src = parse_source(text)
    if src.kind is SourceKind.HUB:
        return src.location
    if src.kind is SourceKind.URI:
        target = CACHE_ROOT / hashlib.sha256(text.encode()).hexdigest()[:16]
        if rt.is_local_leader and not (target / ".complete").exists():
            import fsspec

            try:
                fs, root = fsspec.core.url_to_fs(text)
                fs.get(root.rstrip("/") + "/", str(target) + "/", recursive=True)
            except Exception as exc:
                raise ConfigError(f"{what}: cannot read {text}: {exc}") from exc
            (target / ".complete").touch()
        if dist.is_initialized():
            dist.barrier()
        return str(target)
    path = Path(src.location).expanduser()
    if not path.exists():
        raise ConfigError(f"{what}: {text} does not exist (resolved to {path}); check the path or the PVC mount")
    return str(path)


def load_tokenizer(spec: ModelSpec, rt: Runtime) -> PreTrainedTokenizerBase:
    where = resolve(spec.tokenizer or spec.source, rt, "spec.model.tokenizer" if spec.tokenizer else "spec.model.source")
    try:
        tok = AutoTokenizer.from_pretrained(where, revision=spec.revision, token=_hf_token())
    except Exception as exc:
        raise ConfigError(
            f"spec.model: no usable tokenizer at {where} ({type(exc).__name__}: {exc}); "
            "set spec.model.tokenizer to a location holding tokenizer files"
        ) from exc
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_config(spec: ModelSpec, rt: Runtime) -> PretrainedConfig:
    where = resolve(spec.source, rt, "spec.model.source")
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(where, revision=spec.revision, token=_hf_token())
        return config
    except Exception as exc:
        raise ConfigError(f"spec.model.source: cannot read a model config at {where}: {exc}") from exc


def master_dtype(precision: MixedPrecision) -> torch.dtype:
    """dtype of the sharded parameters the optimizer updates."""
    return torch.bfloat16 if precision is MixedPrecision.PURE_BF16 else torch.float32


def build_meta_model(config: PretrainedConfig, spec: ModelSpec, dtype: torch.dtype) -> nn.Module:
    config._attn_implementation = spec.attn_implementation.value
    with torch.device("meta"):
        model: nn.Module = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def apply_lora(model: nn.Module, lora: LoraSpec) -> nn.Module:
    """Wrap with peft LoRA adapters; only adapter weights stay trainable."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules), task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ConfigError(f"spec.training.lora.targetModules: {exc}") from exc


def read_full_state_dict(spec: ModelSpec, rt: Runtime, dtype: torch.dtype, lora: LoraSpec | None, seed: int) -> dict[str, Any]:
    """Global rank 0 only: the pretrained weights (plus freshly initialised adapters) on CPU."""
    where = resolve(spec.source, rt, "spec.model.source")
    try:
        model: nn.Module = AutoModelForCausalLM.from_pretrained(
            where, revision=spec.revision, token=_hf_token(), dtype=dtype,
            attn_implementation=spec.attn_implementation.value,
        )
    except Exception as exc:
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

