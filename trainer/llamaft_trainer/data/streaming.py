"""`dataset.streaming`: tokenize while training, for sets too large to prepare up front.

The order is one global stream that every rank computes alike: records in file order, cut into
windows of WINDOW records, each window shuffled by (seed, epoch, window). Micro-batch m of an
epoch is the stream's items [m*G, (m+1)*G) with G = world x batch size, and rank r takes its
`batch size` of them; an epoch ends where the stream cannot fill a whole micro-batch, on every
rank at once. Without packing the items are records, and a rank tokenizes only its own; with
packing they are `maxSeqLength` blocks, which every rank tokenizes: by `bfd`, each window's
examples packed whole by best-fit decreasing (data.PackedExamples; a window's block count depends
only on its examples' lengths, not on the epoch's shuffle), by `concatenate`, blocks of the
concatenated token stream (block boundaries depend on every record before them).

A resumed run continues at its exact position from the checkpoint's (epoch, micro-batches done):
without packing it skips whole windows unparsed and starts inside the window; with packing it
jumps by a small index of each window's token count (`concatenate`) or block count (`bfd`)
(`windows.json` beside the token stores,
written as windows are first read: counts do not depend on the epoch's shuffle) and tokenizes
only the window it resumes in. The first `validation_split` of the first window's records (at most MAX_VALIDATION)
are held out for evaluation and never trained on.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from llamaft.api.spec import DatasetSpec, PackingStrategy
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from llamaft_trainer.data import batching, encoding, prepare
from llamaft_trainer.data import store as store_mod
from llamaft_trainer.data.records import Numbered, RecordSource
from llamaft_trainer.process.runtime import Runtime

T = TypeVar("T")

WINDOW = 8192
"""Records shuffled together: the stream's shuffle buffer (and what a rank holds at once)."""
MAX_VALIDATION = 2048


def validation_count(spec: DatasetSpec, first_window: int) -> int:
    """Records held out from the head of the file: validationSplit of the first window (whose
    size is known without reading the rest), at most MAX_VALIDATION, leaving one to train on."""
    if spec.validation_split == 0 or first_window < 2:
        return 0
    return min(MAX_VALIDATION, max(1, round(spec.validation_split * first_window)), first_window - 1)


def _first_window(source: RecordSource) -> int:
    return len(next(iter(source.batches(WINDOW)), []))


class BatchStream:
    """The training stream of one rank (see the module docstring)."""

    def __init__(self, spec: DatasetSpec, tok: PreTrainedTokenizerBase, batch_size: int, seed: int, rt: Runtime,
                 index_path: Path | None) -> None:
        self.spec = spec
        self.source = RecordSource(spec)
        self.encoder, self.collate = self._codec(spec, tok)
        self.batch_size = batch_size
        self.seed = seed
        self.rank, self.world = rt.rank, rt.world_size
        self.skip_records = validation_count(spec, _first_window(self.source))
        self.index_path = index_path
        self.window_tokens: list[int] = self._read_index()
        """Per window: its tokens (`concatenate`) or its blocks (`bfd`)."""
        self.write_index = rt.is_leader

    def _codec(self, spec: DatasetSpec, tok: PreTrainedTokenizerBase) -> tuple[Any, Any]:
        """(records -> a store part, items -> a batch): single sequences here, pairs in
        dpo_stream.PairStream."""
        return encoding.Encoder(spec, tok), batching.Collate(int(tok.pad_token_id))

    # -------------------------------------------------------------------- the window index
    def _read_index(self) -> list[int]:
        if self.index_path is None:
            return []
        try:
            counts = json.loads(self.index_path.read_text())
            return [int(c) for c in counts]
        except (OSError, ValueError, TypeError):
            return []

    def _learn(self, window: int, tokens: int) -> None:
        if window != len(self.window_tokens):
            return
        self.window_tokens.append(tokens)
        if self.write_index and self.index_path is not None:
            self.index_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.index_path.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps(self.window_tokens))
            os.replace(tmp, self.index_path)

    # ------------------------------------------------------------------------ the order
    def _windows(self, epoch: int, first: int) -> Iterator[tuple[int, list[Numbered]]]:
        start = self.skip_records + first * WINDOW
        for offset, batch in enumerate(self.source.batches(WINDOW, start=start)):
            window = first + offset
            order = list(range(len(batch)))
            random.Random(f"{self.seed}/{epoch}/{window}").shuffle(order)
            yield window, [batch[i] for i in order]

    def batches(self, epoch: int, skip: int) -> Iterator[dict[str, torch.Tensor]]:
        if self.spec.packing and self.spec.packing_strategy is PackingStrategy.BFD:
            yield from self._packed_examples(epoch, skip)
        elif self.spec.packing:
            yield from self._packed(epoch, skip)
        else:
            yield from self._records(epoch, skip)

    def _records(self, epoch: int, skip: int) -> Iterator[dict[str, torch.Tensor]]:
        first, offset = divmod(skip * self.world * self.batch_size, WINDOW)  # windows hold WINDOW records each
        windows = (records for _, records in self._windows(epoch, first))
        for mine in self._rank_groups(windows, offset):
            yield self._batch(self.encoder.encode(mine))

    def _resume_point(self, target: int) -> tuple[int, int]:
        """(the window to read from, the stream items to drop from it on) to continue after
        `target` items of the epoch, from the learned items per window (window_tokens)."""
        first, before = 0, 0
        while first < len(self.window_tokens) and before + self.window_tokens[first] <= target:
            before += self.window_tokens[first]
            first += 1
        return first, target - before

    def _rank_groups(self, windows: Iterable[list[T]], drop: int) -> Iterator[list[T]]:
        """This rank's share of each full group (world x batch_size items) of the stream that
        `windows` yields window by window, after its first `drop` items."""
        group = self.world * self.batch_size
        pending: list[T] = []
        for items in windows:
            pending.extend(items)
            if drop:
                cut = min(drop, len(pending))
                pending, drop = pending[cut:], drop - cut
            used = 0
            while len(pending) - used >= group:
                yield pending[used + self.rank * self.batch_size:used + (self.rank + 1) * self.batch_size]
                used += group
            pending = pending[used:]

    def _packed(self, epoch: int, skip: int) -> Iterator[dict[str, torch.Tensor]]:
        length = self.spec.max_seq_length
        group = self.world * self.batch_size
        first, drop = self._resume_point(skip * group * length)  # tokens of this epoch already trained on
        ids = np.zeros(0, dtype=np.int32)
        loss = np.zeros(0, dtype=np.bool_)
        mine = slice(self.rank * self.batch_size * length, (self.rank + 1) * self.batch_size * length)
        for window, records in self._windows(epoch, first):
            part = self.encoder.encode(records)
            self._learn(window, part.total_tokens)
            tokens, flags = part.span(0, part.total_tokens)
            ids = np.concatenate([ids, tokens])
            loss = np.concatenate([loss, flags.astype(np.bool_)])
            if drop:
                cut = min(drop, len(ids))
                ids, loss = ids[cut:], loss[cut:]
                drop -= cut
            used = 0
            while len(ids) - used >= group * length:
                block_ids = ids[used:used + group * length][mine]
                block_loss = loss[used:used + group * length][mine]
                used += group * length
                yield self.collate([
                    batching.training_item(block_ids[i * length:(i + 1) * length], block_loss[i * length:(i + 1) * length])
                    for i in range(self.batch_size)
                ])
            ids, loss = ids[used:], loss[used:]

    def _packed_examples(self, epoch: int, skip: int) -> Iterator[dict[str, torch.Tensor]]:
        """`bfd`: the stream's items are each window's best-fit-decreasing blocks, in block order."""
        first, drop = self._resume_point(skip * self.world * self.batch_size)  # blocks already trained on

        def windows() -> Iterator[list[tuple[batching.PackedExamples, int]]]:
            for window, records in self._windows(epoch, first):
                blocks = batching.PackedExamples(self.encoder.encode(records), self.spec.max_seq_length)
                self._learn(window, len(blocks))
                yield [(blocks, i) for i in range(len(blocks))]
        for mine in self._rank_groups(windows(), drop):
            yield self.collate([blocks_of[i] for blocks_of, i in mine])

    def _batch(self, encoded: store_mod.Part) -> dict[str, torch.Tensor]:
        batch: dict[str, torch.Tensor] = self.collate([batching.training_item(*encoded.example(i))
                                                      for i in range(len(encoded))])
        return batch

    def validation(self) -> store_mod.Part | None:
        n = self.skip_records
        if n == 0:
            return None
        head: list[Numbered] = []
        for batch in self.source.batches(n):
            head.extend(batch)
            if len(head) >= n:
                break
        part: store_mod.Part = self.encoder.encode(head[:n])
        return part


def streaming_data(spec: DatasetSpec, tok: PreTrainedTokenizerBase, batch_size: int, seed: int, rt: Runtime,
                   index_root: Path | None = None) -> batching.Data:
    """Data whose training batches come from a BatchStream; validation is the held-out head, in memory."""
    key = prepare.store_key(spec, encoding.Encoder(spec, tok), RecordSource(spec).fingerprint(), seed)
    index_path = index_root / f"stream-{key}" / "windows.json" if index_root is not None else None
    stream = BatchStream(spec, tok, batch_size, seed, rt, index_path)
    part = stream.validation()
    validation: Any = None
    val_loader = None
    if part is not None and len(part):
        validation = batching.packed_dataset(part, spec, validation=True) if spec.packing else batching.PaddedExamples(part)
        if len(validation):
            val_loader = batching.ValidationShare(validation, rt.rank, rt.world_size, batch_size, stream.collate)
        else:
            validation = None
    data = batching.Data(train=None, validation=validation, loader=None, validation_loader=val_loader,
                         batch_size=batch_size, stream=stream)
    data.info.update(train_sequences=None, streaming=True, window=WINDOW, validation_sequences=0 if validation is None else len(validation))
    return data
