"""training.globalBatchSize (issue 39): the same spec trains the same model on any world size.

1. The order (no processes): one permutation per epoch whatever the world size; the fixed split
   gives every rank the same number of micro-steps, the step's items exactly once over the ranks,
   fillers where a share runs short; a world size that cannot carry the batch is refused by field.
2. Under real torchrun, in three launches (1 rank, 2 ranks, 1 rank) of the harness: the same spec,
   padded (globalBatchSize 5: uneven, a filler on rank 1), packed (4 blocks of several examples),
   LoRA, DoRA and DPO (5 pairs), has the same per-step loss and training items on 1 and 2 ranks, the
   loss to 1e-5 relative (fp32); in every one of those modes a run stopped after its step-3 checkpoint
   on 1 rank resumes on 2, and one stopped on 2 resumes on 1, each continuing the uninterrupted run's
   losses to 1e-5 and its training items step for step (the ranks' `items` events, LLAMAFT_LOG_ITEMS),
   none skipped or repeated, across an epoch boundary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from llamaft_trainer.data.batching import Collate, training_item
from llamaft_trainer.data.global_order import LOG_ITEMS_ENV, GlobalOrder, is_filler
from llamaft_trainer.process.errors import ConfigError
from llamaft_trainer.report.logline import read_events

from tests.trainer.conftest import DATASET, base_config, run_harness
from tests.trainer.methods.test_dpo_run import dpo_config, head


# ------------------------------------------------------------------ the order, in process
class Items(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Item i: a sequence of i + 2 tokens, all carrying loss (its id readable from its length)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        import numpy as np

        return training_item(np.full(index + 2, 7, dtype=np.int64), np.ones(index + 2, dtype=np.bool_))


def _orders(n: int, global_batch: int, batch: int, world: int) -> list[GlobalOrder]:
    return [GlobalOrder(Items(n), Collate(0), global_batch, batch, rank, world, seed=3) for rank in range(world)]


@pytest.mark.parametrize(("global_batch", "batch", "world", "micro_steps"), [
    (6, 2, 1, 3), (6, 2, 2, 2), (6, 2, 3, 1), (5, 2, 2, 2), (7, 4, 3, 1), (4, 1, 4, 1),
])
def test_every_rank_takes_its_share_of_the_same_steps(global_batch: int, batch: int, world: int,
                                                      micro_steps: int) -> None:
    orders = _orders(23, global_batch, batch, world)
    assert {o.micro_steps for o in orders} == {micro_steps}
    assert orders[0].steps_per_epoch == 23 // global_batch
    single = GlobalOrder(Items(23), Collate(0), global_batch, 1, 0, 1, seed=3)
    assert orders[0].permutation(1) == single.permutation(1) != single.permutation(2)
    for start in (0, global_batch):  # from the start of the epoch and resumed one step in
        expected = list(single.steps(1, start))
        per_rank = [list(o.steps(1, start)) for o in orders]
        assert all(len(steps) == len(expected) for steps in per_rank)
        for k, want in enumerate(expected):
            groups = [steps[k] for steps in per_rank]
            assert sorted(i for g in groups for i in g.items) == sorted(want.items)
            assert {g.items_after for g in groups} == {want.items_after}
            assert all(len(g) == micro_steps for g in groups)
            for g in groups:  # each real row is one of its items (length i + 2), fillers carry no label
                real = [b for b in g if not is_filler(b)]
                lengths = sorted(int(n) - 2 for b in real for n in b["attention_mask"].sum(dim=1))
                assert lengths == sorted(g.items)
                assert all(bool((b["labels"] == -100).all()) for b in g if is_filler(b))


def test_an_uneven_split_runs_a_filler() -> None:
    rank0, rank1 = _orders(10, 5, 2, 2)
    first0, first1 = next(rank0.steps(0, 0)), next(rank1.steps(0, 0))
    assert [len(b["input_ids"]) for b in first0] == [2, 1] and len(first0.items) == 3
    assert [is_filler(b) for b in first1] == [False, True] and len(first1.items) == 2


def test_a_batch_the_world_or_the_data_cannot_carry_is_refused_by_field() -> None:
    with pytest.raises(ConfigError, match=r"spec.training.globalBatchSize: 3 is below the world size 4"):
        GlobalOrder(Items(20), Collate(0), 3, 1, 0, 4, seed=0)
    with pytest.raises(ConfigError, match=r"spec.training.globalBatchSize: 8 training sequences cannot fill one step of 9"):
        GlobalOrder(Items(8), Collate(0), 9, 1, 0, 1, seed=0)


def test_a_checkpoint_without_the_global_position_is_refused_by_field(tmp_path: Path) -> None:
    """A run with globalBatchSize cannot continue from a checkpoint of a run without it (its data
    position is per rank); one without it still resumes from it (its keys are today's)."""
    import torch.distributed as dist
    from llamaft_trainer.checkpoint.dcp import Checkpointer, RunState, TrainState

    def checkpointer(state: TrainState) -> Checkpointer:
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        return Checkpointer(str(tmp_path / "ck"), 2, 0, run=RunState(model, optimizer, scheduler, state))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        checkpointer(TrainState(step=3, epoch=1, batches_in_epoch=6)).save(blocking=True)
        assert checkpointer(TrainState()).load(3).to_dict() == {"step": 3, "epoch": 1, "batches_in_epoch": 6, "tokens_seen": 0}
        with pytest.raises(ConfigError, match=r"^spec.training.globalBatchSize: step-00000003 was written by a run without it"):
            checkpointer(TrainState(global_order=True)).load(3)
        checkpointer(TrainState(step=5, epoch=2, items_in_epoch=10, global_order=True)).save(blocking=True)
        assert checkpointer(TrainState(global_order=True)).load(5).items_in_epoch == 10
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ real runs
STEPS, EVERY, STOP = 8, 3, 5
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "targetModules": ["q_proj", "v_proj"]}  # dropout: each rank's own masks
MODES: dict[str, tuple[dict[str, Any], int, dict[str, Any]]] = {
    "padded": ({"packing": False}, 5, {}),
    "packed": ({"maxSeqLength": 256}, 4, {}),  # 2-3 examples a block (best-fit decreasing)
    "lora": ({"packing": False}, 5, {"lora": LORA, "learningRate": 1e-2}),
    "dora": ({"packing": False}, 5, {"lora": {**LORA, "useDora": True}, "learningRate": 1e-2}),
    "dpo": ({}, 5, {}),  # preference pairs (test_dpo_run's data), never packed
}


def _config(model: Path, directory: Path, mode: str, tmp: Path, *, resume: bool = False) -> dict[str, Any]:
    dataset, global_batch, extra = MODES[mode]
    training = {"maxSteps": STEPS, "globalBatchSize": global_batch, "perDeviceBatchSize": 2, **extra}
    checkpointing = {"everyNSteps": EVERY, "keepLast": 3, "resume": resume}
    if mode == "dpo":
        return dpo_config(model, directory, head(40, tmp), training=training, checkpointing=checkpointing)
    return base_config(model, directory, dataset={"source": str(tmp / "small.jsonl"), **dataset},
                       training=training, checkpointing=checkpointing)


def _case(name: str, config: dict[str, Any], steps: int | None = None) -> dict[str, Any]:
    return {"name": name, "config": config, "env": {LOG_ITEMS_ENV: "1"}, **({"steps": steps} if steps else {})}


def _items_by_case(log: Path, names: list[str]) -> dict[str, dict[int, list[int]]]:
    """Each case's training items per step, all ranks together: the `items` events between one
    case's `setup` event and the next (the harness runs the cases one after the other, with
    collectives between them)."""
    out: dict[str, dict[int, list[int]]] = {}
    index = -1
    for event in read_events(log):
        if event["event"] == "setup":
            index += 1
            out[names[index]] = {}
        elif event["event"] == "items":
            out[names[index]].setdefault(event["step"], []).extend(event["items"])
    return out


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("global-batch")
    small = tmp / "small.jsonl"  # 40 records, 36 for training: an epoch boundary inside the run
    small.write_text("".join(DATASET.read_text().splitlines(keepends=True)[:40]))
    results: dict[str, Any] = {}
    items: dict[str, dict[int, list[int]]] = {}
    launches = [
        (1, "one", [_case(f"{m}/straight-1", _config(tiny_model, tmp / m / "s1", m, tmp)) for m in MODES]
         + [_case(f"{m}/stopped-1", _config(tiny_model, tmp / m / "from1", m, tmp), STOP) for m in MODES]),
        (2, "two", [_case(f"{m}/straight-2", _config(tiny_model, tmp / m / "s2", m, tmp)) for m in MODES]
         + [_case(f"{m}/resumed-2", _config(tiny_model, tmp / m / "from1", m, tmp, resume=True)) for m in MODES]
         + [_case(f"{m}/stopped-2", _config(tiny_model, tmp / m / "from2", m, tmp), STOP) for m in MODES]),
        (1, "again", [_case(f"{m}/resumed-1", _config(tiny_model, tmp / m / "from2", m, tmp, resume=True))
                      for m in MODES]),
    ]
    for nproc, folder, cases in launches:
        where = tmp / folder
        where.mkdir()
        results.update(run_harness(where, nproc, cases))
        items.update(_items_by_case(where / f"log-{nproc}.txt", [c["name"] for c in cases]))
    return {"results": results, "items": items}


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("mode", list(MODES))
def test_one_and_two_ranks_train_the_same_steps(runs: dict[str, Any], mode: str) -> None:
    one, two = runs["results"][f"{mode}/straight-1"], runs["results"][f"{mode}/straight-2"]
    assert len(one["losses"]) == STEPS
    assert _close(two["losses"], one["losses"]), (one["losses"], two["losses"])
    items_one, items_two = runs["items"][f"{mode}/straight-1"], runs["items"][f"{mode}/straight-2"]
    assert sorted(items_one) == list(range(1, STEPS + 1))
    assert {s: sorted(v) for s, v in items_two.items()} == {s: sorted(v) for s, v in items_one.items()}


def _epochs(items: dict[int, list[int]]) -> list[list[int]]:
    """The steps' items grouped by epoch: an epoch ends before the first step that takes an item
    again (each epoch is one permutation of the training items)."""
    epochs: list[list[int]] = [[]]
    for step in sorted(items):
        if set(items[step]) & set(epochs[-1]):
            epochs.append([])
        epochs[-1].extend(items[step])
    return epochs


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("stopped", "resumed"), [("stopped-1", "resumed-2"), ("stopped-2", "resumed-1")])
def test_a_run_resumes_on_another_world_size_where_it_stopped(runs: dict[str, Any], mode: str, stopped: str,
                                                              resumed: str) -> None:
    straight = runs["results"][f"{mode}/straight-1"]
    again = runs["results"][f"{mode}/{resumed}"]["losses"]
    assert len(again) == STEPS - EVERY, "resumed from the step-3 checkpoint"
    assert _close(again, straight["losses"][EVERY:]), (again, straight["losses"][EVERY:])
    want = runs["items"][f"{mode}/straight-1"]
    got = {s: v for s, v in runs["items"][f"{mode}/{stopped}"].items() if s <= EVERY} | runs["items"][f"{mode}/{resumed}"]
    assert json.dumps(sorted(got)) == json.dumps(list(range(1, STEPS + 1)))
    assert {s: sorted(v) for s, v in got.items()} == {s: sorted(v) for s, v in want.items()}
    epochs = _epochs(got)
    assert len(epochs) >= 2, "the run crosses an epoch boundary"
    for epoch in epochs:
        assert len(epoch) == len(set(epoch)), "no item skipped or repeated within an epoch"
    if mode in ("padded", "lora", "dora", "dpo"):  # 36 training items (or pairs), 5 a step: 7 steps an epoch
        assert len(epochs[0]) == 35
