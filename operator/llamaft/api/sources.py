"""Where a `source` string points, decided once for the operator (which volumes to mount) and the
trainer (what to read). Forms: hub id, `pvc://<claim>/<path>`, local path, fsspec URI."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

PVC_MOUNT_ROOT = "/mnt/pvc"
"""Each claim named by a `pvc://` source is mounted read-only at PVC_MOUNT_ROOT/<claim>."""
CACHE_MOUNT = "/var/cache/llamaft"
"""The download cache on every worker: spec.cache.volumeClaim, or an emptyDir."""


class SourceKind(StrEnum):
    HUB = "hub"
    PVC = "pvc"
    LOCAL = "local"
    URI = "uri"


@dataclass(frozen=True)
class Source:
    kind: SourceKind
    location: str
    """Hub id, local path (PVC sources: the path where the claim is mounted), or the URI."""
    claim: str | None = None


def parse_source(text: str) -> Source:
    """Classify a source string. A bare `org/name` (one slash, no leading . or /) is a hub id."""
    if text.startswith("pvc://"):
        rest = text[len("pvc://"):]
        claim, _, path = rest.partition("/")
        if not claim:
            raise ValueError(f"{text!r}: pvc:// sources look like pvc://<claim>/<path>")
        return Source(SourceKind.PVC, f"{PVC_MOUNT_ROOT}/{claim}/{path}".rstrip("/"), claim)
    if "://" in text:
        return Source(SourceKind.URI, text)
    if text.startswith(("/", ".", "~")) or text.count("/") != 1 or text.endswith((".json", ".jsonl")):
        return Source(SourceKind.LOCAL, text)
    return Source(SourceKind.HUB, text)
