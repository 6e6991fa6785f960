"""Batching: the token store's examples as datasets (packed blocks or examples padded per batch),
collated, and a distributed, seed-deterministic, resumable loader.

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
Padding happens per batch (to the longest example in it), never in storage.
"""


from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from llamaft.api.spec import DatasetSpec, PackingStrategy
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from llamaft_trainer.data import packing as packing_mod
from llamaft_trainer.data import store as store_mod
from llamaft_trainer.data.encoding import IGNORE_INDEX
from llamaft_trainer.process.errors import ConfigError


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


def loader_generator(seed: int) -> torch.Generator:
    """A loader's own generator: creating an iterator draws a base seed (for worker processes,
    unused with num_workers=0) from the loader's generator, by default the *global* one that
    dropout draws from. A resumed run creates its iterator at another point of the RNG stream than
    an uninterrupted one, so that draw would shift every dropout mask after a resume."""
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
                        generator=loader_generator(seed))
    val_loader = None
    if validation is not None and len(validation) > 0:  # type: ignore[arg-type]
        val_loader = ValidationShare(validation, rank, world, batch_size, collate)
    else:
        validation = None
    return Data(train, validation, loader, val_loader, sampler, batch_size, store.path,
                info={"train_sequences": n_train})
