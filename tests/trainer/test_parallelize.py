"""parallelize.py's activation checkpointing recomputes what it should and changes nothing else
(the CPU overlap's equivalence with FSDP2's defaults: test_fsdp_matrix.py)."""

from __future__ import annotations

import pytest
import torch
from llamaft.api.spec import CheckpointingMode
from llamaft_trainer.parallelize import apply_activation_checkpointing, decoder_layers
from transformers import LlamaConfig, LlamaForCausalLM


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

