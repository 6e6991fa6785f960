"""cel-python's CEL parser, built once per machine instead of once per process.

cel-python builds its parser with lark from `cel.lark` the first time a `celpy.Environment` is
made, and lark's LALR analysis of that grammar is most of the cost of validating a LlamaFineTune
in a new process (about 0.3 s here, more than the validation itself): `llamaft validate`,
`llamaft run --local` before it starts torchrun, each operator start. lark can keep the analysed
parser in a file (its `cache` option, loaded back with the callbacks given again), so this module
makes cel-python's parser the way cel-python does, with that option, in the user's cache folder,
and hands it to cel-python (`CELParser.CEL_PARSER`, the class attribute cel-python documents as
its one shared parser). Where no cache folder can be written (a read-only container), the parser
is built as cel-python builds it. The file name carries the grammar's, lark's and Python's
digests, so an upgrade builds a new one; a lock beside it keeps a process from reading it
half-written. tests/api/test_cel_parser.py checks that the options
are cel-python's own.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lark
from celpy import celparser

from llamaft.api import cache_folders


def options() -> dict[str, Any]:
    """cel-python 0.5's arguments to lark.Lark (celparser.CELParser.__init__), grammar aside."""
    return {
        "parser": "lalr",
        "start": "expr",
        "debug": True,
        "g_regex_flags": re.M,
        "lexer_callbacks": {"IDENT": celparser.CELParser.ambiguous_literals},
        "propagate_positions": True,
        "maybe_placeholders": False,
        "priority": "invert",
        "tree_class": lark.Tree,
    }


def grammar() -> str:
    return (Path(celparser.__file__).parent / "cel.lark").read_text()


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """llamaft's cache folder (cache_folders.llamaft_cache), where the downloads go too."""
    return cache_folders.llamaft_cache(os.environ if environ is None else environ)


def cache_file(folder: Path) -> Path:
    key = hashlib.sha256(f"{grammar()}|{lark.__version__}|{sys.version_info[:2]}".encode()).hexdigest()[:20]
    return folder / f"cel-parser-{key}.lark"


def build(folder: Path | None = None) -> lark.Lark:
    """The parser, from the cache file when there is one (written first when there is not).
    lark reads and writes the file itself (its hash covers the grammar and options, the path
    among them); an exclusive lock beside it keeps a process from reading it half-written."""
    text = grammar()
    folder = cache_dir() if folder is None else folder
    path = cache_file(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / ".cel-parser.lock", "a")  # noqa: SIM115 (held for the build below)
    except OSError:
        # A folder this process cannot write: a file in it is complete (an image built it), else none.
        return lark.Lark(text, cache=str(path), **options()) if path.is_file() else lark.Lark(text, **options())
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return lark.Lark(text, cache=str(path), **options())  # lark ignores a file it cannot write


def install() -> None:
    """Give cel-python its parser (once per process; a parser it already has is kept)."""
    if celparser.CELParser.CEL_PARSER is None:
        celparser.CELParser.CEL_PARSER = build()
