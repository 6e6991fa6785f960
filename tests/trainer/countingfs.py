"""A local fsspec filesystem under its own protocol (`countfile://`) that logs every file fetch.

The trainer treats `countfile:///path` like any remote URI (s3://, gs://): it lists, stats and
fetches files through fsspec. Each fetch (get_file) and each read-mode open appends
"<RANK>\\t<path>" to the file named by $LLAMAFT_COUNT_LOG, so a test can tell which ranks read what
across processes. register() makes the protocol known in the calling process.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "countfile"
LOG_ENV = "LLAMAFT_COUNT_LOG"


class CountingFileSystem(LocalFileSystem):
    protocol = (PROTOCOL,)

    def _log(self, path: str) -> None:
        log = os.environ.get(LOG_ENV)
        if log:
            with open(log, "a") as f:
                f.write(f"{os.environ.get('RANK', '0')}\t{self._strip_protocol(path)}\n")

    def get_file(self, path1: Any, path2: Any, callback: Any = None, **kwargs: Any) -> Any:
        self._log(str(path1))
        return super().get_file(path1, path2, callback=callback, **kwargs)

    def _open(self, path: Any, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode:
            self._log(str(path))
        return super()._open(path, mode=mode, **kwargs)


def register() -> None:
    fsspec.register_implementation(PROTOCOL, CountingFileSystem, clobber=True)


def fetches(log: Path) -> Counter[tuple[int, str]]:
    """(rank, file name) -> how many times it was fetched."""
    counts: Counter[tuple[int, str]] = Counter()
    if log.exists():
        for line in log.read_text().splitlines():
            rank, path = line.split("\t")
            counts[(int(rank), Path(path).name)] += 1
    return counts
