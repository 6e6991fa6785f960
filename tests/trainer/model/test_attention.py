"""attention.DOCUMENT_SDPA: per-example attention on packed CPU rows, transformers' SDPA otherwise."""

from __future__ import annotations

import pytest
import torch
from llamaft_trainer.model import attention
from llamaft_trainer.model.attention import DOCUMENT_SDPA, example_spans
from transformers import LlamaConfig, LlamaForCausalLM


def test_example_spans_start_wherever_the_position_restarts() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert example_spans(positions) == [[(0, 3), (3, 5), (5, 6)], [(0, 6)]]
    assert example_spans(torch.arange(6).unsqueeze(0)) is None, "nothing packed: nothing to split"


def tiny(implementation: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    config._attn_implementation = implementation
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("padding_mask", [False, True])
def test_the_same_logits_as_transformers_sdpa_and_a_split_only_for_a_block_diagonal_mask(
        padding_mask: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed position ids with no mask: split per example. The same position ids beside a 2D
    padding mask: transformers masks causally (and the padding), not per example, so neither
    does DOCUMENT_SDPA. Either way the logits are transformers' own."""
    split = []
    real = attention._per_example
    monkeypatch.setattr(attention, "_per_example", lambda *a: split.append(1) or real(*a))
    ids = torch.randint(0, 64, (2, 9))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2]])
    mask = torch.ones_like(ids) if padding_mask else None
    with torch.no_grad():
        want = tiny("sdpa")(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False).logits
        got = tiny(DOCUMENT_SDPA)(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert bool(split) is not padding_mask


def test_generation_runs_through_transformers_sdpa() -> None:
    ids = torch.randint(0, 64, (1, 5))
    out = [tiny(name).generate(input_ids=ids, max_new_tokens=4, do_sample=False) for name in ("sdpa", DOCUMENT_SDPA)]
    assert torch.equal(out[0], out[1])
