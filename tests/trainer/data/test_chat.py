"""`chat` format (llamaft_trainer.data.chat): labels token by token against hand-built expectations,
template resolution, record validation, truncation and `make-tiny-model --chat-template`.

The expectations are built by tokenizing the template's pieces one by one (header, content,
end-of-turn), never by calling the code under test, so a wrong span shows up as a wrong label.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from llamaft.api.spec import BUILTIN_CHAT_TEMPLATES, DatasetSpec, TrainOn
from llamaft_trainer.data import encoding
from llamaft_trainer.data.chat import (
    BUILTIN_TEMPLATES,
    IGNORE_INDEX,
    ROLES,
    ChatEncoder,
    conversation,
    resolve_template,
)
from llamaft_trainer.process.errors import ConfigError

from tests.conftest import REPO

DATASET = REPO / "examples" / "data" / "samsum-tiny.jsonl"
CHAT_DATASET = REPO / "examples" / "data" / "chat-tiny.jsonl"
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

SYSTEM = "You summarise chats."
TURNS: list[dict[str, str]] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Anna: Do you want to meet at 5?\nBen: Sure."},
    {"role": "assistant", "content": "Anna and Ben will meet at 5."},
    {"role": "user", "content": "Who is talking?"},
    {"role": "assistant", "content": "Anna and Ben."},
]


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny chat model made the way users make it: `llamaft make-tiny-model --chat-template llama3`."""
    from llamaft.cli import main

    out = tmp_path_factory.mktemp("chat") / "tiny-llama3"
    assert main(["make-tiny-model", str(out), "--dataset", str(DATASET), "--chat-template", "llama3"]) == 0
    return out


@pytest.fixture(scope="module")
def llama3_tok(llama3_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama3_dir)


@pytest.fixture(scope="module")
def llama2_tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from llamaft_trainer.tiny import build_tiny_llama
    from transformers import AutoTokenizer

    out = build_tiny_llama(
        tmp_path_factory.mktemp("chat") / "tiny-llama2", DATASET, hidden_size=32, layers=1, heads=2, kv_heads=1,
        vocab_size=512, chat_template="llama2",
    )
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def plain_tok() -> Any:
    """The default tiny tokenizer: no chat template, and none of Llama 3's special tokens."""
    from llamaft_trainer.tiny import build_tokenizer

    return build_tokenizer(DATASET, 512)


def pieces(tok: Any, *texts: str) -> list[list[int]]:
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def spec(**fields: Any) -> DatasetSpec:
    return DatasetSpec.model_validate({"format": "chat", "source": "data.jsonl", **fields})


def test_builtins_match_the_api() -> None:
    assert tuple(BUILTIN_TEMPLATES) == BUILTIN_CHAT_TEMPLATES
    assert ROLES == ("system", "user", "assistant")
    assert IGNORE_INDEX == encoding.IGNORE_INDEX


# ------------------------------------------------------------------------ labels, llama3
def llama3_expected(tok: Any, turns: list[dict[str, str]], train_on: TrainOn) -> tuple[list[int], list[int]]:
    """Meta's Llama 3 layout, assembled from separately tokenized pieces."""
    bos, sh, eh, eot = (tok.convert_tokens_to_ids(t) for t in LLAMA3_SPECIALS)
    last = max(i for i, t in enumerate(turns) if t["role"] == "assistant")
    ids: list[int] = [bos]
    labels: list[int] = [bos if train_on is TrainOn.ALL else IGNORE_INDEX]
    for i, turn in enumerate(turns):
        role, newlines, content = pieces(tok, turn["role"], "\n\n", turn["content"].strip())
        header = [sh, *role, eh, *newlines]
        body = [*content, eot]
        trained = train_on is TrainOn.ALL or (
            turn["role"] == "assistant" and (train_on is TrainOn.ASSISTANT or i == last)
        )
        ids += header + body
        labels += (header if train_on is TrainOn.ALL else [IGNORE_INDEX] * len(header))
        labels += body if trained else [IGNORE_INDEX] * len(body)
    return ids, labels


@pytest.mark.parametrize("train_on", list(TrainOn), ids=[t.value for t in TrainOn])
def test_llama3_labels_token_by_token(llama3_tok: Any, train_on: TrainOn) -> None:
    encoder = ChatEncoder(llama3_tok, BUILTIN_TEMPLATES["llama3"], train_on, max_len=512)
    [(ids, labels)] = encoder.encode([TURNS])
    want_ids, want_labels = llama3_expected(llama3_tok, TURNS, train_on)
    assert ids == want_ids
    assert labels == want_labels
    if train_on is TrainOn.ASSISTANT:  # spelled out once: the answers and their <|eot_id|>, nothing else
        learned = llama3_tok.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
        assert learned == "Anna and Ben will meet at 5.<|eot_id|>Anna and Ben.<|eot_id|>"


def test_llama3_without_system_and_batched(llama3_tok: Any) -> None:
    encoder = ChatEncoder(llama3_tok, BUILTIN_TEMPLATES["llama3"], TrainOn.ASSISTANT, max_len=512)
    convs = [TURNS[1:], TURNS, TURNS[1:3]]
    got = encoder.encode(convs)
    assert got == [llama3_expected(llama3_tok, c, TrainOn.ASSISTANT) for c in convs]


# ------------------------------------------------------------------------ labels, llama2
@pytest.mark.parametrize("train_on", [TrainOn.ASSISTANT, TrainOn.LAST_ASSISTANT], ids=["assistant", "lastAssistant"])
def test_llama2_labels_token_by_token(llama2_tok: Any, train_on: TrainOn) -> None:
    """<s>[INST] <<SYS>>\\nS\\n<</SYS>>\\n\\nU [/INST] A </s><s>[INST] U2 [/INST] A2 </s>: the
    answer's span is ' A ' and </s>."""
    tok = llama2_tok
    bos, eos = tok.bos_token_id, tok.eos_token_id
    system, user1, answer1, user2, answer2 = (t["content"] for t in TURNS)
    [prompt1] = pieces(tok, f"[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user1} [/INST]")
    [prompt2] = pieces(tok, f"[INST] {user2} [/INST]")
    [body1, body2] = pieces(tok, f" {answer1} ", f" {answer2} ")
    want_ids = [bos, *prompt1, *body1, eos, bos, *prompt2, *body2, eos]
    masked = [IGNORE_INDEX]
    first = [*body1, eos] if train_on is TrainOn.ASSISTANT else masked * (len(body1) + 1)
    want_labels = masked * (1 + len(prompt1)) + first + masked * (1 + len(prompt2)) + [*body2, eos]

    encoder = ChatEncoder(tok, BUILTIN_TEMPLATES["llama2"], train_on, max_len=512)
    [(ids, labels)] = encoder.encode([TURNS])
    assert ids == want_ids
    assert labels == want_labels


# ---------------------------------------------------------------- render == transformers
CONVERSATIONS = [
    TURNS,
    TURNS[1:3],
    [{"role": "user", "content": "  padded  "}, {"role": "assistant", "content": "\nok\n"}],
]


@pytest.mark.parametrize("name", BUILTIN_CHAT_TEMPLATES)
def test_render_equals_apply_chat_template(name: str, llama3_tok: Any, llama2_tok: Any) -> None:
    tok = llama3_tok if name == "llama3" else llama2_tok
    assert tok.chat_template == BUILTIN_TEMPLATES[name]
    encoder = ChatEncoder(tok, BUILTIN_TEMPLATES[name], TrainOn.ASSISTANT, max_len=512)
    for turns in CONVERSATIONS:
        for prefix in range(1, len(turns) + 1):
            for gen in (False, True):
                want = tok.apply_chat_template(turns[:prefix], tokenize=False, add_generation_prompt=gen)
                assert encoder.render(turns[:prefix], gen) == want


def test_llama3_builtin_text(llama3_tok: Any) -> None:
    """The built-in writes Meta's Llama 3 layout, character for character."""
    encoder = ChatEncoder(llama3_tok, BUILTIN_TEMPLATES["llama3"], TrainOn.ASSISTANT, max_len=512)
    assert encoder.render(TURNS[:2], add_generation_prompt=True) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou summarise chats.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnna: Do you want to meet at 5?\nBen: Sure.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_generation_tags_render_their_body(llama3_tok: Any) -> None:
    template = (
        "{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    encoder = ChatEncoder(llama3_tok, template, TrainOn.ASSISTANT, max_len=512)
    [(ids, labels)] = encoder.encode([TURNS[1:3]])
    learned = llama3_tok.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    # `assistant: Anna` tokenizes as ..., ':', 'ĠAnna': the token straddling the span's start is
    # labelled (masking it would hide the answer's first word), so its space comes along.
    assert learned == " Anna and Ben will meet at 5.<|eot_id|>"


# --------------------------------------------------------------------- template choice
def test_tokenizer_template_is_the_default(llama3_tok: Any) -> None:
    assert resolve_template(spec(), llama3_tok) == llama3_tok.chat_template


def test_jinja_chat_template_overrides_the_tokenizers(llama3_tok: Any) -> None:
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    assert resolve_template(spec(chatTemplate=template), llama3_tok) == template
    assert resolve_template(spec(chatTemplate="llama2"), llama3_tok) == BUILTIN_TEMPLATES["llama2"]
    encoder = ChatEncoder(llama3_tok, template, TrainOn.ASSISTANT, max_len=512)
    [(ids, labels)] = encoder.encode([TURNS[1:3]])
    assert llama3_tok.decode(ids).startswith("<user>Anna")
    learned = llama3_tok.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    assert learned == "<assistant>Anna and Ben will meet at 5.<|eot_id|>"  # no generation prompt: the header counts


def test_no_template_at_all_names_the_field(plain_tok: Any) -> None:
    assert not plain_tok.chat_template
    with pytest.raises(ConfigError, match=r"^spec\.dataset\.chatTemplate: .*llama3"):
        resolve_template(spec(), plain_tok)
    with pytest.raises(ConfigError, match=r"^spec\.dataset\.chatTemplate: 'llama-3' is neither a built-in"):
        resolve_template(spec(chatTemplate="llama-3"), plain_tok)


def test_bad_templates_name_the_field(llama3_tok: Any) -> None:
    with pytest.raises(ConfigError, match=r"^spec\.dataset\.chatTemplate: the chat template is not valid Jinja"):
        ChatEncoder(llama3_tok, "{% for m in messages %}", TrainOn.ASSISTANT, 512)
    unstable = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    encoder = ChatEncoder(llama3_tok, unstable, TrainOn.ASSISTANT, 512)
    with pytest.raises(ConfigError, match=r"^spec\.dataset\.chatTemplate: data\.jsonl line 3: .*not prefix-stable"):
        encoder.encode([TURNS], where=["data.jsonl line 3"])
    llama2 = ChatEncoder(llama3_tok, BUILTIN_TEMPLATES["llama2"], TrainOn.ASSISTANT, 512)
    with pytest.raises(ConfigError, match=r"data\.jsonl line 4: the chat template refused it: .*must alternate"):
        llama2.encode([[TURNS[1], TURNS[1], TURNS[2]]], where=["data.jsonl line 4"])


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"text": "hi"}, r"has no field 'messages' \(it has \['text'\]\).*fieldMapping\.messages"),
        ({"messages": "hi"}, r"field 'messages' is a str, not a list of turns"),
        ({"messages": ["hi"]}, r"turn 1 of 'messages' is a str, not an object"),
        ({"messages": [{"role": "bot", "content": "x"}]}, r"turn 1 of 'messages' has role 'bot'; the roles are system, user, assistant"),
        ({"messages": [{"content": "x"}]}, r"turn 1 of 'messages' has no role"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 5}]},
         r"turn 2 \(assistant\) of 'messages' has content of type int; content must be a string"),
        ({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]}, r"has no assistant turn"),
    ],
    ids=["missing-field", "not-a-list", "turn-not-object", "unknown-role", "no-role", "non-string-content", "no-assistant"],
)
def test_validation_names_the_record(record: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=r"^spec\.dataset: data\.jsonl line 5.*" + message):
        conversation(record, "messages", "data.jsonl line 5")


def test_valid_records_keep_role_and_content_only() -> None:
    record = {"chat": [{"role": "user", "content": "a", "name": "x"}, {"role": "assistant", "content": "b"}]}
    assert conversation(record, "chat", "x") == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


def test_shipped_chat_dataset_is_valid(llama3_tok: Any) -> None:
    lines = CHAT_DATASET.read_text(encoding="utf-8").splitlines()
    assert 200 <= len(lines) <= 300 and CHAT_DATASET.stat().st_size < 300_000
    convs = [conversation(json.loads(line), "messages", f"chat-tiny.jsonl line {n}") for n, line in enumerate(lines, 1)]
    assert {len(c) for c in convs} >= {2, 3, 4, 5, 6, 7}  # optional system turn, 1-3 exchanges
    encoder = ChatEncoder(llama3_tok, BUILTIN_TEMPLATES["llama3"], TrainOn.ASSISTANT, max_len=512)
    assert all(any(label != IGNORE_INDEX for label in labels) for _, labels in encoder.encode(convs))


# ---------------------------------------------------------------------------- truncation
def test_truncation_never_cuts_a_special_token_in_half(plain_tok: Any) -> None:
    """A tokenizer that spells <|eot_id|> with several tokens: a cut inside one moves back to
    the token where it starts (a plain cut at max_len would end in half a control token)."""
    encoder = ChatEncoder(plain_tok, BUILTIN_TEMPLATES["llama3"], TrainOn.ALL, max_len=16)
    text = encoder.render(TURNS[1:3])
    enc = plain_tok(text, add_special_tokens=False, return_offsets_mapping=True)
    full_ids, offsets = enc["input_ids"], enc["offset_mapping"]
    assert "<|eot_id|>" not in plain_tok.convert_ids_to_tokens(full_ids)  # several tokens per control token
    controls = [m.span() for m in re.finditer("|".join(map(re.escape, LLAMA3_SPECIALS)), text)]
    naive_split = 0
    for max_len in range(16, len(full_ids)):
        encoder.max_len = max_len
        [(ids, labels)] = encoder.encode([TURNS[1:3]])
        assert ids == full_ids[: len(ids)] and labels == ids and 0 < len(ids) <= max_len
        kept = offsets[len(ids) - 1][1]
        assert not any(a < kept < b for a, b in controls), (max_len, text[:kept])
        naive = offsets[max_len - 1][1]
        if any(a < naive < b for a, b in controls):
            naive_split += 1
            assert len(ids) < max_len
    assert naive_split > 5  # the rule mattered for many of these lengths


def test_truncation_drops_whole_trailing_turns(llama3_tok: Any) -> None:
    full_ids, full_labels = llama3_expected(llama3_tok, TURNS, TrainOn.ASSISTANT)
    first_end = len(llama3_expected(llama3_tok, TURNS[:3], TrainOn.ASSISTANT)[0])  # through the first answer's <|eot_id|>
    assert full_ids[first_end - 1] == llama3_tok.convert_tokens_to_ids("<|eot_id|>")
    encoder = ChatEncoder(llama3_tok, BUILTIN_TEMPLATES["llama3"], TrainOn.ASSISTANT, max_len=len(full_ids) - 1)
    [(ids, labels)] = encoder.encode([TURNS])
    assert (ids, labels) == (full_ids[:first_end], full_labels[:first_end])  # the whole first exchange, no partial turn
    encoder.max_len = first_end - 2  # the first answer alone does not fit: cut at max_len, a partial answer
    [(ids, labels)] = encoder.encode([TURNS])
    assert (ids, labels) == (full_ids[: first_end - 2], full_labels[: first_end - 2])
    assert any(label != IGNORE_INDEX for label in labels)


def test_truncation_last_assistant_keeps_its_answer_when_only_trailing_turns_overflow(llama3_tok: Any) -> None:
    turns = [*TURNS, {"role": "user", "content": "Thanks, that is all for today."}]
    full_ids, full_labels = llama3_expected(llama3_tok, turns, TrainOn.LAST_ASSISTANT)
    kept, _ = llama3_expected(llama3_tok, TURNS, TrainOn.LAST_ASSISTANT)
    encoder = ChatEncoder(llama3_tok, BUILTIN_TEMPLATES["llama3"], TrainOn.LAST_ASSISTANT, max_len=len(kept) + 2)
    [(ids, labels)] = encoder.encode([turns])
    assert (ids, labels) == (full_ids[: len(kept)], full_labels[: len(kept)])


# ------------------------------------------------------------------- make-tiny-model --chat
def test_make_tiny_model_chat_template(llama3_dir: Path, llama3_tok: Any, llama2_tok: Any) -> None:
    tok = llama3_tok
    assert tok.chat_template == BUILTIN_TEMPLATES["llama3"]
    assert (tok.bos_token, tok.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    for special in LLAMA3_SPECIALS:
        [single] = tok.encode(special, add_special_tokens=False)
        assert single == tok.convert_tokens_to_ids(special) != tok.unk_token_id
    ids = tok.apply_chat_template(TURNS[1:3], tokenize=True, add_generation_prompt=False, return_dict=False)
    assert ids == llama3_expected(tok, TURNS[1:3], TrainOn.ALL)[0]
    config = json.loads((llama3_dir / "config.json").read_text())
    assert config["vocab_size"] == len(tok) and config["eos_token_id"] == tok.convert_tokens_to_ids("<|eot_id|>")
    # llama2: bos/eos stay <s> </s>, [INST] is plain text.
    assert (llama2_tok.bos_token, llama2_tok.eos_token) == ("<s>", "</s>")
    assert llama2_tok.chat_template == BUILTIN_TEMPLATES["llama2"]
    assert llama2_tok.apply_chat_template(TURNS[1:3], tokenize=False).startswith("<s>[INST] Anna")
