"""The block layout of packed data: which examples share each `maxSeqLength` sequence.

`bfd_layout` is best-fit decreasing as TRL's `pack_dataset(strategy="bfd")` (trl/data_utils.py,
`_pack_bfd`, TRL 0.2x): examples sorted by length, longest first (stable: equal lengths keep their
order), each placed whole into the open block with the least room that still holds it, a new
block opened when none does; blocks come out in the order they were opened, examples inside a
block in the order they were placed. TRL finds the best fit with a segment tree over the room
left; here a sorted list of the distinct room values (at most `capacity` of them) with bisect gives
the same choice (among blocks with equal room, the one that reached it first, as TRL's deque).

The layout is a pure function of the lengths, computed once when the token store is built
(store.py keeps it beside the part's tokens) and shown by `llamaft data preview` through the same
function. An example longer than `capacity` cannot be placed whole; the store never holds one
(examples are cut to maxSeqLength when tokenized), and here it is an error.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence

import numpy as np

__all__ = ["bfd_layout", "fill_ratio", "flatten_layout"]


def bfd_layout(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Blocks of example indices (into `lengths`), best-fit decreasing into `capacity` tokens each.
    Zero-length examples are left out (they carry nothing). Deterministic: the same lengths give
    the same layout on every rank and every attempt."""
    if capacity < 1:
        raise ValueError(f"bfd_layout: capacity must be at least 1, got {capacity}")
    sizes = np.asarray(lengths, dtype=np.int64)
    if sizes.size and int(sizes.max()) > capacity:
        longest = int(np.argmax(sizes))
        raise ValueError(
            f"bfd_layout: example {longest} has {int(sizes[longest])} tokens, more than a block's {capacity}: "
            "examples must be cut to maxSeqLength before packing"
        )
    order = np.argsort(-sizes, kind="stable")
    blocks: list[list[int]] = []
    room: list[int] = []
    rooms: list[int] = []  # the distinct room values of the open blocks that still have room, ascending
    holders: dict[int, deque[int]] = {}  # room -> the blocks with that room, in the order they got it
    for index, size in zip(order.tolist(), sizes[order].tolist(), strict=True):
        if size == 0:
            continue
        at = bisect.bisect_left(rooms, size)
        if at < len(rooms):
            space = rooms[at]
            queue = holders[space]
            block = queue.popleft()
            if not queue:
                del holders[space]
                del rooms[at]
        else:
            block = len(blocks)
            blocks.append([])
            room.append(capacity)
        blocks[block].append(index)
        room[block] -= size
        left = room[block]
        if left > 0:
            if left not in holders:
                holders[left] = deque()
                bisect.insort(rooms, left)
            holders[left].append(block)
    return blocks


def flatten_layout(blocks: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(example indices in block order, block offsets): block b is examples[offsets[b]:offsets[b + 1]].
    The form the token store keeps."""
    offsets = np.zeros(len(blocks) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blocks], out=offsets[1:])
    examples = np.fromiter((i for b in blocks for i in b), dtype=np.int64, count=int(offsets[-1]))
    return examples, offsets


def fill_ratio(lengths: Sequence[int] | np.ndarray, blocks: int, capacity: int) -> float:
    """Real tokens over the blocks' capacity (1.0: no room left anywhere)."""
    return float(np.asarray(lengths, dtype=np.int64).sum()) / max(blocks * capacity, 1)
