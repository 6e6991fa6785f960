"""The trainer's Hugging Face Hub client: fetch a model or dataset repo by id, and say in the spec's
terms why a fetch cannot work.

Files come through huggingface_hub's own cache (HF_HUB_CACHE, which the operator points at storage
shared by the nodes of a run). Its per-file locks and content-addressed blobs make a file fetched
once per cache however many ranks, nodes or restarts ask for it at the same time; this module adds
no cache of its own on purpose, so that the layout stays the one every Hugging Face tool reads.

Errors split in two: a permanent one (no such repo, revision or file; a gated or private repo the
token cannot read) becomes a ConfigError naming the spec field to fix, so the run fails once
instead of restarting into the same answer; a transient one (connection refused, timeout, 5xx,
429) is left as it is for the retry policy (torchrun restarts, the operator's backoff).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote

from llamaft_trainer.process.errors import ConfigError

TOKEN_FIELD = "spec.model.hfTokenSecret"
"""The one token field: the operator puts that Secret's value into HF_TOKEN for models and datasets."""
RepoType = Literal["model", "dataset"]
_RESOLVE_FILE = re.compile(r"/resolve/[^/]+/(?P<file>[^?#]+)")


def hub_token() -> str | None:
    """The Hub token, from HF_TOKEN (filled by the operator from spec.model.hfTokenSecret); None
    when unset or empty, so that anonymous access is tried rather than an empty bearer token."""
    return os.environ.get("HF_TOKEN") or None


def revision_field(what: str) -> str:
    """The spec field that pins the revision of the source named by `what`."""
    return "spec.dataset.revision" if what.startswith("spec.dataset") else "spec.model.revision"


def snapshot(
    repo_id: str,
    *,
    repo_type: RepoType,
    revision: str | None,
    what: str,
    allow_patterns: list[str] | None = None,
    ignore_patterns: list[str] | None = None,
    cache_dir: str | Path | None = None,
) -> Path:
    """The local folder holding `repo_id` at `revision` (None: main), fetched into the HF cache.

    Only the files `allow_patterns` / `ignore_patterns` select are fetched (e.g. no weights for a
    tokenizer). cache_dir None is huggingface_hub's default (HF_HUB_CACHE), the cache shared by a
    run's nodes; files already there are not fetched again, and concurrent fetchers of a file wait
    on its lock and reuse it. `what` is the spec field that named the repo (spec.model.source,
    spec.model.tokenizer, spec.dataset.source): a permanent failure raises ConfigError naming it;
    a transient one propagates unchanged.
    """
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            repo_id, repo_type=repo_type, revision=revision, allow_patterns=allow_patterns,
            ignore_patterns=ignore_patterns, cache_dir=str(cache_dir) if cache_dir is not None else None,
            token=hub_token(),
        )
    except Exception as exc:
        config_error = hub_error(exc, what=what, source=repo_id, revision=revision)
        if config_error is None:
            raise
        raise config_error from exc
    return Path(folder)


def _repo_info(repo_id: str, repo_type: RepoType, revision: str | None, what: str) -> Any:
    from huggingface_hub import HfApi

    try:
        return HfApi().repo_info(repo_id, repo_type=repo_type, revision=revision, token=hub_token())
    except Exception as exc:
        config_error = hub_error(exc, what=what, source=repo_id, revision=revision)
        if config_error is None:
            raise
        raise config_error from exc


def resolved_commit(repo_id: str, repo_type: RepoType, revision: str | None, what: str) -> str:
    """The commit sha `revision` (a branch, tag or sha; None: main) names now, from the Hub's repo
    info: what a fetch of that revision reads, so a moving branch gives another value (a cache key
    that changes with the data). Permanent failures raise ConfigError naming `what`."""
    info = _repo_info(repo_id, repo_type, revision, what)
    if not info.sha:
        raise RuntimeError(f"the Hugging Face Hub named no commit for {repo_type} {repo_id} at {revision or 'main'}")
    return str(info.sha)


def repo_files(repo_id: str, repo_type: RepoType, revision: str | None, what: str) -> set[str]:
    """The file names of the repo at `revision` (the repo info's siblings): what a loader may
    fetch, known without probing for files that are not there."""
    info = _repo_info(repo_id, repo_type, revision, what)
    return {s.rfilename for s in info.siblings or []}


def load_dataset(repo_id: str, *, split: str, revision: str | None, streaming: bool, what: str) -> Any:
    """`datasets.load_dataset(repo_id, split=...)` (a Dataset, or an IterableDataset when
    streaming) at the commit `revision` names now.

    The revision is resolved first (resolved_commit) and the load pinned to that sha: the Hub's
    errors reach us whole there (datasets re-raises them as DatasetNotFoundError `from None`, which
    loses the cause), and every file read comes from one commit even if the branch moves meanwhile;
    a pinned load also skips the datasets-server lookup that loads of `main` make. The raw files go
    through huggingface_hub's cache (HF_HUB_CACHE), the Arrow tables into HF_DATASETS_CACHE.
    """
    import datasets

    sha = resolved_commit(repo_id, "dataset", revision, what)
    try:
        return datasets.load_dataset(repo_id, split=split, revision=sha, streaming=streaming, token=hub_token())
    except Exception as exc:
        config_error = hub_error(exc, what=what, source=repo_id, revision=revision)
        if config_error is not None:
            raise config_error from exc
        from datasets.data_files import EmptyDatasetError
        from datasets.exceptions import DataFilesNotFoundError, DatasetNotFoundError

        if isinstance(exc, (DataFilesNotFoundError, EmptyDatasetError, DatasetNotFoundError)):
            raise ConfigError(
                f"{what}: {repo_id} (commit {sha}) holds no data files datasets can read (JSON Lines, "
                f"Parquet, CSV, Arrow): {exc}"
            ) from exc
        if isinstance(exc, ValueError) and "split" in str(exc).lower():
            raise ConfigError(f"spec.dataset.split: {repo_id} has no split {split!r}: {exc}") from exc
        raise


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """exc and what caused it: huggingface_hub wraps the HTTP error of a failed lookup in
    LocalEntryNotFoundError / OSError (and transformers wraps those in OSError)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        # The cause (`raise ... from`), else the implicit context unless `from None` hid it.
        if current.__cause__ is not None:
            current = current.__cause__
        else:
            current = None if current.__suppress_context__ else current.__context__


def is_transient(exc: BaseException) -> bool:
    """True when the Hub could not be reached or answered "later" (connection refused or reset, a
    timeout, 408, 429, 5xx), anywhere in the cause chain: the retry policy's case, never a
    ConfigError, whatever the caller would otherwise make of it."""
    import httpx2  # huggingface_hub's HTTP client

    for err in _chain(exc):
        if isinstance(err, (ConnectionError, TimeoutError, httpx2.TransportError)):
            return True
        status = _status(err)
        if status is not None and (status in (408, 429) or status >= 500):
            return True
    return False


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def _missing_file(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    url = getattr(response, "url", None)
    match = _RESOLVE_FILE.search(str(url)) if url is not None else None
    return unquote(match.group("file")) if match else None


def hub_error(exc: BaseException, *, what: str, source: str, revision: str | None) -> ConfigError | None:
    """The ConfigError for a permanent Hub failure, or None for a transient one.

    Permanent (the same request would fail again): a gated, private or missing repo, a missing
    revision or file, a token the Hub refuses (401/403), any other 4xx but 408/429, an invalid repo
    id. Transient (None: re-raise `exc` for the retry policy): connection errors, timeouts, 408,
    429, 5xx, and anything that is not a Hub error at all. `exc` may be what huggingface_hub,
    transformers or datasets raised: its causes are searched too. The message names `what` (the
    spec field holding `source`), the revision field or spec.model.hfTokenSecret, never the token.
    """
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    token = hub_token() is not None
    at = f" at revision {revision!r}" if revision else ""
    for err in _chain(exc):
        status = _status(err)
        if isinstance(err, GatedRepoError):
            # 401 without a token, 403 with one that was not granted access.
            why = (f"no token was given: set {TOKEN_FIELD}" if not token else
                   f"the token in {TOKEN_FIELD} has not been granted access")
            return ConfigError(
                f"{what}: {source} is a gated repo on the Hugging Face Hub and the token is missing or lacks "
                f"access ({why}; request access at https://huggingface.co/{source} with the token's account)"
            )
        if isinstance(err, RepositoryNotFoundError):
            # The Hub answers 401 RepoNotFound to anonymous callers for a missing and a private
            # repo alike: without a token the id may be right and the token missing.
            hint = (f"for a private repo, set {TOKEN_FIELD}" if not token else
                    f"for a private repo, check that the token in {TOKEN_FIELD} can read it")
            return ConfigError(
                f"{what}: no such repo {source!r} on the Hugging Face Hub, or it is private: check {what} "
                f"or, {hint}"
            )
        if isinstance(err, RevisionNotFoundError):
            return ConfigError(
                f"{revision_field(what)}: {source} ({what}) has no revision {revision or 'main'!r}: name a "
                "branch, tag or full commit sha of that repo"
            )
        if isinstance(err, RemoteEntryNotFoundError):
            name = _missing_file(err)
            missing = f"no file {name!r}" if name else "no such file"
            return ConfigError(f"{what}: {source}{at} has {missing}: check {what} and {revision_field(what)}")
        if isinstance(err, HFValidationError):
            return ConfigError(f"{what}: {source!r} is not a Hugging Face Hub repo id (org/name): {err}")
        if isinstance(err, HfHubHTTPError) and status is not None:
            if status == 401:
                return ConfigError(
                    f"{what}: the Hugging Face Hub refused the token for {source} (401): the token in "
                    f"{TOKEN_FIELD} is missing, invalid or expired"
                )
            if status == 403:
                return ConfigError(
                    f"{what}: the token in {TOKEN_FIELD} lacks access to {source} (403): give it read access "
                    "to the repo (a fine-grained token needs the repo in its scope)"
                )
            if 400 <= status < 500 and status not in (408, 429):
                return ConfigError(f"{what}: the Hugging Face Hub rejected the request for {source}{at} ({status}): {err}")
            return None
    return None
