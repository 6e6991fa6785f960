"""Reading LlamaFineTune YAML files safely: bounded in size, depth and alias expansion, any
encoding kubectl reads, every document located by line, never an exception other than SpecInvalid.

Limits, as kubectl and the API server have them:
- a file of at most MAX_FILE_BYTES (the API server's request limit is 3 MiB);
- UTF-8, or UTF-16 with a byte-order mark (kubectl reads both); anything else is refused with the
  line of the first bad byte;
- nesting at most MAX_DEPTH levels (kubectl's YAML decoder stops at 10,000): the file is read no
  further than the first level past it, so 100,000 nested lists are refused as fast as 10,001;
- each document, with its YAML aliases expanded, at most MAX_OBJECT_BYTES of JSON (etcd stores at
  most 1.5 MiB per object): a "billion laughs" document is refused as soon as it passes the limit,
  without expanding it;
- duplicate keys are errors (kubectl's strict decoding), timestamps stay strings (kubectl's YAML
  reader keeps them as written), tags other than YAML's core types are refused.

The documents are built from the parser's events without recursion, so thousands of levels cost
no Python stack.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from yaml import events as ev
from yaml.scanner import ScannerError

from llamaft.api import resource
from llamaft.api.validation import MAX_DEPTH, FieldError, SpecInvalid, short

MAX_FILE_BYTES = 3 * 1024 * 1024
"""Largest file read (the API server's request limit)."""
MAX_OBJECT_BYTES = 1536 * 1024
"""Largest document, as JSON with aliases expanded (etcd's default request limit)."""

_CORE = "tag:yaml.org,2002:"
_SCALAR_TAGS = {f"{_CORE}{t}" for t in ("null", "bool", "int", "float", "str", "binary", "timestamp")}
_MAP_TAGS = {None, "!", f"{_CORE}map"}
_SEQ_TAGS = {None, "!", f"{_CORE}seq"}


class _PyLoader(yaml.SafeLoader):
    """Pure-Python parser: no nesting limit of its own (libyaml stops at 1000 levels), in linear time.

    PyYAML's scanner keeps one possible simple key per open flow level and, for every token,
    walks all of them twice (`stale_possible_simple_keys`, `next_possible_simple_key`): with
    thousands of `[` or `{` on a line, up to 1024 keys are alive (a key is stale 1024 characters
    on), so 10,000 levels took 30 s and 100,000 minutes. The keys are kept in a dict whose order
    is their flow level's (a key is saved at the innermost open level, and a level's key is removed
    when the level closes), which is also the order of their token numbers and positions. So the
    nearest key is the first one, and the stale keys are a prefix: same answers, same errors, from
    the front of the dict only (a differential test checks the events against PyYAML's own).
    """

    def next_possible_simple_key(self) -> int | None:
        for key in self.possible_simple_keys.values():
            return int(key.token_number)
        return None

    def stale_possible_simple_keys(self) -> None:
        keys = self.possible_simple_keys
        while keys:
            level = next(iter(keys))
            key = keys[level]
            if key.line == self.line and self.index - key.index <= 1024:
                return
            if key.required:
                raise ScannerError("while scanning a simple key", key.mark, "could not find expected ':'",
                                   self.get_mark())
            del keys[level]


_CLoader: type | None = getattr(yaml, "CSafeLoader", None) if getattr(yaml, "__with_libyaml__", False) else None

# Plain (unquoted, untagged) scalars are resolved as kubectl's YAML reader (go-yaml v2, through
# sigs.k8s.io/yaml) resolves them, not as PyYAML does: `2e-5` and `1e30` are numbers (PyYAML: strings),
# `y`/`n` are booleans, `0o17` is octal, `1:30` is a string (PyYAML: 90), timestamps stay strings.
_GO_TRUE = {"y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"}
_GO_FALSE = {"n", "N", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"}
_GO_NULL = {"", "~", "null", "Null", "NULL"}
_GO_SPECIAL = {**{s: math.nan for s in (".nan", ".NaN", ".NAN")},
               **{s: math.inf for s in (".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF")},
               **{s: -math.inf for s in ("-.inf", "-.Inf", "-.INF")}}
_GO_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_GO_INT = re.compile(r"[-+]?(0[xX][0-9a-fA-F]+|0[oO]?[0-7]*|0[bB][01]+|[1-9][0-9]*)")


def _go_int(text: str) -> int | None:
    """strconv.ParseInt(text, 0, 64), then ParseUint(text, 0, 64), as go-yaml tries them."""
    if not _GO_INT.fullmatch(text):
        return None
    sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
    lower = digits.lower()
    if lower.startswith("0x"):
        value = int(digits[2:], 16)
    elif lower.startswith("0b"):
        value = int(digits[2:], 2)
    elif lower.startswith("0o"):
        value = int(digits[2:], 8) if len(digits) > 2 else -1
    elif digits.startswith("0") and len(digits) > 1:
        value = int(digits[1:], 8)
    else:
        value = int(digits)
    if value < 0:
        return None
    value *= sign
    if -(2**63) <= value < 2**63 or (sign > 0 and text[0] != "+" and value < 2**64):
        return value
    return None


def resolve_plain(text: str) -> Any:
    """The value of a plain scalar as go-yaml v2 (kubectl) reads it, or MERGE for `<<`."""
    if text in _GO_NULL:
        return None
    if text in _GO_TRUE:
        return True
    if text in _GO_FALSE:
        return False
    if text in _GO_SPECIAL:
        return _GO_SPECIAL[text]
    if text == "<<":
        return MERGE
    if text[0] == ".":
        try:
            value = float(text)
        except ValueError:
            return text
        return value if math.isfinite(value) and "_" not in text else text
    if text[0] in "+-0123456789":
        plain = text.replace("_", "")
        number = _go_int(plain)
        if number is not None:
            return number
        if _GO_FLOAT.fullmatch(plain):
            value = float(plain)
            if math.isfinite(value):
                return value
        if plain.startswith(("0b", "-0b")):
            try:
                return int(plain.replace("0b", "", 1), 2)
            except ValueError:
                return text
    return text


class _Merge:
    def __repr__(self) -> str:
        return "<<"


MERGE = _Merge()


@dataclass
class Document:
    """One YAML document of a file, with where it came from (body is None when `error` says why)."""

    source: str
    index: int
    body: Any
    line: int = 1
    errors: list[FieldError] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.source if self.index == 0 else f"{self.source}#{self.index}"


class _DocumentTooBig(Exception):
    pass


class _BadDocument(Exception):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line, self.message = line, message


class _TooDeep(_BadDocument):
    """Nested past MAX_DEPTH: the rest of the file is not read (only the parser could skip the
    document's remaining levels, at its pace: 100,000 levels would take seconds, for a file
    that kubectl and the API server refuse whole)."""


def _json_size(value: Any) -> int:
    """About how many bytes `value` takes as JSON (strings may be escaped longer; close enough)."""
    if isinstance(value, str):
        return len(value) + 2
    if isinstance(value, bytes):
        return len(value) + 2
    return len(repr(value))


@dataclass
class _Frame:
    container: Any
    anchor: str | None
    line: int
    size: int = 2
    attached: int = 0
    key: Any = None
    has_key: bool = False
    merges: list[Any] = field(default_factory=list)
    explicit: set[Any] = field(default_factory=set)


def _line(mark: Any) -> int:
    return int(getattr(mark, "line", 0)) + 1


def _scalar(loader: Any, event: Any) -> tuple[Any, str]:
    tag = event.tag
    if tag is None:
        if not event.style:  # plain (None from PyYAML's parser, '' from libyaml's): resolved as kubectl does
            value = resolve_plain(event.value)
            return value, (f"{_CORE}merge" if value is MERGE else "plain")
        return event.value, f"{_CORE}str"  # quoted
    if tag == "!":
        return event.value, f"{_CORE}str"
    node = yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark, event.style)
    if tag == f"{_CORE}merge":
        return event.value, tag
    if tag not in _SCALAR_TAGS:
        raise _BadDocument(_line(event.start_mark), f"unsupported YAML tag {tag!r}: use plain values")
    if tag == f"{_CORE}timestamp":
        return str(event.value), tag  # kubectl's YAML reader keeps the text
    try:
        return loader.yaml_constructors[tag](loader, node), tag
    except (yaml.YAMLError, ValueError, TypeError) as exc:
        raise _BadDocument(_line(event.start_mark), f"cannot read {short(event.value)} as {tag.rsplit(':', 1)[-1]}: {exc}") from None


def _build(loader: Any, start_line: int) -> Any:
    """The next document's value, from the loader's events (the DocumentStart is consumed)."""
    anchors: dict[str, tuple[Any, int]] = {}
    building: set[str] = set()
    stack: list[_Frame] = []
    running = 0
    result: list[Any] = []

    def attach(value: Any, size: int, line: int, tag: str | None = None, is_key_candidate: bool = True) -> None:
        nonlocal running
        running += size
        if running > MAX_OBJECT_BYTES:
            raise _DocumentTooBig()
        if not stack:
            result.append(value)
            return
        top = stack[-1]
        top.size += size + 1
        top.attached += size
        if isinstance(top.container, list):
            top.container.append(value)
            return
        if not top.has_key:
            if isinstance(value, dict | list):
                raise _BadDocument(line, "a mapping key must be a plain value, not a mapping or a list")
            top.key, top.has_key = (("<<merge>>", tag) if tag == f"{_CORE}merge" else value), True
            return
        key, top.has_key = top.key, False
        if isinstance(key, tuple) and key and key[0] == "<<merge>>":
            sources = value if isinstance(value, list) else [value]
            if not all(isinstance(s, dict) for s in sources):
                raise _BadDocument(line, "a merge key (<<) takes a mapping or a list of mappings")
            top.merges.extend(sources)
            return
        if key in top.explicit:
            raise _BadDocument(line, f"key {short(key)} appears twice in this mapping (kubectl rejects duplicate keys)")
        top.explicit.add(key)
        top.container[key] = value

    while True:
        event = loader.get_event()
        line = event.start_mark.line + 1 if event.start_mark is not None else start_line
        if isinstance(event, ev.DocumentEndEvent):
            return result[0] if result else None
        if isinstance(event, ev.AliasEvent):
            if event.anchor in building:
                raise _BadDocument(line, f"alias *{event.anchor} refers to a node that contains it (a recursive alias)")
            if event.anchor not in anchors:
                raise _BadDocument(line, f"alias *{event.anchor} has no anchor &{event.anchor} before it")
            value, size = anchors[event.anchor]
            attach(value, size, line)
        elif isinstance(event, ev.ScalarEvent):
            value, tag = _scalar(loader, event)
            size = _json_size(value)
            if event.anchor:
                anchors[event.anchor] = (value, size)
            attach(value, size, line, tag)
        elif isinstance(event, ev.MappingStartEvent | ev.SequenceStartEvent):
            is_map = isinstance(event, ev.MappingStartEvent)
            if event.tag not in (_MAP_TAGS if is_map else _SEQ_TAGS):
                raise _BadDocument(line, f"unsupported YAML tag {event.tag!r}: use plain mappings and lists")
            if len(stack) >= MAX_DEPTH:
                raise _TooDeep(line, f"nested deeper than {MAX_DEPTH} levels")
            if event.anchor:
                building.add(event.anchor)
            stack.append(_Frame({} if is_map else [], event.anchor, line))
        elif isinstance(event, ev.MappingEndEvent | ev.SequenceEndEvent):
            frame = stack.pop()
            value = frame.container
            if frame.merges:
                merged: dict[Any, Any] = {}
                for source in frame.merges:
                    for k, v in source.items():
                        merged.setdefault(k, v)
                merged.update(value)
                value = merged
            running -= frame.attached
            if frame.anchor:
                building.discard(frame.anchor)
                anchors[frame.anchor] = (value, frame.size)
            attach(value, frame.size, frame.line)
        else:
            raise _BadDocument(line, f"unexpected YAML event {type(event).__name__}")


def _skip_document(loader: Any) -> None:
    while not isinstance(loader.get_event(), ev.DocumentEndEvent):
        pass


def _decode(data: bytes, source: str) -> str:
    def fail(message: str) -> SpecInvalid:
        return SpecInvalid([FieldError(source, message)])

    if data.startswith((b"\x00\x00\xfe\xff", b"\xff\xfe\x00\x00")):
        raise fail("the file is UTF-32, which kubectl does not read: save it as UTF-8")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError as exc:
            raise fail(f"byte {exc.start}: not valid UTF-16 despite the byte-order mark: save the file as UTF-8") from None
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    if b"\x00" in data[:4096]:
        even, odd = data[0:4096:2].count(0), data[1:4096:2].count(0)
        if max(even, odd) > len(data[:4096]) // 4:
            raise fail("the file looks like UTF-16 without a byte-order mark: save it as UTF-8")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise fail(f"line {line}, column {column}: byte 0x{data[exc.start]:02x} is not valid UTF-8: save the file as "
                   "UTF-8") from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        context = f" ({exc.context})" if exc.context else ""
        return f"not valid YAML: line {mark.line + 1}, column {mark.column + 1}: {exc.problem}{context}"
    return f"not valid YAML: {short(str(exc), 300)}"


def _parse(text: str, source: str, loader_class: type) -> list[Document]:
    loader = loader_class(text)
    docs: list[Document] = []
    try:
        loader.get_event()  # StreamStart
        while not loader.check_event(ev.StreamEndEvent):
            start = loader.get_event()
            line = start.start_mark.line + 1
            # Blank documents are skipped, as kubectl skips them; the index counts the others.
            index = len(docs)
            try:
                body = _build(loader, line)
            except _DocumentTooBig:
                _skip_document(loader)
                docs.append(Document(source, index, None, line, [FieldError(
                    f"document at line {line}", f"larger than {MAX_OBJECT_BYTES // 1024} KiB as JSON once its YAML "
                    "aliases (*name) are expanded: the API server stores at most 1.5 MiB per object")]))
                continue
            except _TooDeep as deep:
                docs.append(Document(source, index, None, line, [
                    FieldError(f"line {deep.line}", deep.message),
                    FieldError(f"document at line {line}", f"kubectl and the API server refuse objects nested deeper "
                               f"than {MAX_DEPTH} levels; the rest of the file is not read")]))
                break
            except _BadDocument as bad:
                _skip_document(loader)
                docs.append(Document(source, index, None, line, [FieldError(f"line {bad.line}", bad.message)]))
                continue
            if body is not None:
                docs.append(Document(source, index, body, line))
    finally:
        loader.dispose()
    return docs


def _too_large(source: str, size: int | None) -> SpecInvalid:
    what = f"{size:,} bytes" if size is not None else f"more than {MAX_FILE_BYTES:,} bytes"
    return SpecInvalid([FieldError(source, f"{what}; at most {MAX_FILE_BYTES:,} are read (the API server's request "
                                           "limit is 3 MiB)")])


def parse_documents(data: bytes, source: str) -> list[Document]:
    """Every non-empty document of a YAML stream. File-level problems (size, encoding, syntax)
    raise SpecInvalid with one message naming the line; a document-level problem (depth, alias
    expansion, duplicate keys, tags) is reported on that document only."""
    if len(data) > MAX_FILE_BYTES:
        raise _too_large(source, None)
    text = _decode(data, source)
    try:
        if _CLoader is not None:
            try:
                return _parse(text, source, _CLoader)
            except yaml.YAMLError as exc:
                if "nesting depth" not in str(exc):
                    raise
        # libyaml stops at 1000 levels; the pure-Python parser has no limit of its own.
        return _parse(text, source, _PyLoader)
    except yaml.YAMLError as exc:
        raise SpecInvalid([FieldError(source, _yaml_problem(exc))]) from None
    except RecursionError:  # pragma: no cover - the builder does not recurse
        raise SpecInvalid([FieldError(source, "nested too deeply")]) from None


def read_documents(path: str | Path) -> list[Document]:
    """Every non-empty document of a file (`-`: standard input); SpecInvalid for file-level problems."""
    source = str(path)
    try:
        if source == "-":
            data = sys.stdin.buffer.read(MAX_FILE_BYTES + 1)
        else:
            with open(path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                if size > MAX_FILE_BYTES:
                    raise _too_large(source, size)
                data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise SpecInvalid([FieldError(source, f"cannot read: {exc.strerror or exc}")]) from None
    return parse_documents(data, source)


def iter_finetunes(path: str | Path) -> Iterator[Document]:
    """Every document of the file, whatever its kind (each must be a LlamaFineTune)."""
    yield from read_documents(path)


def load_finetune(path: str | Path) -> tuple[dict[str, Any], Any]:
    """The single LlamaFineTune of a file, validated (schema + CEL); raises SpecInvalid otherwise."""
    from llamaft.api.validation import validate_resource

    docs = read_documents(path)
    if len(docs) != 1:
        kinds = ", ".join(f"{d.label}: {d.body.get('kind') if isinstance(d.body, dict) else short(d.body)}" for d in docs)
        raise SpecInvalid([FieldError(str(path), f"expected exactly one {resource.KIND} document, found {len(docs)}"
                                                 + (f" ({kinds})" if docs else ""))])
    doc = docs[0]
    if doc.errors:
        raise SpecInvalid(doc.errors)
    return doc.body, validate_resource(doc.body)
