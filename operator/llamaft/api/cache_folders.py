"""Where this machine's user keeps llamaft's and Hugging Face's caches outside a pod: one answer
for the local run's download caches (llamaft.launch.local_cache) and the CEL parser's file
(cel_parser)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def user_cache_root(environ: Mapping[str, str]) -> Path:
    """$XDG_CACHE_HOME, else ~/.cache."""
    if environ.get("XDG_CACHE_HOME"):
        return Path(environ["XDG_CACHE_HOME"])
    return Path(environ.get("HOME") or Path.home()) / ".cache"


def llamaft_cache(environ: Mapping[str, str]) -> Path:
    """$LLAMAFT_CACHE, else llamaft/ in the user's cache root."""
    return Path(environ["LLAMAFT_CACHE"]) if environ.get("LLAMAFT_CACHE") else user_cache_root(environ) / "llamaft"
