"""Parallelize step: activation checkpointing, compile and FSDP, kept apart from model and loop.

Order matters (as in torchtitan): float8 conversion of the linears first (float8.py; torchtitan
converts when it builds the model), then activation checkpointing and torch.compile wrap each decoder
layer, then every FSDP unit is created bottom-up (decoder layers, then the root), on the
device mesh `runtime.build_mesh` made from the sharding plan (llamaft.api.sharding, which also
decides when no FSDP wrapper is needed: one process, or DDP for NO_SHARD in full precision).

Strategy mapping (FSDP2):
  FULL_SHARD    -> 1-D mesh, reshard_after_forward=True
  SHARD_GRAD_OP -> 1-D mesh, reshard_after_forward=False (parameters stay gathered until backward)
  HYBRID_SHARD  -> 2-D (replicate, shard) mesh, reshard_after_forward=True
  NO_SHARD      -> 2-D (world, 1) mesh: full replicas, gradients all-reduced (DDP semantics)

On CPU (gloo) FSDP2's CUDA-stream overlap does not exist: its streams and events are no-ops there,
so every all-gather and reduce-scatter blocks the training thread. `overlap_on_cpu` gets some of it
back (bench/cpu_scaling.py measures it): decoder-layer all-gathers run asynchronously on gloo's
worker thread, issued one unit ahead, and reduce-scatters use all-to-all instead of gloo's
all-reduce-based reduce-scatter. CUDA keeps FSDP2's defaults.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from llamaft.api.sharding import ShardingPlan, Wrapper
from llamaft.api.spec import (
    CheckpointingMode,
    FsdpSpec,
    MixedPrecision,
    ShardingStrategy,
    WrapPolicyType,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from llamaft_trainer.parallel import float8

CPU_OVERLAP_ENV = "LLAMAFT_FSDP_CPU_OVERLAP"
"""Set to 0 to keep FSDP2's defaults on CPU too (bench/cpu_scaling.py --compare measures both)."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder layers of a (possibly peft-wrapped) causal LM."""
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList):
            return module
    raise ValueError("model has no decoder `layers` ModuleList: is it Llama-shaped?")


def mixed_precision_policy(precision: MixedPrecision) -> MixedPrecisionPolicy:
    """Parameter, gradient-reduction and output dtypes for each precision setting."""
    if precision is MixedPrecision.BF16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision is MixedPrecision.FP16:
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    if precision is MixedPrecision.PURE_BF16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def checkpointed(forward: Callable[..., Any], context_fn: Callable[[], Any] | None = None) -> Callable[..., Any]:
    """`forward`, its activations recomputed in backward instead of kept (torch.utils.checkpoint,
    non-reentrant, the RNG state preserved: what torchtitan's wrapper calls too). `context_fn`:
    checkpoint's selective-checkpointing contexts (`op_sac_context`); None keeps nothing inside."""
    extra: dict[str, Any] = {} if context_fn is None else {"context_fn": context_fn}

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    return run


def _op_sac_save_ops() -> frozenset[Any]:
    """The ops whose outputs op-level selective checkpointing keeps: torchtitan's
    `_op_sac_save_list` (torchtitan/models/llama3/infra/parallelize.py at 1f029641b5, used by
    `_apply_op_sac` in torchtitan/distributed/activation_checkpoint.py): the matmuls (aten.mm,
    aten.linear where a backend keeps it whole), every scaled_dot_product_attention kernel, the
    functional reduce-scatter (tensor parallelism; never issued here, kept for parity), aten.max
    (float8's amax) and FlexAttention. Added here: the CPU SDPA kernel
    (`_scaled_dot_product_flash_attention_for_cpu`, what sdpa runs on CPU), so the CPU tests and
    bench exercise the same policy as CUDA's flash/efficient kernels. Ops a torch build lacks
    (cudnn, flex attention, ...) are left out rather than failing."""
    names = [
        "aten.mm.default", "aten.linear.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_attention_math.default",
        "aten._scaled_dot_product_fused_attention_overrideable.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "_c10d_functional.reduce_scatter_tensor.default",
        "aten.max.default",
    ]
    ops: set[Any] = set()
    for name in names:
        target: Any = torch.ops
        try:
            for part in name.split("."):
                target = getattr(target, part)
        except (AttributeError, RuntimeError):
            continue
        ops.add(target)
    flex = getattr(getattr(torch, "_higher_order_ops", None), "flex_attention", None)
    if flex is not None:
        ops.add(flex)
    return frozenset(ops)


OP_SAC_SAVE_OPS = _op_sac_save_ops()
MATMUL_OPS = frozenset(op for op in (getattr(torch.ops.aten.mm, "default", None),
                                     getattr(torch.ops.aten.linear, "default", None)) if op is not None)


def op_sac_context() -> Any:
    """One checkpointed call's selective-checkpointing contexts (a fresh pair per call, as
    `context_fn` asks): keep the outputs of OP_SAC_SAVE_OPS, recompute everything else, and of
    the matmuls keep only the odd-numbered ones of the call (1st, 3rd, ...), as torchtitan's
    `_apply_op_sac` policy does: half the matmul outputs kept, half recomputed. Forward and the
    recompute count separately, so the recompute makes the same decisions in the same order
    (torch.utils.checkpoint.create_selective_checkpoint_contexts pops the kept outputs by order).
    For a plain Llama layer (q, k, v, o, gate, up, down) the q, v, gate and down outputs are kept
    and k, o and up recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func not in OP_SAC_SAVE_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if func in MATMUL_OPS:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(layers: nn.ModuleList, mode: CheckpointingMode, every_n: int) -> int:
    """Checkpoint decoder layers' forwards; returns how many were. `full`: every layer;
    `selective`: layer i when i % every_n == 0; `selective-op`: every layer, keeping what
    `op_sac_context` keeps. The layer's own forward is replaced (not the layer wrapped in another
    module), so parameter names, checkpoints and FSDP's units are the same with and without it,
    and only public torch APIs are involved."""
    if mode is CheckpointingMode.NONE:
        return 0
    wrapped = 0
    for index, layer in enumerate(list(layers)):
        if mode is CheckpointingMode.SELECTIVE_OP:
            layer.forward = checkpointed(layer.forward, op_sac_context)  # type: ignore[method-assign]
            wrapped += 1
        elif mode is CheckpointingMode.FULL or index % every_n == 0:
            layer.forward = checkpointed(layer.forward)  # type: ignore[method-assign]
            wrapped += 1
    return wrapped


def apply_compile(layers: nn.ModuleList) -> None:
    for index, layer in enumerate(list(layers)):
        layers[index] = torch.compile(layer)  # type: ignore[assignment]


@contextlib.contextmanager
def compile_wrappers_removed(model: nn.Module) -> Iterator[nn.Module]:
    """`model` with each `torch.compile` wrapper (`apply_compile`'s) swapped for the module it
    compiled while the body runs, then put back; nothing is copied or recompiled.

    Why: the wrapper adds `_orig_mod` to the module names, while torch.distributed.checkpoint's
    state dicts leave it out of the keys. peft selects an adapter's entries of a state dict by the
    names of its LoRA modules (`_get_tuner_state_dict_key_prefixes`), so on a compiled model it
    matches none and the exported adapter would be empty."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            inner = getattr(child, "_orig_mod", None)
            if isinstance(inner, nn.Module):
                swapped.append((parent, name, child))
                setattr(parent, name, inner)
    try:
        yield model
    finally:
        for parent, name, child in reversed(swapped):
            setattr(parent, name, child)


def _sharded_units(model: nn.Module, layers: nn.ModuleList, fsdp: FsdpSpec) -> list[nn.Module]:
    if fsdp.wrap_policy.type is WrapPolicyType.DECODER_LAYER:
        return list(layers)
    threshold = fsdp.wrap_policy.min_num_params
    return [layer for layer in layers if sum(p.numel() for p in layer.parameters()) >= threshold]


def apply_fsdp2(model: nn.Module, fsdp: FsdpSpec, plan: ShardingPlan, mesh: DeviceMesh) -> nn.Module:
    layers = decoder_layers(model)
    common: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mixed_precision_policy(fsdp.mixed_precision),
        # Pinned host memory speeds host<->GPU copies; it needs CUDA, and on CPU there is no copy.
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if fsdp.cpu_offload else OffloadPolicy(),
    }
    reshard = plan.reshard_after_forward
    units = _sharded_units(model, layers, fsdp)
    for index, unit in enumerate(units):
        # The last layer's parameters are needed again first in backward: keeping them avoids one
        # all-gather (torchtitan does the same).
        fully_shard(unit, reshard_after_forward=reshard and index < len(units) - 1, **common)
    fully_shard(model, reshard_after_forward=reshard, **common)
    if overlaps_on_cpu(mesh.device_type):
        overlap_on_cpu(model, units)
    return model


def overlaps_on_cpu(device_type: str) -> bool:
    """Whether `apply_fsdp2` applies `overlap_on_cpu` (CPU, unless LLAMAFT_FSDP_CPU_OVERLAP=0)."""
    return device_type == "cpu" and os.environ.get(CPU_OVERLAP_ENV, "1") != "0"


def fsdp2_collectives(device_type: str) -> tuple[PlainAllGather, PlainReduceScatter]:
    """The all-gather and reduce-scatter every FSDP2 unit runs on `device_type`, as objects
    `set_custom_all_gather` / `set_custom_reduce_scatter` take: FSDP2's defaults, with all-to-all
    for the reduce-scatter where `overlap_on_cpu` installs it. profiling.py times these."""
    return PlainAllGather(), AllToAllReduceScatter() if overlaps_on_cpu(device_type) else PlainReduceScatter()


def overlap_on_cpu(model: nn.Module, units: Sequence[nn.Module]) -> None:
    """FSDP2 on CPU/gloo: prefetch the next unit's all-gather asynchronously, and reduce-scatter
    with all-to-all. Same collectives' results (bit for bit on 2 ranks), same sharding.

    Forward: each unit (the root first, then the decoder layers in order) issues the next unit's
    all-gather with async_op=True right after its own (`set_modules_to_forward_prefetch`), so
    gloo's thread moves the bytes while this unit computes; the next unit's pre-forward waits for
    it. Backward: FSDP2's default prefetch of the previous unit becomes asynchronous the same way.
    Either holds at most one extra unit's parameters gathered, as FSDP2 on CUDA does (its
    all-gather stream runs one unit ahead); reshard_after_forward is unchanged.
    (torch docs, fully_shard: `set_modules_to_forward_prefetch`, `unshard(async_op=True)`; FSDP2's
    own switch for async pre-forward/pre-backward all-gathers is `FSDPModule._set_unshard_async_op`,
    the one private torch call here: issuing the next unit's
    `unshard(async_op=True)` from a public forward pre-hook instead leaves backward's prefetch
    blocking and gains nothing over FSDP2's defaults (bench/cpu_scaling.py --compare, 3 runs each:
    weak-scaling efficiency 0.66-0.75 vs the defaults' 0.71-0.75; with the switch 0.77-1.04 vs
    0.70-0.91). CPU only: CUDA keeps FSDP2's defaults.)
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return
    chain = [model, *(u for u in units if isinstance(u, FSDPModule))]
    set_async = getattr(model, "_set_unshard_async_op", None)
    if callable(set_async) and len(chain) > 1:
        set_async(True)  # recurses into every FSDP unit
        for current, following in zip(chain, chain[1:], strict=False):
            current.set_modules_to_forward_prefetch([following])
    reduce_scatter = AllToAllReduceScatter()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(reduce_scatter)  # type: ignore[arg-type]


class PlainAllGather:
    """FSDP2's default all-gather (one `all_gather_into_tensor` into a fresh buffer) with public
    torch.distributed calls: `FSDPModule.set_custom_all_gather` (public) takes any object with
    this `allocate` and `__call__` (the interface its docs name; its base class lives in a private
    module)."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False) -> Any:
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class PlainReduceScatter:
    """FSDP2's default reduce-scatter (`reduce_scatter_tensor`), public calls only, for
    `set_custom_reduce_scatter`."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class AllToAllReduceScatter(PlainReduceScatter):
    """A reduce-scatter for FSDP2 that does gloo's reduce-scatter as all-to-all + a local sum.

    Gloo implements reduce_scatter_tensor as an all-reduce of the whole input and a copy of this
    rank's chunk (ProcessGroupGloo::reduce_scatter_tensor_coalesced), so it moves about twice the
    bytes a reduce-scatter needs; all_to_all_single sends each rank only its chunk ((n-1)/n of the
    input, like a ring reduce-scatter), and the sum runs here. On 2 ranks the sum a+b is the same
    float as gloo's, so gradients are bitwise identical; on more ranks only the order of the
    additions differs. Ops other than SUM/AVG, async calls and non-gloo groups use the default."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        world = dist.get_world_size(group)
        if async_op or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or dist.get_backend(group) != "gloo":
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        torch.sum(received.view(world, -1), dim=0, out=output_tensor)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None


def apply_fsdp1(model: nn.Module, fsdp: FsdpSpec, plan: ShardingPlan, mesh: DeviceMesh,
                device: torch.device) -> nn.Module:
    """FSDP1 (FullyShardedDataParallel) with the plan's FSDP1 strategy. HYBRID_SHARD always gets
    the 2-D device mesh: without one FSDP1 silently degrades it to NO_SHARD on CPU and the ranks
    diverge."""
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel
    from torch.distributed.fsdp import MixedPrecision as Fsdp1Precision
    from torch.distributed.fsdp import ShardingStrategy as Fsdp1Strategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    policy = mixed_precision_policy(fsdp.mixed_precision)
    layer_types = {type(layer) for layer in decoder_layers(model)}
    wrap: Any
    if fsdp.wrap_policy.type is WrapPolicyType.DECODER_LAYER:
        wrap = ModuleWrapPolicy(layer_types)
    else:
        wrap = partial(size_based_auto_wrap_policy, min_num_params=fsdp.wrap_policy.min_num_params)
    kwargs: dict[str, Any] = {}
    strategy = plan.fsdp1_strategy
    if strategy is ShardingStrategy.HYBRID_SHARD:
        kwargs["device_mesh"] = mesh
    elif mesh.ndim == 1:
        kwargs["process_group"] = mesh.get_group("shard")
    return FullyShardedDataParallel(
        model,
        sharding_strategy=Fsdp1Strategy[strategy.value],
        mixed_precision=Fsdp1Precision(
            param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype, buffer_dtype=torch.float32
        ),
        cpu_offload=CPUOffload(offload_params=fsdp.cpu_offload),
        auto_wrap_policy=wrap,
        device_id=device,
        param_init_fn=lambda module: _to_empty(module, device),
        use_orig_params=True,
        **kwargs,
    )


def _to_empty(module: nn.Module, device: torch.device) -> None:
    module.to_empty(device=device, recurse=False)


def parallelize(model: nn.Module, fsdp: FsdpSpec, plan: ShardingPlan, mesh: DeviceMesh | None,
                device: torch.device) -> nn.Module:
    """Apply float8, AC, compile and the plan's FSDP wrapper to a meta-device model, as the spec
    says. Without an FSDP wrapper (llamaft.api.sharding) the model comes back unwrapped: the caller
    allocates and loads it, then `replicate` wraps it in DDP where the plan says so."""
    float8.convert(model, fsdp, device)
    layers = decoder_layers(model)
    apply_activation_checkpointing(
        layers, fsdp.activation_checkpointing.mode, fsdp.activation_checkpointing.every_n_layers
    )
    if fsdp.compile:
        apply_compile(layers)
    if not plan.fsdp:
        return model
    if mesh is None:
        raise ValueError(f"the sharding plan wraps with {plan.wrapper.value}: it needs a device mesh")
    if plan.wrapper is Wrapper.FSDP1:
        return apply_fsdp1(model, fsdp, plan, mesh, device)
    return apply_fsdp2(model, fsdp, plan, mesh)


def replicate(model: nn.Module, plan: ShardingPlan, device: torch.device) -> nn.Module:
    """DDP around the loaded model where the plan replicates without FSDP (its constructor
    broadcasts rank 0's parameters, which every rank loaded alike). Buffers are not broadcast
    on every forward: the only ones are the rotary tables, computed alike on every rank. The
    gradients are the buckets' views (no second copy of them)."""
    if plan.wrapper is not Wrapper.DDP:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        broadcast_buffers=False, gradient_as_bucket_view=True,
    )
