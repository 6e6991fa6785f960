"""The trainer's structured log line: one JSON object per line on stdout, written whole.

A record goes out in a single write: `print(text, flush=True)` writes the text and then the
newline as two writes, and wherever stdout and stderr share one file (a container runtime's log
file, `kubectl logs` of a merged stream, the test cluster's pod logs) torchrun's agent writing a
warning to stderr between the two turns the record into an unparseable line. Kept free of torch
so the modules that log without it (kubeflow_progress) import nothing heavy, and so that whatever
reads a trainer's output (`llamaft run --local`, the benches, the tests) reads it here, with the
rule the writer keeps: one record, one whole line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def log_json(event: str, **fields: Any) -> None:
    """One structured log line on stdout (only the caller decides which ranks log)."""
    record = {"ts": datetime.now(UTC).isoformat(timespec="milliseconds"), "event": event, **fields}
    write_line(json.dumps(record, default=str))


def write_line(text: str) -> None:
    """`text` and its newline to stdout in one write, flushed."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def parse_event(line: str) -> dict[str, Any] | None:
    """The record if `line` is one structured log line (a JSON object with an `event` key, from the
    line's first character; the newline and trailing blanks aside), else None. Anything else on the
    stream (torchrun's warnings, tracebacks, progress bars, a line cut off by a kill, two writers'
    text glued together) is not an event: skipped, never an error."""
    if not line.startswith("{"):
        return None
    try:
        record: object = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and "event" in record else None


def read_events(source: str | Path | Iterable[str], event: str | None = None) -> list[dict[str, Any]]:
    """Every structured record of `source`, in order: a text (a str is the text itself, never a
    file name), a log file (undecodable bytes replaced) or lines. `event`: only the records of
    that kind."""
    if isinstance(source, Path):
        lines: Iterable[str] = source.read_text(encoding="utf-8", errors="replace").splitlines()
    elif isinstance(source, str):
        lines = source.splitlines()
    else:
        lines = source
    records = (parse_event(line) for line in lines)
    return [r for r in records if r is not None and (event is None or r["event"] == event)]
