"""The token store: a run's tokenized data on disk, built once and read in place by every rank.

Tokenizing in every rank, on every attempt, into Python lists padded to maxSeqLength made data
cost grow with records x maxSeqLength x ranks. The store holds each example once, unpadded, as
flat arrays that every rank reads in place by position (the page cache shares one copy per node):

    <root>/<key>/train/tokens.bin   int32, every example's token ids back to back
    <root>/<key>/train/loss.bin     uint8, 1 where the token carries loss (its label is itself)
    <root>/<key>/train/offsets.bin  int64, example i is tokens[offsets[i]:offsets[i + 1]]
    <root>/<key>/train/blocks.bin   int64, with packing by best-fit decreasing: example indices in
                                    block order (packing.py's layout, computed once here)
    <root>/<key>/train/block_offsets.bin  int64, block b is blocks[block_offsets[b]:block_offsets[b + 1]]
    <root>/<key>/validation/...     the same for the held-out examples
    <root>/<key>/meta.json          what was built and from what (written last: the store is complete)

The key hashes everything that changes the tokens (store_key in data/prepare.py): the source and its
fingerprint, the format and its templates, the tokenizer, maxSeqLength, packing and its strategy,
the split. The
root is beside the checkpoints, so a later attempt of the run (on any node) reuses the store and a
changed spec builds a new one. A store is built under a temporary name and renamed into place, so
a crash mid-build leaves nothing a reader would take for complete.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

VERSION = 2
"""2: a part may hold its block layout (blocks.bin, block_offsets.bin)."""
TOKENS, LOSS, OFFSETS, META = "tokens.bin", "loss.bin", "offsets.bin", "meta.json"
BLOCKS, BLOCK_OFFSETS = "blocks.bin", "block_offsets.bin"
PARTS = ("train", "validation")


class FileArray:
    """A read-only 1-D array in a file, read by position (pread), never mapped: the pages a rank
    reads stay in the node's page cache, shared and reclaimable, instead of piling up in the
    rank's resident set as a map's pages do over an epoch of random reads."""

    def __init__(self, path: Path, dtype: Any) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        self.length = int(path.stat().st_size) // int(self.dtype.itemsize)
        self._fd: int | None = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> np.ndarray[Any, Any]:
        start, stop, step = key.indices(self.length)
        if step != 1:
            raise IndexError("FileArray reads contiguous slices only")
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        size = self.dtype.itemsize
        data = os.pread(self._fd, (stop - start) * size, start * size)
        return np.frombuffer(data, dtype=self.dtype)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fd": None}  # a descriptor is this process's own

    def __del__(self) -> None:
        if self._fd is not None:
            os.close(self._fd)


Array = np.ndarray[Any, Any] | FileArray


@dataclass(frozen=True)
class Part:
    """One part (train or validation): examples as slices of flat token and loss arrays, in the
    store's files (FileArray) or in memory (a stream's validation head)."""

    tokens: Array
    loss: Array
    offsets: np.ndarray[Any, np.dtype[np.int64]]
    """In memory: 8 bytes per example."""
    layout: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]] | None = None
    """(example indices in block order, block offsets) when the store packed this part by
    best-fit decreasing (packing.flatten_layout's form); None otherwise."""

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def total_tokens(self) -> int:
        return int(self.offsets[-1])

    def example(self, index: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.tokens[start:end], self.loss[start:end]

    def span(self, start: int, end: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Tokens [start, end) of the whole part, across example boundaries (packing)."""
        return self.tokens[start:end], self.loss[start:end]

    @property
    def lengths(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        return np.diff(self.offsets)

    def select(self, keep: np.ndarray[Any, np.dtype[np.bool_]]) -> Part:
        """The examples where `keep` is true, in order (an in-memory part: a batch being stored)."""
        lengths = self.lengths
        tokens = np.asarray(self.tokens)
        by_token = np.repeat(keep, lengths)
        return Part(tokens[by_token], np.asarray(self.loss)[by_token],
                    np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths[keep], dtype=np.int64)]))


def in_memory(tokens: np.ndarray[Any, Any], loss: np.ndarray[Any, Any], lengths: np.ndarray[Any, Any]) -> Part:
    """A part held in memory: flat int32 tokens, flat loss flags, one length per example."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Part(np.asarray(tokens, dtype=np.int32), np.asarray(loss, dtype=np.uint8), offsets)


def open_part(folder: Path) -> Part:
    layout = None
    if (folder / BLOCKS).exists():
        layout = (np.fromfile(folder / BLOCKS, dtype=np.int64), np.fromfile(folder / BLOCK_OFFSETS, dtype=np.int64))
    return Part(FileArray(folder / TOKENS, np.int32), FileArray(folder / LOSS, np.uint8),
                np.fromfile(folder / OFFSETS, dtype=np.int64), layout)


def write_layout(folder: Path, layout: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]) -> None:
    """A part's block layout beside its tokens (StoreBuilder.commit, before the store is renamed
    into place: a reader never sees a store without the layout it was built with)."""
    examples, offsets = layout
    np.asarray(examples, dtype=np.int64).tofile(folder / BLOCKS)
    np.asarray(offsets, dtype=np.int64).tofile(folder / BLOCK_OFFSETS)


@dataclass(frozen=True)
class Store:
    path: Path
    meta: dict[str, Any]
    train: Part
    validation: Part


def open_store(path: Path) -> Store | None:
    """The complete store at `path`, or None when there is none (or an older format)."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        return None
    if meta.get("version") != VERSION:
        return None
    return Store(path, meta, open_part(path / "train"), open_part(path / "validation"))


class PartWriter:
    """Appends examples to one part's files as they are encoded (memory stays one batch)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._tokens: BinaryIO = open(folder / TOKENS, "wb")
        self._loss: BinaryIO = open(folder / LOSS, "wb")
        self._offsets: BinaryIO = open(folder / OFFSETS, "wb")
        self._offsets.write(np.zeros(1, dtype=np.int64).tobytes())
        self.examples = 0
        self.tokens = 0
        self.loss_tokens = 0

    def add(self, batch: Part) -> None:
        """The examples of an in-memory part (an encoded batch), empty ones left out: arrays
        written as they are, nothing per example (the builder's cost is the tokenizer's)."""
        lengths = batch.lengths
        if not lengths.all():
            batch = batch.select(lengths > 0)
            lengths = batch.lengths
        if not len(lengths):
            return
        total = int(batch.offsets[-1])
        loss = np.asarray(batch.loss, dtype=np.uint8)
        self._tokens.write(np.asarray(batch.tokens, dtype=np.int32).tobytes())
        self._loss.write(loss.tobytes())
        self._offsets.write((batch.offsets[1:] + self.tokens).tobytes())
        self.tokens += total
        self.loss_tokens += int(np.count_nonzero(loss))
        self.examples += len(lengths)

    def append(self, folder: Path, offsets: np.ndarray[Any, Any], start: int, end: int) -> None:
        """Examples [start, end) of the part in `folder` (its `offsets`), copied as they are (the
        builders' merge). Read with plain file reads, not a map: a merge of 10^6 examples must not
        leave the merging rank holding every page it copied."""
        first, last = int(offsets[start]), int(offsets[end])
        tokens = np.fromfile(folder / TOKENS, dtype=np.int32, count=last - first, offset=first * 4)
        loss = np.fromfile(folder / LOSS, dtype=np.uint8, count=last - first, offset=first)
        self._tokens.write(tokens.tobytes())
        self._loss.write(loss.tobytes())
        self._offsets.write((np.asarray(offsets[start + 1:end + 1]) - first + self.tokens).astype(np.int64).tobytes())
        self.tokens += last - first
        self.loss_tokens += int(loss.sum())
        self.examples += end - start

    def close(self) -> dict[str, int]:
        for f in (self._tokens, self._loss, self._offsets):
            f.close()
        return {"examples": self.examples, "tokens": self.tokens, "lossTokens": self.loss_tokens}


class StoreBuilder:
    """Builds a store under a temporary name; `commit` renames it into place."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.partial = path.with_name(f".{path.name}.partial-{os.getpid()}-{time.monotonic_ns()}")
        self.parts = {name: PartWriter(self.partial / name) for name in PARTS}
        self.started = time.perf_counter()

    def commit(self, meta: dict[str, Any],
               layouts: dict[str, Callable[[np.ndarray[Any, Any]], tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]]
               | None = None) -> Store:
        """`layouts`: by part name, the block layout of that part's example lengths, written with it."""
        sizes = {name: writer.close() for name, writer in self.parts.items()}
        for name, layout in (layouts or {}).items():
            folder = self.partial / name
            lengths = np.diff(np.fromfile(folder / OFFSETS, dtype=np.int64))
            write_layout(folder, layout(lengths))
        meta = {"version": VERSION, **meta, "parts": sizes, "buildSeconds": round(time.perf_counter() - self.started, 2)}
        (self.partial / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
        try:
            os.rename(self.partial, self.path)
        except OSError:
            # Another builder finished first (the same key: the same content); keep theirs.
            shutil.rmtree(self.partial, ignore_errors=True)
        store = open_store(self.path)
        if store is None:
            raise RuntimeError(f"token store {self.path} is unreadable right after it was written")
        return store

    def abandon(self) -> None:
        for writer in self.parts.values():
            try:
                writer.close()
            except OSError:
                pass
        shutil.rmtree(self.partial, ignore_errors=True)
