"""Preference pairs (dataset.format preference, training.method dpo) in the token store, and the
loaders that give each rank its batches of pairs.

Storage: the store (store.py) and its builders (data.build_store: the same reading, splitting by
validationSplit, team build and merge as every other format) hold one example per pair: the
prompt, chosen and rejected ids back to back, untruncated (truncation is per sequence, when the
pairs are batched: dpo.concatenated_batch, TRL's collator), with the store's per-token byte saying
which part a token belongs to (PROMPT, CHOSEN, REJECTED) instead of whether it carries loss. The
tokens are preference.PreferenceEncoder's (TRL's DPOTrainer's); pairs TRL drops (the prompt alone
fills maxSeqLength, `preference.keeps`) are stored empty, i.e. not at all. The store key holds the
method and the format (`PairEncoder.identity`, data.store_key), so a dpo store is never an SFT one.

Batches: `PairCollate` makes a `dpo.concatenated_batch` of the pairs (chosen rows, then rejected
rows), with each pair's store index, and, once the precomputed reference exists (reference.py),
the reference log-probabilities of each pair. The training sampler is data.ResumableSampler
(seed + epoch, each rank its share, resumable mid-epoch); validation is `PairShare`: every held-out
pair scored once whatever the world size, a filler batch where a rank's share ran out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from llamaft.api.spec import DatasetSpec
from torch.utils.data import DataLoader, Dataset
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from llamaft_trainer.data import store as store_mod
from llamaft_trainer.data.batching import Data, ResumableSampler, ValidationShare, loader_generator
from llamaft_trainer.data.encoding import tokenizer_fingerprint
from llamaft_trainer.data.preference import PreferenceEncoder, PreferenceExample, keeps, preference_record
from llamaft_trainer.data.records import Numbered
from llamaft_trainer.methods.dpo import concatenated_batch
from llamaft_trainer.process.errors import ConfigError

PROMPT, CHOSEN, REJECTED = 0, 1, 2
"""The store's per-token byte for a pair's tokens."""


class PairEncoder:
    """data.build_store's encoder for format preference: records -> one stored example per pair."""

    def __init__(self, spec: DatasetSpec, tok: PreTrainedTokenizerBase) -> None:
        self.spec = spec
        self.tok = tok
        self.encoder = PreferenceEncoder(tok, spec)

    def identity(self) -> dict[str, Any]:
        return {"method": "dpo", "layout": "prompt-chosen-rejected", "tokenizer": tokenizer_fingerprint(self.tok)}

    def encode(self, numbered: Sequence[Numbered]) -> store_mod.Part:
        records = [preference_record(record, self.spec.field_mapping, where) for where, record in numbered]
        examples = self.encoder.encode(records, [where for where, _ in numbered])
        return part_of_pairs(examples, self.spec.max_seq_length)


def part_of_pairs(examples: Sequence[PreferenceExample], max_length: int | None = None) -> store_mod.Part:
    """Pairs as an in-memory part (those TRL drops at `max_length` as empty examples)."""
    tokens: list[int] = []
    parts: list[int] = []
    lengths: list[int] = []
    for e in examples:
        if not keeps(e, max_length):
            lengths.append(0)
            continue
        tokens += e.prompt_ids + e.chosen_ids + e.rejected_ids
        parts += [PROMPT] * len(e.prompt_ids) + [CHOSEN] * len(e.chosen_ids) + [REJECTED] * len(e.rejected_ids)
        lengths.append(len(e.prompt_ids) + len(e.chosen_ids) + len(e.rejected_ids))
    return store_mod.in_memory(np.asarray(tokens, dtype=np.int32), np.asarray(parts, dtype=np.uint8),
                               np.asarray(lengths, dtype=np.int64))


def pair_of(part: store_mod.Part, index: int) -> PreferenceExample:
    """The stored pair `index` as token id lists."""
    tokens, parts = part.example(index)
    ids, kinds = np.asarray(tokens, dtype=np.int64), np.asarray(parts)
    return PreferenceExample(ids[kinds == PROMPT].tolist(), ids[kinds == CHOSEN].tolist(), ids[kinds == REJECTED].tolist())


class PreferencePairs(Dataset[tuple[int, PreferenceExample]]):
    """A store part's pairs: item i is (i, the pair)."""

    def __init__(self, pairs: store_mod.Part) -> None:
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[int, PreferenceExample]:
        return index, pair_of(self.pairs, index)


class PairCollate:
    """Pairs -> the concatenated batch (dpo.concatenated_batch, truncated to maxSeqLength with
    keep_start as TRL), with `index` (the pairs' store indices) and, when `reference` is set (a
    float32 [pairs, 2] array of (chosen, rejected) reference log-probabilities by store index),
    `reference_logps`."""

    def __init__(self, pad_id: int, max_length: int) -> None:
        self.pad_id = pad_id
        self.max_length = max_length
        self.reference: np.ndarray[Any, Any] | None = None

    def __call__(self, items: list[tuple[int, PreferenceExample]]) -> dict[str, torch.Tensor]:
        batch = concatenated_batch([e for _, e in items], self.pad_id, self.max_length, "keep_start")
        indices = np.asarray([i for i, _ in items], dtype=np.int64)
        out = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
               "completion_mask": batch.completion_mask, "index": torch.from_numpy(indices)}
        if self.reference is not None:
            out["reference_logps"] = torch.from_numpy(np.ascontiguousarray(self.reference[indices]))
        return out


def is_filler(batch: dict[str, torch.Tensor]) -> bool:
    """A batch a rank scores only because every rank must run the same forwards (host data)."""
    return "filler" in batch


def pairs_in(batch: dict[str, torch.Tensor]) -> int:
    """The pairs a batch counts (0 for a filler): host data, no device read."""
    return 0 if is_filler(batch) else int(batch["input_ids"].shape[0]) // 2


class PairShare(ValidationShare):
    """This rank's share of a part's pairs, each scored exactly once whatever the world size, as
    ValidationShare shares sequences; a rank whose share ran out yields a filler batch marked
    `filler` (it counts no pair)."""

    def filler(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batch["filler"] = torch.ones(1, dtype=torch.bool)
        return batch


def pair_loaders(store: store_mod.Store, spec: DatasetSpec, pad_id: int, batch_size: int, seed: int, rank: int,
                 world: int, *, global_order: bool = False) -> Data:
    """data.Data over a preference store: training batches of `batch_size` pairs per rank from a
    ResumableSampler, validation by PairShare; `info` for the setup event. `global_order`: as
    data.loaders'."""
    train = PreferencePairs(store.train)
    n_train = len(train)
    if n_train < world * batch_size and not global_order:
        raise ConfigError(
            f"spec.dataset: {n_train} training pairs cannot give {world} ranks a batch of {batch_size}; "
            "use more data or a smaller perDeviceBatchSize"
        )
    collate = PairCollate(pad_id, spec.max_seq_length)
    sampler = ResumableSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    loader: DataLoader[Any] = DataLoader(train, batch_size=batch_size, sampler=sampler, drop_last=True,
                                         collate_fn=collate, generator=loader_generator(seed))
    validation: PreferencePairs | None = PreferencePairs(store.validation)
    val_loader = None
    if validation is not None and len(validation) > 0:
        val_loader = PairShare(validation, rank, world, batch_size, PairCollate(pad_id, spec.max_seq_length))
    else:
        validation = None
    return Data(train, validation, loader, val_loader, sampler, batch_size, store.path,  # type: ignore[arg-type]
                info={"train_pairs": n_train, "validation_pairs": len(store.validation)})
