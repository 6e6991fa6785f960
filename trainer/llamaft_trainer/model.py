"""Model step: tokenizer, config and a meta-device model; where the files come from.

Every rank builds the model on the meta device (no memory). After `parallelize` shards it, each
rank allocates only its shards and `loading.load_weights` streams the pretrained tensors into them
(loading.py). The previous path (global rank 0 reads the whole model with `from_pretrained` and
broadcasts it with `set_model_state_dict(..., broadcast_from_rank0=True)`) stays for checkpoints
that are not safetensors and as `LLAMAFT_WEIGHT_LOADING=full`: `read_full_state_dict`.

fsspec URIs (s3://, gs://, ...) are fetched file by file into a node-local cache, and only where
read: the small files (config, tokenizer, safetensors index) by every rank that needs them, a
weight file only by a rank that reads tensors from it (`fetch_file`). Each cached file carries a
stamp of the remote file's size, mtime and etag (whatever the filesystem reports), and the cache
folder is keyed by URI and revision, so a changed source is fetched again instead of reused. Ranks
of one node share the cache; a per-file lock makes the first fetch and the others wait and reuse.
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

import torch
from llamaft.api.sources import SourceKind, parse_source
from llamaft.api.spec import LoraSpec, MixedPrecision, ModelSpec
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from llamaft_trainer.errors import ConfigError
from llamaft_trainer.metrics import log_json
from llamaft_trainer.runtime import Runtime

CACHE_ROOT = Path(os.environ.get("LLAMAFT_CACHE", "/tmp/llamaft-cache"))
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx")
"""Files that hold weights (large): fetched only by the ranks that read them. Everything else
(config, tokenizer, `*.index.json`) is small and fetched wherever it is needed."""
IDENTITY_KEYS = (
    "size", "mtime", "ETag", "etag", "LastModified", "last_modified", "updated", "generation",
    "md5Hash", "crc32c", "VersionId", "version_id", "checksum",
)
"""The fields of fsspec's `info()` that change when a remote file does (local: size and mtime; S3:
ETag, LastModified, VersionId; GCS: etag, generation, md5Hash, ...): the cache stamp of a file."""


def _hf_token() -> str | None:
    return os.environ.get("HF_TOKEN") or None


def _raise_hub_error(exc: BaseException, what: str, source: str, revision: str | None) -> None:
    """A Hub id that cannot be read for good (gated, missing repo, revision or file): the Hub's
    answer in the spec's terms (hub.hub_error); a transient failure is re-raised as it is, for the
    retry policy."""
    if parse_source(source).kind is not SourceKind.HUB:
        return
    from llamaft_trainer import hub

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


def load_tokenizer(spec: ModelSpec, rt: Runtime) -> PreTrainedTokenizerBase:
    what = "spec.model.tokenizer" if spec.tokenizer else "spec.model.source"
    where = resolve(spec.tokenizer or spec.source, rt, what, revision=spec.revision, weights=False)
    try:
        tok = AutoTokenizer.from_pretrained(where, revision=spec.revision, token=_hf_token())
    except Exception as exc:
        _raise_hub_error(exc, what, spec.tokenizer or spec.source, spec.revision)
        raise ConfigError(
            f"spec.model: no usable tokenizer at {where} ({type(exc).__name__}: {exc}); "
            "set spec.model.tokenizer to a location holding tokenizer files"
        ) from exc
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_config(spec: ModelSpec, rt: Runtime) -> PretrainedConfig:
    where = resolve(spec.source, rt, "spec.model.source", revision=spec.revision, weights=False)
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(where, revision=spec.revision, token=_hf_token())
        return config
    except Exception as exc:
        _raise_hub_error(exc, "spec.model.source", spec.source, spec.revision)
        raise ConfigError(f"spec.model.source: cannot read a model config at {where}: {exc}") from exc
def master_dtype(precision: MixedPrecision) -> torch.dtype:
    """dtype of the sharded parameters the optimizer updates."""
    return torch.bfloat16 if precision is MixedPrecision.PURE_BF16 else torch.float32


def build_meta_model(config: PretrainedConfig, spec: ModelSpec, dtype: torch.dtype) -> nn.Module:
    config._attn_implementation = spec.attn_implementation.value
    with torch.device("meta"):
        model: nn.Module = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def apply_lora(model: nn.Module, lora: LoraSpec) -> nn.Module:
    """Wrap with peft LoRA adapters (DoRA with `useDora`); only adapter weights (and DoRA's
    magnitudes) stay trainable. On a meta model DoRA's magnitudes are placeholders: the loader
    computes them from the real base weights (loading.Magnitude)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules), task_type="CAUSAL_LM", use_dora=lora.use_dora,
    )
    try:
        peft_model: nn.Module = get_peft_model(model, config)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ConfigError(f"spec.training.lora.targetModules: {exc}") from exc
    if lora.use_dora:
        check_dora_layers(peft_model)
    return peft_model


def check_dora_layers(model: nn.Module) -> None:
    """DoRA only on plain Linear layers (weight [out, in], no fan_in_fan_out): their magnitude is
    the norm of each weight row, and a rank holds whole rows of its shard (dim 0), so every rank
    computes its own magnitudes (loading.Magnitude). An embedding's magnitude is a norm over every
    row, a Conv1D's over its columns: refused on every rank, before any collective."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    for name, module in model.named_modules():
        magnitudes = getattr(module, "lora_magnitude_vector", None)
        if not isinstance(magnitudes, nn.ModuleDict) or len(magnitudes) == 0:
            continue
        base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
        if not isinstance(module, LoraLinear) or not isinstance(base, nn.Linear) or getattr(module, "fan_in_fan_out", False):
            short = name.removeprefix("base_model.model.")
            raise ConfigError(
                f"spec.training.lora.useDora: DoRA applies to linear layers only, and targetModules adapts "
                f"{short} ({type(base).__name__}): remove it from targetModules or set useDora: false"
            )


def read_full_state_dict(spec: ModelSpec, rt: Runtime, dtype: torch.dtype, lora: LoraSpec | None, seed: int) -> dict[str, Any]:
    """The previous path, global rank 0 only: the whole pretrained model (plus freshly initialised
    adapters) on CPU. Kept for checkpoints that are not safetensors and LLAMAFT_WEIGHT_LOADING=full."""
    where = resolve(spec.source, rt, "spec.model.source", revision=spec.revision)
    try:
        model: nn.Module = AutoModelForCausalLM.from_pretrained(
            where, revision=spec.revision, token=_hf_token(), dtype=dtype,
            attn_implementation=spec.attn_implementation.value,
        )
    except Exception as exc:
        _raise_hub_error(exc, "spec.model.source", spec.source, spec.revision)
        raise ConfigError(f"spec.model.source: cannot load weights from {where}: {exc}") from exc
    if lora is not None and lora.enabled:
        torch.manual_seed(seed)
        model = apply_lora(model, lora)
    return {k: v for k, v in model.state_dict().items()}


def rebuild_rotary_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (RoPE inverse frequencies) are not in any state dict: after the
    meta model is materialised with `to_empty` they hold garbage and must be recomputed."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "config"):
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf.to(device))

