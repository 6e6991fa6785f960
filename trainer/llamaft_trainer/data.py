"""Data step: records -> token ids with the loss masked -> a token store built once per run ->
packed blocks or examples padded per batch -> a distributed, seed-deterministic, resumable loader.

Packing (`dataset.packing`), by `packingStrategy`: `bfd` places whole examples into maxSeqLength
blocks by best-fit decreasing (packing.py; the layout is computed once, with the store) and each
example attends only to itself: its position ids restart at 0, and the batch goes to the model with
position ids and no attention mask, from which transformers' masking_utils builds a block-diagonal
causal mask (`find_packed_sequence_indices`, transformers 5.x; flash-attention-2 reads the same
position ids) as long as no cache is made (`use_cache=False`, as the trainer's forwards pass: with a
cache, transformers does not look for packed sequences); the first token of an example is never a
target of the one before. `concatenate` lays the examples
back to back and cuts full blocks (each attends to the examples before it in its block; the last
partial block is dropped). Validation, when packing, is always packed by best-fit decreasing:
every held-out example evaluated once and whole, so the eval loss does not depend on packing.

What carries loss, by format: `samsum`, `alpaca` and `jsonl` render a prompt from the record and
train on the response field only (prompt positions carry label -100); `chat` renders the turns
with the tokenizer's chat template and trains on the assistant's turns (`trainOn`, chat.py).

Records are read and tokenized in batches (the fast tokenizer's batch call), each batch by one
rank, and merged into the token store (store.py) beside the checkpoints, keyed by everything that
changes the tokens: once per run, not per rank and not per attempt; every rank then reads it
in place, and a later attempt reuses it. Padding happens per
batch (to the longest example in it), never in storage. `dataset.streaming` skips the store and
tokenizes while training (streaming.py).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import random
import shutil
import string
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from llamaft.api.spec import DatasetFormat, DatasetSpec, PackingStrategy, TrainOn
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from llamaft_trainer import packing as packing_mod
from llamaft_trainer import store as store_mod
from llamaft_trainer.errors import ConfigError
from llamaft_trainer.metrics import log_json
from llamaft_trainer.records import BATCH, Numbered, RecordSource, digest, read_numbered
from llamaft_trainer.runtime import Runtime

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
BUILD_TIMEOUT = timedelta(hours=12)
"""How long the other ranks wait for the store's builder (a 10^6-record set takes minutes)."""

__all__ = ["IGNORE_INDEX", "Data", "loaders", "prepared_store", "read_numbered"]


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]


# ---------------------------------------------------------------------------- formatting
def _template_fields(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


@functools.lru_cache(maxsize=64)
def _required(template: str, response_field: str) -> list[str]:
    """The fields a record needs (parsed once per template, not once per record)."""
    return [*_template_fields(template), response_field]


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
            template = self.template
        elif record.get("input"):
            template = ALPACA_TEMPLATE
        else:
            template = ALPACA_NO_INPUT_TEMPLATE
        return _required(template, self.response_field)

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
    """<bos> prompt response <eos>, prompt positions masked out of the loss, truncated to max_len.
    One record at a time: the reference the batched encoder (Encoder) is tested against."""
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    response_ids = tok.encode(response, add_special_tokens=False)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    input_ids = bos + prompt_ids + response_ids + eos
    labels = [IGNORE_INDEX] * (len(bos) + len(prompt_ids)) + response_ids + eos
    return Example(input_ids[:max_len], labels[:max_len])


def _encode_texts(tok: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of many texts in one call (no special tokens added): the Rust tokenizer's batch
    entry point when there is one (twice as fast as the Python wrapper's, same ids)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    ids: list[list[int]] = tok(texts, add_special_tokens=False)["input_ids"]
    return ids


class Encoder:
    """Records -> (input_ids, labels), a batch at a time, for every format; each record is
    checked first and a bad one is named by `where` (file and line)."""

    def __init__(self, spec: DatasetSpec, tok: PreTrainedTokenizerBase) -> None:
        self.spec = spec
        self.tok = tok
        self.max_len = spec.max_seq_length
        self.chat: Any = None
        self.formatter: Formatter | None = None
        if spec.format is DatasetFormat.PREFERENCE:
            # Pairs are tokenized by llamaft_trainer.preference, for the DPO loop; a single-sequence
            # encoder would train on them as something they are not.
            raise ConfigError(
                "spec.dataset.format: format preference holds pairs for training.method dpo, which this trainer "
                "reads with llamaft_trainer.preference, not as single sequences"
            )
        if spec.format is DatasetFormat.CHAT:
            from llamaft_trainer import chat

            self.template: str | None = chat.resolve_template(spec, tok)
            self.chat = chat.ChatEncoder(tok, self.template, spec.train_on or TrainOn.ASSISTANT, spec.max_seq_length)
        else:
            self.template = None
            self.formatter = Formatter(spec)

    def identity(self) -> dict[str, Any]:
        """What the tokens depend on besides the records (part of the store's key)."""
        return {"template": self.template, "tokenizer": tokenizer_fingerprint(self.tok)}

    def check(self, numbered: Sequence[Numbered]) -> None:
        if self.formatter is not None:
            for where, record in numbered:
                self.formatter.check(record, where)

    def encode(self, numbered: Sequence[Numbered]) -> store_mod.Part:
        """The records as an in-memory part: each example <bos> prompt response <eos> (or the
        rendered conversation), loss on what `tokenize` / `trainOn` label, cut to maxSeqLength."""
        if self.chat is not None:
            from llamaft_trainer import chat

            field_name = self.spec.field_mapping.messages
            conversations = [chat.conversation(record, field_name, where) for where, record in numbered]
            return part_of(self.chat.encode(conversations, where=[w for w, _ in numbered]))
        assert self.formatter is not None
        self.check(numbered)
        pairs = [self.formatter(record) for _, record in numbered]
        both = _encode_texts(self.tok, [p for p, _ in pairs] + [r for _, r in pairs])
        return _assemble(both[: len(pairs)], both[len(pairs):], self.tok.bos_token_id, self.tok.eos_token_id, self.max_len)


def _assemble(prompts: list[list[int]], responses: list[list[int]], bos: int | None, eos: int | None,
              max_len: int) -> store_mod.Part:
    """[bos] + prompt + response + [eos] per example, cut to max_len, loss on response and eos:
    `tokenize`'s examples, laid out with array operations over the whole batch (per-example
    Python lists cost as much as the tokenizer did)."""
    p = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
    r = np.fromiter(map(len, responses), dtype=np.int64, count=len(responses))
    total_p = int(p.sum())
    flat = np.fromiter(itertools.chain.from_iterable(prompts + responses), dtype=np.int32, count=total_p + int(r.sum()))
    b, e = int(bos is not None), int(eos is not None)
    lengths = np.minimum(b + p + r + e, max_len)
    starts = np.cumsum(lengths) - lengths
    example = np.repeat(np.arange(len(lengths)), lengths)
    k = np.arange(int(lengths.sum())) - starts[example]  # position inside its example
    pk = k - b  # position inside the prompt
    rk = pk - p[example]  # position inside the response
    in_prompt = (pk >= 0) & (rk < 0)
    in_response = (rk >= 0) & (rk < r[example])
    tokens = np.full(len(k), -1 if eos is None else eos, dtype=np.int32)
    if bos is not None:
        tokens[k == 0] = bos
    prompt_at = (np.cumsum(p) - p)[example] + pk
    response_at = total_p + (np.cumsum(r) - r)[example] + rk
    tokens[in_prompt] = flat[prompt_at[in_prompt]]
    tokens[in_response] = flat[response_at[in_response]]
    return store_mod.in_memory(tokens, rk >= 0, lengths)


def part_of(pairs: Sequence[tuple[list[int], list[int]]]) -> store_mod.Part:
    """(input_ids, labels) pairs, a label either the token or IGNORE_INDEX, as an in-memory part."""
    lengths = np.fromiter((len(ids) for ids, _ in pairs), dtype=np.int64, count=len(pairs))
    total = int(lengths.sum())
    tokens = np.fromiter(itertools.chain.from_iterable(ids for ids, _ in pairs), dtype=np.int32, count=total)
    labels = np.fromiter(itertools.chain.from_iterable(lab for _, lab in pairs), dtype=np.int64, count=total)
    return store_mod.in_memory(tokens, labels != IGNORE_INDEX, lengths)


def pairs_of(part: store_mod.Part) -> list[tuple[list[int], list[int]]]:
    """An in-memory part as (input_ids, labels) lists (tests and references compare these)."""
    out = []
    for i in range(len(part)):
        tokens, loss = part.example(i)
        ids = [int(t) for t in tokens]
        out.append((ids, [t if flag else IGNORE_INDEX for t, flag in zip(ids, loss, strict=True)]))
    return out


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    """The tokenizer's vocabulary, merges, normalisation and special tokens, hashed."""
    backend = getattr(tok, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else f"{tok.name_or_path}:{len(tok)}"
    return digest(body, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, getattr(tok, "chat_template", None))


# ------------------------------------------------------------------------------- splitting
def split_records(records: list[Any], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """A seed-deterministic train/validation split (at least one validation record when fraction > 0)."""
    held_out = validation_mask(len(records), fraction, seed)
    val = [r for r, v in zip(records, held_out, strict=True) if v]
    train = [r for r, v in zip(records, held_out, strict=True) if not v]
    return train, val


def validation_mask(n: int, fraction: float, seed: int) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """True for the records held out for validation (the same ones at any scale and world size)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = 0 if fraction == 0 else max(1, round(n * fraction))
    n_val = min(n_val, n - 1)
    mask = np.zeros(n, dtype=np.bool_)
    mask[order[:n_val]] = True
    return mask


def check_sequence_length(spec: DatasetSpec, max_positions: int | None) -> None:
    if max_positions is not None and spec.max_seq_length > max_positions:
        raise ConfigError(
            f"spec.dataset.maxSeqLength: {spec.max_seq_length} exceeds the model's max_position_embeddings "
            f"{max_positions}; lower maxSeqLength to at most {max_positions}"
        )


# ----------------------------------------------------------------------------- the store
class StoreEncoder(Protocol):
    """What build_store needs of an encoder: Encoder (single sequences) or
    preference_data.PairEncoder (pairs, format preference, which inputs.build_data passes)."""

    def identity(self) -> dict[str, Any]: ...

    def encode(self, numbered: Sequence[Numbered]) -> store_mod.Part: ...


EncoderFactory = Callable[[DatasetSpec, PreTrainedTokenizerBase], StoreEncoder]
"""Builds a store's encoder: Encoder, or preference_data.PairEncoder for format preference."""


def store_key(spec: DatasetSpec, encoder: StoreEncoder, fingerprint: str, seed: int) -> str:
    """Everything that changes the stored tokens; another value builds another store."""
    fields = spec.model_dump(
        by_alias=True, include={"format", "source", "revision", "split", "prompt_template", "field_mapping",
                                "chat_template", "train_on", "max_seq_length", "packing", "packing_strategy",
                                "validation_split"},
    )
    return digest(store_mod.VERSION, fields, fingerprint, encoder.identity(), seed)


@contextlib.contextmanager
def _parallel_tokenizer(builders_per_node: int) -> Iterator[None]:
    """While the store is built, let the Rust tokenizer's threads share the node's cores among its
    builders (the pods set TOKENIZERS_PARALLELISM=false for training, which never forks after
    this). RAYON_NUM_THREADS sizes the pool when the tokenizer first starts it."""
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(builders_per_node, 1))))
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


@dataclass(frozen=True)
class Team:
    """The processes that build one store together: member `me` of `size` tokenizes every
    `size`-th batch, member 0 merges. `gather(value)` returns every member's value, in member
    order (an all-gather among them; each call must be made by every member)."""

    me: int = 0
    size: int = 1
    per_node: int = 1
    """Members on this node (they share its cores)."""
    gather: Callable[[Any], list[Any]] = field(default=lambda value: [value])


@dataclass(frozen=True)
class _Failure:
    """An exception of one member, passed to the others (they must not wait for it forever)."""

    config: bool
    message: str

    def exception(self) -> Exception:
        return ConfigError(self.message) if self.config else RuntimeError(f"building the token store failed: {self.message}")


def _failure(exc: Exception) -> _Failure:
    return _Failure(isinstance(exc, ConfigError), str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}")


@dataclass
class _Shard:
    """One member's share of a build: the examples of its batches, in its own part files."""

    folder: str
    batches: list[tuple[int, int, int]] = field(default_factory=list)
    """(batch index, training examples, validation examples) in the order written."""
    error: tuple[int, str] | None = None
    """(batch index, message) of the first bad record it met."""


def build_store(spec: DatasetSpec, tok: PreTrainedTokenizerBase, seed: int, root: Path, team: Team = Team(),
                make_encoder: EncoderFactory = Encoder) -> store_mod.Store:
    """The store of this dataset under `root`: reused when complete, else built by `team` (this
    process alone by default). Every member makes the same calls to `team.gather`, whatever the
    outcome, so members never wait on each other at different points."""
    source = RecordSource(spec)
    plan: Any = None
    if team.me == 0:
        try:
            encoder = make_encoder(spec, tok)
            key = store_key(spec, encoder, source.fingerprint(), seed)
            exists = store_mod.open_store(root / key) is not None
            plan = (key, 0 if exists else source.count(), exists)
        except Exception as exc:
            plan = _failure(exc)
    plan = team.gather(plan)[0]
    if isinstance(plan, _Failure):
        raise plan.exception()
    key, n, exists = plan
    path = root / key
    started = time.perf_counter()
    shard: _Shard | _Failure | None = None
    if not exists:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shard = _encode_shard(source, make_encoder(spec, tok), validation_mask(n, spec.validation_split, seed), path, team)
        except Exception as exc:
            shard = _failure(exc)
    shards: list[_Shard | _Failure | None] = team.gather(shard)
    crashed = next((s for s in shards if isinstance(s, _Failure)), None)
    failed = sorted(s.error for s in shards if isinstance(s, _Shard) and s.error is not None)
    built: Any = None
    if crashed is None and not failed and not exists and team.me == 0:
        try:
            built = str(_merge([s for s in shards if isinstance(s, _Shard)], path,
                               {"key": key, "source": spec.source, "records": n}, stored_layouts(spec)).path)
        except Exception as exc:
            built = _failure(exc)
    merged = team.gather(built)[0]  # the store is complete (or was already) before anyone opens it
    if isinstance(shard, _Shard):
        shutil.rmtree(shard.folder, ignore_errors=True)  # after the merge read it
    for problem in (crashed, merged):
        if isinstance(problem, _Failure):
            raise problem.exception()
    if failed:
        raise ConfigError(failed[0][1])
    found = store_mod.open_store(path)
    if found is None:
        raise ConfigError(
            f"spec.checkpointing.directory: the token store {path} is not visible to this rank: every worker "
            "must mount the same checkpoint volume"
        )
    seconds = time.perf_counter() - started
    if team.me == 0:
        log_json("data", store=str(path), reused=exists, records=found.meta.get("records"), train_examples=len(found.train),
                 validation_examples=len(found.validation), seconds=round(seconds, 2), builders=team.size,
                 records_per_second=None if exists else round(n / max(seconds, 1e-9)), **block_report(found, spec))
    return found


def _encode_shard(source: RecordSource, encoder: StoreEncoder, held_out: np.ndarray[Any, Any], path: Path, team: Team) -> _Shard:
    folder = path.with_name(f".{path.name}.shard-{team.me}-{os.getpid()}-{time.monotonic_ns()}")
    parts = {name: store_mod.PartWriter(folder / name) for name in store_mod.PARTS}
    shard = _Shard(str(folder))
    started, last_log, index = time.perf_counter(), time.monotonic(), 0
    try:
        with _parallel_tokenizer(team.per_node):
            batches = source.some_batches(BATCH, keep=lambda number: number % team.size == team.me)
            for number, (count, batch) in enumerate(batches):
                first, index = index, index + count
                if batch is None:
                    continue  # another member's
                try:
                    encoded = encoder.encode(batch)
                except ConfigError as exc:
                    shard.error = (number, str(exc))  # the first in file order wins among the members
                    break
                flags = held_out[first:index]
                nonempty = encoded.lengths > 0
                parts["train"].add(encoded.select(~flags))
                parts["validation"].add(encoded.select(flags))
                shard.batches.append((number, int(np.count_nonzero(nonempty & ~flags)), int(np.count_nonzero(nonempty & flags))))
                if team.me == 0 and time.monotonic() - last_log > 10:
                    last_log = time.monotonic()
                    log_json("data_progress", records=index, total=len(held_out),
                             records_per_second=round(index / (time.perf_counter() - started)))
    finally:
        for writer in parts.values():
            writer.close()
    return shard


def stored_layouts(spec: DatasetSpec) -> dict[str, Callable[[np.ndarray[Any, Any]], tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]]:
    """The block layouts a store keeps, by part: with packing, validation's always (evaluation
    packs by best-fit decreasing whatever the strategy) and train's with `bfd`."""
    if not spec.packing:
        return {}

    def layout(lengths: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        return packing_mod.flatten_layout(packing_mod.bfd_layout(lengths, spec.max_seq_length))

    parts = ("train", "validation") if spec.packing_strategy is PackingStrategy.BFD else ("validation",)
    return dict.fromkeys(parts, layout)


def block_report(store: store_mod.Store, spec: DatasetSpec) -> dict[str, Any]:
    """The `data` event's packing keys: blocks per part and their fill (real tokens / capacity)."""
    if not spec.packing:
        return {}
    out: dict[str, Any] = {"packing_strategy": spec.packing_strategy.value}
    for name, part in (("train", store.train), ("validation", store.validation)):
        if part.layout is not None:
            blocks, real = len(part.layout[1]) - 1, part.total_tokens
        else:  # concatenate: full blocks only, the tail dropped
            blocks = part.total_tokens // spec.max_seq_length
            real = blocks * spec.max_seq_length
        out[f"{name}_blocks"] = blocks
        out[f"{name}_fill"] = round(real / max(blocks * spec.max_seq_length, 1), 4) if blocks else None
    return out


def _merge(shards: list[_Shard], path: Path, meta: dict[str, Any],
           layouts: dict[str, Callable[[np.ndarray[Any, Any]], tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]] | None = None,
           ) -> store_mod.Store:
    """The members' shards, batch by batch in file order, as one store (a sequential copy), with
    the block `layouts` of its parts (computed once, here, by the merging member)."""
    builder = store_mod.StoreBuilder(path)
    try:
        order = sorted((number, k, train, val) for k, s in enumerate(shards) for number, train, val in s.batches)
        for name, column in (("train", 2), ("validation", 3)):
            folders = [Path(s.folder) / name for s in shards]
            offsets = [np.fromfile(folder / store_mod.OFFSETS, dtype=np.int64) for folder in folders]
            cursor = [0] * len(shards)
            writer = builder.parts[name]
            for row in order:
                k, count = row[1], row[column]
                if count:
                    writer.append(folders[k], offsets[k], cursor[k], cursor[k] + count)
                    cursor[k] += count
        return builder.commit(meta, layouts)
    except BaseException:
        builder.abandon()
        raise


def store_root(checkpoint_directory: str) -> tuple[Path, bool]:
    """(where stores go, whether every node sees it): beside the checkpoints when they are on a
    filesystem (a volume every worker mounts), else in the download cache (shared when the
    operator mounted spec.cache.volumeClaim there: LLAMAFT_CACHE_SHARED=1)."""
    if "://" not in checkpoint_directory:
        return Path(checkpoint_directory).expanduser() / "data", True
    from llamaft_trainer.downloads import CACHE_ROOT

    return CACHE_ROOT / "data", os.environ.get("LLAMAFT_CACHE_SHARED") == "1"


def prepared_store(spec: DatasetSpec, tok: PreTrainedTokenizerBase, seed: int, rt: Runtime, root: Path, shared: bool,
                   make_encoder: EncoderFactory = Encoder) -> store_mod.Store:
    """The store, built once: by every rank together when `root` is shared (each tokenizes every
    world-size-th batch, rank 0 merges), else by the ranks of each node for that node; the others'
    wait is bounded by BUILD_TIMEOUT, not the collective timeout. A bad record is every rank's
    ConfigError, the first in file order."""
    if rt.world_size == 1 or not dist.is_initialized():
        return build_store(spec, tok, seed, root, make_encoder=make_encoder)
    group = dist.new_group(backend="gloo", timeout=BUILD_TIMEOUT)
    first = 0 if shared else rt.rank - rt.local_rank  # torchrun numbers a node's ranks contiguously
    size = rt.world_size if shared else rt.local_world_size

    def gather(value: Any) -> list[Any]:
        everyone: list[Any] = [None] * rt.world_size
        dist.all_gather_object(everyone, value, group=group)
        return everyone[first:first + size]

    try:
        return build_store(spec, tok, seed, root, Team(rt.rank - first, size, rt.local_world_size, gather), make_encoder)
    finally:
        dist.destroy_process_group(group)


# ------------------------------------------------------------------------------ batching
class PaddedExamples(Dataset[dict[str, torch.Tensor]]):
    """One example per item, unpadded: `collate` pads each batch to its longest example."""

    def __init__(self, part: store_mod.Part) -> None:
        self.part = part

    def __len__(self) -> int:
        return len(self.part)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens, loss = self.part.example(index)
        return training_item(tokens, loss)


class PackedBlocks(Dataset[dict[str, torch.Tensor]]):
    """The examples back to back, cut into full `max_len` blocks (the last partial block is
    dropped): no padding at all."""

    def __init__(self, part: store_mod.Part, max_len: int) -> None:
        self.part = part
        self.max_len = max_len

    def __len__(self) -> int:
        return self.part.total_tokens // self.max_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens, loss = self.part.span(index * self.max_len, (index + 1) * self.max_len)
        return training_item(tokens, loss)


class PackedExamples(Dataset[dict[str, torch.Tensor]]):
    """Whole examples packed into blocks of at most `max_len` tokens by best-fit decreasing (the
    store's layout, or computed here for an in-memory part), one block per item, each example
    isolated: position ids restart at 0 per example, and the first token of each example carries
    no label (it is not the previous example's target). Every example is in exactly one block."""

    def __init__(self, part: store_mod.Part, max_len: int) -> None:
        self.part = part
        self.max_len = max_len
        layout = part.layout
        if layout is None:
            layout = packing_mod.flatten_layout(packing_mod.bfd_layout(part.lengths, max_len))
        self.examples: np.ndarray[Any, Any] = layout[0]
        self.block_offsets: np.ndarray[Any, Any] = layout[1]

    def __len__(self) -> int:
        return int(self.block_offsets.shape[0]) - 1

    def block(self, index: int) -> list[int]:
        """The example indices of block `index`, in the order they are laid out."""
        return [int(i) for i in self.examples[int(self.block_offsets[index]):int(self.block_offsets[index + 1])]]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        pieces = [self.part.example(i) for i in self.block(index)]
        item = training_item(np.concatenate([t for t, _ in pieces]), np.concatenate([f for _, f in pieces]))
        lengths = [len(t) for t, _ in pieces]
        starts = np.cumsum([0, *lengths[:-1]])
        item["labels"][torch.from_numpy(starts)] = IGNORE_INDEX
        item["position_ids"] = torch.from_numpy(np.concatenate([np.arange(n, dtype=np.int64) for n in lengths]))
        return item


def packed_dataset(part: store_mod.Part, spec: DatasetSpec, validation: bool) -> Dataset[dict[str, torch.Tensor]]:
    """A part's packed items: `concatenate` training blocks, else (and always for validation)
    whole examples by best-fit decreasing."""
    if spec.packing_strategy is PackingStrategy.CONCATENATE and not validation:
        return PackedBlocks(part, spec.max_seq_length)
    return PackedExamples(part, spec.max_seq_length)


def training_item(tokens: np.ndarray[Any, Any], loss: np.ndarray[Any, Any]) -> dict[str, torch.Tensor]:
    """One sequence as the model's inputs: ids, labels (IGNORE_INDEX where no loss), attention mask."""
    ids = torch.from_numpy(np.array(tokens, dtype=np.int64))
    labels = torch.where(torch.from_numpy(np.array(loss, dtype=np.bool_)), ids, IGNORE_INDEX)
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


class Collate:
    """Right-pad a batch to its longest sequence; padding is masked from attention and loss.
    Packed examples (items with `position_ids`): the padding's position ids restart at 0, so it is
    one more packed sequence of its own, which no real token attends to (the model gets position
    ids and no attention mask; `attention_mask` stays in the batch, counting real tokens)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        width = max(int(item["input_ids"].shape[0]) for item in items)
        fill = {"input_ids": self.pad_id, "labels": IGNORE_INDEX, "attention_mask": 0}
        out: dict[str, torch.Tensor] = {}
        for name, value in fill.items():
            batch = torch.full((len(items), width), value, dtype=torch.long)
            for row, item in enumerate(items):
                batch[row, : item[name].shape[0]] = item[name]
            out[name] = batch
        if "position_ids" in items[0]:
            positions = torch.arange(width, dtype=torch.long).repeat(len(items), 1)
            for row, item in enumerate(items):
                n = int(item["position_ids"].shape[0])
                positions[row, :n] = item["position_ids"]
                positions[row, n:] = torch.arange(width - n)
            out["position_ids"] = positions
        return out


class ResumableSampler(DistributedSampler[Any]):
    """DistributedSampler's order (seed + epoch, this rank's share), started `start` items in:
    a resumed run continues mid-epoch without reading the batches it already trained on."""

    start: int = 0

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())
        return iter(indices[self.start :])

    def __len__(self) -> int:
        return max(0, super().__len__() - self.start)


class ValidationShare:
    """This rank's share of the validation set, every sequence evaluated exactly once whatever the
    world size: rank r takes items r, r + W, r + 2W, ... (no padding with repeats, no dropped
    tail, unlike DistributedSampler). Every rank yields the same number of batches, because under
    FSDP each forward is a collective: a rank whose share ran out yields a filler batch (one of
    the set's sequences with every label ignored), which adds no loss and no tokens."""

    def __init__(self, dataset: Dataset[Any], rank: int, world: int, batch_size: int,
                 collate: Any) -> None:
        self.dataset, self.rank, self.world, self.batch_size, self.collate = dataset, rank, world, batch_size, collate
        self.size = len(dataset)  # type: ignore[arg-type]
        self.indices = list(range(rank, self.size, world))

    def __len__(self) -> int:
        """Batches per rank: those of the largest share."""
        largest_share = -(-self.size // self.world)
        return -(-largest_share // self.batch_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            chosen = self.indices[start : start + self.batch_size]
            if chosen:
                yield self.collate([self.dataset[i] for i in chosen])
            else:
                yield self.filler(self.collate([self.dataset[self.indices[0] if self.indices else 0]]))

    def filler(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`batch` made a filler: every label ignored, so it adds no loss and no tokens."""
        batch["labels"].fill_(IGNORE_INDEX)
        return batch


class StepGroup(list[dict[str, torch.Tensor]]):
    """One optimizer step's micro-batches of this rank, with the training items it consumed and
    where the epoch stands after the step (its items consumed by all ranks together)."""

    def __init__(self, batches: Sequence[dict[str, torch.Tensor]], items: list[int], items_after: int) -> None:
        super().__init__(batches)
        self.items = items
        self.items_after = items_after


class StepOrder(Protocol):
    """Training items taken step by step from an order that does not depend on the world size
    (training.globalBatchSize: global_order.GlobalOrder)."""

    @property
    def steps_per_epoch(self) -> int: ...

    def steps(self, epoch: int, start: int) -> Iterator[StepGroup]:
        """The epoch's optimizer steps from its global item `start` on, each this rank's micro-batches."""
        ...


@dataclass
class Data:
    """The run's training and validation batches. `batches(epoch, skip)` yields the epoch's
    micro-batches from the `skip`-th on; `batches_per_epoch` is None for a stream of unknown length.
    With `order` (training.globalBatchSize) the loop takes whole steps from it instead."""

    train: Dataset[dict[str, torch.Tensor]] | None
    """None for a stream."""
    validation: Dataset[dict[str, torch.Tensor]] | None
    loader: DataLoader[dict[str, torch.Tensor]] | None
    """None for a stream (no known length)."""
    validation_loader: ValidationShare | None
    sampler: ResumableSampler | None = None
    batch_size: int = 1
    store_path: Path | None = None
    stream: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    order: StepOrder | None = None
    """training.globalBatchSize: the steps of one global order (the loader is then unused)."""

    @property
    def batches_per_epoch(self) -> int | None:
        """Per epoch, what gradientAccumulationSteps groups into optimizer steps: this rank's
        micro-batches, or with a global order (accumulation 1 by the API, the micro-steps of each
        step derived) the steps themselves."""
        if self.order is not None:
            return self.order.steps_per_epoch
        return None if self.loader is None else len(self.loader)

    def batches(self, epoch: int, skip: int) -> Iterator[dict[str, torch.Tensor]]:
        if self.stream is not None:
            yield from self.stream.batches(epoch, skip)
            return
        assert self.sampler is not None and self.loader is not None
        self.sampler.set_epoch(epoch)
        self.sampler.start = skip * self.batch_size
        try:
            yield from self.loader
        finally:
            self.sampler.start = 0


def _generator(seed: int) -> torch.Generator:
    # Each loader gets its own generator: creating an iterator draws a base seed (for worker
    # processes, unused with num_workers=0) from the loader's generator, by default the *global*
    # one that dropout draws from. A resumed run creates its iterator at another point of the RNG
    # stream than an uninterrupted one, so that draw shifted every dropout mask after a resume.
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def loaders(store: store_mod.Store, spec: DatasetSpec, pad_id: int, batch_size: int, seed: int, rank: int, world: int,
            *, global_order: bool = False) -> Data:
    """Loaders over a store: every rank sees a disjoint, seed-determined share per epoch.
    `global_order`: the steps will come from a global order (global_order.attach), which checks
    the data against training.globalBatchSize instead of a batch per rank."""
    train: Dataset[dict[str, torch.Tensor]]
    if spec.packing:
        train = packed_dataset(store.train, spec, validation=False)
        validation: Dataset[dict[str, torch.Tensor]] | None = packed_dataset(store.validation, spec, validation=True)
    else:
        train = PaddedExamples(store.train)
        validation = PaddedExamples(store.validation)
    n_train = len(train)  # type: ignore[arg-type]
    if n_train < world * batch_size and not global_order:
        raise ConfigError(
            f"spec.dataset: {n_train} training sequences cannot give {world} ranks a batch of {batch_size}; "
            "use more data, a smaller perDeviceBatchSize or padding instead of packing"
        )
    collate = Collate(pad_id)
    sampler = ResumableSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(train, batch_size=batch_size, sampler=sampler, drop_last=True, collate_fn=collate,
                        generator=_generator(seed))
    val_loader = None
    if validation is not None and len(validation) > 0:  # type: ignore[arg-type]
        val_loader = ValidationShare(validation, rank, world, batch_size, collate)
    else:
        validation = None
    return Data(train, validation, loader, val_loader, sampler, batch_size, store.path,
                info={"train_sequences": n_train})
