"""export.merged_weights: the merged export peft's own merge gives, computed in float32 and rounded
once to the training dtype, from a LoRA model rebuilt on the meta device (no copy of the model)."""

from __future__ import annotations

import copy

import pytest
import torch
from llamaft_trainer.checkpoint.export import merged_weights
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2)


def _trained(use_dora: bool) -> PeftModel:
    """A LoRA/DoRA model whose adapters hold values a training run could have left."""
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_dora=use_dora)
    model = get_peft_model(LlamaForCausalLM(CONFIG), lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
            if "magnitude" in name:
                param.mul_(1.05)
    return model


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_float32_merge_is_peft_merge_and_unload(use_dora: bool) -> None:
    model = _trained(use_dora)
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    got = merged_weights(model, CONFIG, dict(model.state_dict()))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[key], want[key]) for key in want)


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_a_bf16_model_is_merged_in_float32_and_rounded_once(use_dora: bool) -> None:
    """pure-bf16 training gathers bf16 weights: each merged weight is the float32 merge of those
    bf16 values rounded to bf16 once, closer to it than peft's merge in bf16."""
    model = _trained(use_dora).to(torch.bfloat16)
    exact = copy.deepcopy(model).float().merge_and_unload().state_dict()
    in_bf16 = copy.deepcopy(model).merge_and_unload().state_dict()
    got = merged_weights(model, CONFIG, dict(model.state_dict()))
    for key in exact:
        assert got[key].dtype == torch.bfloat16, key
        assert torch.equal(got[key], exact[key].to(torch.bfloat16)), key
    merged = [k for k in exact if any(p in k for p in ("q_proj", "v_proj", "down_proj"))]
    ours = sum((got[k].float() - exact[k]).abs().sum().item() for k in merged)
    peft_bf16 = sum((in_bf16[k].float() - exact[k]).abs().sum().item() for k in merged)
    assert ours < peft_bf16
