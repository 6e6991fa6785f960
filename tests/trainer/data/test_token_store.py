"""The token store: batched encoding gives the same tokens as the one-record reference, a store is
built once and reused, its key changes with everything that changes the tokens, packing and
per-batch padding over the memory-mapped store, and the ranks building one store together."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from llamaft.api.spec import DatasetSpec
from llamaft_trainer.data import batching, encoding, prepare
from llamaft_trainer.data import store as store_mod
from llamaft_trainer.data.records import read_numbered
from llamaft_trainer.process.errors import ConfigError
from transformers import AutoTokenizer

from tests.trainer.conftest import DATASET, trainer_env


def spec(**kw: object) -> DatasetSpec:
    return DatasetSpec.model_validate({"format": "samsum", "source": str(DATASET), "maxSeqLength": 96, **kw})


def reference(records: list[dict[str, Any]], s: DatasetSpec, tok: Any) -> list[tuple[list[int], list[int]]]:
    fmt = encoding.Formatter(s)
    return [(e.input_ids, e.labels) for e in (encoding.tokenize(*fmt(r), tok, s.max_seq_length) for r in records)]


def stored(part: store_mod.Part) -> list[tuple[list[int], list[int]]]:
    out = []
    for i in range(len(part)):
        tokens, loss = part.example(i)
        ids = [int(t) for t in tokens]
        out.append((ids, [t if m else encoding.IGNORE_INDEX for t, m in zip(ids, loss, strict=True)]))
    return out


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("bos, eos", [(1, 2), (None, 2), (1, None), (None, None)])
@pytest.mark.parametrize("max_len", [1, 2, 3, 5, 8, 64])
def test_batch_assembly_is_the_one_record_layout(bos: int | None, eos: int | None, max_len: int) -> None:
    """Every cut of <bos> prompt response <eos> (inside the prompt, the response, at the eos),
    empty prompts and responses, with and without bos/eos: the array layout equals the lists'."""
    prompts = [[10, 11, 12], [], [13], [14, 15], []]
    responses = [[20, 21], [22, 23, 24], [], [25], []]
    expected = []
    for p, r in zip(prompts, responses, strict=True):
        head, tail = ([bos] if bos is not None else []), ([eos] if eos is not None else [])
        ids, labels = head + p + r + tail, [encoding.IGNORE_INDEX] * (len(head) + len(p)) + r + tail
        expected.append((ids[:max_len], labels[:max_len]))
    assert encoding.pairs_of(encoding._assemble(prompts, responses, bos, eos, max_len)) == expected


def test_batched_encoding_equals_the_one_record_reference(tok: Any, tmp_path: Path) -> None:
    records = [r for _, r in read_numbered(spec())]
    samsum = spec()
    assert encoding.pairs_of(encoding.Encoder(samsum, tok).encode([("x", r) for r in records])) == reference(records, samsum, tok)
    alpaca_records = [{"instruction": r["dialogue"][:40], "input": r["summary"] if i % 2 else "", "output": r["summary"]}
                      for i, r in enumerate(records)]
    alpaca = spec(format="alpaca", maxSeqLength=64)
    assert encoding.pairs_of(encoding.Encoder(alpaca, tok).encode([("x", r) for r in alpaca_records])) == reference(alpaca_records, alpaca, tok)
    jsonl = spec(format="jsonl", promptTemplate="Q: {dialogue}\nA: ", fieldMapping={"response": "summary"}, maxSeqLength=2048)
    assert encoding.pairs_of(encoding.Encoder(jsonl, tok).encode([("x", r) for r in records])) == reference(records, jsonl, tok)


def test_the_store_holds_the_split_examples_in_file_order(tok: Any, tmp_path: Path) -> None:
    s = spec(validationSplit=0.1)
    store = prepare.build_store(s, tok, 7, tmp_path)
    records = [r for _, r in read_numbered(s)]
    train, val = prepare.split_records(records, 0.1, 7)
    assert stored(store.train) == reference(train, s, tok)
    assert stored(store.validation) == reference(val, s, tok)
    assert store.meta["records"] == 320 and store.meta["parts"]["validation"]["examples"] == 32
    assert isinstance(store.train.tokens, store_mod.FileArray), "ranks read the store in place, they do not load it"


def test_a_complete_store_is_reused_without_tokenizing(tok: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = prepare.build_store(spec(), tok, 0, tmp_path)

    def refuse(self: Any, numbered: Any) -> Any:
        raise AssertionError("tokenized again")

    monkeypatch.setattr(encoding.Encoder, "encode", refuse)
    again = prepare.build_store(spec(), tok, 0, tmp_path)
    assert again.path == first.path and stored(again.train) == stored(first.train)


def test_the_key_changes_with_what_changes_the_tokens(tok: Any, tiny_model: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", [r for _, r in read_numbered(spec())][:40])
    base = spec(source=str(data))
    paths = {prepare.build_store(base, tok, 0, tmp_path / "s").path}
    variants = [
        spec(source=str(data), maxSeqLength=64),
        spec(source=str(data), promptTemplate="Dialog: {dialogue}\nSummary: "),
        spec(source=str(data), packing=True),
        spec(source=str(data), validationSplit=0.2),
    ]
    for v in variants:
        paths.add(prepare.build_store(v, tok, 0, tmp_path / "s").path)
    paths.add(prepare.build_store(base, tok, 1, tmp_path / "s").path)  # another seed: another split
    assert len(paths) == 6
    other_tok = AutoTokenizer.from_pretrained(tiny_model)
    other_tok.add_tokens(["<extra>"])
    assert prepare.build_store(base, other_tok, 0, tmp_path / "s").path not in paths
    records = [r for _, r in read_numbered(base)]
    records[0]["summary"] = "changed"
    write_jsonl(data, records)
    os.utime(data, ns=(1, 2))  # a new mtime even on a coarse clock
    changed = prepare.build_store(base, tok, 0, tmp_path / "s")
    assert changed.path not in paths
    assert prepare.build_store(base, tok, 0, tmp_path / "s").path == changed.path


def test_a_failed_build_leaves_no_store(tok: Any, tmp_path: Path) -> None:
    good = json.dumps({"dialogue": "a: hi", "summary": "a greets"})
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([good] * 3000 + [json.dumps({"dialogue": "x"})]) + "\n")  # the bad one is in the third batch
    with pytest.raises(ConfigError, match="line 3001 has no field"):
        prepare.build_store(spec(source=str(path)), tok, 0, tmp_path / "s")
    assert list((tmp_path / "s").iterdir()) == []


def test_packing_cuts_the_concatenated_examples_into_full_blocks(tok: Any, tmp_path: Path) -> None:
    s = spec(packing=True, maxSeqLength=64, validationSplit=0.0)
    store = prepare.build_store(s, tok, 0, tmp_path)
    flat_ids = [t for ids, _ in stored(store.train) for t in ids]
    flat_labels = [t for _, labels in stored(store.train) for t in labels]
    blocks = batching.PackedBlocks(store.train, 64)
    assert len(blocks) == len(flat_ids) // 64
    for i in (0, 1, len(blocks) - 1):
        item = blocks[i]
        assert item["input_ids"].tolist() == flat_ids[i * 64 : (i + 1) * 64]
        assert item["labels"].tolist() == flat_labels[i * 64 : (i + 1) * 64]
        assert item["attention_mask"].tolist() == [1] * 64


def test_padding_happens_per_batch_to_the_longest_example(tok: Any, tmp_path: Path) -> None:
    store = prepare.build_store(spec(validationSplit=0.0), tok, 0, tmp_path)
    examples = batching.PaddedExamples(store.train)
    items = [examples[i] for i in range(4)]
    batch = batching.Collate(pad_id=int(tok.pad_token_id))(items)
    width = max(len(i["input_ids"]) for i in items)
    assert batch["input_ids"].shape == (4, width)
    assert len({len(i["input_ids"]) for i in items}) > 1, "examples of different lengths: the case padding is for"
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        assert batch["input_ids"][row, :n].tolist() == item["input_ids"].tolist()
        assert batch["input_ids"][row, n:].tolist() == [tok.pad_token_id] * (width - n)
        assert batch["labels"][row, n:].tolist() == [-100] * (width - n)
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)


def test_a_resumed_epoch_starts_at_its_position_without_reading_earlier_batches(tok: Any, tmp_path: Path) -> None:
    store = prepare.build_store(spec(validationSplit=0.0), tok, 0, tmp_path)
    data = batching.loaders(store, spec(validationSplit=0.0), int(tok.pad_token_id), 4, 3, rank=1, world=2)
    whole = [b["input_ids"] for b in data.batches(epoch=2, skip=0)]
    resumed = [b["input_ids"] for b in data.batches(epoch=2, skip=5)]
    assert len(resumed) == len(whole) - 5
    assert all(torch.equal(a, b) for a, b in zip(resumed, whole[5:], strict=True))
    assert len([b for b in data.batches(epoch=2, skip=0)]) == len(whole), "the next epoch starts from its beginning"


def _rank(rank: int, port: int, root: str, sources: list[str], model: str, out: str) -> None:
    import torch.distributed as dist
    from llamaft_trainer.process.runtime import Runtime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    rt = Runtime(rank=rank, local_rank=rank, world_size=2, local_world_size=2, device=torch.device("cpu"))
    tok = AutoTokenizer.from_pretrained(model)
    encoded: list[int] = []
    original = encoding.Encoder.encode

    def counting(self: Any, numbered: Any) -> Any:
        encoded.append(len(numbered))
        return original(self, numbered)

    encoding.Encoder.encode = counting  # type: ignore[method-assign]
    results = []
    for source in sources:
        encoded.clear()
        try:
            store = prepare.prepared_store(spec(source=source), tok, 0, rt, Path(root), shared=True)
            results.append({"path": str(store.path), "encoded": list(encoded), "train": stored(store.train)})
        except ConfigError as exc:
            results.append({"error": str(exc), "encoded": list(encoded)})
    Path(out, f"{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_ranks_build_one_store_together_or_all_get_the_first_bad_record(
    tok: Any, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each rank tokenizes every other batch and rank 0 merges: the store is the one a single
    process builds; a bad record in either rank's batches is every rank's error, the first in
    file order (line 1500, in rank 1's second batch, not line 2500 in rank 0's third)."""
    from llamaft_trainer.process.local_etcd import free_port

    for path in reversed(trainer_env()["PYTHONPATH"].split(os.pathsep)):
        monkeypatch.syspath_prepend(path)  # spawned ranks take the parent's sys.path and import this module
    records = [r for _, r in read_numbered(spec())]
    many = write_jsonl(tmp_path / "many.jsonl", [records[i % len(records)] for i in range(3000)])
    bad_records = [dict(records[i % len(records)]) for i in range(3000)]
    for line in (1500, 2500):
        bad_records[line - 1] = {"dialogue": "only"}
    bad = write_jsonl(tmp_path / "bad.jsonl", bad_records)
    ctx = multiprocessing.get_context("spawn")
    args = (free_port(), str(tmp_path / "root"), [str(many), str(bad)], str(tiny_model), str(tmp_path))
    procs = [ctx.Process(target=_rank, args=(r, *args)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    (good0, bad0), (good1, bad1) = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    assert good0["encoded"] == [1024, 952] and good1["encoded"] == [1024], "every other batch: one tokenization"
    assert good0["path"] == good1["path"] and good0["train"] == good1["train"]
    alone = prepare.build_store(spec(source=str(many)), tok, 0, tmp_path / "alone")
    assert [list(map(list, e)) for e in stored(alone.train)] == good0["train"], "the same store as one process builds"
    assert all(f"{bad} line 1500 has no field(s) ['summary']" in r["error"] for r in (bad0, bad1)), (bad0, bad1)
