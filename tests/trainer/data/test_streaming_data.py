"""dataset.streaming: one deterministic global order shared by every rank, disjoint shares, the
epoch ending on every rank at once, and a resumed epoch that continues at its exact position
(with packing, by the window index or, without it, by tokenizing forward)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from llamaft.api.spec import DatasetSpec
from llamaft_trainer.data import encoding, streaming
from llamaft_trainer.data.records import read_numbered

from tests.trainer.conftest import DATASET, cpu_runtime

pytestmark = pytest.mark.usefixtures("small_stream_windows")


def spec(**kw: object) -> DatasetSpec:
    return DatasetSpec.model_validate({"format": "samsum", "source": str(DATASET), "maxSeqLength": 64,
                                       "streaming": True, "validationSplit": 0.1, **kw})


def stream(s: DatasetSpec, tok: Any, r: int, index: Path | None = None, world: int = 2) -> streaming.BatchStream:
    return streaming.BatchStream(s, tok, 2, 5, cpu_runtime(r, world), index)


def rows(batches: Any) -> list[list[int]]:
    out = []
    for b in batches:
        for ids, mask in zip(b["input_ids"], b["attention_mask"], strict=True):
            out.append(ids[mask.bool()].tolist())
    return out


def test_ranks_share_one_order_and_take_disjoint_records(tok: Any) -> None:
    s = spec()
    held_out = streaming.validation_count(s, 50)
    assert held_out == 5 and streaming.validation_count(s, 7) == 1 and streaming.validation_count(spec(validationSplit=0.5), 2) == 1
    records = [r for _, r in read_numbered(s)][held_out:]
    expected = {tuple(ids) for ids, _ in encoding.pairs_of(encoding.Encoder(s, tok).encode([("x", r) for r in records]))}
    per_rank = [rows(stream(s, tok, r).batches(epoch=0, skip=0)) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]), "the epoch ends on every rank at the same micro-batch"
    seen = [tuple(x) for x in per_rank[0] + per_rank[1]]
    assert len(seen) == len(set(seen)) and set(seen) <= expected
    assert len(expected) - len(seen) < 2 * 2, "only the last incomplete micro-batch is dropped"
    assert rows(stream(s, tok, 0).batches(epoch=0, skip=0)) == per_rank[0], "deterministic"
    assert rows(stream(s, tok, 0).batches(epoch=1, skip=0)) != per_rank[0], "another epoch, another shuffle"


def test_the_validation_head_is_never_trained_on(tok: Any) -> None:
    s = spec()
    head = {tuple(ids) for ids, _ in encoding.pairs_of(encoding.Encoder(s, tok).encode(read_numbered(s)[:5]))}
    data = streaming.streaming_data(s, tok, 2, 5, cpu_runtime(0, 1))
    assert data.validation is not None and len(data.validation) == 5
    assert data.batches_per_epoch is None
    trained = {tuple(x) for x in rows(data.batches(0, 0))}
    assert not trained & head


@pytest.mark.parametrize("packing", [False, True])
def test_a_resumed_epoch_continues_at_its_exact_position(tok: Any, tmp_path: Path, packing: bool) -> None:
    s = spec(packing=packing)
    index = tmp_path / "windows.json"
    whole = [b["input_ids"] for b in stream(s, tok, 1, index).batches(epoch=3, skip=0)]
    assert len(whole) > 12
    if packing:
        assert not index.exists(), "only global rank 0 writes the index"
        leader = [b["input_ids"] for b in stream(s, tok, 0, index).batches(epoch=3, skip=0)]
        assert len(leader) == len(whole) and len(json.loads(index.read_text())) == 7  # 315 records / 50
    for skip in (1, 7, len(whole) - 1):
        resumed = [b["input_ids"] for b in stream(s, tok, 1, index).batches(epoch=3, skip=skip)]
        assert len(resumed) == len(whole) - skip
        assert all(torch.equal(a, b) for a, b in zip(resumed, whole[skip:], strict=True)), skip
        if packing:  # without the index: tokenized forward from the epoch's start, the same batches
            forward = [b["input_ids"] for b in stream(s, tok, 1, None).batches(epoch=3, skip=skip)]
            assert all(torch.equal(a, b) for a, b in zip(forward, whole[skip:], strict=True)), skip


def test_packed_blocks_are_full_and_cover_the_token_stream_in_order(tok: Any) -> None:
    s = spec(packing=True, packingStrategy="concatenate")
    one = stream(s, tok, 0, world=1)
    blocks = [row for b in one.batches(0, 0) for row in b["input_ids"].tolist()]
    assert all(len(b) == 64 for b in blocks)
    two = [[row for b in stream(s, tok, r).batches(0, 0) for row in b["input_ids"].tolist()] for r in (0, 1)]
    # micro-batch m: ranks 0 and 1 take consecutive pairs of the same global blocks a 1-rank run sees
    interleaved = [blk for m in range(len(two[0]) // 2) for r in (0, 1) for blk in two[r][2 * m:2 * m + 2]]
    assert interleaved == blocks[:len(interleaved)]
