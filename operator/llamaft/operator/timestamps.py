"""RFC 3339 timestamps as the Kubernetes API writes them (`2026-12-05T08:00:00Z`): the one place
the operator's pure decisions read and write them, so lifecycle and elastic agree on both."""

from __future__ import annotations

from datetime import datetime
from typing import Any


def iso(t: datetime) -> str:
    return t.isoformat(timespec="seconds").replace("+00:00", "Z")


def parse_time(text: Any) -> datetime | None:
    """None for a missing or unreadable value: a decision then treats the time as unknown."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None
