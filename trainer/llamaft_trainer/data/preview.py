"""`llamaft data preview`: the first examples of a split exactly as the trainer will train on them.

A chat template that masks the wrong turns, a prompt without its newline or a maxSeqLength that
cuts every answer shows up only as a bad model hours later. This module shows the tokens before a
run, through the trainer's own code and nothing else: the tokenizer as `model.load_tokenizer`
loads it, the token store as `data.build_store` builds it (same function, same key), each shown
example read back with `store.Part.example`, the packing layout the store keeps and the figures of
`data.block_report`. Nothing here re-implements a format, a template, the split or the packing, so
what it shows cannot drift from what the trainer does.

What the store cannot tell, truncation, is found by encoding the same records again with the
same `data.Encoder` on a copy of the dataset spec whose maxSeqLength is unlimited: truncation keeps
a prefix of the untruncated tokens, so the difference is what the cut removed.

`build_preview` computes a `Preview` (plain data: token ids, loss flags, spans of decoded text);
`render_text` and `render_json` present it. `preview` is what the command calls: the tokenizer, a
store directory (a temporary one unless given), then `build_preview`. No GPU, no torchrun.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from llamaft.api.spec import DatasetSpec, PackingStrategy, TrainingJobConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from llamaft_trainer.data import encoding, prepare
from llamaft_trainer.data import store as store_mod
from llamaft_trainer.data.records import Numbered, RecordSource
from llamaft_trainer.process.errors import ConfigError
from llamaft_trainer.process.runtime import Runtime

SPLITS = ("train", "validation")
"""The store's parts a preview can show (`--split`)."""
UNLIMITED = 2**31 - 1
"""maxSeqLength of the untruncated encoding: longer than any sequence a tokenizer produces."""
OPEN, CLOSE = "[[", "]]"
"""Marks around the tokens that carry loss in the plain text form."""
LOSS_COLOUR, RESET = "\x1b[1;32m", "\x1b[0m"
"""Bold green for the tokens that carry loss on a terminal; context stays in the default colour."""

__all__ = ["BlockPlacement", "Preview", "PreviewExample", "Span", "build_preview", "preview", "render_json",
           "render_text", "spans", "to_document", "trainer_tokenizer", "use_colour"]


@dataclass(frozen=True)
class Span:
    """A run of consecutive tokens that all carry loss or all do not, with their decoded text."""

    start: int
    """Index of the first token in the example."""
    end: int
    """One past the last token."""
    loss: bool
    text: str


@dataclass(frozen=True)
class BlockPlacement:
    """Where a packed example lands among the split's blocks (the sequences the model sees)."""

    blocks: list[int]
    """The blocks holding its tokens: one with `bfd`; with `concatenate` every full block it spans
    (none when it lies wholly in the dropped last partial block)."""
    offset: int
    """Position of its first token inside its first block."""
    with_examples: list[int]
    """`bfd`: the other examples of its block, in layout order (empty for `concatenate`)."""
    block_tokens: int
    """Real tokens in `blocks[0]` (`bfd`; maxSeqLength for a full `concatenate` block)."""
    dropped_tokens: int = 0
    """`concatenate`: its tokens in the last partial block, which training drops."""


@dataclass(frozen=True)
class PreviewExample:
    """One example of the split, as stored, and what truncation removed from it."""

    index: int
    """Its index in the store's part (the trainer's example number)."""
    where: str
    """The record it came from, as a person finds it (file and line, or Hub split and row)."""
    input_ids: list[int]
    loss: list[bool]
    """Per token: whether it carries loss (its label is itself, not -100)."""
    spans: list[Span]
    untruncated_tokens: int
    untruncated_loss_tokens: int
    placement: BlockPlacement | None = None
    """With packing: its block(s)."""

    @property
    def tokens(self) -> int:
        return len(self.input_ids)

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss)

    @property
    def removed_tokens(self) -> int:
        """Tokens the cut to maxSeqLength removed."""
        return self.untruncated_tokens - self.tokens

    @property
    def removed_loss_tokens(self) -> int:
        """Of those, the ones that would have carried loss."""
        return self.untruncated_loss_tokens - self.loss_tokens


@dataclass(frozen=True)
class PackingSummary:
    """The split's packing, as the trainer's `data` log line reports it (`block_report`)."""

    strategy: str
    """How this split is packed: the spec's strategy for train, always `bfd` for validation."""
    blocks: int
    fill: float | None
    """Real tokens / (blocks x maxSeqLength); None without blocks."""
    report: dict[str, Any]
    """`block_report` of the whole store (both parts)."""


@dataclass(frozen=True)
class Preview:
    """What `llamaft data preview` shows; plain data, rendered by `render_text` / `render_json`."""

    source: str
    format: str
    train_on: str | None
    max_seq_length: int
    split: str
    records: int
    """Records in the source (both parts)."""
    examples_in_split: int
    store: str
    store_kept: bool
    """False: a temporary directory, removed when the preview ended."""
    store_reused: bool
    """The store was already complete there (built by an earlier preview or run)."""
    trainer_store: str
    """Where the trainer keeps this store (beside the checkpoints): a run with it there reuses it."""
    packing: PackingSummary | None
    examples: list[PreviewExample]
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------ building
def single_process() -> Runtime:
    """The runtime of one process on the CPU: what `load_tokenizer` and the store need here
    (downloads by this process alone, no process group)."""
    return Runtime(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))


def trainer_tokenizer(config: TrainingJobConfig) -> PreTrainedTokenizerBase:
    """The tokenizer exactly as the trainer's `setup` loads it, after the same maxSeqLength check
    against the model's config (a preview of data the trainer would refuse would mislead)."""
    from llamaft_trainer.model import model as model_mod

    rt = single_process()
    tokenizer = model_mod.load_tokenizer(config.model, rt)
    model_config = model_mod.load_model_config(config.model, rt)
    encoding.check_sequence_length(config.dataset, getattr(model_config, "max_position_embeddings", None))
    return tokenizer


@contextlib.contextmanager
def _trainer_log_kept_off_stdout() -> Iterator[None]:
    """The store's builder writes the trainer's JSON log lines (`data`, `fetch`) to stdout, where
    they would break `--json`'s single document; the preview reports the same facts itself."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def build_preview(dataset: DatasetSpec, tokenizer: PreTrainedTokenizerBase, seed: int, root: Path, *,
                  count: int = 3, split: str = "train", kept: bool = True,
                  trainer_root: Path | None = None) -> Preview:
    """The first `count` examples of `split` of the store `data.build_store` builds (or finds)
    under `root` for this dataset, tokenizer and seed, with their truncation and packing.

    `kept`: whether `root` outlives the preview (only reported). `trainer_root`: where the trainer
    keeps its stores (`data.store_root` of the checkpoint directory), reported beside the key."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    notes: list[str] = []
    if dataset.streaming:
        # A stream is tokenized while training, by the same Encoder, and has no store: the store
        # built as for `streaming: false` holds the same examples (only the held-out ones differ).
        notes.append("dataset.streaming: the trainer tokenizes while training with the same encoder; shown from a "
                     "store built as for streaming: false (a stream holds out the head of the file for validation "
                     "instead, and reads the records in shuffled windows)")
        dataset = dataset.model_copy(update={"streaming": False})
    before = set(os.listdir(root)) if root.is_dir() else set()
    with _trainer_log_kept_off_stdout():
        store = prepare.build_store(dataset, tokenizer, seed, root)
    part = store.train if split == "train" else store.validation
    shown = min(count, len(part))
    records = _split_records(dataset, seed, split, store, tokenizer, shown)
    blocks = _placements(part, dataset, split, shown) if dataset.packing else [None] * shown
    examples = []
    for index in range(shown):
        tokens, loss = part.example(index)
        ids = [int(t) for t in tokens]
        flags = [bool(f) for f in loss]
        where, full = records[index]
        examples.append(PreviewExample(
            index=index, where=where, input_ids=ids, loss=flags, spans=spans(tokenizer, ids, flags),
            untruncated_tokens=full[0], untruncated_loss_tokens=full[1], placement=blocks[index],
        ))
        if not any(flags):
            notes.append(f"example {index} ({where}) carries no loss: every token is context")
    packing = None
    if dataset.packing:
        report = prepare.block_report(store, dataset)
        strategy = dataset.packing_strategy.value if split == "train" else PackingStrategy.BFD.value
        packing = PackingSummary(strategy, int(report[f"{split}_blocks"]), report[f"{split}_fill"], report)
    return Preview(
        source=dataset.source, format=dataset.format.value,
        train_on=dataset.train_on.value if dataset.train_on is not None else None,
        max_seq_length=dataset.max_seq_length, split=split, records=int(store.meta.get("records", 0)),
        examples_in_split=len(part), store=str(store.path), store_kept=kept, store_reused=store.path.name in before,
        trainer_store=str((trainer_root or root) / store.path.name), packing=packing, examples=examples, notes=notes,
    )


def _split_records(dataset: DatasetSpec, seed: int, split: str, store: store_mod.Store,
                   tokenizer: PreTrainedTokenizerBase, count: int) -> list[tuple[str, tuple[int, int]]]:
    """(where, (untruncated tokens, untruncated loss tokens)) of the first `count` examples of the
    split, in store order: the split's records (`data.validation_mask`, as the store splits them),
    those whose encoding is empty left out (the store leaves them out too), encoded with the
    trainer's Encoder twice, as stored and with maxSeqLength unlimited. The stored form is checked
    against the store itself, so the records named are the ones shown."""
    if count == 0:
        return []
    part = store.train if split == "train" else store.validation
    encoder = encoding.Encoder(dataset, tokenizer)
    untruncated = encoding.Encoder(dataset.model_copy(update={"max_seq_length": UNLIMITED}), tokenizer)
    source = RecordSource(dataset)
    held_out = prepare.validation_mask(int(store.meta["records"]), dataset.validation_split, seed)
    out: list[tuple[str, tuple[int, int]]] = []
    for batch in _records_of_split(source, held_out, split == "validation"):
        stored, full = encoder.encode(batch), untruncated.encode(batch)
        for k, (where, _) in enumerate(batch):
            tokens, loss = stored.example(k)
            if not len(tokens):
                continue
            expected, expected_loss = part.example(len(out))
            if not (np.array_equal(np.asarray(tokens), np.asarray(expected))
                    and np.array_equal(np.asarray(loss, dtype=bool), np.asarray(expected_loss, dtype=bool))):
                # A store is keyed by the data's fingerprint, so this is a bug rather than bad input.
                raise RuntimeError(f"the token store's example {len(out)} is not the encoding of {where}: the store at "
                                   f"{store.path} does not match the data; remove it and preview again")
            full_tokens, full_loss = full.example(k)
            out.append((where, (len(full_tokens), int(np.count_nonzero(full_loss)))))
            if len(out) == count:
                return out
    raise RuntimeError(f"the source has fewer {split} records than the store's {len(part)} examples")


def _records_of_split(source: RecordSource, held_out: np.ndarray[Any, Any], validation: bool,
                      size: int = 64) -> Iterator[list[Numbered]]:
    """The split's records in file order, `size` at a time (read only as far as the preview needs)."""
    pending: list[Numbered] = []
    index = 0
    for batch in source.batches():
        for numbered in batch:
            if bool(held_out[index]) == validation:
                pending.append(numbered)
            index += 1
            if len(pending) == size:
                yield pending
                pending = []
    if pending:
        yield pending


def _placements(part: store_mod.Part, dataset: DatasetSpec, split: str, count: int) -> list[BlockPlacement | None]:
    """Where each of the first `count` examples lands: the store's own layout where it keeps one
    (`bfd`, and validation always), else `concatenate`'s cut of the examples laid back to back
    into maxSeqLength blocks, the last partial block dropped (`data.PackedBlocks`)."""
    capacity = dataset.max_seq_length
    if part.layout is not None:
        order, offsets = part.layout
        block_of = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
        at = np.empty(len(part), dtype=np.int64)
        at[order] = np.arange(len(order))
        sizes = part.lengths
        out: list[BlockPlacement | None] = []
        for index in range(count):
            b = int(block_of[at[index]])
            members = [int(i) for i in order[offsets[b]:offsets[b + 1]]]
            lengths = [int(sizes[i]) for i in members]
            mine = members.index(index)
            out.append(BlockPlacement([b], sum(lengths[:mine]), [i for i in members if i != index], sum(lengths)))
        return out
    if split != "train" or dataset.packing_strategy is not PackingStrategy.CONCATENATE:
        raise RuntimeError(f"the token store's {split} part has no block layout, which {dataset.packing_strategy.value} "
                           "packing keeps: the store is from another version; remove it and preview again")
    full_blocks = part.total_tokens // capacity
    out = []
    for index in range(count):
        start, end = int(part.offsets[index]), int(part.offsets[index + 1])
        spanned = range(start // capacity, (end - 1) // capacity + 1)
        kept = [b for b in spanned if b < full_blocks]
        dropped = max(0, end - max(start, full_blocks * capacity))
        out.append(BlockPlacement(kept, start % capacity, [], capacity if kept else 0, dropped))
    return out


def spans(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], loss: Sequence[bool]) -> list[Span]:
    """The example cut into runs of equal loss flags, each with its decoded text (special tokens
    shown as text). A run's text is the decoded prefix up to its end minus the decoded prefix
    before it, so the texts join into exactly the example's decoded text (a decoder may merge or
    strip spaces at a token boundary, which decoding each run alone would get wrong); where a run
    starts inside a character (byte-level tokens), it is decoded alone."""
    out: list[Span] = []
    before = ""
    start = 0
    for end in range(1, len(ids) + 1):
        if end < len(ids) and loss[end] == loss[start]:
            continue
        upto = _decode(tokenizer, ids[:end])
        text = upto[len(before):] if upto.startswith(before) else _decode(tokenizer, ids[start:end])
        out.append(Span(start, end, bool(loss[start]), text))
        before, start = upto, end
    return out


def _decode(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    return str(tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))


def preview(config: TrainingJobConfig, *, count: int = 3, split: str = "train", store: Path | None = None,
            tokenizer: PreTrainedTokenizerBase | None = None) -> Preview:
    """`llamaft data preview`: the trainer's tokenizer (unless given), the store built into `store`
    (kept) or a temporary directory (removed before this returns), and the preview of it."""
    tok = tokenizer if tokenizer is not None else trainer_tokenizer(config)
    trainer_root, _ = prepare.store_root(config.checkpointing.directory)
    if store is not None:
        store = store.expanduser()
        try:
            store.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--store: cannot create the token store's directory {store} ({type(exc).__name__}: "
                              f"{exc}); give a directory this user can write") from exc
        return build_preview(config.dataset, tok, config.training.seed, store, count=count, split=split,
                             kept=True, trainer_root=trainer_root)
    with tempfile.TemporaryDirectory(prefix="llamaft-preview-") as folder:
        return build_preview(config.dataset, tok, config.training.seed, Path(folder), count=count, split=split,
                             kept=False, trainer_root=trainer_root)


# ----------------------------------------------------------------------------- rendering
def use_colour(mode: str, stream: TextIO, environ: Mapping[str, str]) -> bool:
    """`--color`: always, never, or auto (a terminal, unless NO_COLOR is set: no-color.org)."""
    if mode == "always":
        return True
    if mode == "never":
        return False
    return stream.isatty() and not environ.get("NO_COLOR")


def marked(example: PreviewExample, colour: bool) -> str:
    """The example's decoded text with its loss-carrying spans marked: bold green, or [[...]]."""
    out = []
    for span in example.spans:
        if not span.loss:
            out.append(span.text)
        elif colour:
            out.append(f"{LOSS_COLOUR}{span.text}{RESET}")
        else:
            out.append(f"{OPEN}{span.text}{CLOSE}")
    return "".join(out)


def legend(colour: bool) -> str:
    if colour:
        return f"legend: {LOSS_COLOUR}bold green{RESET} text carries loss; the rest is context (label -100, no loss)"
    return f"legend: {OPEN}...{CLOSE} carries loss; text outside the brackets is context (label -100, no loss)"


def _store_line(p: Preview) -> str:
    state = "reused" if p.store_reused else "built"
    if not p.store_kept:
        return f"store: {state} by the trainer's build_store in a temporary directory, {p.store}, removed at the end"
    if Path(p.store).resolve() == Path(p.trainer_store).resolve():
        return f"store: {state} at {p.store}, kept (the trainer's own: a run of this spec reuses it)"
    return f"store: {state} at {p.store}, kept (the trainer keeps this store at {p.trainer_store})"


def _placement_line(p: Preview, example: PreviewExample) -> str | None:
    place = example.placement
    if p.packing is None or place is None:
        return None
    if p.packing.strategy == PackingStrategy.BFD.value:
        others = ", ".join(f"#{i}" for i in place.with_examples) or "none"
        return (f"  block {place.blocks[0]} at position {place.offset} ({place.block_tokens}/{p.max_seq_length} "
                f"tokens; other examples in it, by their index in the split: {others})")
    if not place.blocks:
        return f"  in the last partial block, which training drops ({place.dropped_tokens} tokens)"
    where = f"block {place.blocks[0]}" if len(place.blocks) == 1 else f"blocks {place.blocks[0]}-{place.blocks[-1]}"
    line = f"  {where}, starting at position {place.offset}"
    if place.dropped_tokens:
        line += f"; its last {place.dropped_tokens} tokens fall in the dropped partial block"
    return line


def render_text(p: Preview, colour: bool = False) -> str:
    """The human form: a header (dataset, split, packing, store, legend), then each example's
    counts, truncation, block and marked text."""
    fmt = p.format + (f", trainOn {p.train_on}" if p.train_on else "")
    lines = [f"dataset: {p.source} ({fmt}), maxSeqLength {p.max_seq_length}",
             f"split: {p.split}, {p.examples_in_split} examples of {p.records} records; showing "
             f"{len(p.examples)}"]
    if p.packing is not None:
        fill = "n/a" if p.packing.fill is None else f"{p.packing.fill:.4f}"
        how = " (evaluation always packs by bfd)" if p.split == "validation" else ""
        lines.append(f"packing: {p.packing.strategy}{how}, {p.packing.blocks} blocks of {p.max_seq_length} tokens, "
                     f"fill {fill}")
    else:
        lines.append("packing: off (each example its own sequence, padded per batch)")
    lines.append(_store_line(p))
    lines += [f"note: {note}" for note in p.notes]
    lines.append(legend(colour))
    for example in p.examples:
        lines.append("")
        lines.append(f"--- example {example.index} ({example.where}) ---")
        counts = f"  {example.tokens} tokens, {example.loss_tokens} carry loss"
        if example.removed_tokens:
            counts += (f"; truncated to maxSeqLength: {example.removed_tokens} tokens removed, "
                       f"{example.removed_loss_tokens} of which carried loss (untruncated {example.untruncated_tokens})")
        else:
            counts += "; not truncated"
        lines.append(counts)
        place = _placement_line(p, example)
        if place is not None:
            lines.append(place)
        lines.append(marked(example, colour))
    if not p.examples:
        lines.append("")
        lines.append(f"the {p.split} part is empty" + (" (dataset.validationSplit is 0)" if p.split == "validation" else ""))
    return "\n".join(lines) + "\n"


def to_document(p: Preview) -> dict[str, Any]:
    """The machine-readable form: everything of the Preview, with each example's counts."""
    doc = asdict(p)
    for example, out in zip(p.examples, doc["examples"], strict=True):
        out.update(tokens=example.tokens, loss_tokens=example.loss_tokens, truncation={
            "removed_tokens": example.removed_tokens, "removed_loss_tokens": example.removed_loss_tokens,
            "untruncated_tokens": example.untruncated_tokens, "untruncated_loss_tokens": example.untruncated_loss_tokens,
        })
        del out["untruncated_tokens"], out["untruncated_loss_tokens"]
    return doc


def render_json(p: Preview) -> str:
    """One JSON document on one line (`--json`; token lists make an indented one thousands of lines)."""
    return json.dumps(to_document(p)) + "\n"
