"""`llamaft data preview` (llamaft_trainer.data.preview): what it shows is what the trainer trains on.

Each shown example is checked against the record it names, encoded by the trainer's one-record
reference (`data.tokenize`) or its chat encoder, and against a store the test builds itself with
`data.build_store`; the marked text is parsed back into the loss flags; truncation counts against
the untruncated reference; packing against the trainer's own packed datasets and `block_report`.
No torchrun, no GPU: a few seconds in all.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from llamaft.api.spec import DatasetSpec, TrainOn
from llamaft.cli import main as cli
from llamaft_trainer.data import batching, encoding, prepare
from llamaft_trainer.data.chat import ChatEncoder, conversation, resolve_template
from llamaft_trainer.data.preview import (
    CLOSE,
    LOSS_COLOUR,
    OPEN,
    Preview,
    PreviewExample,
    build_preview,
    render_json,
    render_text,
)
from llamaft_trainer.process.errors import ConfigError

from tests.conftest import REPO

SAMSUM = REPO / "examples" / "data" / "samsum-tiny.jsonl"
CHAT = REPO / "examples" / "data" / "chat-tiny.jsonl"
SEED = 7
CHAT_CASES = [f"chat-{t.value}" for t in TrainOn]



@pytest.fixture(scope="module")
def chat_tok() -> Any:
    """A Llama 3 style chat tokenizer (its template and control tokens), as make-tiny-model builds it."""
    from llamaft_trainer.tiny import build_tokenizer

    return build_tokenizer(SAMSUM, 512, chat_template="llama3")


@pytest.fixture(scope="module")
def data_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """alpaca and jsonl records made from the samsum sample (half the alpaca ones without input)."""
    folder = tmp_path_factory.mktemp("records")
    samsum = [json.loads(line) for line in SAMSUM.read_text().splitlines() if line.strip()]
    alpaca = [{"instruction": "Summarize the dialogue.", "input": r["dialogue"] if i % 2 else "", "output": r["summary"]}
              for i, r in enumerate(samsum)]
    jsonl = [{"question": r["dialogue"], "answer": r["summary"]} for r in samsum]
    out = {}
    for name, records in (("alpaca", alpaca), ("jsonl", jsonl)):
        out[name] = folder / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


def dataset_spec(case: str, files: dict[str, Path], **extra: Any) -> DatasetSpec:
    fields: dict[str, Any]
    if case == "samsum":
        fields = {"format": "samsum", "source": str(SAMSUM)}
    elif case == "alpaca":
        fields = {"format": "alpaca", "source": str(files["alpaca"])}
    elif case == "jsonl":
        fields = {"format": "jsonl", "source": str(files["jsonl"]), "promptTemplate": "Q: {question}\nA: ",
                  "fieldMapping": {"response": "answer"}}
    else:
        fields = {"format": "chat", "source": str(CHAT), "trainOn": case.removeprefix("chat-")}
    return DatasetSpec.model_validate({"maxSeqLength": 512, "validationSplit": 0.1, **fields, **extra})


def tokenizer_for(case: str, tok: Any, chat_tok: Any) -> Any:
    return chat_tok if case.startswith("chat") else tok


def record_at(where: str) -> dict[str, Any]:
    """The record a preview names (`path line N`), read straight from the file."""
    path, _, line = where.rpartition(" line ")
    record: dict[str, Any] = json.loads(Path(path).read_text().splitlines()[int(line) - 1])
    return record


def reference(spec: DatasetSpec, tokenizer: Any, record: dict[str, Any], max_len: int) -> tuple[list[int], list[int]]:
    """The trainer's (input_ids, labels) of one record by its reference paths: `data.tokenize`
    (one record at a time) or the chat encoder, not the batched Encoder the store uses."""
    if spec.format.value == "chat":
        encoder = ChatEncoder(tokenizer, resolve_template(spec, tokenizer), spec.train_on or TrainOn.ASSISTANT, max_len)
        return encoder.encode([conversation(record, spec.field_mapping.messages, "test")])[0]
    example = encoding.tokenize(*encoding.Formatter(spec)(record), tokenizer, max_len)
    return example.input_ids, example.labels


def labels_of(example: PreviewExample) -> list[int]:
    return [t if flag else encoding.IGNORE_INDEX for t, flag in zip(example.input_ids, example.loss, strict=True)]


# ------------------------------------------------------------------------ every format
@pytest.mark.parametrize("case", ["samsum", "alpaca", "jsonl", *CHAT_CASES])
@pytest.mark.parametrize("split", ["train", "validation"])
def test_each_format_shows_the_trainers_tokens_and_labels(
    case: str, split: str, tok: Any, chat_tok: Any, data_files: dict[str, Path], tmp_path: Path,
) -> None:
    spec = dataset_spec(case, data_files)
    tokenizer = tokenizer_for(case, tok, chat_tok)
    shown = build_preview(spec, tokenizer, SEED, tmp_path / "preview", count=4, split=split)
    trainers = prepare.build_store(spec, tokenizer, SEED, tmp_path / "trainer")
    part = trainers.train if split == "train" else trainers.validation
    assert shown.store == str(tmp_path / "preview" / trainers.path.name), "the same key as the trainer's store"
    assert (shown.examples_in_split, shown.records, shown.split) == (len(part), 256 if case.startswith("chat") else 320,
                                                                     split)
    assert [e.index for e in shown.examples] == [0, 1, 2, 3]
    for example in shown.examples:
        tokens, loss = part.example(example.index)
        assert example.input_ids == [int(t) for t in tokens]
        assert example.loss == [bool(f) for f in loss]
        assert (example.input_ids, labels_of(example)) == reference(spec, tokenizer, record_at(example.where), 512)
        assert example.loss_tokens > 0 and example.removed_tokens == 0
    wheres = [e.where for e in shown.examples]
    held_out = prepare.validation_mask(shown.records, spec.validation_split, SEED)
    lines = [int(w.rpartition(" line ")[2]) for w in wheres]
    assert all(bool(held_out[n - 1]) == (split == "validation") for n in lines), "records of the split, as the store splits"
    assert lines == sorted(lines), "in file order"


# ------------------------------------------------------------------------ the marks
def parse_marked(text: str) -> list[tuple[str, bool]]:
    """The text form of one example back into (text, carries loss) pieces."""
    pieces = []
    for k, piece in enumerate(re.split(rf"{re.escape(OPEN)}(.*?){re.escape(CLOSE)}", text, flags=re.DOTALL)):
        if piece:
            pieces.append((piece, k % 2 == 1))
    return pieces


def example_texts(rendered: str) -> list[str]:
    """The marked text of each example of `render_text`'s output (after its indented lines)."""
    out = []
    for chunk in rendered.split("\n--- example ")[1:]:
        lines = chunk.split("\n")[1:]
        while lines and lines[0].startswith("  "):
            lines = lines[1:]
        out.append("\n".join(lines).removesuffix("\n"))
    return out


@pytest.mark.parametrize("case", ["samsum", "alpaca", *CHAT_CASES])
def test_the_marked_spans_are_exactly_the_tokens_that_carry_loss(
    case: str, tok: Any, chat_tok: Any, data_files: dict[str, Path], tmp_path: Path,
) -> None:
    tokenizer = tokenizer_for(case, tok, chat_tok)
    shown = build_preview(dataset_spec(case, data_files, packing=True), tokenizer, SEED, tmp_path, count=5)
    texts = example_texts(render_text(shown, colour=False))
    assert len(texts) == 5
    documents = json.loads(render_json(shown))["examples"]
    for example, text, document in zip(shown.examples, texts, documents, strict=True):
        # The spans tile the example, alternate, and each has one loss flag: that of all its tokens.
        assert example.spans[0].start == 0 and example.spans[-1].end == example.tokens
        for before, after in zip(example.spans, example.spans[1:], strict=False):
            assert before.end == after.start and before.loss != after.loss
        for span in example.spans:
            assert set(example.loss[span.start:span.end]) == {span.loss}
        # Their texts join into the decoded example; the brackets sit exactly around the loss spans.
        decoded = tokenizer.decode(example.input_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert "".join(s.text for s in example.spans) == decoded
        assert parse_marked(text) == [(s.text, s.loss) for s in example.spans if s.text]
        # The JSON document carries the same spans and per-token flags.
        assert document["input_ids"] == example.input_ids and document["loss"] == example.loss
        assert [(s["start"], s["end"], s["loss"], s["text"]) for s in document["spans"]] == \
            [(s.start, s.end, s.loss, s.text) for s in example.spans]
        assert (document["tokens"], document["loss_tokens"]) == (example.tokens, example.loss_tokens)
    if case == "chat-assistant":  # the second record has two answers: both marked, the user turn between not
        assert [s.loss for s in shown.examples[1].spans] == [False, True, False, True]
    if case == "chat-all":
        assert all(s.loss for e in shown.examples for s in e.spans)


def test_colour_marks_the_same_spans(tok: Any, data_files: dict[str, Path], tmp_path: Path) -> None:
    shown = build_preview(dataset_spec("samsum", data_files), tok, SEED, tmp_path, count=2)
    coloured = render_text(shown, colour=True)
    assert OPEN not in coloured and "bold green" in coloured
    for example in shown.examples:
        for span in example.spans:
            if span.loss:
                assert f"{LOSS_COLOUR}{span.text}\x1b[0m" in coloured


# ------------------------------------------------------------------------ truncation
@pytest.mark.parametrize(("case", "max_len"), [("samsum", 72), ("alpaca", 80), ("chat-assistant", 120),
                                               ("chat-lastAssistant", 120), ("chat-all", 64)])
def test_truncation_reports_the_tokens_and_loss_tokens_it_removed(
    case: str, max_len: int, tok: Any, chat_tok: Any, data_files: dict[str, Path], tmp_path: Path,
) -> None:
    spec = dataset_spec(case, data_files, maxSeqLength=max_len)
    tokenizer = tokenizer_for(case, tok, chat_tok)
    shown = build_preview(spec, tokenizer, SEED, tmp_path, count=12)
    assert all(e.tokens <= max_len for e in shown.examples)
    for example in shown.examples:
        record = record_at(example.where)
        ids, labels = reference(spec, tokenizer, record, max_len)
        full_ids, full_labels = reference(spec, tokenizer, record, 100_000)
        assert (example.input_ids, labels_of(example)) == (ids, labels)
        assert full_ids[:len(ids)] == ids, "truncation keeps a prefix"
        assert example.removed_tokens == len(full_ids) - len(ids)
        assert example.removed_loss_tokens == (sum(label != encoding.IGNORE_INDEX for label in full_labels)
                                               - sum(label != encoding.IGNORE_INDEX for label in labels))
    cut = [e for e in shown.examples if e.removed_tokens]
    assert cut and any(e.removed_loss_tokens for e in cut), "the case must cut answers"
    text = render_text(shown)
    for e in cut:
        assert (f"truncated to maxSeqLength: {e.removed_tokens} tokens removed, {e.removed_loss_tokens} of which "
                f"carried loss (untruncated {e.untruncated_tokens})") in text
    document = json.loads(render_json(shown))
    assert [x["truncation"]["removed_tokens"] for x in document["examples"]] == [e.removed_tokens for e in shown.examples]
    assert [x["truncation"]["removed_loss_tokens"] for x in document["examples"]] == \
        [e.removed_loss_tokens for e in shown.examples]


def test_an_example_the_cut_leaves_without_loss_is_named(tok: Any, data_files: dict[str, Path], tmp_path: Path) -> None:
    shown = build_preview(dataset_spec("samsum", data_files, maxSeqLength=32), tok, SEED, tmp_path, count=2)
    assert all(e.loss_tokens == 0 and e.removed_loss_tokens > 0 for e in shown.examples)
    assert f"note: example 0 ({shown.examples[0].where}) carries no loss" in render_text(shown)


# ------------------------------------------------------------------------ packing
@pytest.mark.parametrize("strategy", ["bfd", "concatenate"])
@pytest.mark.parametrize("split", ["train", "validation"])
def test_packing_info_is_the_stores_layout_and_block_report(
    strategy: str, split: str, tok: Any, data_files: dict[str, Path], tmp_path: Path,
) -> None:
    spec = dataset_spec("samsum", data_files, maxSeqLength=160, packing=True, packingStrategy=strategy)
    shown = build_preview(spec, tok, SEED, tmp_path / "preview", count=10, split=split)
    store = prepare.build_store(spec, tok, SEED, tmp_path / "trainer")
    report = prepare.block_report(store, spec)
    part = store.train if split == "train" else store.validation
    packed = batching.packed_dataset(part, spec, validation=split == "validation")  # what the trainer iterates
    assert shown.packing is not None and shown.packing.report == report
    assert shown.packing.blocks == report[f"{split}_blocks"] == len(packed)  # type: ignore[arg-type]
    assert shown.packing.fill == report[f"{split}_fill"]
    bfd = strategy == "bfd" or split == "validation"
    assert shown.packing.strategy == ("bfd" if bfd else "concatenate")
    for example in shown.examples:
        place = example.placement
        assert place is not None
        if bfd:
            assert isinstance(packed, batching.PackedExamples)
            members = packed.block(place.blocks[0])
            assert example.index in members and place.with_examples == [i for i in members if i != example.index]
            lengths = [int(part.lengths[i]) for i in members]
            assert place.offset == sum(lengths[:members.index(example.index)])
            assert place.block_tokens == sum(lengths) <= spec.max_seq_length
            item = packed[place.blocks[0]]
            assert item["input_ids"][place.offset:place.offset + example.tokens].tolist() == example.input_ids
        else:
            assert isinstance(packed, batching.PackedBlocks)
            assert place.blocks == list(range(place.blocks[0], place.blocks[-1] + 1))
            joined = [t for b in place.blocks for t in packed[b]["input_ids"].tolist()]
            kept = example.tokens - place.dropped_tokens
            assert joined[place.offset:place.offset + kept] == example.input_ids[:kept]
    text = render_text(shown)
    assert f"packing: {shown.packing.strategy}" in text and f"{len(packed)} blocks of 160 tokens" in text  # type: ignore[arg-type]
    if bfd:
        assert any(e.placement is not None and e.placement.with_examples for e in shown.examples), "blocks are shared"
        assert f"block {shown.examples[0].placement.blocks[0]} at position" in text  # type: ignore[union-attr]
    else:
        assert any(e.placement is not None and len(e.placement.blocks) == 2 for e in shown.examples), \
            "an example across a block edge"


def test_without_packing_there_is_no_block_info(tok: Any, data_files: dict[str, Path], tmp_path: Path) -> None:
    shown = build_preview(dataset_spec("samsum", data_files), tok, SEED, tmp_path, count=1)
    assert shown.packing is None and shown.examples[0].placement is None
    assert "packing: off" in render_text(shown)


# ------------------------------------------------------------------------ the command
@pytest.fixture
def tiny_spec(tiny_model: Path, tmp_path: Path) -> Path:
    """examples/tiny.yaml pointing at the test's tiny model, its checkpoints under tmp_path."""
    body = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    body["spec"]["model"]["source"] = str(tiny_model)
    body["spec"]["dataset"]["source"] = str(SAMSUM)
    body["spec"]["checkpointing"]["directory"] = str(tmp_path / "checkpoints")
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_the_command_previews_tiny_yaml(tiny_spec: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["data", "preview", str(tiny_spec), "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"dataset: {SAMSUM} (samsum), maxSeqLength 128\n")
    assert "split: train, 288 examples of 320 records; showing 3" in out
    assert re.search(r"^packing: bfd, \d+ blocks of 128 tokens, fill 0\.\d+$", out, re.MULTILINE)
    assert re.search(r"^store: built by the trainer's build_store in a temporary directory, .+, removed at the end$",
                     out, re.MULTILINE)
    assert out.count("\n--- example ") == 3 and "[[" in out and "\x1b[" not in out
    assert str(SAMSUM) + " line 1" in out

    assert cli(["data", "preview", str(tiny_spec), "--json", "--examples", "2", "--split", "validation"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["split"] == "validation" and len(document["examples"]) == 2
    assert document["packing"]["strategy"] == "bfd" and document["store_kept"] is False
    assert not Path(document["store"]).exists(), "the temporary store is removed"
    first = document["examples"][0]
    assert len(first["input_ids"]) == len(first["loss"]) == first["tokens"] and first["placement"]["blocks"]

    # --store: the trainer's own store root keeps it, and the next preview (or run) reuses it.
    root = tmp_path / "checkpoints" / "data"
    assert cli(["data", "preview", str(tiny_spec), "--store", str(root), "--color", "always"]) == 0
    out = capsys.readouterr().out
    assert "store: built at" in out and "the trainer's own: a run of this spec reuses it" in out
    assert LOSS_COLOUR in out and "[[" not in out
    assert cli(["data", "preview", str(tiny_spec), "--store", str(root), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["store_reused"] is True and Path(document["store"]).parent == root


def test_a_missing_dataset_file_is_an_error_naming_the_field(
    tiny_spec: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    body = yaml.safe_load(tiny_spec.read_text())
    body["spec"]["dataset"]["source"] = str(tmp_path / "absent.jsonl")
    tiny_spec.write_text(yaml.safe_dump(body))
    assert cli(["data", "preview", str(tiny_spec)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: spec.dataset.source: {tmp_path / 'absent.jsonl'} does not exist")


def test_a_record_without_its_fields_is_an_error_naming_the_record(
    tiny_spec: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"dialogue": "A: hi", "summary": "A greets."}\n\n{"dialogue": "B: hi"}\n')
    body = yaml.safe_load(tiny_spec.read_text())
    body["spec"]["dataset"]["source"] = str(bad)
    tiny_spec.write_text(yaml.safe_dump(body))
    assert cli(["data", "preview", str(tiny_spec)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"error: spec.dataset: {bad} line 3 has no field(s) ['summary'] (it has ['dialogue']); "
                            "set spec.dataset.promptTemplate / fieldMapping to match the data\n")


def test_an_invalid_spec_is_reported_as_validate_reports_it(
    tiny_spec: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    body = yaml.safe_load(tiny_spec.read_text())
    body["spec"]["dataset"]["maxSeqLength"] = 4
    tiny_spec.write_text(yaml.safe_dump(body))
    assert cli(["data", "preview", str(tiny_spec)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: spec.dataset.maxSeqLength:")


def test_a_config_error_of_the_trainer_reaches_the_caller(tok: Any, tmp_path: Path) -> None:
    """build_preview raises the trainer's ConfigError (the command prints it): a chat spec whose
    tokenizer has no template."""
    spec = DatasetSpec.model_validate({"format": "chat", "source": str(CHAT)})
    with pytest.raises(ConfigError, match=r"^spec\.dataset\.chatTemplate: the tokenizer of spec\.model has no chat"):
        build_preview(spec, tok, SEED, tmp_path)


def test_a_preview_is_plain_data(tok: Any, data_files: dict[str, Path], tmp_path: Path) -> None:
    shown = build_preview(dataset_spec("jsonl", data_files), tok, SEED, tmp_path, count=1)
    assert isinstance(shown, Preview) and shown.store_kept and not shown.store_reused
    again = build_preview(dataset_spec("jsonl", data_files), tok, SEED, tmp_path, count=1)
    assert again.store_reused and again.examples == shown.examples


def test_a_streamed_dataset_is_shown_from_the_store_it_would_have(
    tok: Any, data_files: dict[str, Path], tmp_path: Path,
) -> None:
    """A stream has no store; its examples are the same encoder's, shown with a note that says so."""
    streamed = build_preview(dataset_spec("samsum", data_files, streaming=True), tok, SEED, tmp_path, count=2)
    stored = build_preview(dataset_spec("samsum", data_files), tok, SEED, tmp_path, count=2)
    assert streamed.examples == stored.examples and stored.store_reused
    assert not stored.notes and streamed.notes[0].startswith("dataset.streaming: the trainer tokenizes while training")
    assert f"note: {streamed.notes[0]}" in render_text(streamed)
