"""`preference` format: records of a prompt, a chosen and a rejected completion -> token ids, as
TRL's DPOTrainer tokenizes them, so that a run here and a TRL run on the same records train on
the same tokens.

Matched against TRL 1.16.0 (the version bench/peers-requirements.txt pins next to torch 2.13.0 and
transformers 5.24.0), `trl/trainer/dpo_trainer.py`:

* `DPOTrainer._prepare_dataset`: plain-text records get the tokenizer's eos appended to chosen
  and rejected unless they already end with it (`add_eos`); conversational ones do not (the
  chat template ends the assistant turn itself).
* its `tokenize_fn`: the prompt, prompt + chosen and prompt + rejected are each tokenized WHOLE,
  plain text with `tokenizer(text)` (special tokens added as the tokenizer adds them: a Llama
  tokenizer's bos), turns with `apply_chat_template(..., tokenize=True)` (the prompt with
  `add_generation_prompt=True`, prompt + completion without). The completion starts where the
  tokenized prompt and the tokenized prompt + completion first differ (`common_prefix_length`
  in `trl/data_utils.py`, the smaller of the two pairs' prefixes), not at the prompt's length:
  BPE can merge across the boundary, and some templates render a prompt alone differently.
* examples whose prompt alone fills `max_length` are dropped (with `keep_start` truncation the
  collator would cut every completion token away).

Implicit prompts (`implicit_prompt`): TRL's preference sets such as trl-lib/ultrafeedback_binarized
hold only chosen and rejected, each the whole text or conversation, the prompt being their shared
start. A record without the prompt field gets TRL's `trl/data_utils.py::extract_prompt` (which
`DPOTrainer._prepare_dataset` maps over a set whose first record has no prompt), and, as
`maybe_extract_prompt` does, so does one whose prompt is of the other kind than its completions
(a string prompt beside whole conversations, HuggingFaceH4/ultrafeedback_binarized's layout).

Turns are rendered with the chat format's compiled template (`chat.compile_template`, built
like transformers' own and tested equal to it) and tokenized in one batched call with
`add_special_tokens=False`, which is what `apply_chat_template(..., tokenize=True)` does
(`transformers/tokenization_utils_base.py`), at a fraction of the cost of one call per text.

Truncation to `max_length` happens later, per sequence, when pairs are batched
(`dpo.concatenated_batch`, TRL's `DataCollatorForPreference`), so the stored ids are untruncated.
Bad records are ConfigErrors naming the file and line (`where`), as for the other formats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from llamaft.api.spec import DatasetSpec, FieldMapping

from llamaft_trainer.data.chat import (
    BUILTIN_TEMPLATES,
    TURN_HINT,
    checked_turns,
    compile_template,
    resolve_template,
)
from llamaft_trainer.process.errors import ConfigError

Text = str | list[dict[str, str]]
"""A prompt or completion: a string, or a list of `{role, content}` turns."""


@dataclass(frozen=True)
class PreferenceRecord:
    """One checked record: all three parts strings, or all three lists of turns."""

    prompt: Text
    chosen: Text
    rejected: Text

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass(frozen=True)
class PreferenceExample:
    """A tokenized pair: TRL's `prompt_ids`, `chosen_ids`, `rejected_ids` (untruncated)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


def field_names(mapping: FieldMapping) -> tuple[str, str, str]:
    """The record fields of the prompt, the chosen and the rejected completion."""
    return (mapping.prompt[0] if mapping.prompt else "prompt"), mapping.chosen, mapping.rejected


def _turns(value: list[Any], field: str, where: str) -> list[dict[str, str]]:
    if not value:
        raise ConfigError(f"spec.dataset: {where}: field {field!r} is an empty list; give at least one turn ({TURN_HINT})")
    return checked_turns(value, field, where)


def _kind(value: Any) -> str | None:
    return "text" if isinstance(value, str) else "turns" if isinstance(value, list) else None


def implicit_prompt(chosen: Text, rejected: Text, names: tuple[str, str], where: str) -> tuple[Text, Text, Text]:
    """(prompt, chosen, rejected) of a pair whose prompt is the shared start of its chosen and
    rejected (two strings, or two checked lists of turns), split as TRL 1.16.0's
    `trl/data_utils.py::extract_prompt` splits it: the prompt ends where they first differ (a
    character, or a turn), less a space just before that point (the completion keeps it); where
    one is a prefix of the other, before their last shared element. A pair that differs from its
    first element has no prompt to extract (TRL would index before the start): a ConfigError."""
    n = min(len(chosen), len(rejected))
    if n == 0 or chosen[0] != rejected[0]:
        unit = "character" if isinstance(chosen, str) else "turn"
        raise ConfigError(
            f"spec.dataset: {where} has no prompt field, and its {names[0]!r} and {names[1]!r} share no leading {unit} "
            "to take the prompt from (TRL's implicit-prompt layout: both hold the whole text or conversation, the "
            "prompt being their common start); give the prompt in its own field (spec.dataset.fieldMapping.prompt "
            "names it), or fix the record"
        )
    idx = n - 1  # extract_prompt's loop variable when it runs out without a difference
    for k in range(n):
        if chosen[k] != rejected[k]:
            idx = k - 1 if chosen[k - 1] == " " else k
            break
    if not chosen[:idx] and isinstance(chosen, list):
        raise ConfigError(
            f"spec.dataset: {where} has no prompt field, and its {names[0]!r} and {names[1]!r} share only their last "
            "turn, which leaves no prompt turn before the completions; give the prompt in its own field "
            "(spec.dataset.fieldMapping.prompt names it), or fix the record"
        )
    return chosen[:idx], chosen[idx:], rejected[idx:]


def preference_record(record: dict[str, Any], mapping: FieldMapping, where: str) -> PreferenceRecord:
    """The record's prompt, chosen and rejected, checked; every error names `where` (`data.jsonl
    line 5`) and says what to fix. Without a prompt field (the default `prompt`) the prompt is
    `implicit_prompt`; a prompt field that fieldMapping names must be there."""
    names = field_names(mapping)
    if names[0] not in record and not mapping.prompt and names[1] in record and names[2] in record:
        return _implicit(record, names[1:], where)
    missing = [n for n in (names[1], names[2], names[0]) if n not in record]  # a prompt may be implicit
    if missing:
        raise ConfigError(
            f"spec.dataset: {where} has no field {missing[0]!r} (it has {sorted(record)}): format preference reads "
            f"the prompt from {names[0]!r}, the chosen completion from {names[1]!r} and the rejected one from "
            f"{names[2]!r}; rename them with spec.dataset.fieldMapping (prompt: [<field>], chosen, rejected)"
        )
    values = [record[n] for n in names]
    kinds = [_kind(v) for v in values]
    _check_kinds(names, values, kinds, where)
    if kinds[1] == kinds[2] != kinds[0]:  # TRL's maybe_extract_prompt: the prompt is also inside both
        return _implicit(record, names[1:], where)
    if len(set(kinds)) > 1:
        said = ", ".join(f"{n} is {'a string' if k == 'text' else 'a list of turns'}" for n, k in zip(names, kinds, strict=True))
        raise ConfigError(
            f"spec.dataset: {where}: {said}; prompt, chosen and rejected must all be strings or all lists of turns "
            "(TRL's standard or conversational preference format)"
        )
    if kinds[0] == "text":
        return PreferenceRecord(values[0], values[1], values[2])
    prompt, chosen, rejected = (_turns(v, n, where) for v, n in zip(values, names, strict=True))
    return PreferenceRecord(prompt, chosen, rejected)


def _check_kinds(names: Sequence[str], values: Sequence[Any], kinds: Sequence[str | None], where: str) -> None:
    for name, value, kind in zip(names, values, kinds, strict=True):
        if kind is None:
            raise ConfigError(
                f"spec.dataset: {where}: field {name!r} is a {type(value).__name__}; it must be a string or a list of "
                f"turns ({TURN_HINT})"
            )


def _implicit(record: dict[str, Any], names: tuple[str, str], where: str) -> PreferenceRecord:
    """A record whose prompt is the shared start of its chosen and rejected (module docstring)."""
    values = [record[n] for n in names]
    kinds = [_kind(v) for v in values]
    _check_kinds(names, values, kinds, where)
    if kinds[0] != kinds[1]:
        said = ", ".join(f"{n} is {'a string' if k == 'text' else 'a list of turns'}" for n, k in zip(names, kinds, strict=True))
        raise ConfigError(
            f"spec.dataset: {where}: {said}; chosen and rejected must both be strings or both lists of turns "
            "(TRL's standard or conversational preference format)"
        )
    if kinds[0] == "turns":
        values = [_turns(v, n, where) for v, n in zip(values, names, strict=True)]
    prompt, chosen, rejected = implicit_prompt(values[0], values[1], names, where)
    return PreferenceRecord(prompt, chosen, rejected)


def common_prefix_length(ids: Sequence[int], other: Sequence[int]) -> int:
    """Leading tokens `ids` and `other` share (TRL's `trl/data_utils.py::common_prefix_length`)."""
    n = 0
    for a, b in zip(ids, other, strict=False):
        if a != b:
            break
        n += 1
    return n


class PreferenceEncoder:
    """Tokenizes checked records as TRL's DPOTrainer does (see the module docstring)."""

    def __init__(self, tokenizer: Any, spec: DatasetSpec) -> None:
        self.tokenizer = tokenizer
        self.spec = spec
        self._template: jinja2.Template | None = None

    def _compiled(self) -> jinja2.Template:
        """The chat template, resolved only when a record is made of turns (plain-text data needs
        no template, and the tokenizer may have none)."""
        if self._template is None:
            self._template = compile_template(resolve_template(self.spec, self.tokenizer))
        return self._template

    def render(self, turns: Sequence[dict[str, str]], add_generation_prompt: bool, where: str) -> str:
        """`apply_chat_template(turns, tokenize=False, add_generation_prompt=...)`'s text: the
        tokenizer's special tokens are the template's variables, as transformers passes them."""
        variables = dict(getattr(self.tokenizer, "special_tokens_map", {}) or {})
        try:
            return self._compiled().render(variables, messages=list(turns), add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as exc:
            raise ConfigError(
                f"spec.dataset.chatTemplate: {where}: the chat template refused it: {type(exc).__name__}: {exc}; "
                f"fix the record or use a template that accepts it (e.g. a built-in: {', '.join(BUILTIN_TEMPLATES)})"
            ) from exc

    def _eos(self) -> str:
        eos = getattr(self.tokenizer, "eos_token", None)
        if not isinstance(eos, str) or not eos:
            raise ConfigError(
                "spec.model: the tokenizer has no eos token, which ends every plain-text completion of format "
                "preference (as in TRL's DPOTrainer): use a tokenizer with an eos_token"
            )
        return eos

    def encode(self, records: Sequence[PreferenceRecord], where: Sequence[str] | None = None) -> list[PreferenceExample]:
        """One PreferenceExample per record, in order (none dropped: see `keeps`)."""
        names = list(where) if where is not None else [f"record {k + 1}" for k in range(len(records))]
        plain: list[str] = []
        chat: list[str] = []
        kinds: list[bool] = []
        for record, name in zip(records, names, strict=True):
            kinds.append(record.conversational)
            if record.conversational:
                assert isinstance(record.prompt, list) and isinstance(record.chosen, list) and isinstance(record.rejected, list)
                chat += [
                    self.render(record.prompt, True, name),
                    self.render(record.prompt + record.chosen, False, name),
                    self.render(record.prompt + record.rejected, False, name),
                ]
            else:
                assert isinstance(record.prompt, str) and isinstance(record.chosen, str) and isinstance(record.rejected, str)
                eos = self._eos()
                chosen = record.chosen if record.chosen.endswith(eos) else record.chosen + eos
                rejected = record.rejected if record.rejected.endswith(eos) else record.rejected + eos
                plain += [record.prompt, record.prompt + chosen, record.prompt + rejected]
        plain_ids: list[list[int]] = self.tokenizer(plain)["input_ids"] if plain else []
        chat_ids: list[list[int]] = self.tokenizer(chat, add_special_tokens=False)["input_ids"] if chat else []
        out: list[PreferenceExample] = []
        p = c = 0
        for conversational in kinds:
            if conversational:
                prompt, with_chosen, with_rejected = chat_ids[c:c + 3]
                c += 3
            else:
                prompt, with_chosen, with_rejected = plain_ids[p:p + 3]
                p += 3
            n = min(common_prefix_length(prompt, with_chosen), common_prefix_length(prompt, with_rejected))
            out.append(PreferenceExample(list(prompt[:n]), list(with_chosen[n:]), list(with_rejected[n:])))
        return out


def keeps(example: PreferenceExample, max_length: int | None) -> bool:
    """Whether TRL keeps the example: with `keep_start` truncation (TRL's default and only
    supported mode) an example whose prompt alone fills `max_length` is dropped, as no completion
    token would survive truncation (`DPOTrainer._prepare_dataset`)."""
    return max_length is None or len(example.prompt_ids) < max_length


def encode_records(
    tokenizer: Any, spec: DatasetSpec, numbered: Sequence[tuple[str, dict[str, Any]]],
) -> list[PreferenceExample]:
    """(where, record) pairs -> the examples TRL would train on at `spec.max_seq_length` (those
    whose prompt fills it dropped)."""
    records = [preference_record(record, spec.field_mapping, where) for where, record in numbered]
    examples = PreferenceEncoder(tokenizer, spec).encode(records, [where for where, _ in numbered])
    return [e for e in examples if keeps(e, spec.max_seq_length)]
