"""Chunked cross-entropy (training.lossChunks): the LM head and the loss over slices of the sequence.

Unchunked, a micro-batch's loss materialises the logits of every position at once: the head's
output in the compute dtype, its fp32 copy and log-softmax's fp32 output in forward, and in
backward the saved log-softmax plus two fp32 gradients (12 bytes per vocabulary entry per token at
the peak; 128k vocabulary x 8k tokens is 12 GiB per sequence). Here the decoder's final hidden
states are computed once and split along the sequence into N slices; each slice's logits are
computed, upcast to fp32 and reduced to a summed loss inside `torch.utils.checkpoint` (non-
reentrant), which keeps only the slice's hidden states (a view of tensors kept anyway) and
recomputes the slice's logits in backward, one slice at a time. Peak logits memory: one slice's.
The price: the head's forward runs twice. (torchtune's CEWithChunkedOutputLoss splits the same
way but keeps every chunk's logits for backward; checkpointing each chunk is what frees them.)

The FSDP question. The root FSDP unit (the embedding, the final norm and the LM head live in it)
all-gathers its parameters in its forward pre-hook and registers the hooks that unshard them again
for backward and reduce-scatter their gradients on the root's outputs; calling the decoder and the
head from outside the root's forward would meet sharded parameters and skip those hooks. So the
chunked computation *is* the forward of the root's call: the Hugging Face causal LM's `forward`
is replaced, for the duration of one call, by one that returns the loss sum, and the model is
called as always (`model(...)`, through FSDP2's or FSDP1's root, peft's wrapper and whatever
hooks they hold). Backward's recompute then runs while the root is unsharded for backward, and
the head's gradient reaches the root's reduce-scatter as the unchunked path's does. It needs no
extra FSDP unit (a tied LM head shares its weight with the embedding, which a separate unit could
not hold) and no private FSDP call. A LoRA-adapted head (peft's `lora.Linear`) is called as a
module, so its adapter and dropout (replayed with the RNG state by the checkpoint) are included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from transformers import PreTrainedModel

from llamaft_trainer.data.encoding import IGNORE_INDEX


def causal_lm(model: nn.Module) -> PreTrainedModel:
    """The Hugging Face causal LM inside FSDP1's wrapper or peft's: the module with an LM head."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module.get_output_embeddings() is not None:
            return module
    raise ValueError("training.lossChunks: the model has no LM head (get_output_embeddings): is it a causal LM?")


def chunked_cross_entropy_sum(hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module, chunks: int) -> torch.Tensor:
    """Sum over the target positions of cross-entropy(head(hidden).float(), targets), computed over
    `chunks` slices of the sequence (dim 1; sizes differ by at most one where it does not divide,
    empty ones skipped). With gradients enabled each slice is checkpointed (its logits recomputed
    in backward); without (evaluation), slices run one after the other and are freed."""
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for h, t in zip(torch.tensor_split(hidden, chunks, dim=1), torch.tensor_split(targets, chunks, dim=1), strict=True):
        if h.size(1) == 0:
            continue
        if torch.is_grad_enabled():
            part = torch.utils.checkpoint.checkpoint(_head_loss_sum, head, h, t, use_reentrant=False)
        else:
            part = _head_loss_sum(head, h, t)
        total = total + part
    return total


def _head_loss_sum(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


@contextlib.contextmanager
def _forward_replaced(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """`module.forward` is `forward` inside the block; the module's own forward again after."""
    own = module.__dict__.get("forward")
    module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own  # type: ignore[method-assign]


def chunked_token_loss_sum(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                           labels: torch.Tensor, chunks: int, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The summed next-token loss of `model` (the trainer's model: plain, peft-wrapped, FSDP2 or
    FSDP1) with the head and loss over `chunks` slices, computed as the forward of the root's own
    call (see the module docstring). `position_ids` (packed examples, no attention mask) reach
    the decoder as they would the unchunked model."""
    lm = causal_lm(model)

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor,
                position_ids: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        hidden = lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=False).last_hidden_state
        return chunked_cross_entropy_sum(hidden[:, :-1], labels[:, 1:], lm.get_output_embeddings(), chunks)

    with _forward_replaced(lm, forward):
        loss: torch.Tensor = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   labels=labels)
    return loss
