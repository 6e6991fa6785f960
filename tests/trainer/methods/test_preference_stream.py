"""dataset.streaming with format preference (dpo_stream.PairStream): one order of the kept
pairs shared by every rank, disjoint shares, pairs TRL drops (prompt alone filling maxSeqLength)
left out as the token store leaves them out, each batch's `index` naming its pairs' records (what
the precomputed reference is read by), and a resumed epoch continuing at its exact position, with
the window index or by tokenizing forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from llamaft.api.spec import DatasetSpec
from llamaft_trainer.data import streaming
from llamaft_trainer.data.records import read_numbered
from llamaft_trainer.methods.dpo import concatenated_batch
from llamaft_trainer.methods.dpo_pairs import PairEncoder, pair_of
from llamaft_trainer.methods.dpo_stream import PairStream

from tests.conftest import REPO
from tests.trainer.conftest import cpu_runtime

PAIRS = REPO / "examples" / "data" / "preference-tiny.jsonl"
MAX_LENGTH = 64
"""The tiny tokenizer's prompts of preference-tiny fill 64 tokens in 47 of 320 records: those pairs are dropped."""



pytestmark = pytest.mark.usefixtures("small_stream_windows")


def spec(**kw: object) -> DatasetSpec:
    return DatasetSpec.model_validate({"format": "preference", "source": str(PAIRS), "maxSeqLength": MAX_LENGTH,
                                       "packing": False, "streaming": True, "validationSplit": 0.1, **kw})


def stream(s: DatasetSpec, tok: Any, r: int, world: int = 2, index: Path | None = None) -> PairStream:
    return PairStream(s, tok, 3, 5, cpu_runtime(r, world), index)


def test_ranks_share_one_order_of_the_kept_pairs_and_each_batch_names_its_records(tok: Any) -> None:
    s = spec()
    held_out = streaming.validation_count(s, 50)
    records = list(read_numbered(s))[held_out:]
    encoded = PairEncoder(s, tok).encode(records)
    kept = {i for i in range(len(encoded)) if encoded.lengths[i] > 0}
    assert 0 < len(kept) < len(records), "some pairs are dropped, as the token store drops them"
    per_rank = [list(stream(s, tok, r).batches(epoch=0, skip=0)) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]), "the epoch ends on every rank at the same micro-batch"
    seen = [[int(i) for b in batches for i in b["index"]] for batches in per_rank]
    assert not set(seen[0]) & set(seen[1])
    everything = set(seen[0]) | set(seen[1])
    assert everything <= kept and len(kept) - len(everything) < 2 * 3  # only the epoch's remainder is left
    for batch in per_rank[0][:4]:
        want = concatenated_batch([pair_of(encoded, int(i)) for i in batch["index"]], int(tok.pad_token_id), MAX_LENGTH)
        assert torch.equal(batch["input_ids"], want.input_ids) and torch.equal(batch["completion_mask"], want.completion_mask)
    again = [int(i) for b in stream(s, tok, 0).batches(epoch=1, skip=0) for i in b["index"]]
    assert again != seen[0] and set(again) <= kept, "each epoch is shuffled again"
    validation = stream(s, tok, 0).validation()
    head = PairEncoder(s, tok).encode(list(read_numbered(s))[:held_out])
    assert validation is not None and len(validation) == int((head.lengths > 0).sum())


@pytest.mark.parametrize("indexed", [True, False], ids=["window-index", "tokenizing-forward"])
def test_a_resumed_epoch_continues_at_its_position(tok: Any, tmp_path: Path, indexed: bool) -> None:
    s = spec()
    index = tmp_path / "windows.json" if indexed else None
    whole = list(stream(s, tok, 0, index=index).batches(epoch=2, skip=0))  # the leader writes the index
    if indexed:
        assert index is not None and index.exists()
    resumed = list(stream(s, tok, 0, index=index).batches(epoch=2, skip=17))
    assert len(resumed) == len(whole) - 17
    for a, b in zip(resumed, whole[17:], strict=True):
        assert torch.equal(a["index"], b["index"]) and torch.equal(a["input_ids"], b["input_ids"])
