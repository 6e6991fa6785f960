"""`chat` format: conversations -> token ids with loss only where `spec.dataset.trainOn` says.

A record holds a list of `{role, content}` turns. They are rendered with a Jinja chat template
(the tokenizer's own, what `apply_chat_template` uses, or `spec.dataset.chatTemplate`), and the
labels come from character spans, which works for ANY template, not only ones that mark the
assistant's text with `{% generation %}` tags (TRL's `assistant_only_loss`):

* the whole conversation is rendered once (`add_generation_prompt=False`);
* assistant turn i spans from `len(render(turns[:i], add_generation_prompt=True))` (the prompt up
  to and including the assistant header) to `len(render(turns[:i + 1]))`, so the span is the
  assistant's content and its end-of-turn token(s) (`<|eot_id|>`, or ` </s>` for Llama 2),
  never the header: the model learns to answer and to stop, not to write headers;
* every prefix render must be a prefix of the full text, else the template is not
  prefix-stable (it rewrites earlier turns as the conversation grows, e.g. templates that drop
  earlier reasoning) and spans cannot be found this way: a ConfigError says so;
* the full texts are tokenized in one batched call of the fast tokenizer with offsets and
  `add_special_tokens=False` (templates write bos themselves); a token is labelled with its own
  id when its characters overlap a trainable span, else IGNORE_INDEX. Overlap, not "lies
  inside", as transformers' `return_assistant_tokens_mask` does: with a template such as
  `assistant: {content}` BPE merges the header's space into the answer's first word
  (`ĠAnna`), and masking that token would hide every answer's first word from the loss. With
  the Llama templates (headers end in `\n\n` or a control token) no token straddles a span's
  edge, so both rules give the same labels there.

Templates are compiled once with an environment built like transformers' own
(`transformers/utils/chat_template_utils.py`: an ImmutableSandboxedEnvironment with trim_blocks
and lstrip_blocks, `raise_exception`, `strftime_now`, its `tojson`, the tokenizer's special
tokens as variables), because calling `apply_chat_template` once per prefix is several times
slower; a test checks the two render alike.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from operator import itemgetter
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from llamaft.api.spec import BUILTIN_CHAT_TEMPLATES, DatasetSpec, TrainOn

from llamaft_trainer.process.errors import ConfigError

IGNORE_INDEX = -100
"""Label of a position without loss; the same value as `llamaft_trainer.data.IGNORE_INDEX` (kept
here too because data/encoding.py imports this module)."""

ROLES = ("system", "user", "assistant")

# Meta's Llama 3 Instruct template, verbatim: the `chat_template` of the tokenizer_config.json of
# meta-llama/Meta-Llama-3-8B-Instruct on the Hugging Face Hub (the same format torchtune's
# Llama3Tokenizer writes: <|start_header_id|>role<|end_header_id|>\n\n content <|eot_id|>). Llama 3.1
# Instruct writes turns the same way; its hub template also injects a dated system header and tool
# prompts, which a fine-tune on plain conversations does not want.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Llama 2 chat, verbatim: the `chat_template` of the tokenizer_config.json of
# meta-llama/Llama-2-7b-chat-hf (and -13b/-70b-chat-hf) on the Hugging Face Hub, i.e. Meta's
# `<s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {answer} </s>` from llama's
# generation.py (torchtune's Llama2ChatTemplate writes the same). It has no generation prompt:
# the prompt ends at ` [/INST]`, so an assistant span is ` {answer} </s>`.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
BUILTIN_TEMPLATES: dict[str, str] = {"llama3": LLAMA3_TEMPLATE, "llama2": LLAMA2_TEMPLATE}
assert tuple(BUILTIN_TEMPLATES) == BUILTIN_CHAT_TEMPLATES, "the API's built-in names and these templates must agree"

# Strings in a template's literal text that look like control tokens: <|eot_id|>, <|im_start|>,
# <s>, </s>, <start_of_turn>, [INST], [/INST], <<SYS>>, <</SYS>>. Truncation never cuts one of them
# in half, even when the tokenizer spells it with several tokens.
_CONTROL_LIKE = re.compile(r"<\|[^\s|<>]{1,64}\|>|<</?[A-Za-z_]{1,16}>>|</?[A-Za-z_]{1,32}>|\[/?[A-Z_]{1,16}\]")


def resolve_template(spec: DatasetSpec, tokenizer: Any) -> str:
    """The Jinja text to render conversations with: `spec.chat_template` (a built-in name or
    Jinja text), else the tokenizer's own `chat_template`, else a ConfigError with the fix."""
    if spec.chat_template is not None:
        if spec.chat_template in BUILTIN_TEMPLATES:
            return BUILTIN_TEMPLATES[spec.chat_template]
        if "{{" not in spec.chat_template and "{%" not in spec.chat_template:
            # A constant "template" would render every conversation to the same text: a typo'd name.
            raise ConfigError(
                f"spec.dataset.chatTemplate: {spec.chat_template!r} is neither a built-in template "
                f"({', '.join(BUILTIN_TEMPLATES)}) nor a Jinja template (it has no {{{{ }}}} or {{% %}}): "
                "name a built-in, e.g. chatTemplate: llama3, or give the template's text"
            )
        return spec.chat_template
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates (transformers' format): use the default one
        own = own.get("default")
    if isinstance(own, str) and own.strip():
        return own
    raise ConfigError(
        "spec.dataset.chatTemplate: the tokenizer of spec.model has no chat template, so format chat "
        f"cannot render the conversations: set chatTemplate to a built-in ({', '.join(BUILTIN_TEMPLATES)}; "
        "e.g. chatTemplate: llama3 for a Llama 3 model) or to a Jinja template"
    )


TURN_HINT = 'each turn is {"role": "system"|"user"|"assistant", "content": "..."}'


def checked_turns(turns: list[Any], field: str, where: str) -> list[dict[str, str]]:
    """The turns of a record's field as {role, content} strings; an error names `where`, the
    field and the turn. Used by the chat format and by preference records given as turns."""
    out: list[dict[str, str]] = []
    for number, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            raise ConfigError(f"spec.dataset: {where}: turn {number} of {field!r} is a {type(turn).__name__}, not an object ({TURN_HINT})")
        role = turn.get("role")
        if role not in ROLES:
            said = "has no role" if role is None else f"has role {role!r}"
            raise ConfigError(f"spec.dataset: {where}: turn {number} of {field!r} {said}; the roles are {', '.join(ROLES)}")
        content = turn.get("content")
        if not isinstance(content, str):
            said = "has no content" if content is None else f"has content of type {type(content).__name__}"
            raise ConfigError(f"spec.dataset: {where}: turn {number} ({role}) of {field!r} {said}; content must be a string")
        out.append({"role": role, "content": content})
    return out


def conversation(record: dict[str, Any], field: str, where: str) -> list[dict[str, str]]:
    """The record's turns as plain `{role, content}` dicts, checked; `where` names the record
    (`data.jsonl line 5`) in every error, so that a person can find and fix it."""
    hint = TURN_HINT
    if field not in record:
        raise ConfigError(
            f"spec.dataset: {where} has no field {field!r} (it has {sorted(record)}): the conversation, a list "
            f"of turns ({hint}); set spec.dataset.fieldMapping.messages to the field that holds it"
        )
    turns = record[field]
    if not isinstance(turns, list):
        raise ConfigError(f"spec.dataset: {where}: field {field!r} is a {type(turns).__name__}, not a list of turns ({hint})")
    out = checked_turns(turns, field, where)
    if not any(t["role"] == "assistant" for t in out):
        raise ConfigError(
            f"spec.dataset: {where}: the conversation in {field!r} has no assistant turn, so nothing in it carries "
            "loss; give every record at least one turn with role assistant"
        )
    return out


# ------------------------------------------------------------------------------ rendering
class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (templates written for TRL's assistant-only loss)
    renders its body unchanged: the spans here come from prefix renders, not from these tags."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' override: Jinja's own tojson escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """The template compiled as transformers compiles it (sandboxed; the same globals)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(
            f"spec.dataset.chatTemplate: the chat template is not valid Jinja (line {exc.lineno}: {exc.message}); "
            f"fix it or name a built-in ({', '.join(BUILTIN_TEMPLATES)})"
        ) from exc


def _control_pattern(template: str, tokenizer: Any) -> re.Pattern[str]:
    """The strings truncation must not cut: the tokenizer's added tokens plus every control-like
    string in the template's literal text (found even when the tokenizer does not know them)."""
    strings: set[str] = set(getattr(tokenizer, "added_tokens_encoder", {}) or {})
    strings |= {str(v) for v in (getattr(tokenizer, "special_tokens_map", {}) or {}).values() if isinstance(v, str)}
    ast = compile_template(template).environment.parse(template)
    literals = [n.data for n in ast.find_all(jinja2.nodes.TemplateData)]
    literals += [n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)]
    for text in literals:
        strings.update(_CONTROL_LIKE.findall(text))
    strings.discard("")
    # Longest first: `<|eot_id|>` must win over a shorter string it contains.
    return re.compile("|".join(re.escape(s) for s in sorted(strings, key=len, reverse=True)) or "(?!)")


_START = itemgetter(0)
_END = itemgetter(1)


class ChatEncoder:
    """Encodes validated conversations (see `conversation`) into (input_ids, labels).

    Truncation to `max_len` (decided here, so that every caller truncates alike):

    1. Whole trailing turns go first: the cut lands at the end of the last assistant turn whose
       tokens fit, provided something before it carries loss. A partly kept answer would teach
       the model to answer without ever finishing, and a dangling user turn carries no loss, so
       this keeps only complete exchanges. (With `lastAssistant` the only such cut is the end of
       the final answer itself, so a conversation too long for it is cut as in 2.)
    2. When no assistant turn ends within `max_len` tokens (the first answer alone is too long),
       the sequence is cut at `max_len` tokens and keeps a partial answer, as TRL's SFTTrainer
       and torchtune do.
    3. Either way a cut never splits a control token: when the tokenizer spells e.g.
       `<|eot_id|>` with several tokens (a tokenizer without the template's special tokens), a
       cut inside its characters moves back to the token where it starts, so no sequence ends
       in half a control token the model would then learn to write.

    A conversation whose kept part carries no loss at all (e.g. a system prompt longer than
    `max_len`) comes back with every label IGNORE_INDEX; the caller decides whether to drop it.
    """

    def __init__(self, tokenizer: Any, template: str, train_on: TrainOn, max_len: int) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError(
                "spec.model: format chat needs a fast (Rust) tokenizer, for the character offsets that place "
                "the loss; the model's tokenizer loads as a slow one (ship its tokenizer.json)"
            )
        self.tokenizer = tokenizer
        self.template = template
        self._compiled = compile_template(template)
        special = getattr(tokenizer, "special_tokens_map", {}) or {}
        # The variables apply_chat_template passes: bos_token, eos_token, unk_token, pad_token, ...
        self._variables: dict[str, Any] = {k: v for k, v in special.items() if isinstance(v, str)}
        self.train_on = train_on
        self.max_len = max_len
        self._control = _control_pattern(template, tokenizer)

    # -------------------------------------------------------------------- rendering
    def render(self, turns: Sequence[dict[str, str]], add_generation_prompt: bool = False, where: str = "") -> str:
        """The template's text for `turns` (what `apply_chat_template(..., tokenize=False)` gives)."""
        try:
            return self._compiled.render(
                self._variables, messages=list(turns), add_generation_prompt=add_generation_prompt
            )
        except jinja2.TemplateError as exc:
            raise ConfigError(
                f"spec.dataset.chatTemplate: {where or 'a conversation'}: the chat template refused it: "
                f"{type(exc).__name__}: {exc}; fix the record or use a template that accepts it"
            ) from exc

    def _spans(self, turns: Sequence[dict[str, str]], full: str, where: str, last_only: bool) -> list[tuple[int, int]]:
        """Character spans (start, end) of the assistant turns in `full`, in order."""
        indices = [i for i, t in enumerate(turns) if t["role"] == "assistant"]
        if last_only:
            indices = indices[-1:]
        spans = []
        for i in indices:
            prompt = self.render(turns[:i], True, where)
            end_text = full if i == len(turns) - 1 else self.render(turns[: i + 1], False, where)
            if not (full.startswith(prompt) and full.startswith(end_text)) or len(end_text) < len(prompt):
                raise ConfigError(
                    f"spec.dataset.chatTemplate: {where}: the chat template is not prefix-stable (rendering the "
                    f"first {i} turns gives text that the whole conversation does not start with), so the "
                    "assistant turns cannot be located for the loss; use a template that renders earlier turns "
                    f"the same whatever follows, e.g. a built-in ({', '.join(BUILTIN_TEMPLATES)})"
                )
            spans.append((len(prompt), len(end_text)))
        return spans

    # --------------------------------------------------------------------- encoding
    def encode(
        self, conversations: Sequence[list[dict[str, str]]], where: Sequence[str] | None = None
    ) -> list[tuple[list[int], list[int]]]:
        """(input_ids, labels) per conversation, each at most `max_len` long. `where` (optional,
        one per conversation) names the records in errors."""
        names = list(where) if where is not None else [f"conversation {k + 1}" for k in range(len(conversations))]
        texts: list[str] = []
        spans: list[list[tuple[int, int]]] = []
        for turns, name in zip(conversations, names, strict=True):
            full = self.render(turns, False, name)
            texts.append(full)
            if self.train_on is TrainOn.ALL:
                spans.append([(0, len(full))])
            else:
                spans.append(self._spans(turns, full, name, last_only=self.train_on is TrainOn.LAST_ASSISTANT))
        if not texts:
            return []
        batch = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        out = []
        for k, (ids, offsets) in enumerate(zip(batch["input_ids"], batch["offset_mapping"], strict=True)):
            labels = [IGNORE_INDEX] * len(ids)
            for a, b in spans[k]:
                lo = bisect_right(offsets, a, key=_END)  # the first token ending after a
                hi = bisect_left(offsets, b, key=_START)  # the tokens starting before b
                if hi > lo:
                    labels[lo:hi] = ids[lo:hi]
            if len(ids) > self.max_len:
                n = self._cut(conversations[k], texts[k], offsets, labels, spans[k], names[k])
                ids, labels = ids[:n], labels[:n]
            out.append((list(ids), labels))
        return out

    def _cut(
        self, turns: Sequence[dict[str, str]], text: str, offsets: Sequence[tuple[int, int]], labels: list[int],
        spans: list[tuple[int, int]], where: str,
    ) -> int:
        """How many tokens to keep of a conversation longer than max_len (see the class docstring)."""
        ends = spans if self.train_on is TrainOn.ASSISTANT else self._spans(turns, text, where, last_only=False)
        first_label = next((t for t, label in enumerate(labels) if label != IGNORE_INDEX), None)
        n = self.max_len
        for _, end in reversed(ends):
            fits = bisect_right(offsets, end, key=_END)
            if fits <= self.max_len:
                if first_label is not None and fits > first_label:
                    n = fits
                break
        # Never end inside a control token: move back to the token where it starts, until stable.
        controls = [m.span() for m in self._control.finditer(text)]
        starts = [a for a, _ in controls]
        while n > 0:
            c = offsets[n - 1][1]
            j = bisect_left(starts, c) - 1  # the last control starting before c
            if j < 0 or not (starts[j] < c < controls[j][1]):
                break
            n = bisect_right(offsets, starts[j], key=_END)
        return n
