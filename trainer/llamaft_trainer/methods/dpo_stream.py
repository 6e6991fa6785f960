"""`dataset.streaming` for format preference: pairs tokenized while training, as streaming.py
streams SFT records, for preference sets too large to prepare up front.

The order is streaming.BatchStream's: records in file order after the held-out head, cut into
windows of streaming.WINDOW records, each window shuffled by (seed, epoch, window). The stream's
items are the window's pairs that TRL keeps (`preference.keeps`: a pair whose prompt alone fills
maxSeqLength is dropped, as the token store drops it), never packed (a pair's two sequences are
one example); micro-batch m of an epoch is items [m*G, (m+1)*G) with G = world x batch size, and
rank r takes its `batch size` of them. Which pairs a window keeps depends on their tokens, so every
rank tokenizes every window (as BatchStream does with packing); a resumed run skips whole windows
by their kept-pair counts (`windows.json` beside the token stores, BatchStream's index) and
tokenizes only the window it resumes in.

Each pair is known by its ordinal: its record's position among the training records (window x
streaming.WINDOW + its place in the file's window). The batches carry it as `index`, so the precomputed
reference (`precompute_stream_reference`) is one float32 (chosen, rejected) row per training
record, scored once by the initial model in a pass over the stream in file order before training
(dropped records keep a row of zeros no batch reads), stored beside the stream's index and read
back by later attempts, exactly as dpo_step stores a token store's. Where the ranks share no
folder for it (several nodes without a shared checkpoint volume) every attempt scores it again: the
same initial model over the same pairs in the same batches.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from llamaft.api.spec import DatasetSpec, TrainingJobConfig
from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from llamaft_trainer.data import batching, prepare, streaming
from llamaft_trainer.data import store as store_mod
from llamaft_trainer.data.records import Numbered, RecordSource
from llamaft_trainer.data.streaming import BatchStream
from llamaft_trainer.methods.dpo_pairs import PairCollate, PairEncoder, PairShare, PreferencePairs, pair_of
from llamaft_trainer.methods.dpo_reference import (
    REFERENCE_DIR,
    read_reference,
    reference_key,
    write_reference,
)
from llamaft_trainer.process.runtime import Runtime
from llamaft_trainer.report.metrics import log_json

Ordered = tuple[int, Numbered]
"""(the record's ordinal among the training records, the record)."""


class PairStream(BatchStream):
    """The training stream of one rank's preference pairs (see the module docstring)."""

    encoder: PairEncoder
    collate: PairCollate

    def _codec(self, spec: DatasetSpec, tok: PreTrainedTokenizerBase) -> tuple[Any, Any]:
        return PairEncoder(spec, tok), PairCollate(int(tok.pad_token_id), spec.max_seq_length)

    def _ordered_windows(self, epoch: int | None, first: int) -> Iterator[tuple[int, list[Ordered]]]:
        """Window `first` on, each shuffled as BatchStream shuffles it (file order when `epoch` is None)."""
        start = self.skip_records + first * streaming.WINDOW
        for offset, batch in enumerate(self.source.batches(streaming.WINDOW, start=start)):
            window = first + offset
            order = list(range(len(batch)))
            if epoch is not None:
                random.Random(f"{self.seed}/{epoch}/{window}").shuffle(order)
            yield window, [(window * streaming.WINDOW + i, batch[i]) for i in order]

    def kept(self, records: list[Ordered]) -> tuple[list[int], store_mod.Part]:
        """The ordinals of the pairs TRL keeps, and those pairs (a part without the dropped ones)."""
        part = self.encoder.encode([record for _, record in records])
        keep = part.lengths > 0
        return [o for (o, _), k in zip(records, keep.tolist(), strict=True) if k], part.select(keep)

    def batches(self, epoch: int, skip: int) -> Iterator[dict[str, torch.Tensor]]:
        first, drop = self._resume_point(skip * self.world * self.batch_size)  # kept pairs already trained on

        def windows() -> Iterator[list[tuple[int, store_mod.Part, int]]]:
            for window, records in self._ordered_windows(epoch, first):
                ordinals, part = self.kept(records)
                self._learn(window, len(ordinals))
                yield [(ordinal, part, i) for i, ordinal in enumerate(ordinals)]
        for mine in self._rank_groups(windows(), drop):
            yield self.collate([(ordinal, pair_of(p, i)) for ordinal, p, i in mine])

    def validation(self) -> store_mod.Part | None:
        """The held-out head's kept pairs (empty ones left out, as the token store leaves them out)."""
        part = super().validation()
        return None if part is None else part.select(part.lengths > 0)


def streaming_pairs(spec: DatasetSpec, tok: PreTrainedTokenizerBase, batch_size: int, seed: int, rt: Runtime,
                    index_root: Path | None = None) -> batching.Data:
    """Data whose training pairs come from a PairStream; validation is the held-out head's pairs,
    in memory, scored by PairShare as a token store's. `store_path` is the stream's folder (its
    window index and reference), None where ranks share no folder."""
    key = prepare.store_key(spec, PairEncoder(spec, tok), RecordSource(spec).fingerprint(), seed)
    folder = index_root / f"stream-{key}" if index_root is not None else None
    stream = PairStream(spec, tok, batch_size, seed, rt, folder / "windows.json" if folder is not None else None)
    part = stream.validation()
    validation: PreferencePairs | None = PreferencePairs(part) if part is not None and len(part) else None
    val_loader = None
    if validation is not None:
        val_loader = PairShare(validation, rt.rank, rt.world_size, batch_size,
                               PairCollate(int(tok.pad_token_id), spec.max_seq_length))
    data = batching.Data(train=None, validation=validation, loader=None,  # type: ignore[arg-type]
                         validation_loader=val_loader, batch_size=batch_size, store_path=folder, stream=stream)
    data.info.update(train_pairs=None, streaming=True, window=streaming.WINDOW,
                     validation_pairs=0 if validation is None else len(validation))
    return data


Scorer = Callable[[PreferencePairs, PairCollate], np.ndarray[Any, Any]]
"""A part's (chosen, rejected) log-probabilities under the initial model, float32 [pairs, 2] on
every rank (dpo_step's no-grad pass over the part's PairShare, summed across ranks)."""


def precompute_stream_reference(cfg: TrainingJobConfig, rt: Runtime, model: nn.Module, data: batching.Data,
                                 score: Scorer) -> dict[str, Any]:
    """dpo_step.precompute_reference for a stream: read back, or scored now by `score` in one pass
    over the stream in file order (every rank tokenizes each window and scores the kept pairs) and
    over the held-out pairs, then stored when the ranks share the stream's folder. Collective:
    every rank calls it."""
    stream: PairStream = data.stream
    held: PreferencePairs | None = data.validation  # type: ignore[assignment]
    folder = Path(data.store_path) / REFERENCE_DIR / reference_key(cfg) if data.store_path is not None else None
    validation_collate = data.validation_loader.collate if data.validation_loader is not None else None
    count = _stream_records(folder)
    found_train = read_reference(folder / "train.f32", count) if folder is not None and count is not None else None
    found_validation = None
    if held is not None and folder is not None:
        found_validation = read_reference(folder / "validation.f32", len(held))
    complete = found_train is not None and (held is None or found_validation is not None)
    have = torch.tensor([1.0 if complete else 0.0], dtype=torch.float64, device=rt.device)
    dist.all_reduce(have, op=dist.ReduceOp.MIN)  # every rank reads, or every rank scores
    reused = bool(have.item() > 0)
    started = time.perf_counter()
    if reused:
        train, held_out = found_train, found_validation
    else:
        was_training = model.training
        model.eval()
        try:
            train = _score_stream(stream, score)
            held_out = score(held, validation_collate) if held is not None and validation_collate is not None else None
        finally:
            model.train(was_training)
        if folder is not None and rt.local_rank == 0:
            write_reference(folder / "train.f32", train)
            if held_out is not None:
                write_reference(folder / "validation.f32", held_out)
            _write_count(folder, len(train))
    assert train is not None
    stream.collate.reference = train
    if validation_collate is not None:
        validation_collate.reference = held_out
    if not reused and dist.is_initialized():
        dist.barrier()  # the files are complete before any rank could stop and a retry read them
    # A kept pair's row is two sums of log-probabilities (< 0); a dropped record's stays zeros.
    report = {"path": str(folder) if folder is not None else None, "reused": reused,
              "pairs": int((np.abs(train).sum(axis=1) > 0).sum()) + (0 if held is None else len(held)),
              "seconds": round(time.perf_counter() - started, 3), "streaming": True}
    if rt.is_leader:
        log_json("reference", **report)
    return report


COUNT_FILE = "records"
"""Beside a stream's reference: how many training records it has rows for (a stream's length is
known only after a pass)."""


def _stream_records(folder: Path | None) -> int | None:
    if folder is None:
        return None
    try:
        return int((folder / COUNT_FILE).read_text())
    except (OSError, ValueError):
        return None


def _write_count(folder: Path, count: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{COUNT_FILE}.partial"
    partial.write_text(str(count))
    partial.replace(folder / COUNT_FILE)


def _score_stream(stream: PairStream, score: Scorer) -> np.ndarray[Any, Any]:
    """(chosen, rejected) of every training record by ordinal, float32 [records, 2] on every rank."""
    rows: list[np.ndarray[Any, Any]] = []
    for window, records in stream._ordered_windows(None, 0):
        ordinals, part = stream.kept(records)
        stream._learn(window, len(ordinals))
        values = np.zeros((len(records), 2), dtype=np.float32)
        if ordinals:
            scored = score(PreferencePairs(part), stream.collate)
            values[np.asarray(ordinals) - window * streaming.WINDOW] = scored
        rows.append(values)
    return np.concatenate(rows) if rows else np.zeros((0, 2), dtype=np.float32)
