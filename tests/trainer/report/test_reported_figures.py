"""Two figures a run reports must be true whatever the launch: the eval loss covers every
validation sequence exactly once at any world size (DistributedSampler's drop_last lost the tail,
padding with repeats would count some twice), and tokens (so tokens/s and MFU) count real tokens,
not the padding of a batch. Runs tests/trainer/eval_worker.py under torchrun at 1 and 3 ranks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from llamaft_trainer.data.batching import Collate, ValidationShare
from llamaft_trainer.data.encoding import IGNORE_INDEX

from tests.conftest import REPO
from tests.trainer.conftest import base_config, torchrun_cmd, trainer_env

WORKER = REPO / "tests" / "trainer" / "eval_worker.py"


def _item(n: int, value: int) -> dict[str, torch.Tensor]:
    ids = torch.full((n,), value, dtype=torch.long)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(n, dtype=torch.long)}


@pytest.mark.parametrize(("size", "world", "batch"), [(17, 2, 2), (17, 3, 4), (2, 3, 2), (9, 1, 4), (12, 4, 3)])
def test_every_validation_sequence_once_and_the_same_batch_count_on_every_rank(size: int, world: int, batch: int) -> None:
    items = [_item(1 + i % 5, i) for i in range(size)]
    shares = [ValidationShare(items, rank, world, batch, Collate(0)) for rank in range(world)]  # type: ignore[arg-type]
    counts = {len(list(share)) for share in shares}
    assert counts == {len(shares[0])}, "every rank runs as many forwards as the others (FSDP collectives)"
    seen: list[int] = []
    for share in shares:
        for out in share:
            kept = out["labels"] != IGNORE_INDEX
            seen += [int(out["input_ids"][row, 0]) for row in range(out["input_ids"].shape[0]) if kept[row].any()]
    assert sorted(seen) == list(range(size)), "each sequence exactly once, filler batches count nothing"


def _measure(tiny_model: Path, tmp: Path, nproc: int) -> dict[str, Any]:
    config = base_config(tiny_model, tmp / f"ck-{nproc}", dataset={"packing": False, "validationSplit": 0.2, "maxSeqLength": 256},
                         training={"perDeviceBatchSize": 4})
    path, out = tmp / f"config-{nproc}.json", tmp / f"out-{nproc}.json"
    path.write_text(json.dumps(config))
    proc = subprocess.run(torchrun_cmd(nproc, str(WORKER), str(path), str(out)), env=trainer_env(),
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return dict(json.loads(out.read_text()))


def test_eval_loss_and_tokens_do_not_depend_on_the_launch(tiny_model: Path, tmp_path: Path) -> None:
    one, three = _measure(tiny_model, tmp_path, 1), _measure(tiny_model, tmp_path, 3)
    n = one["validation_sequences"]
    assert n == three["validation_sequences"] and n % 3 != 0, "an uneven split: some rank gets a shorter share"
    for run in (one, three):
        assert sum(share["sequences"] for share in run["shares"]) == n
        assert len({share["batches"] for share in run["shares"]}) == 1
    assert sum(s["targets"] for s in three["shares"]) == sum(s["targets"] for s in one["shares"])
    assert three["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    for run in (one, three):
        assert run["padded_tokens"] > run["real_tokens"], "the padded batches hold padding (the check can fail)"
        assert run["tokens_seen"] == run["real_tokens"]
