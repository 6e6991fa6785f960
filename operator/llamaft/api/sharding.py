"""The sharding plan: what `fsdp.shardingStrategy` (with the rest of `spec.fsdp`) means for a run
of a given world size, derived once here and read by the trainer (mesh, wrapper, gradient sync)
and the planner (shard group size).

Which wrapper runs the model:

- FSDP2 (`fully_shard`) for every sharded strategy, for mixed precision (its policy casts the
  parameters), CPU offload and float8 (torchao's scales and all-gather are FSDP2's);
- FSDP1 when `fsdp.implementation` is fsdp1;
- no wrapper at all at world size 1 when nothing above needs FSDP: one process has nothing to
  shard, and FSDP2 there only copies (an all-gather of one shard, a reduce-scatter into it) and
  adds hooks to every step (forward, backward and optimizer each slower, bench/peers.py);
- DDP (`DistributedDataParallel`) for NO_SHARD in full precision: replication is what DDP does, and
  its bucketed all-reduce overlaps backward, where FSDP2's replicate mesh all-reduces unit by unit.

`LLAMAFT_WRAPPER=fsdp` (a benchmark and debugging switch) keeps the FSDP wrapper the spec names at
every world size, to compare the two paths side by side.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from llamaft.api.base import ApiEnum
from llamaft.api.spec import FsdpImplementation, FsdpSpec, MixedPrecision, ShardingStrategy

WRAPPER_ENV = "LLAMAFT_WRAPPER"
"""`fsdp`: always wrap with FSDP as the spec says; unset or `auto`: this module's choice."""


class Wrapper(ApiEnum):
    NONE = "none"
    DDP = "ddp"
    FSDP2 = "fsdp2"
    FSDP1 = "fsdp1"


class GradientSync(ApiEnum):
    """How a micro-step that does not complete the optimizer step communicates gradients."""

    EVERY_MICRO_STEP = "every-micro-step"
    """Sharded gradients are reduce-scattered on every micro-step and accumulate in the shards (FSDP
    over a 1-D mesh; FSDP1 for every strategy but NO_SHARD, having no all-reduce-only switch), or
    there is nobody to sync with (one process)."""
    ALL_REDUCE_ON_LAST = "all-reduce-on-last"
    """FSDP2 over a 2-D mesh (HYBRID_SHARD, NO_SHARD): reduce-scatter inside the shard group every
    micro-step, the all-reduce across replicas only on the last (`set_requires_all_reduce`)."""
    NO_SYNC_UNTIL_LAST = "no-sync-until-last"
    """Replicated gradients (DDP, FSDP1 NO_SHARD): nothing is communicated until the last micro-step
    (`no_sync`); the full gradients it holds meanwhile are held anyway."""


FULL_PRECISION = (MixedPrecision.FP32, MixedPrecision.PURE_BF16)
"""Precisions whose compute dtype is the master dtype: no cast for FSDP's policy to do, so a plain
module (or DDP, which reduces in the parameters' dtype as these do) computes the same thing."""


@dataclass(frozen=True)
class ShardingPlan:
    """One run's sharding: the wrapper, the device mesh FSDP gets, and how gradients are synced."""

    strategy: ShardingStrategy
    wrapper: Wrapper
    world_size: int
    shard_size: int
    """Ranks one parameter is sharded over (1: replicated)."""

    @property
    def replicate_size(self) -> int:
        return self.world_size // self.shard_size

    @property
    def fsdp(self) -> bool:
        return self.wrapper in (Wrapper.FSDP2, Wrapper.FSDP1)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """FSDP's device mesh: 1-D (shard) for FULL_SHARD and SHARD_GRAD_OP, 2-D (replicate,
        shard) for HYBRID_SHARD and NO_SHARD (shard groups of one: DDP's semantics in FSDP2)."""
        if self.strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
            return (self.world_size,)
        return (self.replicate_size, self.shard_size)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return ("shard",) if len(self.mesh_shape) == 1 else ("replicate", "shard")

    @property
    def reshard_after_forward(self) -> bool:
        """SHARD_GRAD_OP keeps the gathered parameters from forward to backward."""
        return self.strategy is not ShardingStrategy.SHARD_GRAD_OP

    @property
    def fsdp1_strategy(self) -> ShardingStrategy:
        """The strategy FSDP1 is given. Shard groups of one rank are pure replication, and FSDP1
        HYBRID_SHARD over such a mesh skips the replicate all-reduce so the ranks diverge (seen
        with torch 2.13): those run as NO_SHARD."""
        if len(self.mesh_shape) == 2 and self.shard_size == 1:
            return ShardingStrategy.NO_SHARD
        return self.strategy

    @property
    def gradient_sync(self) -> GradientSync:
        """What the training loop does on a micro-step that does not complete the optimizer step."""
        if self.wrapper is Wrapper.DDP or (self.wrapper is Wrapper.FSDP1 and self.strategy is ShardingStrategy.NO_SHARD):
            return GradientSync.NO_SYNC_UNTIL_LAST
        if self.wrapper is Wrapper.FSDP2 and len(self.mesh_shape) == 2:
            return GradientSync.ALL_REDUCE_ON_LAST
        return GradientSync.EVERY_MICRO_STEP


def shard_size(fsdp: FsdpSpec, world_size: int, local_world_size: int) -> int:
    """Ranks a parameter is sharded over: every rank (FULL_SHARD, SHARD_GRAD_OP), none (NO_SHARD),
    or hybridShard.shardGroupSize, by default one node's ranks (HYBRID_SHARD)."""
    strategy = fsdp.sharding_strategy
    if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        return world_size
    if strategy is ShardingStrategy.NO_SHARD:
        return 1
    return fsdp.hybrid_shard.shard_group_size if fsdp.hybrid_shard is not None else local_world_size


def needs_fsdp(fsdp: FsdpSpec) -> bool:
    """Whether the spec asks for something only an FSDP wrapper does, whatever the world size."""
    return (
        fsdp.implementation is FsdpImplementation.FSDP1
        or fsdp.mixed_precision not in FULL_PRECISION
        or fsdp.cpu_offload
        or fsdp.float8.enabled
    )


def always_fsdp(environ: Mapping[str, str] | None = None) -> bool:
    """Whether LLAMAFT_WRAPPER asks for FSDP at every world size."""
    forced = (os.environ if environ is None else environ).get(WRAPPER_ENV, "auto").strip().lower()
    if forced not in ("auto", "fsdp"):
        raise ValueError(f"{WRAPPER_ENV}={forced!r}: use fsdp (always wrap with FSDP) or auto")
    return forced == "fsdp"


def plan_sharding(fsdp: FsdpSpec, world_size: int, local_world_size: int, *,
                  force_fsdp: bool | None = None) -> ShardingPlan:
    """The plan for `world_size` ranks, `local_world_size` of them per node. `force_fsdp`: keep
    the spec's FSDP wrapper at every world size (None: as LLAMAFT_WRAPPER says)."""
    force = always_fsdp() if force_fsdp is None else force_fsdp
    size = shard_size(fsdp, world_size, local_world_size)
    if world_size % size:
        raise ValueError(f"fsdp.hybridShard.shardGroupSize {size} does not divide world size {world_size}")
    wrapper = Wrapper.FSDP1 if fsdp.implementation is FsdpImplementation.FSDP1 else Wrapper.FSDP2
    if not force and not needs_fsdp(fsdp):
        if world_size == 1:
            wrapper = Wrapper.NONE
        elif fsdp.sharding_strategy is ShardingStrategy.NO_SHARD:
            wrapper = Wrapper.DDP
    return ShardingPlan(fsdp.sharding_strategy, wrapper, world_size, size)
