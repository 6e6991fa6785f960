"""Preference records without a prompt field (TRL's implicit-prompt layout, e.g.
trl-lib/ultrafeedback_binarized): the prompt is the shared start of chosen and rejected, split as
TRL 1.16.0's `trl/data_utils.py::extract_prompt` splits it, and the pairs tokenized as
DPOTrainer tokenizes the same records (TRL run in .venv-peers: tests/trainer/trl_peer.py)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from llamaft.api.spec import DatasetSpec, FieldMapping
from llamaft_trainer.data.preference import encode_records, implicit_prompt, preference_record
from llamaft_trainer.data.records import read_numbered
from llamaft_trainer.process.errors import ConfigError
from transformers import AutoTokenizer

from tests.conftest import REPO
from tests.trainer.trl_compare import run_trl

MAX_LENGTH = 128
USER = {"role": "user", "content": "Where did Anna meet Bob?"}

PLAIN = [
    {"chosen": "Summarize: Anna met Bob at the cafe. They met.", "rejected": "Summarize: Anna met Bob at the cafe. Nobody came."},
    # they differ right after a space: the space goes to the completions (extract_prompt's rule)
    {"chosen": "The sky is blue", "rejected": "The sky is green"},
    # they differ inside a word: the prompt ends mid-word
    {"chosen": "Bob is lat", "rejected": "Bob is late"},
]
CHAT = [
    {"chosen": [USER, {"role": "assistant", "content": "At the cafe."}],
     "rejected": [USER, {"role": "assistant", "content": "I don't know."}]},
    {"chosen": [{"role": "system", "content": "Be brief."}, USER, {"role": "assistant", "content": "Cafe."},
                {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."}],
     "rejected": [{"role": "system", "content": "Be brief."}, USER, {"role": "assistant", "content": "Cafe."},
                  {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "No, the park."}]},
]


def spec(**extra: Any) -> DatasetSpec:
    return DatasetSpec.model_validate({"format": "preference", "source": "pairs.jsonl", "maxSeqLength": MAX_LENGTH, **extra})


def ours(tokenizer: Any, records: list[dict[str, Any]]) -> list[dict[str, list[int]]]:
    numbered = [(f"pairs.jsonl line {i + 1}", r) for i, r in enumerate(records)]
    return [asdict(e) for e in encode_records(tokenizer, spec(), numbered)]


# ------------------------------------------------------------------ extract_prompt's rule
def test_the_prompt_is_the_shared_start_as_trls_extract_prompt_splits_it() -> None:
    names = ("chosen", "rejected")
    assert implicit_prompt("The sky is blue", "The sky is green", names, "l1") == ("The sky is", " blue", " green")
    assert implicit_prompt("Bob is lat", "Bob is late", names, "l1") == ("Bob is la", "t", "te")  # ran out: last shared
    assert implicit_prompt("ab", "ac", names, "l1") == ("a", "b", "c")
    turns = implicit_prompt(CHAT[0]["chosen"], CHAT[0]["rejected"], names, "l1")
    assert turns == ([USER], CHAT[0]["chosen"][1:], CHAT[0]["rejected"][1:])
    record = preference_record(CHAT[1], FieldMapping(), "l1")
    assert record.prompt == CHAT[1]["chosen"][:4] and record.chosen == CHAT[1]["chosen"][4:]


def test_a_string_prompt_beside_whole_conversations_is_taken_from_them() -> None:
    """HuggingFaceH4/ultrafeedback_binarized's layout: TRL's maybe_extract_prompt ignores a prompt
    of the other kind than the completions and extracts it from them."""
    record = preference_record({"prompt": USER["content"], **CHAT[0]}, FieldMapping(), "l1")
    assert (record.prompt, record.chosen, record.rejected) == ([USER], CHAT[0]["chosen"][1:], CHAT[0]["rejected"][1:])


def test_pairs_without_a_prompt_are_tokenized_as_trl_does(tiny_model: Path) -> None:
    theirs = run_trl({"do": "tokenize", "tokenizer": str(tiny_model), "records": PLAIN, "max_length": MAX_LENGTH})
    mine = ours(AutoTokenizer.from_pretrained(tiny_model), PLAIN)
    assert mine == theirs["examples"] and len(mine) == len(PLAIN)


def test_conversations_without_a_prompt_are_tokenized_as_trl_does(tmp_path: Path) -> None:
    from llamaft_trainer.tiny import build_tokenizer

    build_tokenizer(REPO / "examples" / "data" / "samsum-tiny.jsonl", 512, "llama3").save_pretrained(tmp_path)
    theirs = run_trl({"do": "tokenize", "tokenizer": str(tmp_path), "records": CHAT, "max_length": MAX_LENGTH})
    mine = ours(AutoTokenizer.from_pretrained(tmp_path), CHAT)
    assert mine == theirs["examples"] and len(mine) == len(CHAT)
    explicit = [{"prompt": r["chosen"][:k], "chosen": r["chosen"][k:], "rejected": r["rejected"][k:]}
                for r, k in zip(CHAT, (1, 4), strict=True)]
    assert ours(AutoTokenizer.from_pretrained(tmp_path), explicit) == mine


# ------------------------------------------------------------------------- bad records
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("nothing shared", {"chosen": "yes", "rejected": "no"},
     "spec.dataset: pairs.jsonl line 3 has no prompt field, and its 'chosen' and 'rejected' share no leading "
     "character to take the prompt from (TRL's implicit-prompt layout: both hold the whole text or conversation, the "
     "prompt being their common start); give the prompt in its own field (spec.dataset.fieldMapping.prompt names it), "
     "or fix the record"),
    ("no shared turn", {"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
     "spec.dataset: pairs.jsonl line 3 has no prompt field, and its 'chosen' and 'rejected' share no leading turn "
     "to take the prompt from (TRL's implicit-prompt layout: both hold the whole text or conversation, the prompt "
     "being their common start); give the prompt in its own field (spec.dataset.fieldMapping.prompt names it), or "
     "fix the record"),
    ("only the last turn shared", {"chosen": [USER], "rejected": [USER, {"role": "assistant", "content": "b"}]},
     "spec.dataset: pairs.jsonl line 3 has no prompt field, and its 'chosen' and 'rejected' share only their last "
     "turn, which leaves no prompt turn before the completions; give the prompt in its own field "
     "(spec.dataset.fieldMapping.prompt names it), or fix the record"),
    ("mixed kinds", {"chosen": "a", "rejected": [USER]},
     "spec.dataset: pairs.jsonl line 3: chosen is a string, rejected is a list of turns; chosen and rejected must "
     "both be strings or both lists of turns (TRL's standard or conversational preference format)"),
]


@pytest.mark.parametrize(("record", "message"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_a_pair_without_a_prompt_to_extract_names_the_file_and_line(tmp_path: Path, tiny_model: Path,
                                                                     record: dict[str, Any], message: str) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(PLAIN[0]) + "\n\n" + json.dumps(record) + "\n")
    dataset = spec(source=str(path))
    with pytest.raises(ConfigError) as info:
        encode_records(AutoTokenizer.from_pretrained(tiny_model), dataset, read_numbered(dataset))
    assert str(info.value) == message.replace("pairs.jsonl", str(path))


def test_a_named_prompt_field_must_be_there(tiny_model: Path) -> None:
    """fieldMapping.prompt says where the prompt is: a record without it is an error, not implicit."""
    with pytest.raises(ConfigError, match="has no field 'question'"):
        preference_record(PLAIN[0], FieldMapping(prompt=["question"]), "l1")


def test_a_missing_completion_is_named_before_the_optional_prompt() -> None:
    with pytest.raises(ConfigError, match="has no field 'rejected'"):
        preference_record({"chosen": "The sky is blue"}, FieldMapping(), "l1")
