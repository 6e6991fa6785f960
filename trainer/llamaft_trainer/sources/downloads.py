"""Where a model's or dataset's files come from: Hub ids stay ids (huggingface_hub's own cache,
hub.py), local paths stay paths, and fsspec URIs (s3://, gs://, ...) are fetched file by file into
a node-local cache, and only where read: the small files (config, tokenizer, safetensors index) by
every rank that needs them, a weight file only by a rank that reads tensors from it (`fetch_file`).
Each cached file carries a stamp of the remote file's size, mtime and etag (whatever the filesystem
reports), and the cache folder is keyed by URI and revision, so a changed source is fetched again
instead of reused. Ranks of one node share the cache; a per-file lock makes the first fetch and the
others wait and reuse.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llamaft.api.sources import SourceKind, parse_source

from llamaft_trainer.process.errors import ConfigError
from llamaft_trainer.process.runtime import Runtime
from llamaft_trainer.report.metrics import log_json

CACHE_ROOT = Path(os.environ.get("LLAMAFT_CACHE", "/tmp/llamaft-cache"))
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
"""Files that hold weights (large): fetched only by the ranks that read them. Everything else
(config, tokenizer, `*.index.json`) is small and fetched wherever it is needed."""
IDENTITY_KEYS = (
    "size", "mtime", "ETag", "etag", "LastModified", "last_modified", "updated", "generation",
    "md5Hash", "crc32c", "VersionId", "version_id", "checksum",
)
"""The fields of fsspec's `info()` that change when a remote file does (local: size and mtime; S3:
ETag, LastModified, VersionId; GCS: etag, generation, md5Hash, ...): the cache stamp of a file."""


def hf_token() -> str | None:
    """HF_TOKEN (the operator sets it from spec.model.hfTokenSecret), None when unset."""
    return os.environ.get("HF_TOKEN") or None


def raise_hub_error(exc: BaseException, what: str, source: str, revision: str | None) -> None:
    """A Hub id that cannot be read for good (gated, missing repo, revision or file): the Hub's
    answer in the spec's terms (hub.hub_error); a transient failure is re-raised as it is, for the
    retry policy."""
    if parse_source(source).kind is not SourceKind.HUB:
        return
    from llamaft_trainer.sources import hub

    error = hub.hub_error(exc, what=what, source=source, revision=revision)
    if error is not None:
        raise error from exc
    if hub.is_transient(exc):
        raise exc


def is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)


def cache_dir(text: str, revision: str | None) -> Path:
    """The node-local folder of one URI at one revision (another URI or revision: another folder)."""
    return CACHE_ROOT / hashlib.sha256(f"{text}\0{revision or ''}".encode()).hexdigest()[:16]


def _identity(info: dict[str, Any]) -> dict[str, str]:
    return {k: str(info[k]) for k in IDENTITY_KEYS if info.get(k) is not None}


@contextlib.contextmanager
def _locked(target: Path, name: str) -> Iterator[None]:
    """One fetch of a file per node: the ranks of a node share the cache folder."""
    locks = target / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / (name.replace("/", "%") + ".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fetch(fs: Any, remote: str, info: dict[str, Any], target: Path, name: str, rt: Runtime | None) -> Path:
    """`target/name`, fetched unless the cached copy carries the remote file's current stamp."""
    local = target / name
    stamp_path = target / ".stamps" / (name.replace("/", "%") + ".json")
    stamp = json.dumps(_identity(info), sort_keys=True)
    with _locked(target, name):
        if local.exists() and stamp_path.exists() and stamp_path.read_text() == stamp:
            return local
        started = time.perf_counter()
        local.parent.mkdir(parents=True, exist_ok=True)
        partial = local.with_name(f".{local.name}.partial-{os.getpid()}")
        try:
            fs.get_file(remote, str(partial))
            os.replace(partial, local)  # a reader of the old copy keeps its open file
        finally:
            partial.unlink(missing_ok=True)
        stamp_path.parent.mkdir(parents=True, exist_ok=True)
        stamp_path.with_suffix(".tmp").write_text(stamp)
        os.replace(stamp_path.with_suffix(".tmp"), stamp_path)
        log_json("fetch", file=name, bytes=info.get("size"), seconds=round(time.perf_counter() - started, 2),
                 rank=rt.rank if rt is not None else None)
    return local


def _remote(text: str, what: str) -> tuple[Any, str]:
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(text)
    except Exception as exc:
        raise ConfigError(f"{what}: cannot read {text}: {exc}") from exc
    return fs, root.rstrip("/")


def remote_files(text: str, what: str) -> dict[str, dict[str, Any]]:
    """Name (relative to the URI) -> fsspec info of every file under the URI."""
    fs, root = _remote(text, what)
    try:
        found = fs.find(root, detail=True)
    except Exception as exc:
        raise ConfigError(f"{what}: cannot read {text}: {exc}") from exc
    files = {path.rstrip("/")[len(root) + 1:]: info for path, info in found.items() if info.get("type") != "directory"}
    if not files:
        raise ConfigError(f"{what}: cannot read {text}: no files there")
    return files


def fetch_file(text: str, name: str, rt: Runtime | None, what: str, revision: str | None = None) -> Path:
    """One file of a URI source in the node-local cache (fetched again if the remote file changed)."""
    fs, root = _remote(text, what)
    remote = f"{root}/{name}"
    try:
        info = fs.info(remote)
        return _fetch(fs, remote, info, cache_dir(text, revision), name, rt)
    except Exception as exc:
        raise ConfigError(f"{what}: cannot read {remote} from {text}: {exc}") from exc


def resolve(text: str, rt: Runtime | None, what: str, *, revision: str | None = None, weights: bool = True) -> str:
    """A location `from_pretrained` can read: hub ids stay ids, paths stay paths; fsspec URIs are
    fetched into the node-local cache by the calling rank: every file, or with weights=False only
    the small ones (config, tokenizer, index), so that ranks that read no weights fetch none."""
    src = parse_source(text)
    if src.kind is SourceKind.HUB:
        return src.location
    if src.kind is SourceKind.URI:
        target = cache_dir(text, revision)
        fs, root = _remote(text, what)
        for name, info in sorted(remote_files(text, what).items()):
            if weights or not is_weight_file(name):
                try:
                    _fetch(fs, f"{root}/{name}", info, target, name, rt)
                except Exception as exc:
                    raise ConfigError(f"{what}: cannot read {text}: {exc}") from exc
        if weights:
            (target / ".complete").touch()  # every file was current when this rank looked
        return str(target)
    path = Path(src.location).expanduser()
    if not path.exists():
        raise ConfigError(f"{what}: {text} does not exist (resolved to {path}); check the path or the PVC mount")
    return str(path)
