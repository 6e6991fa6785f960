"""`preference` records -> token ids (llamaft_trainer.data.preference), bit for bit as TRL's DPOTrainer
tokenizes them (TRL run in .venv-peers: tests/trainer/trl_peer.py), plain text and conversations,
and bad records refused naming the file and line."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from llamaft.api.spec import DatasetSpec
from llamaft_trainer.data.preference import (
    PreferenceEncoder,
    PreferenceExample,
    common_prefix_length,
    encode_records,
    keeps,
    preference_record,
)
from llamaft_trainer.data.records import read_numbered
from llamaft_trainer.methods.dpo import concatenated_batch
from llamaft_trainer.process.errors import ConfigError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.conftest import REPO
from tests.trainer.trl_compare import run_trl

MAX_LENGTH = 40

PLAIN = [
    {"prompt": "Summarize: Anna met Bob at the cafe.", "chosen": " They met.", "rejected": " Nobody came."},
    # A prompt that ends in a space: byte-level BPE merges it into the completion's first word
    # (`Ġwent`), so the completion starts where the tokenizations diverge, not at the prompt's length.
    {"prompt": "Anna ", "chosen": "went home with Bob", "rejected": "stayed"},
    # A completion that already ends with eos gets no second one.
    {"prompt": "Bob: hi", "chosen": " Anna: hi</s>", "rejected": " Anna: bye"},
    {"prompt": "", "chosen": "an empty prompt", "rejected": "still a pair"},
    # Long enough to be cut at MAX_LENGTH by the batch (keep_start), not dropped.
    {"prompt": "Tell me about the meeting.", "chosen": " Anna and Bob talked about the weekend and the weather" * 3,
     "rejected": " no"},
    # A prompt that fills MAX_LENGTH: dropped, as TRL drops it.
    {"prompt": "Anna said hello to Bob and Bob said hello to Anna. " * 6, "chosen": " ok", "rejected": " no"},
]
CHAT = [
    {"prompt": [{"role": "user", "content": "Where did Anna meet Bob?"}],
     "chosen": [{"role": "assistant", "content": "At the cafe."}],
     "rejected": [{"role": "assistant", "content": "I don't know."}]},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Summarize: Bob is late."}],
     "chosen": [{"role": "assistant", "content": "Bob is late."}],
     "rejected": [{"role": "assistant", "content": "Anna is early, and that is all there is to say about it."}]},
]


@pytest.fixture(scope="module")
def plain_tokenizer(tiny_model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llamaft_trainer.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("chat-tokenizer")
    build_tokenizer(REPO / "examples" / "data" / "samsum-tiny.jsonl", 512, "llama3").save_pretrained(out)
    return out


def spec(**extra: Any) -> DatasetSpec:
    return DatasetSpec.model_validate({"format": "preference", "source": "pairs.jsonl", "maxSeqLength": MAX_LENGTH, **extra})


def ours(tokenizer: Any, records: list[dict[str, Any]], dataset: DatasetSpec | None = None) -> list[dict[str, list[int]]]:
    numbered = [(f"pairs.jsonl line {i + 1}", r) for i, r in enumerate(records)]
    return [asdict(e) for e in encode_records(tokenizer, dataset or spec(), numbered)]


def _same_batch(examples: list[dict[str, list[int]]], pad: int, theirs: dict[str, Any]) -> None:
    batch = concatenated_batch([PreferenceExample(**e) for e in examples], pad, max_length=MAX_LENGTH)
    assert batch.input_ids.tolist() == theirs["input_ids"]
    assert batch.attention_mask.tolist() == theirs["attention_mask"]
    assert batch.completion_mask.tolist() == theirs["completion_mask"]


# --------------------------------------------------------------------------- against TRL
def test_plain_text_pairs_are_tokenized_as_trl_does(tiny_model: Path, plain_tokenizer: PreTrainedTokenizerBase) -> None:
    theirs = run_trl({"do": "tokenize", "tokenizer": str(tiny_model), "records": PLAIN, "max_length": MAX_LENGTH})
    mine = ours(plain_tokenizer, PLAIN)
    assert len(mine) == len(PLAIN) - 1  # the prompt that fills MAX_LENGTH is dropped
    assert mine == theirs["examples"]
    _same_batch(mine, plain_tokenizer.pad_token_id, theirs["batch"])


def test_conversations_are_tokenized_as_trl_does(chat_tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    theirs = run_trl({"do": "tokenize", "tokenizer": str(chat_tokenizer_dir), "records": CHAT, "max_length": MAX_LENGTH})
    mine = ours(tokenizer, CHAT)
    assert mine == theirs["examples"]
    _same_batch(mine, tokenizer.pad_token_id, theirs["batch"])


def test_renamed_fields_read_the_same_pairs(tiny_model: Path, plain_tokenizer: PreTrainedTokenizerBase) -> None:
    renamed = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in PLAIN]
    mapping = {"fieldMapping": {"prompt": ["question"], "chosen": "good", "rejected": "bad"}}
    assert ours(plain_tokenizer, renamed, spec(**mapping)) == ours(plain_tokenizer, PLAIN)


# ------------------------------------------------------------------------------ by hand
def test_the_completion_starts_where_the_tokenizations_diverge(plain_tokenizer: PreTrainedTokenizerBase) -> None:
    record = preference_record(PLAIN[1], spec().field_mapping, "x")
    (example,) = PreferenceEncoder(plain_tokenizer, spec()).encode([record])
    prompt = plain_tokenizer(PLAIN[1]["prompt"])["input_ids"]
    whole = plain_tokenizer(PLAIN[1]["prompt"] + PLAIN[1]["chosen"] + "</s>")["input_ids"]
    assert example.prompt_ids + example.chosen_ids == whole
    assert len(example.prompt_ids) == common_prefix_length(prompt, whole) < len(prompt)
    assert example.chosen_ids[-1] == plain_tokenizer.eos_token_id


def test_eos_ends_every_plain_completion_once(plain_tokenizer: PreTrainedTokenizerBase) -> None:
    (example,) = PreferenceEncoder(plain_tokenizer, spec()).encode([preference_record(PLAIN[2], spec().field_mapping, "x")])
    eos = plain_tokenizer.eos_token_id
    for ids in (example.chosen_ids, example.rejected_ids):
        assert ids[-1] == eos and ids.count(eos) == 1


def test_common_prefix_and_keep() -> None:
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
    assert keeps(PreferenceExample([1, 2, 3], [4], [5]), 4)
    assert not keeps(PreferenceExample([1, 2, 3, 4], [5], [6]), 4)
    assert keeps(PreferenceExample([1] * 100, [5], [6]), None)


# --------------------------------------------------------------------------- bad records
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("no chosen", {"prompt": "p", "rejected": "r"},
     "spec.dataset: pairs.jsonl line 3 has no field 'chosen' (it has ['prompt', 'rejected']): format preference reads "
     "the prompt from 'prompt', the chosen completion from 'chosen' and the rejected one from 'rejected'; rename "
     "them with spec.dataset.fieldMapping (prompt: [<field>], chosen, rejected)"),
    ("a number", {"prompt": "p", "chosen": 5, "rejected": "r"},
     "spec.dataset: pairs.jsonl line 3: field 'chosen' is a int; it must be a string or a list of turns "
     '(each turn is {"role": "system"|"user"|"assistant", "content": "..."})'),
    ("mixed kinds", {"prompt": "p", "chosen": [{"role": "assistant", "content": "c"}], "rejected": "r"},
     "spec.dataset: pairs.jsonl line 3: prompt is a string, chosen is a list of turns, rejected is a string; "
     "prompt, chosen and rejected must all be strings or all lists of turns (TRL's standard or conversational "
     "preference format)"),
    ("a bad role", {"prompt": [{"role": "human", "content": "p"}], "chosen": [{"role": "assistant", "content": "c"}],
                    "rejected": [{"role": "assistant", "content": "r"}]},
     "spec.dataset: pairs.jsonl line 3: turn 1 of 'prompt' has role 'human'; the roles are system, user, assistant"),
    ("an empty completion", {"prompt": [{"role": "user", "content": "p"}], "chosen": [],
                             "rejected": [{"role": "assistant", "content": "r"}]},
     "spec.dataset: pairs.jsonl line 3: field 'chosen' is an empty list; give at least one turn "
     '(each turn is {"role": "system"|"user"|"assistant", "content": "..."})'),
]


@pytest.mark.parametrize(("record", "message"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_a_bad_record_names_the_file_and_line(tmp_path: Path, record: dict[str, Any], message: str,
                                              plain_tokenizer: PreTrainedTokenizerBase) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(PLAIN[0]) + "\n\n" + json.dumps(record) + "\n")
    dataset = spec(source=str(path))
    with pytest.raises(ConfigError) as info:
        encode_records(plain_tokenizer, dataset, read_numbered(dataset))
    assert str(info.value) == message.replace("pairs.jsonl", str(path))


def test_conversations_need_a_chat_template(plain_tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ConfigError, match="has no chat template"):
        ours(plain_tokenizer, CHAT[:1])


def test_the_single_sequence_encoder_refuses_pairs(plain_tokenizer: PreTrainedTokenizerBase) -> None:
    from llamaft_trainer.data.encoding import Encoder

    with pytest.raises(ConfigError, match="format preference holds pairs for training.method dpo"):
        Encoder(spec(), plain_tokenizer)
