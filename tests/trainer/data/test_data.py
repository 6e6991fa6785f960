"""Data formatting, label masking, packing/padding and splits, checked on exact token ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llamaft.api.spec import DatasetSpec
from llamaft_trainer.data import encoding, prepare
from llamaft_trainer.data.records import read_numbered
from llamaft_trainer.process.errors import ConfigError

from tests.trainer.conftest import DATASET


def spec(**kw: object) -> DatasetSpec:
    return DatasetSpec.model_validate({"format": "samsum", "source": str(DATASET), **kw})


def test_tokenize_masks_the_prompt_and_ends_with_eos(tok) -> None:  # type: ignore[no-untyped-def]
    ex = encoding.tokenize("Summarize: hi", "Anna will go.", tok, 64)
    prompt = tok.encode("Summarize: hi", add_special_tokens=False)
    response = tok.encode("Anna will go.", add_special_tokens=False)
    assert ex.input_ids == [tok.bos_token_id, *prompt, *response, tok.eos_token_id]
    assert ex.labels == [-100] * (1 + len(prompt)) + response + [tok.eos_token_id]
    assert tok.decode(response) == "Anna will go."


def test_truncation_keeps_ids_and_labels_aligned(tok) -> None:  # type: ignore[no-untyped-def]
    ex = encoding.tokenize("a " * 50, "b " * 50, tok, 16)
    assert len(ex.input_ids) == len(ex.labels) == 16
    assert all(label == -100 for label in ex.labels)  # the response was cut off entirely


def test_samsum_template_and_response_field() -> None:
    fmt = encoding.Formatter(spec())
    prompt, response = fmt({"dialogue": "A: hi\nB: yo", "summary": "They greet."})
    assert prompt == "Summarize this dialog:\nA: hi\nB: yo\n---\nSummary:\n"
    assert response == "They greet."


def test_alpaca_with_and_without_input() -> None:
    fmt = encoding.Formatter(spec(format="alpaca"))
    with_input, out = fmt({"instruction": "Add", "input": "1 2", "output": "3"})
    without, _ = fmt({"instruction": "Say hi", "input": "", "output": "hi"})
    assert "### Input:\n1 2" in with_input and out == "3"
    assert "### Input" not in without and without.endswith("### Instruction:\nSay hi\n\n### Response:\n")


def test_jsonl_template_and_field_mapping() -> None:
    fmt = encoding.Formatter(spec(format="jsonl", promptTemplate="Q: {question}\nA: ", fieldMapping={"response": "answer"}))
    assert fmt({"question": "2+2?", "answer": "4"}) == ("Q: 2+2?\nA: ", "4")
    mapped = encoding.Formatter(spec(format="jsonl", fieldMapping={"prompt": ["title", "body"]}))
    assert mapped({"title": "T", "body": "B", "output": "O"}) == ("T\nB\n", "O")


def test_missing_record_field_is_a_config_error() -> None:
    fmt = encoding.Formatter(spec())
    with pytest.raises(ConfigError, match=r"data.jsonl line 4 has no field\(s\) \['dialogue'\].*promptTemplate"):
        fmt.check({"text": "x", "summary": "y"}, "data.jsonl line 4")
    with pytest.raises(ConfigError, match=r"no field\(s\) \['summary'\]"):
        fmt.check({"dialogue": "x", "summary": None}, "data.jsonl line 4")  # null is as good as missing


def test_a_bad_record_is_named_by_its_file_line_before_any_shuffle(tok, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """File line 5 (blank lines count, as in an editor) is reported as line 5, whatever the seeded
    train/validation split does with it."""
    path = tmp_path / "data.jsonl"
    good = json.dumps({"dialogue": "a: hi", "summary": "a greets"})
    path.write_text("\n".join([good, good, "", good, json.dumps({"dialogue": "b: yo"}), good]) + "\n")
    numbered = read_numbered(spec(source=str(path)))
    assert [where for where, _ in numbered] == [f"{path} line {n}" for n in (1, 2, 4, 5, 6)]
    with pytest.raises(ConfigError, match=rf"{path} line 5 has no field\(s\) \['summary'\]"):
        encoding.Encoder(spec(source=str(path)), tok).check(numbered)
    with pytest.raises(ConfigError, match=rf"{path} line 5 has no field\(s\) \['summary'\]"):
        prepare.build_store(spec(source=str(path), validationSplit=0.5), tok, 0, tmp_path / "store")


def test_split_is_deterministic_and_disjoint() -> None:
    records = [{"i": i} for i in range(100)]
    train, val = prepare.split_records(records, 0.1, seed=3)
    assert prepare.split_records(records, 0.1, seed=3) == (train, val)
    assert len(val) == 10 and len(train) == 90
    assert {r["i"] for r in train}.isdisjoint({r["i"] for r in val})
    assert prepare.split_records(records, 0.1, seed=4)[1] != val
    assert prepare.split_records(records, 0.0, seed=3) == (records, [])


def test_sequence_length_over_the_model_limit() -> None:
    with pytest.raises(ConfigError, match="maxSeqLength: 4096 exceeds the model's max_position_embeddings 512"):
        encoding.check_sequence_length(spec(maxSeqLength=4096), 512)


def test_reads_local_and_fsspec_sources(tmp_path: Path) -> None:
    local = [r for _, r in read_numbered(spec())]
    assert len(local) == 320 and set(local[0]) == {"id", "dialogue", "summary"}
    uri = [r for _, r in read_numbered(spec(source=f"file://{DATASET}"))]
    assert uri == local


def test_unreadable_and_malformed_sources(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="spec.dataset.source: cannot read"):
        read_numbered(spec(source=str(tmp_path / "absent.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"dialogue": "a", "summary": "b"}\nnot json\n')
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        read_numbered(spec(source=str(bad)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ConfigError, match="holds no records"):
        read_numbered(spec(source=str(empty)))
