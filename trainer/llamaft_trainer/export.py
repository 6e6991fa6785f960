"""Export step: consolidated Hugging Face safetensors (or the LoRA adapter) at the end of a run.

The result loads with `AutoModelForCausalLM.from_pretrained(path)` (LoRA: `PeftModel.from_pretrained`
on the base model). Written to a local staging folder by rank 0, then copied to the destination, so
URIs work too.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import fsspec
import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from llamaft_trainer.checkpoint import full_model_state_dict


def export_hugging_face(
    model: nn.Module,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    destination: str,
    *,
    rank: int,
    dtype: torch.dtype,
    lora: bool,
) -> str:
    """Gather the weights (collective: every rank calls this) and write them on rank 0."""
    state = full_model_state_dict(model)
    if rank != 0:
        return destination
    with tempfile.TemporaryDirectory(prefix="llamaft-export-") as tmp:
        staging = Path(tmp)
        if lora:
            _save_adapter(model, state, staging)
        else:
            from huggingface_hub import save_torch_state_dict

            weights = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
            save_torch_state_dict(weights, staging, max_shard_size="5GB")
            config.dtype = dtype
            config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        fs, root = fsspec.core.url_to_fs(destination)
        if fs.exists(root):
            fs.rm(root, recursive=True)
        fs.makedirs(root, exist_ok=True)
        for file in sorted(staging.iterdir()):
            fs.put_file(str(file), f"{root.rstrip('/')}/{file.name}")
    return destination


def _save_adapter(model: nn.Module, state: dict[str, Any], staging: Path) -> None:
    from peft import get_peft_model_state_dict

    adapter = get_peft_model_state_dict(model, state_dict=state)  # type: ignore[arg-type]
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in adapter.items()}, str(staging / "adapter_model.safetensors"))
    model.peft_config["default"].save_pretrained(str(staging))  # type: ignore[union-attr,index,operator]
