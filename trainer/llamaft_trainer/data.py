"""Data step: records -> prompt/response -> token ids with the prompt masked -> packed or padded
sequences -> a distributed, seed-deterministic loader.

Loss is only taken on response tokens: prompt positions carry label -100. Records come from a
local or PVC path, an fsspec URI (JSON Lines) or a hub dataset (`datasets`).
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from llamaft.api.sources import SourceKind, parse_source
from llamaft.api.spec import DatasetFormat, DatasetSpec
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from llamaft_trainer.errors import ConfigError

IGNORE_INDEX = -100

# The built-in formats: prompt template and response field. samsum follows llama-recipes'
# summarisation prompt; alpaca uses Stanford Alpaca's two prompts (with and without input).
SAMSUM_TEMPLATE = "Summarize this dialog:\n{dialogue}\n---\nSummary:\n"
ALPACA_TEMPLATE = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT_TEMPLATE = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
DEFAULT_RESPONSE = {DatasetFormat.SAMSUM: "summary", DatasetFormat.ALPACA: "output", DatasetFormat.JSONL: "output"}


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]


# ------------------------------------------------------------------------------- reading
def read_records(spec: DatasetSpec) -> list[dict[str, Any]]:
    """All records of the dataset source, in file order."""
    return [record for _, record in read_numbered(spec)]


def read_numbered(spec: DatasetSpec) -> list[tuple[str, dict[str, Any]]]:
    """(where, record) for every record, in file order: `where` is what a person can find, the
    file and its line number (`data.jsonl line 5`), or a hub dataset's split and row."""
    src = parse_source(spec.source)
    try:
        if src.kind is SourceKind.HUB:
            import datasets

            rows = datasets.load_dataset(src.location, split=spec.split)
            return [(f"{spec.source} ({spec.split} row {i})", dict(r)) for i, r in enumerate(rows)]
        if src.kind is SourceKind.URI:
            import fsspec

            with fsspec.open(src.location, "rt", encoding="utf-8") as f:
                return _parse_jsonl(f, spec.source)
        with Path(src.location).expanduser().open(encoding="utf-8") as f:
            return _parse_jsonl(f, spec.source)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"spec.dataset.source: cannot read {spec.source}: {type(exc).__name__}: {exc}") from exc


def _parse_jsonl(lines: Any, name: str) -> list[tuple[str, dict[str, Any]]]:
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"spec.dataset.source: {name} line {number} is not JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise ConfigError(f"spec.dataset.source: {name} line {number} is not a JSON object")
        records.append((f"{name} line {number}", record))
    if not records:
        raise ConfigError(f"spec.dataset.source: {name} holds no records (an empty file); point spec.dataset.source at the data")
    return records


# ---------------------------------------------------------------------------- formatting
def _template_fields(template: str) -> list[str]:
    return [field for _, field, _, _ in string.Formatter().parse(template) if field]


class Formatter:
    """Turns one record into (prompt, response) text, per the spec's format and mapping."""

    def __init__(self, spec: DatasetSpec) -> None:
        self.spec = spec
        self.response_field = spec.field_mapping.response or DEFAULT_RESPONSE[spec.format]
        self.template = spec.prompt_template
        if self.template is None and spec.field_mapping.prompt:
            self.template = "\n".join("{" + f + "}" for f in spec.field_mapping.prompt) + "\n"
        if self.template is None and spec.format is DatasetFormat.SAMSUM:
            self.template = SAMSUM_TEMPLATE

    def required_fields(self, record: dict[str, Any]) -> list[str]:
        if self.template is not None:
            fields = _template_fields(self.template)
        elif record.get("input"):
            fields = _template_fields(ALPACA_TEMPLATE)
        else:
            fields = _template_fields(ALPACA_NO_INPUT_TEMPLATE)
        return [*fields, self.response_field]

    def check(self, record: dict[str, Any], where: str) -> None:
        """`where`: the record's place in the source, as a person finds it (file and line)."""
        missing = [f for f in self.required_fields(record) if record.get(f) is None]
        if missing:
            raise ConfigError(
                f"spec.dataset: {where} has no field(s) {missing} "
                f"(it has {sorted(record)}); set spec.dataset.promptTemplate / fieldMapping to match the data"
            )

    def __call__(self, record: dict[str, Any]) -> tuple[str, str]:
        if self.template is not None:
            prompt = self.template.format(**record)
        elif record.get("input"):
            prompt = ALPACA_TEMPLATE.format(**record)
        else:
            prompt = ALPACA_NO_INPUT_TEMPLATE.format(**record)
        return prompt, str(record[self.response_field])


def tokenize(prompt: str, response: str, tok: PreTrainedTokenizerBase, max_len: int) -> Example:
    """<bos> prompt response <eos>, prompt positions masked out of the loss, truncated to max_len."""
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    response_ids = tok.encode(response, add_special_tokens=False)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    input_ids = bos + prompt_ids + response_ids + eos
    labels = [IGNORE_INDEX] * (len(bos) + len(prompt_ids)) + response_ids + eos
    return Example(input_ids[:max_len], labels[:max_len])


# ------------------------------------------------------------------------- packing/padding
class SequenceDataset(Dataset[dict[str, torch.Tensor]]):
    """Fixed-length sequences (input_ids, labels, attention_mask), all `max_len` long."""

    def __init__(self, rows: list[tuple[list[int], list[int], list[int]]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, labels, mask = self.rows[index]
        return {
            "input_ids": torch.tensor(ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            "attention_mask": torch.tensor(mask, dtype=torch.long),
        }


def pack(examples: Sequence[Example], max_len: int) -> SequenceDataset:
    """Concatenate examples and cut into full `max_len` blocks (the last partial block is dropped)."""
    ids: list[int] = []
    labels: list[int] = []
    for ex in examples:
        ids.extend(ex.input_ids)
        labels.extend(ex.labels)
    rows = [
        (ids[i : i + max_len], labels[i : i + max_len], [1] * max_len)
        for i in range(0, len(ids) - max_len + 1, max_len)
    ]
    return SequenceDataset(rows)


def pad(examples: Sequence[Example], max_len: int, pad_id: int) -> SequenceDataset:
    """Right-pad every example to `max_len`; padding is masked from attention and loss."""
    rows = []
    for ex in examples:
        n = len(ex.input_ids)
        rows.append(
            (
                ex.input_ids + [pad_id] * (max_len - n),
                ex.labels + [IGNORE_INDEX] * (max_len - n),
                [1] * n + [0] * (max_len - n),
            )
        )
    return SequenceDataset(rows)


# ------------------------------------------------------------------------------- loaders
@dataclass
class Data:
    train: SequenceDataset
    validation: SequenceDataset | None
    sampler: DistributedSampler[Any]
    loader: DataLoader[dict[str, torch.Tensor]]
    validation_loader: DataLoader[dict[str, torch.Tensor]] | None


def split_records(records: list[dict[str, Any]], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """A seed-deterministic train/validation split (at least one validation record when fraction > 0)."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_val = 0 if fraction == 0 else max(1, round(len(records) * fraction))
    n_val = min(n_val, len(records) - 1)
    val = [records[i] for i in sorted(order[:n_val])]
    train = [records[i] for i in sorted(order[n_val:])]
    return train, val


def check_records(numbered: list[tuple[str, dict[str, Any]]], spec: DatasetSpec) -> None:
    """Every record has what the format needs; the first that does not is named by file and line
    (checked in file order, before any split or shuffle)."""
    fmt = Formatter(spec)
    for where, record in numbered:
        fmt.check(record, where)


def to_sequences(records: list[dict[str, Any]], spec: DatasetSpec, tok: PreTrainedTokenizerBase) -> SequenceDataset:
    fmt = Formatter(spec)
    examples = []
    for index, record in enumerate(records):
        fmt.check(record, f"record {index} (after the train/validation split) of {spec.source}")
        examples.append(tokenize(*fmt(record), tok, spec.max_seq_length))
    if spec.packing:
        return pack(examples, spec.max_seq_length)
    return pad(examples, spec.max_seq_length, int(tok.pad_token_id))


def check_sequence_length(spec: DatasetSpec, max_positions: int | None) -> None:
    if max_positions is not None and spec.max_seq_length > max_positions:
        raise ConfigError(
            f"spec.dataset.maxSeqLength: {spec.max_seq_length} exceeds the model's max_position_embeddings "
            f"{max_positions}; lower maxSeqLength to at most {max_positions}"
        )


def build_data(
    spec: DatasetSpec, tok: PreTrainedTokenizerBase, batch_size: int, seed: int, rank: int, world: int
) -> Data:
    """Train and validation loaders; every rank sees a disjoint, seed-determined shard per epoch."""
    numbered = read_numbered(spec)
    check_records(numbered, spec)
    records = [record for _, record in numbered]
    train_records, val_records = split_records(records, spec.validation_split, seed)
    train = to_sequences(train_records, spec, tok)
    if len(train) < world * batch_size:
        raise ConfigError(
            f"spec.dataset: {len(train)} training sequences cannot give {world} ranks a batch of {batch_size}; "
            "use more data, a smaller perDeviceBatchSize or padding instead of packing"
        )
    validation = to_sequences(val_records, spec, tok) if val_records else None
    sampler: DistributedSampler[Any] = DistributedSampler(
        train, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    # Each loader gets its own generator: creating an iterator draws a base seed (for worker
    # processes, unused with num_workers=0) from the loader's generator, by default the *global*
    # one that dropout draws from. A resumed run creates its iterator at another point of the RNG
    # stream than an uninterrupted one, so that draw shifted every dropout mask after a resume.
    loader = DataLoader(train, batch_size=batch_size, sampler=sampler, drop_last=True, generator=_loader_generator(seed))
    val_loader = None
    if validation is not None and len(validation) >= world:
        val_sampler: DistributedSampler[Any] = DistributedSampler(
            validation, num_replicas=world, rank=rank, shuffle=False, drop_last=True
        )
        val_loader = DataLoader(validation, batch_size=batch_size, sampler=val_sampler, generator=_loader_generator(seed))
    return Data(train, validation, sampler, loader, val_loader)


def _loader_generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def batches_from(loader: DataLoader[dict[str, torch.Tensor]], skip: int) -> Iterator[dict[str, torch.Tensor]]:
    """The loader's batches, skipping the first `skip` (resume mid-epoch at the same position)."""
    for index, batch in enumerate(loader):
        if index >= skip:
            yield batch
