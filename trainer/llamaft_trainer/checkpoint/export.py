"""Export step: consolidated Hugging Face safetensors (or the LoRA adapter) at the end of a run.

The result loads with `AutoModelForCausalLM.from_pretrained(path)`. A LoRA run writes, by
`training.lora.export`: the adapter (`PeftModel.from_pretrained` on the base model), the adapter
merged into the base weights by peft's own `merge_and_unload` (a plain model), or both (the merged
model, the adapter in `adapter/`). Written to a local staging folder by rank 0, then copied to the
destination, so URIs work too.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import fsspec
import torch
from llamaft.api.spec import LoraExport
from torch import nn
from transformers import PretrainedConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from llamaft_trainer.checkpoint.dcp import full_model_state_dict
from llamaft_trainer.parallel.parallelize import compile_wrappers_removed


def export_hugging_face(
    model: nn.Module,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    destination: str,
    *,
    rank: int,
    dtype: torch.dtype,
    lora: bool,
    lora_export: LoraExport = LoraExport.ADAPTER,
) -> str:
    """Gather the weights (collective: every rank calls this) and write them on rank 0."""
    state = full_model_state_dict(model)
    if rank != 0:
        return destination
    # The peft model inside DDP (NO_SHARD in full precision): its peft_config and adapter names are
    # the inner module's (found by tests/trainer/test_feature_matrix.py).
    from torch.nn.parallel import DistributedDataParallel

    model = model.module if isinstance(model, DistributedDataParallel) else model
    with tempfile.TemporaryDirectory(prefix="llamaft-export-") as tmp:
        staging = Path(tmp)
        if lora and lora_export is LoraExport.ADAPTER:
            _save_adapter(model, state, staging)
        elif lora:
            if lora_export is LoraExport.BOTH:
                _save_adapter(model, state, staging / "adapter")
                tokenizer.save_pretrained(staging / "adapter")
            _save_weights(merged_weights(model, config, state), config, staging, dtype)
        else:
            _save_weights(state, config, staging, dtype)
        tokenizer.save_pretrained(staging)
        fs, root = fsspec.core.url_to_fs(destination)
        if fs.exists(root):
            fs.rm(root, recursive=True)
        fs.makedirs(root, exist_ok=True)
        for file in sorted(p for p in staging.rglob("*") if p.is_file()):
            relative = file.relative_to(staging).as_posix()
            if "/" in relative:
                fs.makedirs(f"{root.rstrip('/')}/{relative.rsplit('/', 1)[0]}", exist_ok=True)
            fs.put_file(str(file), f"{root.rstrip('/')}/{relative}")
    return destination


def _save_weights(state: dict[str, Any], config: PretrainedConfig, staging: Path, dtype: torch.dtype) -> None:
    from huggingface_hub import save_torch_state_dict

    weights = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    save_torch_state_dict(weights, staging, max_shard_size="5GB")
    config.dtype = dtype
    config.save_pretrained(staging)


def merged_weights(model: nn.Module, config: PretrainedConfig, state: dict[str, Any]) -> dict[str, Any]:
    """The base model's weights with the trained adapters merged in, by peft itself: a LoRA model
    of the same structure built on the meta device takes the gathered tensors in place (no copy
    of the model), and `merge_and_unload` folds each adapter into its base layer."""
    import copy

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    peft_config: Any = copy.deepcopy(model.peft_config["default"])  # type: ignore[index]
    peft_config.inference_mode = False
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    peft_model = get_peft_model(skeleton, peft_config)
    result = peft_model.load_state_dict(state, assign=True, strict=False)
    if result.unexpected_keys or result.missing_keys:
        tied = {k for k in result.missing_keys if "lm_head" in k} if getattr(config, "tie_word_embeddings", False) else set()
        if result.unexpected_keys or set(result.missing_keys) - tied:
            raise RuntimeError(f"merging the adapters: the gathered weights do not fit the LoRA model "
                               f"(missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]})")
    _merge_in_full_precision(peft_model)
    merged: Any = peft_model.unload()  # the base layers, each already holding its merged weight
    if getattr(config, "tie_word_embeddings", False):
        merged.tie_weights()
    return {k: v for k, v in merged.state_dict().items() if v.device.type != "meta"}


def _merge_in_full_precision(peft_model: nn.Module) -> None:
    """Fold each adapter into its base layer computing in float32, one layer at a time, and round
    the result once to the layer's own dtype. With `pure-bf16` the gathered weights are bf16, and
    peft's merge in bf16 rounds at every step of DoRA's weight norm (W + BA) * m / ||W + BA||: the
    merged model's logits then strayed from the adapter's by a few percent (found by
    tests/trainer/test_feature_matrix.py). One layer's float32 copy at a time keeps rank 0's memory
    at the gathered model's."""
    from peft.tuners.lora import LoraLayer

    for module in peft_model.modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        weight = base.weight
        assert isinstance(weight, torch.Tensor)
        dtype = weight.dtype
        module.float()
        module.merge()
        base.to(dtype)


def _save_adapter(model: nn.Module, state: dict[str, Any], staging: Path) -> None:
    from peft import get_peft_model_state_dict

    staging.mkdir(parents=True, exist_ok=True)
    with compile_wrappers_removed(model):
        adapter = get_peft_model_state_dict(model, state_dict=state)  # type: ignore[arg-type]
    if not adapter:
        raise RuntimeError("the LoRA adapter to export holds no tensor: peft matched none of the trained model's "
                           f"{len(state)} state entries to its LoRA modules")
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in adapter.items()}, str(staging / "adapter_model.safetensors"))
    model.peft_config["default"].save_pretrained(str(staging))  # type: ignore[union-attr,index,operator]
