"""Preparing the token store: the train/validation split, then records read and tokenized in
batches (the fast tokenizer's batch call), each batch by one rank, and merged into the token store
(store.py) beside the checkpoints, keyed by everything that changes the tokens: once per run, not
per rank and not per attempt; every rank then reads it in place, and a later attempt reuses it.
`dataset.streaming` skips the store and tokenizes while training (streaming.py).
"""


from __future__ import annotations

import contextlib
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch.distributed as dist
from llamaft.api.spec import DatasetSpec, PackingStrategy
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from llamaft_trainer.data import packing as packing_mod
from llamaft_trainer.data import store as store_mod
from llamaft_trainer.data.encoding import Encoder
from llamaft_trainer.data.records import BATCH, Numbered, RecordSource, digest
from llamaft_trainer.process.errors import ConfigError
from llamaft_trainer.process.runtime import Runtime
from llamaft_trainer.report.metrics import log_json

BUILD_TIMEOUT = timedelta(hours=12)
"""How long the other ranks wait for the store's builder (a 10^6-record set takes minutes)."""

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




# ----------------------------------------------------------------------------- the store
class StoreEncoder(Protocol):
    """What build_store needs of an encoder: Encoder (single sequences) or
    methods.dpo_pairs.PairEncoder (pairs, format preference, which inputs.build_data passes)."""

    def identity(self) -> dict[str, Any]: ...

    def encode(self, numbered: Sequence[Numbered]) -> store_mod.Part: ...


EncoderFactory = Callable[[DatasetSpec, PreTrainedTokenizerBase], StoreEncoder]
"""Builds a store's encoder: Encoder, or methods.dpo_pairs.PairEncoder for format preference."""


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
    from llamaft_trainer.sources.downloads import CACHE_ROOT

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


