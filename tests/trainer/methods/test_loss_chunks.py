"""training.lossChunks: the chunked LM head + cross-entropy (methods/sft.py) gives the unchunked loss and
gradients, and never holds more than one chunk's logits (single process; 1 and 2 ranks under
FSDP: test_loss_chunks_fsdp.py).

Tolerances (fp32): the loss is a sum of per-chunk sums instead of one sum, the hidden states'
gradient a sum of per-chunk contributions, and a chunk's matmul may block differently: relative
1e-6 on the loss; every gradient element within 1e-5 relative or 2e-6 of its tensor's largest
magnitude (measured: at most 4e-7 of it, 1.2e-6 absolute).
"""

from __future__ import annotations

import pytest
import torch
from llamaft_trainer.data.encoding import IGNORE_INDEX
from llamaft_trainer.methods.sft import causal_lm, chunked_cross_entropy_sum
from llamaft_trainer.train import token_loss_sum
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from tests.trainer.tensor_memory import LiveBytes

VOCAB = 256


def tiny(seed: int = 0, tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def lora(model: nn.Module, targets: list[str]) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                                                  task_type="CAUSAL_LM"))
    # peft's B starts at 0; move it so the adapters change the logits and receive gradients
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return peft_model


def batch(seq: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    """Two sequences, the second padded (mask 0, labels ignored) and its prompt not trained on."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, seq), generator=g)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, -3:] = 0
    labels = ids.clone()
    labels[1, -3:] = IGNORE_INDEX
    labels[1, :4] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss_and_grads(model: nn.Module, chunks: int, b: dict[str, torch.Tensor]) -> tuple[float, int, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss, n = token_loss_sum(model, b, torch.device("cpu"), chunks)
    loss.backward()
    return float(loss.detach()), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


BUILDS = {
    "plain": lambda: tiny(),
    "tied": lambda: tiny(tied=True),
    "lora": lambda: lora(tiny(), ["q_proj", "v_proj"]),
    "lora-lm_head": lambda: lora(tiny(), ["q_proj", "v_proj", "lm_head"]),
}


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("chunks", [2, 3, 5, 64])
def test_same_loss_and_gradients_as_one_chunk(build: str, chunks: int) -> None:
    """3 and 5 do not divide the 11 target positions; 64 leaves most chunks empty."""
    model = BUILDS[build]()
    b = batch()
    want_loss, want_n, want = loss_and_grads(model, 1, b)
    got_loss, got_n, got = loss_and_grads(model, chunks, b)
    assert got_n == want_n == 11 + 11 - 3 - 3  # the padded tail and the 4 prompt labels (one is shifted out)
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    assert got.keys() == want.keys() and want
    if build.startswith("lora"):
        assert any("lora" in k for k in got) and not any(k.endswith("base_layer.weight") for k in got)
    if build == "lora-lm_head":
        assert any("lm_head.lora" in k for k in got)
    for name in want:
        scale = float(want[name].abs().max())
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=2e-6 * scale, msg=lambda m, n=name: f"{n}: {m}")
    # the model's own forward is back
    assert "forward" not in causal_lm(model).__dict__


def test_evaluation_loss_unchanged_and_nothing_kept() -> None:
    model = tiny().eval()
    b = batch(seq=40)
    with torch.no_grad():
        want, n1 = token_loss_sum(model, b, torch.device("cpu"), 1)
        got, n4 = token_loss_sum(model, b, torch.device("cpu"), 4)
    assert n1 == n4 and float(got) == pytest.approx(float(want), rel=1e-6)
    assert got.grad_fn is None


def _logits_bytes(chunks: int, seq: int) -> tuple[int, int]:
    """Peak live bytes of vocab-wide tensors (logits, their fp32 copies, log-softmax, their
    gradients) over one forward + backward, and the bytes still alive between them."""
    model = tiny()
    b = batch(seq=seq)
    with LiveBytes(which=lambda t: t.dim() > 0 and t.size(-1) == VOCAB) as live:
        loss, _ = token_loss_sum(model, b, torch.device("cpu"), chunks)
        kept = live.now
        loss.backward()
    return live.peak, kept


def test_peak_logits_memory_divided_by_the_chunks() -> None:
    seq = 65  # 64 target positions: 4 and 8 chunks of 16 and 8
    one, kept_one = _logits_bytes(1, seq)
    positions = 2 * (seq - 1)
    # unchunked (fp32 model: .float() is the same tensor): the logits, cross_entropy's flattened
    # copy of their shifted slice and log-softmax's output, 12 bytes per vocabulary entry per
    # position; log-softmax's output stays for backward
    assert one >= 12 * VOCAB * positions
    assert kept_one >= 4 * VOCAB * positions
    for chunks in (4, 8):
        peak, kept = _logits_bytes(chunks, seq)
        assert kept == 0, "the checkpointed chunks keep no logits for backward"
        assert one / peak == pytest.approx(chunks, rel=0.1), (one, peak)


def test_chunk_checkpoint_keeps_nothing_vocab_wide_with_uneven_chunks() -> None:
    hidden = torch.randn(2, 13, 8, requires_grad=True)
    head = nn.Linear(8, VOCAB, bias=False)
    targets = torch.randint(0, VOCAB, (2, 13))
    with LiveBytes(which=lambda t: t.dim() > 0 and t.size(-1) == VOCAB) as live:
        loss = chunked_cross_entropy_sum(hidden, targets, head, 5)
        kept = live.now
    want = nn.functional.cross_entropy(head(hidden).reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
    assert kept == 0 and float(loss) == pytest.approx(float(want), rel=1e-6)
    loss.backward()
    got = hidden.grad.clone()
    hidden.grad = None
    want.backward()
    torch.testing.assert_close(got, hidden.grad, rtol=1e-5, atol=2e-6 * float(hidden.grad.abs().max()))


def test_a_model_without_an_lm_head_is_refused_with_the_field() -> None:
    with pytest.raises(ValueError, match="training.lossChunks"):
        causal_lm(tiny().model)
