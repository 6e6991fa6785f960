"""The CEL parser built once per machine (llamaft.api.cel_parser): cel-python's own parser, from a
cache file that a second build reads instead of analysing the grammar again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lark
import pytest
from celpy import celparser
from llamaft.api import cel_parser
from llamaft.api.crd import spec_schema


def rules(schema: Any) -> Iterator[str]:
    if isinstance(schema, dict):
        for rule in schema.get("x-kubernetes-validations") or []:
            yield rule["rule"]
        for value in schema.values():
            yield from rules(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from rules(item)


@pytest.fixture
def celpys_own() -> Iterator[lark.Lark]:
    """The parser cel-python builds itself (its shared parser put back afterwards)."""
    before = celparser.CELParser.CEL_PARSER
    celparser.CELParser.CEL_PARSER = None
    try:
        celparser.CELParser()
        built = celparser.CELParser.CEL_PARSER
        assert built is not None
        yield built
    finally:
        celparser.CELParser.CEL_PARSER = before


def test_the_options_are_cel_pythons_own(celpys_own: lark.Lark, tmp_path: Path) -> None:
    ours = cel_parser.build(tmp_path)
    theirs_options = {k: v for k, v in celpys_own.options.options.items() if k != "cache"}
    our_options = {k: v for k, v in ours.options.options.items() if k != "cache"}
    assert our_options == theirs_options
    assert ours.options.cache == str(cel_parser.cache_file(tmp_path))


def test_every_crd_rule_parses_as_cel_python_parses_it(celpys_own: lark.Lark, tmp_path: Path) -> None:
    cel_parser.build(tmp_path)  # writes the cache
    cached = cel_parser.build(tmp_path)  # reads it
    found = sorted(set(rules(spec_schema())))
    assert len(found) > 20
    for rule in found:
        assert cached.parse(rule) == celpys_own.parse(rule), rule


def test_a_second_build_reads_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cel_parser.build(tmp_path)
    [written] = tmp_path.glob("cel-parser-*.lark")
    assert written == cel_parser.cache_file(tmp_path) and written.stat().st_size > 0

    def analysed(*_: Any) -> None:
        raise AssertionError("the grammar was analysed again")

    monkeypatch.setattr(lark.Lark, "_build_parser", analysed)
    assert cel_parser.build(tmp_path).parse("self.a > 0") is not None


def test_without_a_writable_folder_the_parser_is_built_in_memory(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    parser = cel_parser.build(blocked / "cache")
    assert parser.parse("self.a > 0") is not None and not parser.options.cache


def test_a_folder_it_cannot_lock_is_read_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder this process cannot write (a read-only image layer; here the lock's name taken
    by a folder, which even root cannot open for appending): its file is read, or, without
    one, the parser is built in memory."""
    empty = tmp_path / "empty"
    (empty / ".cel-parser.lock").mkdir(parents=True)
    parser = cel_parser.build(empty)
    assert parser.parse("self.a > 0") is not None and not parser.options.cache
    assert list(empty.glob("cel-parser-*")) == []
    built = tmp_path / "built"
    cel_parser.build(built)
    (built / ".cel-parser.lock").unlink()
    (built / ".cel-parser.lock").mkdir()

    def analysed(*_: Any) -> None:
        raise AssertionError("the grammar was analysed again")

    monkeypatch.setattr(lark.Lark, "_build_parser", analysed)
    assert cel_parser.build(built).parse("self.a > 0") is not None
