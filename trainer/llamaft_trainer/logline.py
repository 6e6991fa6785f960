"""The trainer's structured log line: one JSON object per line on stdout, written whole.

A record goes out in a single write: `print(text, flush=True)` writes the text and then the
newline as two writes, and wherever stdout and stderr share one file (a container runtime's log
file, `kubectl logs` of a merged stream, the test cluster's pod logs) torchrun's agent writing a
warning to stderr between the two turns the record into an unparseable line. Kept free of torch
so the modules that log without it (kubeflow_progress) import nothing heavy.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from typing import Any


def log_json(event: str, **fields: Any) -> None:
    """One structured log line on stdout (only the caller decides which ranks log)."""
    record = {"ts": datetime.now(UTC).isoformat(timespec="milliseconds"), "event": event, **fields}
    write_line(json.dumps(record, default=str))


def write_line(text: str) -> None:
    """`text` and its newline to stdout in one write, flushed."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
