"""Attention over packed examples on CPU: each example's attention computed on its own.

Packed rows (bfd packing, `data.PackedExamples`) carry position ids that restart at 0 for each
example and no attention mask. transformers' `sdpa` turns that into a dense block-diagonal causal
mask (masking_utils.find_packed_sequence_indices), so SDPA computes the whole L x L score matrix
of a row whatever its examples' lengths, and the masked kernel cannot skip the upper triangle as
plain causal attention does. For the short examples packing is for, most of that work is thrown
away. This is what flash attention's varlen kernels avoid on a GPU (transformers derives their
cu_seqlens from the same position ids); on CPU there is no varlen kernel, so this module runs
SDPA per example (causal, no mask), which costs the sum of the examples' squares instead of the
block's square, and gives the same result the block-diagonal mask gives.

It is registered with transformers' AttentionInterface as `DOCUMENT_SDPA`, with transformers'
own `sdpa_mask` as its mask function, and the model runs with it where the spec says
`attnImplementation: sdpa` (model.build_meta_model). It splits a batch only when the mask
transformers built is exactly the block-diagonal causal mask of the examples the position ids
mark (checked once per forward), on CPU, outside a compiled graph. Anything else (padded
batches, a padding mask given beside packed positions, generation with a cache, CUDA, where
finding the examples would read the device from the host on every step, and torch.compile,
which cannot trace data-dependent splits) goes to transformers' own SDPA with that mask.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

DOCUMENT_SDPA = "llamaft_document_sdpa"


def example_spans(position_ids: torch.Tensor) -> list[list[tuple[int, int]]] | None:
    """Per row, the [start, end) of each example: a new example starts wherever the position id
    is 0. None when no row holds more than one example (nothing packed to split)."""
    starts = position_ids == 0
    if not bool(starts[:, 1:].any()):
        return None
    length = int(position_ids.shape[1])
    spans: list[list[tuple[int, int]]] = []
    for row in starts:
        edges = row.nonzero().flatten().tolist()
        if not edges or edges[0] != 0:
            edges.insert(0, 0)
        edges.append(length)
        spans.append([(s, e) for s, e in itertools.pairwise(edges) if e > s])
    return spans


def _per_example(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: list[list[tuple[int, int]]],
                 dropout: float, scaling: float | None) -> torch.Tensor:
    rows = []
    for b, row in enumerate(spans):
        parts = [F.scaled_dot_product_attention(query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e],
                                                dropout_p=dropout, scale=scaling, is_causal=True)
                 for s, e in row]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)


def block_diagonal_causal(spans: list[list[tuple[int, int]]], length: int) -> torch.Tensor:
    """(batch, length, length) bool: each token sees the tokens of its own span up to itself."""
    ids = torch.zeros(len(spans), length, dtype=torch.long)
    for b, row in enumerate(spans):
        for i, (s, e) in enumerate(row):
            ids[b, s:e] = i
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return (ids[:, :, None] == ids[:, None, :]) & causal


class _Spans:
    """The spans of the forward running now, or None where it is not a packed batch masked
    block-diagonally. Every decoder layer (and the recomputation under activation checkpointing)
    gets the same position ids and mask, so this is decided once per forward, not per layer."""

    def __init__(self) -> None:
        self.seen: tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor], int, int] | None = None
        self.spans: list[list[tuple[int, int]]] | None = None

    def of(self, position_ids: torch.Tensor, mask: torch.Tensor) -> list[list[tuple[int, int]]] | None:
        # The very tensors (weak references: a freed tensor's address may come back holding the
        # next batch), unmodified since.
        seen = self.seen
        if not (seen and seen[0]() is position_ids and seen[1]() is mask
                and (seen[2], seen[3]) == (position_ids._version, mask._version)):
            spans = example_spans(position_ids)
            if spans is not None and not (mask.dtype == torch.bool and mask.shape[1] == 1 and torch.equal(
                    mask[:, 0], block_diagonal_causal(spans, int(position_ids.shape[1])))):
                spans = None
            self.seen = (weakref.ref(position_ids), weakref.ref(mask), position_ids._version, mask._version)
            self.spans = spans
        return self.spans


_SPANS = _Spans()


def document_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature ((batch, heads, seq, dim) in, (batch, seq,
    heads, dim) out)."""
    position_ids = kwargs.get("position_ids")
    spans = None
    if (attention_mask is not None and attention_mask.dim() == 4 and position_ids is not None
            and query.device.type == "cpu" and not torch.compiler.is_compiling()
            and position_ids.shape == (query.shape[0], query.shape[2]) == attention_mask.shape[::2]
            and attention_mask.shape[-1] == key.shape[2] == query.shape[2]):
        spans = _SPANS.of(position_ids, attention_mask)
    if spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    out = _per_example(query, repeat_kv(key, groups), repeat_kv(value, groups), spans, dropout, scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(DOCUMENT_SDPA, document_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(DOCUMENT_SDPA, sdpa_mask)
