"""Encoding: a record -> a prompt and a response (the built-in formats' templates, or a field mapping)
-> token ids with the loss masked.

What carries loss, by format: `samsum`, `alpaca` and `jsonl` render a prompt from the record and
train on the response field only (prompt positions carry label -100); `chat` renders the turns
with the tokenizer's chat template and trains on the assistant's turns (`trainOn`, chat.py).
"""


from __future__ import annotations

import functools
import itertools
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from llamaft.api.spec import DatasetFormat, DatasetSpec, TrainOn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from llamaft_trainer.data import store as store_mod
from llamaft_trainer.data.records import Numbered, digest
from llamaft_trainer.process.errors import ConfigError

IGNORE_INDEX = -100

# The built-in formats: prompt template and response field. samsum follows llama-recipes'
# summarisation prompt; alpaca uses Stanford Alpaca's two prompts (with and without input).
SAMSUM_TEMPLATE = "Summarize this dialog:\n{dialogue}\n---\nSummary:\n"
ALPACA_TEMPLATE = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT_TEMPLATE = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
DEFAULT_RESPONSE = {DatasetFormat.SAMSUM: "summary", DatasetFormat.ALPACA: "output", DatasetFormat.JSONL: "output"}



@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]


# ---------------------------------------------------------------------------- formatting
def _template_fields(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


@functools.lru_cache(maxsize=64)
def _required(template: str, response_field: str) -> list[str]:
    """The fields a record needs (parsed once per template, not once per record)."""
    return [*_template_fields(template), response_field]


class Formatter:
    """Turns one record into (prompt, response) text, per the spec's format and mapping."""

    def __init__(self, spec: DatasetSpec) -> None:
        self.spec = spec
        self.response_field = spec.field_mapping.response or DEFAULT_RESPONSE[spec.format]
        self.template = spec.prompt_template
        if self.template is None and spec.field_mapping.prompt:
            self.template = "\n".join("{" + f + "}" for f in spec.field_mapping.prompt) + "\n"
        if self.template is None and spec.format is DatasetFormat.SAMSUM:
            self.template = SAMSUM_TEMPLATE

    def required_fields(self, record: dict[str, Any]) -> list[str]:
        if self.template is not None:
            template = self.template
        elif record.get("input"):
            template = ALPACA_TEMPLATE
        else:
            template = ALPACA_NO_INPUT_TEMPLATE
        return _required(template, self.response_field)

    def check(self, record: dict[str, Any], where: str) -> None:
        """`where`: the record's place in the source, as a person finds it (file and line)."""
        missing = [f for f in self.required_fields(record) if record.get(f) is None]
        if missing:
            raise ConfigError(
                f"spec.dataset: {where} has no field(s) {missing} "
                f"(it has {sorted(record)}); set spec.dataset.promptTemplate / fieldMapping to match the data"
            )

    def __call__(self, record: dict[str, Any]) -> tuple[str, str]:
        if self.template is not None:
            prompt = self.template.format(**record)
        elif record.get("input"):
            prompt = ALPACA_TEMPLATE.format(**record)
        else:
            prompt = ALPACA_NO_INPUT_TEMPLATE.format(**record)
        return prompt, str(record[self.response_field])


def tokenize(prompt: str, response: str, tok: PreTrainedTokenizerBase, max_len: int) -> Example:
    """<bos> prompt response <eos>, prompt positions masked out of the loss, truncated to max_len.
    One record at a time: the reference the batched encoder (Encoder) is tested against."""
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    response_ids = tok.encode(response, add_special_tokens=False)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    input_ids = bos + prompt_ids + response_ids + eos
    labels = [IGNORE_INDEX] * (len(bos) + len(prompt_ids)) + response_ids + eos
    return Example(input_ids[:max_len], labels[:max_len])


def _encode_texts(tok: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of many texts in one call (no special tokens added): the Rust tokenizer's batch
    entry point when there is one (twice as fast as the Python wrapper's, same ids)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    ids: list[list[int]] = tok(texts, add_special_tokens=False)["input_ids"]
    return ids


class Encoder:
    """Records -> (input_ids, labels), a batch at a time, for every format; each record is
    checked first and a bad one is named by `where` (file and line)."""

    def __init__(self, spec: DatasetSpec, tok: PreTrainedTokenizerBase) -> None:
        self.spec = spec
        self.tok = tok
        self.max_len = spec.max_seq_length
        self.chat: Any = None
        self.formatter: Formatter | None = None
        if spec.format is DatasetFormat.PREFERENCE:
            # Pairs are tokenized by llamaft_trainer.data.preference, for the DPO loop; a single-sequence
            # encoder would train on them as something they are not.
            raise ConfigError(
                "spec.dataset.format: format preference holds pairs for training.method dpo, which this trainer "
                "reads with llamaft_trainer.data.preference, not as single sequences"
            )
        if spec.format is DatasetFormat.CHAT:
            from llamaft_trainer.data import chat

            self.template: str | None = chat.resolve_template(spec, tok)
            self.chat = chat.ChatEncoder(tok, self.template, spec.train_on or TrainOn.ASSISTANT, spec.max_seq_length)
        else:
            self.template = None
            self.formatter = Formatter(spec)

    def identity(self) -> dict[str, Any]:
        """What the tokens depend on besides the records (part of the store's key)."""
        return {"template": self.template, "tokenizer": tokenizer_fingerprint(self.tok)}

    def check(self, numbered: Sequence[Numbered]) -> None:
        if self.formatter is not None:
            for where, record in numbered:
                self.formatter.check(record, where)

    def encode(self, numbered: Sequence[Numbered]) -> store_mod.Part:
        """The records as an in-memory part: each example <bos> prompt response <eos> (or the
        rendered conversation), loss on what `tokenize` / `trainOn` label, cut to maxSeqLength."""
        if self.chat is not None:
            from llamaft_trainer.data import chat

            field_name = self.spec.field_mapping.messages
            conversations = [chat.conversation(record, field_name, where) for where, record in numbered]
            return part_of(self.chat.encode(conversations, where=[w for w, _ in numbered]))
        assert self.formatter is not None
        self.check(numbered)
        pairs = [self.formatter(record) for _, record in numbered]
        both = _encode_texts(self.tok, [p for p, _ in pairs] + [r for _, r in pairs])
        return _assemble(both[: len(pairs)], both[len(pairs):], self.tok.bos_token_id, self.tok.eos_token_id, self.max_len)


def _assemble(prompts: list[list[int]], responses: list[list[int]], bos: int | None, eos: int | None,
              max_len: int) -> store_mod.Part:
    """[bos] + prompt + response + [eos] per example, cut to max_len, loss on response and eos:
    `tokenize`'s examples, laid out with array operations over the whole batch (per-example
    Python lists cost as much as the tokenizer did)."""
    p = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
    r = np.fromiter(map(len, responses), dtype=np.int64, count=len(responses))
    total_p = int(p.sum())
    flat = np.fromiter(itertools.chain.from_iterable(prompts + responses), dtype=np.int32, count=total_p + int(r.sum()))
    b, e = int(bos is not None), int(eos is not None)
    lengths = np.minimum(b + p + r + e, max_len)
    starts = np.cumsum(lengths) - lengths
    example = np.repeat(np.arange(len(lengths)), lengths)
    k = np.arange(int(lengths.sum())) - starts[example]  # position inside its example
    pk = k - b  # position inside the prompt
    rk = pk - p[example]  # position inside the response
    in_prompt = (pk >= 0) & (rk < 0)
    in_response = (rk >= 0) & (rk < r[example])
    tokens = np.full(len(k), -1 if eos is None else eos, dtype=np.int32)
    if bos is not None:
        tokens[k == 0] = bos
    prompt_at = (np.cumsum(p) - p)[example] + pk
    response_at = total_p + (np.cumsum(r) - r)[example] + rk
    tokens[in_prompt] = flat[prompt_at[in_prompt]]
    tokens[in_response] = flat[response_at[in_response]]
    return store_mod.in_memory(tokens, rk >= 0, lengths)


def part_of(pairs: Sequence[tuple[list[int], list[int]]]) -> store_mod.Part:
    """(input_ids, labels) pairs, a label either the token or IGNORE_INDEX, as an in-memory part."""
    lengths = np.fromiter((len(ids) for ids, _ in pairs), dtype=np.int64, count=len(pairs))
    total = int(lengths.sum())
    tokens = np.fromiter(itertools.chain.from_iterable(ids for ids, _ in pairs), dtype=np.int32, count=total)
    labels = np.fromiter(itertools.chain.from_iterable(lab for _, lab in pairs), dtype=np.int64, count=total)
    return store_mod.in_memory(tokens, labels != IGNORE_INDEX, lengths)


def pairs_of(part: store_mod.Part) -> list[tuple[list[int], list[int]]]:
    """An in-memory part as (input_ids, labels) lists (tests and references compare these)."""
    out = []
    for i in range(len(part)):
        tokens, loss = part.example(i)
        ids = [int(t) for t in tokens]
        out.append((ids, [t if flag else IGNORE_INDEX for t, flag in zip(ids, loss, strict=True)]))
    return out


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    """The tokenizer's vocabulary, merges, normalisation and special tokens, hashed."""
    backend = getattr(tok, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else f"{tok.name_or_path}:{len(tok)}"
    return digest(body, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, getattr(tok, "chat_template", None))



def check_sequence_length(spec: DatasetSpec, max_positions: int | None) -> None:
    if max_positions is not None and spec.max_seq_length > max_positions:
        raise ConfigError(
            f"spec.dataset.maxSeqLength: {spec.max_seq_length} exceeds the model's max_position_embeddings "
            f"{max_positions}; lower maxSeqLength to at most {max_positions}"
        )

