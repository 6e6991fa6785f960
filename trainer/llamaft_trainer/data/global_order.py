"""A data order that does not depend on the world size (training.globalBatchSize, issue 39).

Without a global batch, each rank reads its DistributedSampler share (data.ResumableSampler): what
a step trains on, where an epoch ends and what a resume skips all depend on the number of ranks.
With `globalBatchSize` G they do not:

- one seeded permutation of the epoch's training items (sequences, packed blocks or preference
  pairs), the same on every rank and for every world size: `torch.randperm(n)` from a generator
  seeded with seed + epoch, as DistributedSampler draws its own (torch/utils/data/distributed.py
  `DistributedSampler.__iter__`);
- optimizer step k of the epoch takes the items at positions [start + k*G, start + (k+1)*G) of it
  (`start`: where a resumed epoch continues); an epoch has floor((n - start) / G) steps, the tail
  that cannot fill a step is left out (as drop_last does, but the same items at every size);
- the split of a step's G items, a fixed rule: rank r takes the step's items r, r + W, r + 2W, ...
  (W ranks; ValidationShare's rule), in micro-batches of perDeviceBatchSize B, so every rank runs
  ceil(G / (W*B)) micro-steps; a rank whose share is short of a micro-step runs a filler (one of
  the step's items, marked `filler` and with every label ignored), which adds no loss, no target
  tokens and no pairs, and is not counted as tokens trained on.

The loop normalises each step's loss by the global count of target tokens (or pairs), so the same
spec on any number of ranks computes the same gradient at each step (float rounding aside), and a
checkpoint records the items of the epoch consumed (`TrainState.items_in_epoch`), not a per-rank
offset: a run checkpointed on N ranks resumes on M at the next item.

`LLAMAFT_LOG_ITEMS=1`: every rank logs an `items` event per step with the training items it
consumed (the tests read what a run trained on from them); off by default, the step event stays
small.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from llamaft_trainer.data.batching import Data, StepGroup
from llamaft_trainer.data.encoding import IGNORE_INDEX
from llamaft_trainer.process.errors import ConfigError

LOG_ITEMS_ENV = "LLAMAFT_LOG_ITEMS"

Batch = dict[str, torch.Tensor]


def is_filler(batch: Batch) -> bool:
    """A micro-batch run only because every rank must run the same forwards and backwards."""
    return "filler" in batch


def filler(batch: Batch) -> Batch:
    """`batch` made a filler: marked, and every label ignored (no loss, no target tokens; a pair
    batch has no labels: the DPO step reads the mark, dpo_step.DpoMethod.micro_step)."""
    if "labels" in batch:
        batch["labels"].fill_(IGNORE_INDEX)
    batch["filler"] = torch.ones(1, dtype=torch.bool)
    return batch


def log_items() -> bool:
    return os.environ.get(LOG_ITEMS_ENV) == "1"


class GlobalOrder:
    """The steps of an epoch for this rank under training.globalBatchSize (module docstring)."""

    def __init__(self, dataset: Dataset[Any], collate: Callable[[list[Any]], Batch], global_batch: int,
                 batch_size: int, rank: int, world: int, seed: int, what: str = "sequences") -> None:
        self.dataset, self.collate = dataset, collate
        self.global_batch, self.batch_size, self.rank, self.world, self.seed = global_batch, batch_size, rank, world, seed
        self.size = len(dataset)  # type: ignore[arg-type]
        if global_batch < world:
            raise ConfigError(
                f"spec.training.globalBatchSize: {global_batch} is below the world size {world}: every rank needs at "
                f"least one of the step's {what}; set globalBatchSize >= {world} or run on at most {global_batch} ranks"
            )
        if self.size < global_batch:
            raise ConfigError(
                f"spec.training.globalBatchSize: {self.size} training {what} cannot fill one step of {global_batch}; "
                "use more data or a smaller globalBatchSize"
            )
        self.micro_steps = -(-global_batch // (world * batch_size))  # TrainingSpec.micro_steps
        """Micro-steps per optimizer step, on every rank (the derived accumulation)."""

    @property
    def steps_per_epoch(self) -> int:
        return self.size // self.global_batch

    def permutation(self, epoch: int) -> list[int]:
        """The epoch's order of the training items, the same on every rank and world size."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def share(self, step_items: Sequence[int]) -> list[list[int]]:
        """This rank's items of a step, per micro-step (an empty list: a filler)."""
        mine = list(step_items[self.rank :: self.world])
        b = self.batch_size
        return [mine[m * b : (m + 1) * b] for m in range(self.micro_steps)]

    def steps(self, epoch: int, start: int) -> Iterator[StepGroup]:
        """The epoch's steps from global item `start` on, each this rank's micro-batches."""
        order = self.permutation(epoch)
        for first in range(start, self.size - self.global_batch + 1, self.global_batch):
            step_items = order[first : first + self.global_batch]
            shares = self.share(step_items)
            batches = [self.collate([self.dataset[i] for i in chosen]) if chosen
                       else filler(self.collate([self.dataset[step_items[0]]]))
                       for chosen in shares]
            yield StepGroup(batches, [i for chosen in shares for i in chosen], first + self.global_batch)


def attach(data: Data, global_batch: int, rank: int, world: int, seed: int, what: str) -> Data:
    """`data` with its steps taken from a GlobalOrder over its training items, batched by its
    loader's collate in micro-batches of its batch size (perDeviceBatchSize)."""
    if data.train is None or data.loader is None:
        raise ConfigError("spec.training.globalBatchSize needs the token store's training items: set dataset.streaming: false")
    order = GlobalOrder(data.train, data.loader.collate_fn, global_batch, data.batch_size, rank, world, seed, what)
    data.order = order
    data.info.update(global_batch_size=global_batch, micro_steps=order.micro_steps)
    return data
