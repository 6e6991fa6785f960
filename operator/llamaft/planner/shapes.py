"""The model's shape, from its config only: never the weights.

A shape comes from a `config.json` (a local directory, the Hugging Face cache on this machine, or
a dict the caller read) or, offline, from the built-in table of well-known Llama checkpoints keyed
by their hub ids. Parameter counts are analytic (exact for Llama-shaped models: the formula is
checked against `AutoModelForCausalLM.from_config` on the meta device in the tests);
`meta_parameter_count` builds the model on the meta device when torch and transformers are
installed (the CLI's `--exact`), and the operator, which has no torch, uses the analytic count.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llamaft.api.sources import SourceKind, parse_source

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs from a Llama config (HF `LlamaConfig` field names in comments)."""

    vocab_size: int  # vocab_size
    hidden_size: int  # hidden_size
    intermediate_size: int  # intermediate_size
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads (defaults to num_attention_heads)
    head_dim: int  # head_dim (defaults to hidden_size // num_attention_heads)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    name: str = "custom"
    """Where the shape came from (a hub id, a path, `config`)."""

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of each projection of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (self.q_dim, h), "k_proj": (self.kv_dim, h), "v_proj": (self.kv_dim, h),
            "o_proj": (h, self.q_dim), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
        }

    def layer_tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter of one decoder layer with its shape."""
        tensors: list[tuple[str, tuple[int, ...]]] = []
        for name, (out_f, in_f) in self.linear_shapes().items():
            tensors.append((f"{name}.weight", (out_f, in_f)))
            attention = name in ("q_proj", "k_proj", "v_proj", "o_proj")
            if (attention and self.attention_bias) or (not attention and self.mlp_bias):
                tensors.append((f"{name}.bias", (out_f,)))
        tensors.append(("input_layernorm.weight", (self.hidden_size,)))
        tensors.append(("post_attention_layernorm.weight", (self.hidden_size,)))
        return tensors

    def root_tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Parameters outside the decoder layers (embedding, final norm, LM head unless tied)."""
        tensors: list[tuple[str, tuple[int, ...]]] = [
            ("embed_tokens.weight", (self.vocab_size, self.hidden_size)),
            ("norm.weight", (self.hidden_size,)),
        ]
        if not self.tie_word_embeddings:
            tensors.append(("lm_head.weight", (self.vocab_size, self.hidden_size)))
        return tensors

    @property
    def layer_parameters(self) -> int:
        return sum(_numel(s) for _, s in self.layer_tensors())

    @property
    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def parameters(self) -> int:
        """All parameters (analytic; equals the meta-device count for Llama-shaped models)."""
        return self.num_layers * self.layer_parameters + sum(_numel(s) for _, s in self.root_tensors())

    def lora_parameters(self, r: int, targets: list[str], dora: bool = False) -> int:
        """Adapter parameters for rank `r` on the named projections of every layer (DoRA: plus a
        magnitude per output row)."""
        shapes = self.linear_shapes()
        per_layer = sum(r * (shapes[t][0] + shapes[t][1]) + (shapes[t][0] if dora else 0) for t in targets if t in shapes)
        return per_layer * self.num_layers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class UnknownShape(ValueError):
    """The model's shape cannot be determined offline."""


def shape_from_config(config: dict[str, Any], name: str = "config") -> ModelShape:
    """A shape from a Hugging Face `config.json` dict (Llama-shaped: llama, mistral, ...)."""
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = config.get("head_dim") or hidden // heads
        return ModelShape(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            name=name,
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise UnknownShape(f"{name}: not a Llama-shaped config ({type(exc).__name__}: {exc})") from None


def _llama(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, positions: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "max_position_embeddings": positions,
        "tie_word_embeddings": False,
    }


# The config.json values of Meta's published checkpoints (huggingface.co/<id>/blob/main/config.json).
# Parameter counts the analytic formula gives for them (tested): Llama 2 7B 6,738,415,616;
# 13B 13,015,864,320; 70B 68,976,648,192; Llama 3(.1) 8B 8,030,261,248; 70B 70,553,706,496;
# 405B 405,853,388,800 (the figures on the model cards: 7B, 13B, 70B, 8B, 70B, 405B).
_LLAMA2_7B = _llama(32000, 4096, 11008, 32, 32, 32, 4096)
_LLAMA2_13B = _llama(32000, 5120, 13824, 40, 40, 40, 4096)
_LLAMA2_70B = _llama(32000, 8192, 28672, 80, 64, 8, 4096)
_LLAMA3_8B = _llama(128256, 4096, 14336, 32, 32, 8, 8192)
_LLAMA3_70B = _llama(128256, 8192, 28672, 80, 64, 8, 8192)
_LLAMA31_8B = _llama(128256, 4096, 14336, 32, 32, 8, 131072)
_LLAMA31_70B = _llama(128256, 8192, 28672, 80, 64, 8, 131072)
_LLAMA31_405B = _llama(128256, 16384, 53248, 126, 128, 8, 131072)

KNOWN_CONFIGS: dict[str, dict[str, Any]] = {}
for _ids, _cfg in (
    (("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-chat-hf"), _LLAMA2_7B),
    (("meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-13b-chat-hf"), _LLAMA2_13B),
    (("meta-llama/Llama-2-70b-hf", "meta-llama/Llama-2-70b-chat-hf"), _LLAMA2_70B),
    (("meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct"), _LLAMA3_8B),
    (("meta-llama/Meta-Llama-3-70B", "meta-llama/Meta-Llama-3-70B-Instruct"), _LLAMA3_70B),
    (("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct",
      "meta-llama/Meta-Llama-3.1-8B", "meta-llama/Meta-Llama-3.1-8B-Instruct"), _LLAMA31_8B),
    (("meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct",
      "meta-llama/Meta-Llama-3.1-70B", "meta-llama/Meta-Llama-3.1-70B-Instruct"), _LLAMA31_70B),
    (("meta-llama/Llama-3.1-405B", "meta-llama/Llama-3.1-405B-Instruct",
      "meta-llama/Meta-Llama-3.1-405B", "meta-llama/Meta-Llama-3.1-405B-Instruct"), _LLAMA31_405B),
):
    for _id in _ids:
        KNOWN_CONFIGS[_id.lower()] = _cfg
_BY_NAME = {key.split("/", 1)[1]: key for key in KNOWN_CONFIGS}


def known_shape(source: str) -> ModelShape | None:
    """The built-in shape for a hub id, or for an s3://, pvc:// or local path whose last component
    is a well-known checkpoint's name (e.g. `s3://bucket/models/Llama-2-7b-hf`)."""
    key = source.strip().rstrip("/").lower()
    if key in KNOWN_CONFIGS:
        return shape_from_config(KNOWN_CONFIGS[key], name=source)
    base = key.rsplit("/", 1)[-1]
    if base in _BY_NAME:
        hub_id = _BY_NAME[base]
        return shape_from_config(KNOWN_CONFIGS[hub_id], name=f"{source} (as {hub_id})")
    return None


def known_model_ids() -> list[str]:
    return sorted({k for k in KNOWN_CONFIGS})


def _hub_cache_config(repo_id: str) -> Path | None:
    """config.json of a hub model already in this machine's Hugging Face cache (no download)."""
    home = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface")), "hub"
    )
    folder = Path(home) / ("models--" + repo_id.replace("/", "--")) / "snapshots"
    if not folder.is_dir():
        return None
    found = sorted(folder.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None


def read_model_config(source: str) -> tuple[dict[str, Any], str] | None:
    """The `config.json` of `source` when it can be read here without downloading anything: a local
    (or mounted PVC) directory, or a hub id in the local Hugging Face cache. None otherwise."""
    try:
        src = parse_source(source)
    except ValueError:
        return None
    path: Path | None = None
    if src.kind in (SourceKind.LOCAL, SourceKind.PVC):
        candidate = Path(src.location).expanduser()
        path = candidate / "config.json" if candidate.is_dir() else None
    elif src.kind is SourceKind.HUB:
        path = _hub_cache_config(src.location)
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return (data, str(path)) if isinstance(data, dict) else None


def resolve_shape(source: str, model_config: dict[str, Any] | None = None) -> ModelShape:
    """The shape of `source`: from `model_config` when given, else the built-in table. Raises
    UnknownShape with a message that says what to do."""
    if model_config is not None:
        return shape_from_config(model_config, name=source)
    shape = known_shape(source)
    if shape is not None:
        return shape
    raise UnknownShape(
        f"the shape of {source!r} is unknown offline: it is not in the built-in table "
        "(Llama 2 7B/13B/70B, Llama 3 and 3.1 8B/70B, Llama 3.1 405B by hub id) and no config.json "
        "was given; run `llamaft plan FILE --model-config path/to/config.json`, or name the "
        "directory after the checkpoint (e.g. .../Llama-2-7b-hf)"
    )


def meta_parameter_count(config: dict[str, Any]) -> int | None:
    """Parameters of the model built on the meta device with transformers (no memory, no weights),
    or None when torch/transformers are not installed (the operator image has neither)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return None
    cfg = dict(config)
    model_type = cfg.pop("model_type", "llama")
    hf_config = AutoConfig.for_model(model_type, **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)  # type: ignore[no-untyped-call]
    return int(sum(p.numel() for p in model.parameters()))
