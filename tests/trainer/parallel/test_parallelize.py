"""parallelize.py's activation checkpointing recomputes what it should and changes nothing else
(the CPU overlap's equivalence with FSDP2's defaults: test_fsdp_matrix.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from llamaft.api.spec import CheckpointingMode, ShardingStrategy
from llamaft_trainer.parallel.parallelize import apply_activation_checkpointing, decoder_layers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from tests.trainer.tensor_memory import LiveBytes


def tiny(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def counted(model: LlamaForCausalLM) -> list[int]:
    """Calls of each decoder layer's MLP (a recomputed layer calls it again in backward). A pre-hook:
    non-reentrant recomputation stops as soon as the last saved tensor is back, inside the MLP."""
    counts = [0] * len(decoder_layers(model))
    for index, layer in enumerate(decoder_layers(model)):
        layer.mlp.register_forward_pre_hook(lambda *_, i=index: counts.__setitem__(i, counts[i] + 1))
    return counts


def step(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    ids = torch.arange(24).remainder(64).view(2, 12)
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("mode", "every_n", "recomputed"), [
    (CheckpointingMode.NONE, 1, [1, 1, 1, 1]),
    (CheckpointingMode.FULL, 1, [2, 2, 2, 2]),
    (CheckpointingMode.SELECTIVE, 2, [2, 1, 2, 1]),
])
def test_checkpointed_layers_recompute_in_backward_and_nothing_else_changes(
        mode: CheckpointingMode, every_n: int, recomputed: list[int]) -> None:
    reference, model = tiny(), tiny()
    expected = step(reference)
    wrapped = apply_activation_checkpointing(decoder_layers(model), mode, every_n)
    counts = counted(model)
    got = step(model)
    assert counts == recomputed and wrapped == sum(c == 2 for c in recomputed)
    # Same parameter names (checkpoints and the loading code see the same model), same gradients.
    assert list(model.state_dict()) == list(reference.state_dict())
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)



def full_step(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """`step` without Hugging Face's KV cache (as the trainer calls the model): a cache filled in
    forward changes what the recompute computes, which selective checkpointing refuses."""
    ids = torch.arange(24).remainder(64).view(2, 12)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_selective_op_gradients_are_bitwise_those_without_checkpointing() -> None:
    reference, model = tiny(), tiny()
    expected = full_step(reference)
    assert apply_activation_checkpointing(decoder_layers(model), CheckpointingMode.SELECTIVE_OP, 2) == 4
    got = full_step(model)
    assert list(model.state_dict()) == list(reference.state_dict())
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


class MatmulCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.mm += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


def test_selective_op_recomputes_every_second_matmul() -> None:
    """Backward's matmuls: two per projection (input and weight gradients) and the LM head's, plus
    what the recompute runs: selective-op recomputes the 2nd, 4th and 6th of a layer's 7
    projections (k, o, up); the kept q, v, gate and down outputs come from its cache."""
    counts = {}
    for mode in (CheckpointingMode.NONE, CheckpointingMode.SELECTIVE_OP):
        model = tiny()
        apply_activation_checkpointing(decoder_layers(model), mode, 2)
        ids = torch.arange(24).remainder(64).view(2, 12)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        with MatmulCount() as count:
            loss.backward()
        counts[mode] = count.mm
    assert counts[CheckpointingMode.NONE] == 4 * 7 * 2 + 2
    assert counts[CheckpointingMode.SELECTIVE_OP] == counts[CheckpointingMode.NONE] + 4 * 3


def activation_bytes(mode: CheckpointingMode, tokens: tuple[int, int] = (2, 12)) -> int:
    """Bytes the decoder layers keep between forward and backward (LiveBytes: storages created in
    forward still alive; saved_tensors_hooks cannot see inside a checkpointed region)."""
    model = tiny()
    apply_activation_checkpointing(decoder_layers(model), mode, 2)
    batch, seq = tokens
    ids = torch.arange(batch * seq).remainder(64).view(batch, seq)
    hidden = model.model.embed_tokens(ids).detach().requires_grad_()
    positions = torch.arange(seq).unsqueeze(0)
    rotary = model.model.rotary_emb(hidden, positions)
    with LiveBytes() as live:
        out = hidden
        for layer in decoder_layers(model):
            out = layer(out, position_embeddings=rotary, attention_mask=None, position_ids=positions)
        kept = live.now
        out.sum().backward()
    return kept


def test_selective_op_keeps_activations_between_none_and_full_as_the_planner_says() -> None:
    from llamaft.api.spec import MixedPrecision
    from llamaft.planner.memory import Setup, op_sac_saved_bytes
    from llamaft.planner.shapes import ModelShape

    none, full, op = (activation_bytes(m) for m in (CheckpointingMode.NONE, CheckpointingMode.FULL,
                                                      CheckpointingMode.SELECTIVE_OP))
    assert full < op < none
    tokens = 2 * 12
    # 4 layers of the tiny Llama, fp32 on CPU: what the planner counts per layer
    shape = ModelShape(name="tiny", hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                       head_dim=8, vocab_size=64)
    setup = Setup(strategy=ShardingStrategy.FULL_SHARD, world_size=1, shard_size=1, precision=MixedPrecision.FP32,
                  batch=2, seq=12, ac_mode=CheckpointingMode.SELECTIVE_OP, device="cpu")
    assert full == 4 * 4 * 32 * tokens  # each layer's input only
    assert op == 4 * op_sac_saved_bytes(shape, setup, tokens)
    # input, q, v, gate, down, the attention output and its log-sum-exp
    assert op == 4 * tokens * 4 * (32 + 32 + 16 + 64 + 32 + 32 + 4 * 4 / 4)


def test_the_adapter_of_a_compiled_model_is_selected_by_the_names_its_state_dict_keys_have() -> None:
    """torch.compile's wrappers add `_orig_mod` to the module names and distributed checkpoint's
    state dicts leave it out: peft, which selects the adapter by its modules' names, found none of
    a compiled model's LoRA weights (an empty exported adapter) until the wrappers are set aside."""
    from llamaft_trainer.parallel.parallelize import apply_compile, compile_wrappers_removed
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    layers = decoder_layers(model)
    apply_compile(layers)
    compiled = list(layers)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert not any("_orig_mod" in key for key in state)
    assert get_peft_model_state_dict(model, state_dict=state) == {}, "peft's own behaviour this works around"
    with compile_wrappers_removed(model) as plain:
        adapter = get_peft_model_state_dict(plain, state_dict=state)
        assert not any(hasattr(layer, "_orig_mod") for layer in decoder_layers(plain))
    assert sorted(adapter) == sorted(
        f"base_model.model.model.layers.{i}.self_attn.{p}.lora_{ab}.weight"
        for i in range(2) for p in ("q_proj", "v_proj") for ab in "AB")
    assert list(decoder_layers(model)) == compiled, "the compiled layers are back in place"
