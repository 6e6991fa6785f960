"""Weights step: stream a safetensors checkpoint, tensor by tensor, into the sharded model.

Why: the previous path had global rank 0 build the whole model with `from_pretrained` (a full copy
in the master dtype, next to the mapped checkpoint) and broadcast it with `set_model_state_dict`.
Rank 0 grew by the whole model. Here every rank allocates only its shards (`parallelize` +
`to_empty`) and the checkpoint is read one tensor at a time, so no rank holds more than its shards
plus one tensor. Two ways to read, chosen with LLAMAFT_WEIGHT_LOADING (not a spec field):

  sliced     (default) every rank opens the safetensors files and reads only the rows of its own
             shards (`safe_open(...).get_slice(key)[rows]`): no collective, no full tensor on any
             rank (FSDP2; FSDP1 ranks read a unit's whole tensors), reads in parallel. Needs the files on every node: local paths and PVCs are;
             fsspec URIs and hub ids are fetched per node, only the files that rank reads.
  broadcast  global rank 0 reads each tensor whole (stored dtype) and broadcasts it; every rank
             copies its shard out. Only rank 0 needs (and fetches) the files.
  full       the previous path: rank 0 `from_pretrained`, then
             `set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`. Also the
             fallback for checkpoints without safetensors files (.bin only), with a log line.

bench/load_memory.py measures the three against every rank calling from_pretrained (134M Llama,
bf16 file, fp32 master weights, FSDP2 FULL_SHARD on one node; figures in its docstring). `sliced`
is the default because it is the leanest and the fastest: rank 0 grows by 291 MiB with 2 ranks (its
shard is 256) and 151 MiB with 4 (shard 128), against 314 / 186 MiB for `broadcast` (whose every
rank holds a whole tensor while it is sent) and 783 / 781 MiB for `full`; the node totals are 0.38 /
0.20 of the naive load (broadcast 0.42 / 0.25); and with no collective at all it was faster in 10
of 12 paired runs on a loaded 2-core machine (slowest rank, medians: 1.1 s against 1.75 s with 2
ranks, 2.3 s against 2.9 s with 4; the previous path 2.5 / 4.8 s). `broadcast`
stays for sources that only rank 0 should fetch (a slow object store, a hub quota): one download
per job instead of one per node.

What `from_pretrained` does and this keeps: the dtype conversion (each tensor is cast into the
parameter's dtype, the master dtype, exactly as `Tensor.to` does it), tied embeddings (a parameter
shared by two names, like lm_head and embed_tokens with `tie_word_embeddings`, is read once, from
whichever of its names the checkpoint holds), sharded checkpoints (`model.safetensors.index.json`),
the base-model prefix (a checkpoint saved from the bare `LlamaModel` has no `model.` in its keys) and
LoRA: peft's names (`base_model.model.` prefix, `.base_layer` in wrapped layers) map back to the
checkpoint's, and the adapters are initialised exactly as the previous path did it (torch.manual_seed
then apply_lora, on the same module structure: `initial_adapters`), so they are bit for bit the same.
DoRA (`lora.useDora`): peft sets each magnitude, at wrap time, to the row norms of the base weight
plus the scaled initial adapter, `||W + s * B A||` over dim 1 (peft/tuners/lora/dora.py,
DoraLinearLayer.get_weight_norm; B is 0 at init, so it is `||W||`); on the meta model that is a
placeholder. Each rank computes the magnitudes of the rows it holds from the rows it has just
filled, on the CPU in the base weight's dtype as peft does on a loaded model (`Magnitude`): a
Linear weight and its magnitude are both sharded on dim 0 over the same mesh, so a rank holds
whole rows of the one and the same rows of the other, and a row's norm does not depend on the
other rows (bit for bit, tests/trainer/model/test_dora.py). No collective, no extra read.
Stricter than `from_pretrained`: a missing or unexpected tensor is a ConfigError naming
spec.model.source (it would initialise the missing ones randomly and warn).

The reading uses public APIs: safetensors' `safe_open`/`get_slice` (huggingface.co/docs/safetensors,
"Speed up loading" / slicing), DTensor's `device_mesh`/`placements`/`to_local` for the rows a rank
holds (the chunking of `torch.distributed.tensor.Shard`, as `distribute_tensor` does it), and FSDP1's
`summon_full_params(writeback=True)`, one FSDP unit at a time. torchtitan's Hugging Face load
(CheckpointManager.dcp_load with from_hf) is of the sliced kind too: it renames its sharded state
dict to HF keys and lets torch.distributed.checkpoint's HuggingFaceStorageReader read each rank's
parts of the safetensors files.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from llamaft.api.sources import SourceKind, parse_source
from llamaft.api.spec import LoraSpec, ModelSpec
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import PretrainedConfig

from llamaft_trainer.model import model as model_step
from llamaft_trainer.process.errors import ConfigError
from llamaft_trainer.process.runtime import Runtime
from llamaft_trainer.report.metrics import log_json
from llamaft_trainer.sources import downloads

METHOD_ENV = "LLAMAFT_WEIGHT_LOADING"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PEFT_PREFIX = "base_model.model."
BASE_PREFIX = "model."
"""`base_model_prefix` of LlamaForCausalLM: a checkpoint of the bare LlamaModel lacks it."""
WRAPPERS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
"""Name segments FSDP1, torch's checkpoint wrapper and torch.compile add to parameter names; the
same ones torch.distributed.checkpoint.state_dict._get_fqns drops. (llamaft's own activation
checkpointing adds none: parallelize.apply_activation_checkpointing.)"""
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Old Llama checkpoints saved RoPE buffers; the model recomputes them (from_pretrained ignores them too)."""
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class Method(StrEnum):
    SLICED = "sliced"
    BROADCAST = "broadcast"
    FULL = "full"


def method_from_env() -> Method:
    value = os.environ.get(METHOD_ENV, Method.SLICED.value).strip().lower()
    try:
        return Method(value)
    except ValueError:
        raise ConfigError(f"{METHOD_ENV}={value!r}: expected one of {', '.join(m.value for m in Method)}") from None


# --- names -------------------------------------------------------------------------------------


def clean_fqn(name: str) -> str:
    """A parameter name without wrapper segments: the key of the unwrapped model's state dict."""
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def checkpoint_key(fqn: str) -> str:
    """The Hugging Face checkpoint key of a model key: peft's prefix and `.base_layer` removed."""
    return fqn.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def _find_key(key: str, available: dict[str, str]) -> str | None:
    if key in available:
        return key
    bare = key.removeprefix(BASE_PREFIX)
    return bare if bare != key and bare in available else None


@dataclass(frozen=True)
class Wanted:
    """The state-dict keys of the unwrapped model (taken before parallelize)."""

    shapes: dict[str, tuple[int, ...]]
    canonical: dict[str, str]
    """Key -> the first key naming the same tensor (tied weights), itself otherwise."""


def wanted(model: nn.Module) -> Wanted:
    """Keys, shapes and ties of a (meta) model, before any wrapper renames its parameters."""
    shapes: dict[str, tuple[int, ...]] = {}
    canonical: dict[str, str] = {}
    first: dict[int, str] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        shapes[key] = tuple(value.shape)
        canonical[key] = first.setdefault(id(value), key)
    return Wanted(shapes, canonical)


# --- LoRA adapters ------------------------------------------------------------------------------


def _hollow(model: nn.Module) -> set[int]:
    """Give every parameter a CPU tensor of its shape and dtype backed by one element (expand), so
    that peft creates and initialises the adapters on the CPU exactly as on a loaded model, without
    the base weights. Ties are kept. Returns the ids of the hollow parameters."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                data = torch.empty((), dtype=param.dtype).expand(param.shape)
                replaced[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            module._parameters[name] = replaced[id(param)]
    return {id(p) for p in replaced.values()}


def initial_adapters(
    config: PretrainedConfig, spec: ModelSpec, dtype: torch.dtype, lora: LoraSpec, seed: int,
) -> dict[str, torch.Tensor]:
    """The freshly initialised adapters, keyed as in the LoRA model's state dict.

    The previous path ran torch.manual_seed(seed) then apply_lora on the loaded model; peft draws
    from the CPU generator while it creates the adapter layers, in module order. The same calls on
    the same modules with hollow base weights draw the same numbers and leave the generator in the
    same state, without reading or holding any base weight.

    DoRA's magnitudes are left out (`magnitudes` says how the loader computes them): peft's DoRA
    init draws no random number, so the adapters and the generator are the same without it, and
    it would compute a norm of every hollow weight for nothing."""
    skeleton = model_step.build_meta_model(config, spec, dtype)
    hollow = _hollow(skeleton)
    torch.manual_seed(seed)
    peft_model = model_step.apply_lora(skeleton, lora.model_copy(update={"use_dora": False}))
    return {k: v.detach() for k, v in peft_model.state_dict(keep_vars=True).items() if id(v) not in hollow}


MAGNITUDE = ".lora_magnitude_vector."
"""The DoRA magnitude of a peft LoRA layer: `<layer>.lora_magnitude_vector.<adapter>.weight`."""


@dataclass(frozen=True)
class Magnitude:
    """How a DoRA magnitude is computed: the row norms of its layer's base weight plus the scaled
    initial adapter (peft's DoraLinearLayer.update_layer / get_weight_norm, fan_in_fan_out off:
    check_dora_layers refuses the rest)."""

    weight: str
    """Canonical key of the layer's base weight [out, in]."""
    lora_a: str
    lora_b: str
    scaling: float
    """peft's `lora_alpha / r` (LoraLayer.update_layer without rslora)."""

    def rows(self, weight: torch.Tensor, rows: slice, adapters: dict[str, torch.Tensor]) -> torch.Tensor:
        """The magnitudes of `weight`'s rows (those `rows` of the full weight), as peft computes
        them: in the weight's dtype (peft moves the adapters to it before DoRA's init), on the CPU.
        With peft's default init B is 0 and `W + s * B A` is W itself (only a -0.0 turns +0.0,
        which squares the same), so no weight-sized temporary is made for it."""
        base = weight.detach().to("cpu")
        b = adapters[self.lora_b][rows]
        full = base
        if b.any():
            full = base + self.scaling * (b.to(base.dtype) @ adapters[self.lora_a].to(base.dtype))
        norm: torch.Tensor = torch.linalg.norm(full, dim=1).to(full.dtype)
        return norm


def magnitudes(want: Wanted, adapters: dict[str, torch.Tensor], lora: LoraSpec | None) -> dict[str, Magnitude]:
    """The DoRA magnitudes of the model (none without useDora), keyed as in its state dict."""
    found: dict[str, Magnitude] = {}
    if lora is None or not lora.use_dora:
        return found
    for key in want.canonical:
        if MAGNITUDE not in key:
            continue
        layer, rest = key.split(MAGNITUDE)
        adapter = rest.removesuffix(".weight")
        weight, a, b = f"{layer}.base_layer.weight", f"{layer}.lora_A.{adapter}.weight", f"{layer}.lora_B.{adapter}.weight"
        if weight not in want.canonical or a not in adapters or b not in adapters:
            raise RuntimeError(f"DoRA magnitude {key}: no {weight}, {a} or {b} to compute it from")
        found[key] = Magnitude(want.canonical[weight], a, b, lora.alpha / lora.r)
    return found


# --- where the files are ------------------------------------------------------------------------


@dataclass
class Weights:
    """The safetensors files of spec.model.source and how to get one locally: paths and PVCs are
    read in place; a URI is fetched into the node-local cache and a hub id into the Hugging Face
    cache, each file by the rank that first asks for it on that node (model.fetch_file)."""

    spec: ModelSpec
    rt: Runtime
    _headers: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = field(default_factory=dict)
    _paths: dict[str, Path] = field(default_factory=dict)

    @property
    def kind(self) -> SourceKind:
        return parse_source(self.spec.source).kind

    def names(self) -> set[str]:
        """The files at the source (a hub id: its repo info's file list at the revision)."""
        if self.kind is SourceKind.HUB:
            from llamaft_trainer.sources import hub

            return hub.repo_files(self.spec.source, "model", self.spec.revision, "spec.model.source")
        if self.kind is SourceKind.URI:
            return set(downloads.remote_files(self.spec.source, "spec.model.source"))
        where = Path(downloads.resolve(self.spec.source, self.rt, "spec.model.source"))
        return {p.name for p in where.iterdir()} if where.is_dir() else set()

    def path(self, name: str) -> Path:
        if name not in self._paths:
            self._paths[name] = self._locate(name)
        return self._paths[name]

    def _locate(self, name: str) -> Path:
        source = self.spec.source
        if self.kind is SourceKind.URI:
            return downloads.fetch_file(source, name, self.rt, "spec.model.source", self.spec.revision)
        if self.kind is SourceKind.HUB:
            from huggingface_hub import hf_hub_download

            try:
                return Path(hf_hub_download(source, name, revision=self.spec.revision, token=downloads.hf_token()))
            except Exception as exc:
                downloads.raise_hub_error(exc, "spec.model.source", source, self.spec.revision)
                raise
        return Path(downloads.resolve(source, self.rt, "spec.model.source")) / name

    def layout(self) -> dict[str, str] | None:
        """Checkpoint key -> file name, or None when the source has no safetensors checkpoint."""
        names = self.names()
        if SINGLE in names:  # from_pretrained's order: the single file first
            return dict.fromkeys(self.header(SINGLE), SINGLE)
        if INDEX in names:
            try:
                index = json.loads(self.path(INDEX).read_text())
                return {str(k): str(v) for k, v in index["weight_map"].items()}
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"spec.model.source: {self.spec.source}: unreadable {INDEX}: {exc}") from exc
        return None

    def header(self, name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Key -> (safetensors dtype, shape) of one file (its header only)."""
        if name not in self._headers:
            from safetensors import safe_open

            try:
                with safe_open(str(self.path(name)), framework="pt") as f:
                    self._headers[name] = {
                        k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()
                    }
            except ConfigError:
                raise
            except Exception as exc:
                raise ConfigError(f"spec.model.source: {self.spec.source}: unreadable {name}: {exc}") from exc
        return self._headers[name]

    def read(self, name: str, key: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        """One tensor (index None) or the given rows of it, in the stored dtype. The file is opened
        for this one read: safetensors maps the file, and pages stay resident while it is open."""
        from safetensors import safe_open

        with safe_open(str(self.path(name)), framework="pt") as f:
            tensor: torch.Tensor = f.get_tensor(key) if index is None else f.get_slice(key)[index]
        return tensor


# --- what goes where ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    key: str
    file: str


def plan(want: Wanted, layout: dict[str, str], adapters: Collection[str], source: str) -> dict[str, Item]:
    """Canonical model key -> where its tensor is in the checkpoint. The checkpoint and the model
    must agree: every tensor present, none left over (a ConfigError naming spec.model.source).
    `adapters`: the keys that are not in the checkpoint (LoRA adapters, DoRA magnitudes)."""
    groups: dict[str, list[str]] = {}
    for key, canonical in want.canonical.items():
        if canonical not in adapters:
            groups.setdefault(canonical, []).append(key)
    items: dict[str, Item] = {}
    used: set[str] = set()
    missing: list[str] = []
    for canonical, names in groups.items():
        found = [k for k in (_find_key(checkpoint_key(n), layout) for n in names) if k is not None]
        used.update(found)
        if found:
            items[canonical] = Item(found[0], layout[found[0]])
        else:
            missing.append(checkpoint_key(canonical))
    unexpected = sorted(k for k in layout if k not in used and not k.endswith(IGNORED_SUFFIXES))
    if missing or unexpected:
        raise ConfigError(
            f"spec.model.source: the checkpoint at {source} does not match the model: "
            f"{len(missing)} missing tensor(s) {missing[:5]}, {len(unexpected)} unexpected {unexpected[:5]}"
        )
    return items


def check_shapes(items: dict[str, Item], want: Wanted, weights: Weights, files: set[str]) -> dict[str, str]:
    """Canonical key -> stored dtype, for the items in `files`; a ConfigError on a shape mismatch."""
    dtypes: dict[str, str] = {}
    for canonical, item in items.items():
        if item.file not in files:
            continue
        stored, shape = weights.header(item.file)[item.key]
        if shape != want.shapes[canonical]:
            raise ConfigError(
                f"spec.model.source: {item.key} in {weights.spec.source} has shape {list(shape)}, "
                f"the model expects {list(want.shapes[canonical])}"
            )
        if stored not in SAFETENSORS_DTYPES:
            raise ConfigError(f"spec.model.source: {item.key} in {weights.spec.source}: unsupported dtype {stored}")
        dtypes[canonical] = stored
    return dtypes


def local_index(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The part of the full tensor this rank holds: everything for a plain tensor; for a DTensor
    the chunk of each Shard(dim) placement along its mesh dimension (torch.chunk's split, as
    DTensor's Shard does it), nothing cut for Replicate."""
    starts = [0] * tensor.dim()
    sizes = list(tensor.shape)
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        coordinate = mesh.get_coordinate()
        assert coordinate is not None, "this rank holds no part of the parameter"
        for mesh_dim, placement in enumerate(tensor.placements):
            if isinstance(placement, Replicate):
                continue
            if type(placement) is not Shard:
                raise NotImplementedError(f"streaming load of a {placement} placement")
            dim, count = placement.dim, mesh.size(mesh_dim)
            chunk = math.ceil(sizes[dim] / count)
            begin = min(coordinate[mesh_dim] * chunk, sizes[dim])
            end = min(begin + chunk, sizes[dim])
            starts[dim] += begin
            sizes[dim] = end - begin
        assert tuple(sizes) == tuple(tensor.to_local().shape), (sizes, tensor.to_local().shape)
    return tuple(slice(s, s + n) for s, n in zip(starts, sizes, strict=True))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The storage this rank writes: a DTensor's local shard (under no_grad `to_local` returns it
    without a copy), the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class Target:
    canonical: str
    tensor: torch.Tensor


Group = tuple[Callable[[], contextlib.AbstractContextManager[Any]], list[Target]]


def targets(model: nn.Module, want: Wanted) -> list[Group]:
    """The live tensors to fill, in groups that run inside one context each: one group for FSDP2
    (the DTensor shards are written in place), one per FSDP1 unit (its parameters unsharded with
    summon_full_params(writeback=True), so the unit's full tensors are written and then resharded),
    and last the buffers. A tensor shared by two names is filled once."""
    seen: set[int] = set()
    live: list[Target] = []
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        key = clean_fqn(name)
        if key in want.canonical and id(tensor) not in seen:
            seen.add(id(tensor))
            live.append(Target(want.canonical[key], tensor))
    covered = {t.canonical for t in live}
    lost = sorted(set(want.canonical.values()) - covered)
    if lost:
        raise RuntimeError(f"parallelize lost track of {lost[:5]}: cannot load them")
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = FSDP.fsdp_modules(model)
    if not units:
        return [(contextlib.nullcontext, live)]
    groups: list[Group] = []
    placed: set[int] = set()
    for unit in units:
        nested = {id(p) for sub in FSDP.fsdp_modules(unit) if sub is not unit for p in sub.parameters()}
        own = {id(p) for p in unit.parameters()} - nested - placed
        placed |= own
        members = [t for t in live if id(t.tensor) in own]
        if members:
            groups.append((functools.partial(FSDP.summon_full_params, unit, recurse=False, writeback=True), members))
    rest = [t for t in live if id(t.tensor) not in placed]
    if rest:
        groups.append((contextlib.nullcontext, rest))
    return groups


def _needed_files(groups: list[Group], items: dict[str, Item]) -> set[str]:
    """The files this rank reads from: those holding a tensor with a non-empty part on this rank
    (with FSDP1 every rank reads whole tensors, so every file)."""
    files = set()
    for context, members in groups:
        for target in members:
            item = items.get(target.canonical)
            if item is not None and (context is not contextlib.nullcontext or _local(target.tensor).numel() > 0):
                files.add(item.file)
    return files


# --- collectives --------------------------------------------------------------------------------


def _first_error(error: str | None, rt: Runtime) -> str | None:
    """Every rank's error (a string or None) -> the first one, on every rank."""
    if rt.world_size == 1:
        return error
    gathered: list[Any] = [None] * rt.world_size
    dist.all_gather_object(gathered, error)
    return next((e for e in gathered if e is not None), None)


def _from_leader(value: Any, rt: Runtime) -> Any:
    if rt.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# --- loading ------------------------------------------------------------------------------------


@dataclass
class WeightStream:
    """Fills the targets. After a failure it keeps taking part in every collective (broadcasts,
    FSDP1's unsharding) without reading, so that no rank hangs; the error is agreed on at the end."""

    weights: Weights
    items: dict[str, Item]
    dtypes: dict[str, str]
    adapters: dict[str, torch.Tensor]
    method: Method
    rt: Runtime
    magnitudes: dict[str, Magnitude] = field(default_factory=dict)
    error: str | None = None
    _norms: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    """Base weight -> (first row, the DoRA magnitudes of the rows this rank filled)."""

    def fill(self, groups: list[Group]) -> None:
        """Each group's tensors, a DoRA magnitude after its base weight. A magnitude whose weight
        is in a later group (FSDP1 can wrap a large Linear as a unit of its own) waits for a second
        pass: the same on every rank, since the groups are."""
        weights = {m.weight for m in self.magnitudes.values()}
        done: set[str] = set()
        later: list[Group] = []
        with torch.no_grad():
            for context, members in groups:
                plain = [t for t in members if t.canonical not in self.magnitudes]
                done.update(t.canonical for t in plain)
                dora = [t for t in members if t.canonical in self.magnitudes]
                ready = [t for t in dora if self.magnitudes[t.canonical].weight in done]
                waiting = [t for t in dora if self.magnitudes[t.canonical].weight not in done]
                with context():
                    for target in plain:
                        self._fill_one(target, norms=target.canonical in weights)
                    for target in ready:
                        self._fill_magnitude(target)
                if waiting:
                    later.append((context, waiting))
            for context, members in later:
                with context():
                    for target in members:
                        self._fill_magnitude(target)

    def _fill_one(self, target: Target, *, norms: bool = False) -> None:
        dest = _local(target.tensor)
        index = local_index(target.tensor)
        if target.canonical in self.adapters:
            dest.copy_(self.adapters[target.canonical][index])
        elif self.method is Method.BROADCAST:
            self._broadcast(target, dest, index)
        elif dest.numel() and self.error is None:
            self._read_into(dest, target.canonical, index)
        if norms and self.error is None:  # after the read buffer is freed: the host holds one of the two
            magnitude = next(m for m in self.magnitudes.values() if m.weight == target.canonical)
            self._norms[target.canonical] = (index[0].start, magnitude.rows(dest, index[0], self.adapters))

    def _read_into(self, dest: torch.Tensor, canonical: str, index: tuple[slice, ...]) -> None:
        part = self._read(canonical, index)
        if part is not None:
            dest.copy_(part)

    def _fill_magnitude(self, target: Target) -> None:
        """This rank's part of a DoRA magnitude: the norms of the same rows of its base weight."""
        if self.error is not None:
            return  # the weight was not read; the error is reported after the fill
        dest = _local(target.tensor)
        (rows,) = local_index(target.tensor)
        first, norms = self._norms[self.magnitudes[target.canonical].weight]
        if rows.start < first or rows.stop > first + len(norms):
            raise RuntimeError(f"DoRA magnitude {target.canonical}: rows {rows.start}:{rows.stop} are not among "
                               f"the base weight's rows this rank holds ({first}:{first + len(norms)})")
        dest.copy_(norms[rows.start - first:rows.stop - first])

    def _broadcast(self, target: Target, dest: torch.Tensor, index: tuple[slice, ...]) -> None:
        """Rank 0 sends the whole tensor in its stored dtype (half the bytes of fp32 for a bf16
        checkpoint); every rank casts only its own part into its shard."""
        full = self._read(target.canonical, None) if self.rt.is_leader and self.error is None else None
        if full is None:
            dtype = SAFETENSORS_DTYPES[self.dtypes[target.canonical]]
            full = torch.empty(tuple(target.tensor.shape), dtype=dtype, device=self.rt.device)
        full = full.to(self.rt.device)
        if self.rt.world_size > 1:
            dist.broadcast(full, src=0)
        dest.copy_(full[index])

    def _read(self, canonical: str, index: tuple[slice, ...] | None) -> torch.Tensor | None:
        item = self.items[canonical]
        try:
            return self.weights.read(item.file, item.key, index)
        except Exception as exc:
            self.error = f"spec.model.source: cannot read {item.key} from {item.file} of {self.weights.spec.source}: {exc}"
            return None


Outcome = tuple[str, Any]
"""("stream", (items, dtypes)) | ("fallback", reason) | ("error", message)."""


def _prepare(weights: Weights, want: Wanted, adapters: Collection[str], groups: list[Group] | None) -> Outcome:
    """Layout, plan and header checks, never raising, so that the outcome can be shared with the
    other ranks first. `groups` None: check every file (rank 0 broadcasting), else only the files
    this rank reads (it fetches only those)."""
    try:
        layout = weights.layout()
        if layout is None:
            return "fallback", f"no {SINGLE} or {INDEX} at {weights.spec.source}"
        items = plan(want, layout, adapters, weights.spec.source)
        files = {i.file for i in items.values()} if groups is None else _needed_files(groups, items)
        return "stream", (items, check_shapes(items, want, weights, files))
    except ConfigError as exc:
        return "error", str(exc)


def _agree(local: Outcome | None, method: Method, rt: Runtime) -> tuple[str, Any, dict[str, Item], dict[str, str]]:
    """One outcome for every rank: broadcast, rank 0's (with the stored dtypes the others need);
    sliced, an error anywhere beats a fallback anywhere beats streaming."""
    if method is Method.BROADCAST:
        summary = None
        if local is not None:
            summary = ("stream", local[1][1]) if local[0] == "stream" else local
        kind, detail = _from_leader(summary, rt)
        items = local[1][0] if local is not None and kind == "stream" else {}
        return kind, detail, items, detail if kind == "stream" else {}
    assert local is not None
    summaries = _gather((local[0], None if local[0] == "stream" else local[1]), rt)
    for kind in ("error", "fallback"):
        for other_kind, detail in summaries:
            if other_kind == kind:
                return kind, detail, {}, {}
    items, dtypes = local[1]
    return "stream", None, items, dtypes


def load_weights(
    model: nn.Module, want: Wanted, spec: ModelSpec, rt: Runtime, *, config: PretrainedConfig, dtype: torch.dtype,
    lora: LoraSpec | None, seed: int, method: Method | None = None,
) -> None:
    """Fill the parallelized, materialised model with the pretrained weights (collective: every
    rank calls it). `want` comes from `wanted(model)` before parallelize."""
    method = method or method_from_env()
    started = time.perf_counter()
    if method is not Method.FULL:
        adapters = initial_adapters(config, spec, dtype, lora, seed) if lora is not None else {}
        dora = magnitudes(want, adapters, lora)
        derived = adapters.keys() | dora.keys()
        weights = Weights(spec, rt)
        groups = targets(model, want)
        local = None
        if method is Method.SLICED:
            local = _prepare(weights, want, derived, groups)
        elif rt.is_leader:
            local = _prepare(weights, want, derived, None)
        kind, detail, items, dtypes = _agree(local, method, rt)
        if kind == "error":
            raise ConfigError(str(detail))
        if kind == "stream":
            stream = WeightStream(weights, items, dtypes, adapters, method, rt, dora)
            stream.fill(groups)
            message = _first_error(stream.error, rt)
            if message is not None:
                raise ConfigError(message)
            _log(rt, method, started, files=len({i.file for i in items.values()}), tensors=len(dtypes) + len(adapters) + len(dora))
            return
        if rt.is_leader:
            log_json("weights", fallback=f"{detail}: the {method.value} method needs safetensors; rank 0 reads the "
                     "whole model with from_pretrained instead")
    load_full(model, spec, rt, dtype, lora, seed)
    _log(rt, Method.FULL, started)


def _gather(value: Any, rt: Runtime) -> list[Any]:
    if rt.world_size == 1:
        return [value]
    gathered: list[Any] = [None] * rt.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def _log(rt: Runtime, method: Method, started: float, **fields: Any) -> None:
    if rt.is_leader:
        log_json("weights", method=method.value, seconds=round(time.perf_counter() - started, 2), **fields)


def load_full(model: nn.Module, spec: ModelSpec, rt: Runtime, dtype: torch.dtype, lora: LoraSpec | None, seed: int) -> None:
    """The previous path: rank 0 reads the whole model with from_pretrained and broadcasts it."""
    full: dict[str, Any] = {}
    error: str | None = None
    if rt.is_leader:
        try:
            full = model_step.read_full_state_dict(spec, rt, dtype, lora, seed)
        except ConfigError as exc:
            error = str(exc)
    message = _first_error(error, rt)
    if message is not None:
        raise ConfigError(message)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
