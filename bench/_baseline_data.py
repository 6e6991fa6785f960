"""The data step as it was before the token store, kept only as the baseline bench/data_scale.py
measures against: every rank reads every record into memory, tokenizes them one at a time in
Python and keeps Python lists of ints padded (or packed) to maxSeqLength, again on every attempt.
The record reader, formatter, split and one-record tokenizer are llamaft_trainer.data's (they
are unchanged); what went away is kept here: per-record tokenization and the padded lists.
"""

from __future__ import annotations

from typing import Any

from llamaft.api.spec import DatasetSpec
from llamaft_trainer.data import encoding
from llamaft_trainer.data.prepare import split_records
from llamaft_trainer.data.records import read_numbered
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

Rows = list[tuple[list[int], list[int], list[int]]]


def pack(examples: list[encoding.Example], max_len: int) -> Rows:
    ids: list[int] = []
    labels: list[int] = []
    for ex in examples:
        ids.extend(ex.input_ids)
        labels.extend(ex.labels)
    return [(ids[i:i + max_len], labels[i:i + max_len], [1] * max_len) for i in range(0, len(ids) - max_len + 1, max_len)]


def pad(examples: list[encoding.Example], max_len: int, pad_id: int) -> Rows:
    rows = []
    for ex in examples:
        n = len(ex.input_ids)
        rows.append((ex.input_ids + [pad_id] * (max_len - n), ex.labels + [encoding.IGNORE_INDEX] * (max_len - n),
                     [1] * n + [0] * (max_len - n)))
    return rows


def to_sequences(records: list[dict[str, Any]], spec: DatasetSpec, tok: PreTrainedTokenizerBase) -> Rows:
    fmt = encoding.Formatter(spec)
    examples = []
    for index, record in enumerate(records):
        fmt.check(record, f"record {index}")
        examples.append(encoding.tokenize(*fmt(record), tok, spec.max_seq_length))
    return pack(examples, spec.max_seq_length) if spec.packing else pad(examples, spec.max_seq_length, int(tok.pad_token_id))


def prepare(spec: DatasetSpec, tok: PreTrainedTokenizerBase, seed: int) -> tuple[Rows, Rows]:
    """What build_data did before its loaders: read all, check, split, tokenize, pad or pack."""
    numbered = read_numbered(spec)
    fmt = encoding.Formatter(spec)
    for where, record in numbered:
        fmt.check(record, where)
    train, val = split_records([r for _, r in numbered], spec.validation_split, seed)
    return to_sequences(train, spec, tok), to_sequences(val, spec, tok)
