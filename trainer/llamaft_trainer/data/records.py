"""Where the records come from: JSON Lines on a path, a PVC or an fsspec URI, or a Hub dataset.

Records are read in batches and never all at once, so reading costs the same memory at 10^3 and
10^6 records. Each record comes with `where`, what a person can find: the file and its line
number (`data.jsonl line 5`; blank lines count, as in an editor) or a Hub dataset's split and row.

`fingerprint()` names the data as it is now (a file's size and modification time, a URI's remote
stamp, a Hub dataset's resolved commit): it is part of the token store's key (store.py), so a
changed source is tokenized again and an unchanged one never is.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from llamaft.api.sources import SourceKind, parse_source
from llamaft.api.spec import DatasetSpec

from llamaft_trainer.process.errors import ConfigError

Numbered = tuple[str, dict[str, Any]]
"""(where, record)."""

BATCH = 1024
"""Records per batch: big enough for the fast tokenizer's batch call, small enough to stay cheap."""


@dataclass(frozen=True)
class RecordSource:
    """One dataset source, read in file order."""

    spec: DatasetSpec

    @property
    def kind(self) -> SourceKind:
        return parse_source(self.spec.source).kind

    @property
    def location(self) -> str:
        return parse_source(self.spec.source).location

    # ------------------------------------------------------------------------------ identity
    @cached_property
    def hub_commit(self) -> str:
        """A Hub dataset's commit at spec.dataset.revision, resolved once: the fingerprint and
        every read use it, so a branch that moves meanwhile cannot mix two commits."""
        from llamaft_trainer.sources import hub

        return hub.resolved_commit(self.location, "dataset", self.spec.revision, "spec.dataset.source")

    def fingerprint(self) -> str:
        """What the data is now; another value means other data (the store's key)."""
        try:
            if self.kind is SourceKind.HUB:
                return f"hub:{self.location}@{self.hub_commit}"
            if self.kind is SourceKind.URI:
                import fsspec

                fs, path = fsspec.core.url_to_fs(self.location)
                info = fs.info(path)
                from llamaft_trainer.sources.downloads import IDENTITY_KEYS

                stamp = {k: str(info[k]) for k in IDENTITY_KEYS if info.get(k) is not None}
                return f"uri:{self.location}:{json.dumps(stamp, sort_keys=True)}"
            path = Path(self.location).expanduser().resolve()
            stat = path.stat()
            return f"file:{path}:{stat.st_size}:{stat.st_mtime_ns}"
        except ConfigError:
            raise
        except Exception as exc:
            raise self._unreadable(exc) from exc

    # ------------------------------------------------------------------------------- reading
    def count(self) -> int:
        """How many records there are (JSON Lines: non-blank lines, not parsed: the split needs
        the number before the records are read)."""
        try:
            if self.kind is SourceKind.HUB:
                from llamaft_trainer.sources import hub

                return len(hub.load_dataset(self.location, split=self.spec.split, revision=self.hub_commit,
                                            streaming=False, what="spec.dataset.source"))
            if self.kind is SourceKind.URI:
                import fsspec

                with fsspec.open(self.location, "rb") as f:
                    return sum(1 for line in f if line.strip())
            with Path(self.location).expanduser().open("rb") as f:
                return sum(1 for line in f if line.strip())
        except ConfigError:
            raise
        except Exception as exc:
            raise self._unreadable(exc) from exc

    def batches(self, size: int = BATCH, start: int = 0) -> Iterator[list[Numbered]]:
        """Every record from the `start`-th on (0-based, blank lines not counted), in file order,
        `size` at a time. An empty source is a ConfigError."""
        for _, batch in self.some_batches(size, start):
            assert batch is not None
            yield batch

    def some_batches(
        self, size: int = BATCH, start: int = 0, keep: Callable[[int], bool] | None = None,
    ) -> Iterator[tuple[int, list[Numbered] | None]]:
        """(records in the batch, the batch) for batch 0, 1, ... from the `start`-th record; a
        batch whose number `keep` refuses comes as (count, None), its records read but not
        parsed (a builder's share of a store: the other builders parse those)."""
        seen = False
        try:
            for count, batch in self._batches(size, start, keep):
                seen = True
                yield count, batch
        except ConfigError:
            raise
        except Exception as exc:
            raise self._unreadable(exc) from exc
        if not seen and start == 0:
            raise ConfigError(
                f"spec.dataset.source: {self.spec.source} holds no records (an empty file); point spec.dataset.source at the data"
            )

    def _batches(self, size: int, start: int, keep: Callable[[int], bool] | None) -> Iterator[tuple[int, list[Numbered] | None]]:
        if self.kind is SourceKind.HUB:
            yield from self._hub_batches(size, start, keep)
            return
        if self.kind is SourceKind.URI:
            import fsspec

            with fsspec.open(self.location, "rt", encoding="utf-8") as f:
                yield from _jsonl_batches(f, self.spec.source, size, start, keep)
            return
        with Path(self.location).expanduser().open(encoding="utf-8") as f:
            yield from _jsonl_batches(f, self.spec.source, size, start, keep)

    def _hub_batches(self, size: int, start: int, keep: Callable[[int], bool] | None) -> Iterator[tuple[int, list[Numbered] | None]]:
        from llamaft_trainer.sources import hub

        rows = hub.load_dataset(self.location, split=self.spec.split, revision=self.hub_commit,
                                streaming=self.spec.streaming, what="spec.dataset.source")
        if start:
            rows = rows.skip(start) if self.spec.streaming else rows.select(range(min(start, len(rows)), len(rows)))
        index = start
        for number, batch in enumerate(rows.iter(batch_size=size)):
            columns = list(batch)
            n = len(batch[columns[0]]) if columns else 0
            if keep is not None and not keep(number):
                yield n, None
            else:
                where = f"{self.spec.source} ({self.spec.split} row "
                yield n, [(f"{where}{index + i})", {c: batch[c][i] for c in columns}) for i in range(n)]
            index += n

    def _unreadable(self, exc: BaseException) -> ConfigError:
        return ConfigError(f"spec.dataset.source: cannot read {self.spec.source}: {type(exc).__name__}: {exc}")


def _jsonl_batches(
    lines: Any, name: str, size: int, start: int, keep: Callable[[int], bool] | None,
) -> Iterator[tuple[int, list[Numbered] | None]]:
    batch: list[Numbered] = []
    index = count = number = 0
    wanted = keep is None or keep(0)
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        index += 1
        if index <= start:
            continue  # skipped unparsed: a resumed stream seeks at the speed of reading lines
        count += 1
        if wanted:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"spec.dataset.source: {name} line {line_number} is not JSON: {exc}") from exc
            if not isinstance(record, dict):
                raise ConfigError(f"spec.dataset.source: {name} line {line_number} is not a JSON object")
            batch.append((f"{name} line {line_number}", record))
        if count == size:
            yield count, batch if wanted else None
            batch, count, number = [], 0, number + 1
            wanted = keep is None or keep(number)
    if count:
        yield count, batch if wanted else None


def read_numbered(spec: DatasetSpec) -> list[Numbered]:
    """Every (where, record) at once: for small data and tests; the trainer reads in batches."""
    return [item for batch in RecordSource(spec).batches() for item in batch]


def digest(*parts: object) -> str:
    """A short stable hash of JSON-able parts (the store's key)."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]
