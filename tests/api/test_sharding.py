"""The sharding plan (llamaft.api.sharding) as a table: spec and world size -> wrapper, mesh,
gradient sync; the planner's shard group is the plan's."""

from __future__ import annotations

from typing import Any

import pytest
from llamaft.api.sharding import WRAPPER_ENV, GradientSync, ShardingPlan, Wrapper, plan_sharding
from llamaft.api.spec import FsdpSpec, LlamaFineTuneSpec, ShardingStrategy
from llamaft.planner.memory import shard_group_size


def fsdp(**fields: Any) -> FsdpSpec:
    return FsdpSpec.model_validate({"mixedPrecision": "fp32", **fields})


E, A, N = GradientSync.EVERY_MICRO_STEP, GradientSync.ALL_REDUCE_ON_LAST, GradientSync.NO_SYNC_UNTIL_LAST
ROWS = [
    # (fsdp fields, world, local world) -> (wrapper, mesh shape, shard size, a non-last micro-step's gradient sync)
    ({}, 1, 1, Wrapper.NONE, (1,), 1, E),
    ({"mixedPrecision": "pure-bf16"}, 1, 1, Wrapper.NONE, (1,), 1, E),
    ({"shardingStrategy": "HYBRID_SHARD"}, 1, 1, Wrapper.NONE, (1, 1), 1, E),
    ({"mixedPrecision": "bf16"}, 1, 1, Wrapper.FSDP2, (1,), 1, E),
    ({"cpuOffload": True}, 1, 1, Wrapper.FSDP2, (1,), 1, E),
    ({"float8": {"enabled": True}}, 1, 1, Wrapper.FSDP2, (1,), 1, E),
    ({"implementation": "fsdp1"}, 1, 1, Wrapper.FSDP1, (1,), 1, E),
    ({}, 4, 4, Wrapper.FSDP2, (4,), 4, E),
    ({"shardingStrategy": "SHARD_GRAD_OP"}, 4, 4, Wrapper.FSDP2, (4,), 4, E),
    ({"shardingStrategy": "NO_SHARD"}, 4, 2, Wrapper.DDP, (4, 1), 1, N),
    ({"shardingStrategy": "NO_SHARD", "mixedPrecision": "bf16"}, 4, 2, Wrapper.FSDP2, (4, 1), 1, A),
    ({"shardingStrategy": "NO_SHARD", "implementation": "fsdp1"}, 4, 2, Wrapper.FSDP1, (4, 1), 1, N),
    ({"shardingStrategy": "HYBRID_SHARD"}, 8, 4, Wrapper.FSDP2, (2, 4), 4, A),
    ({"shardingStrategy": "HYBRID_SHARD", "hybridShard": {"shardGroupSize": 2, "replicaGroupSize": 4}}, 8, 4, Wrapper.FSDP2, (4, 2), 2, A),
    ({"shardingStrategy": "HYBRID_SHARD", "implementation": "fsdp1"}, 8, 4, Wrapper.FSDP1, (2, 4), 4, E),
    ({"implementation": "fsdp1"}, 4, 4, Wrapper.FSDP1, (4,), 4, E),
]


@pytest.mark.parametrize(("fields", "world", "local", "wrapper", "mesh", "shard", "sync"), ROWS)
def test_plan_table(monkeypatch: pytest.MonkeyPatch, fields: dict[str, Any], world: int, local: int, wrapper: Wrapper,
                    mesh: tuple[int, ...], shard: int, sync: GradientSync) -> None:
    monkeypatch.delenv(WRAPPER_ENV, raising=False)
    plan = plan_sharding(fsdp(**fields), world, local)
    assert (plan.wrapper, plan.mesh_shape, plan.shard_size, plan.gradient_sync) == (wrapper, mesh, shard, sync)
    assert plan.replicate_size * plan.shard_size == world
    assert len(plan.mesh_dim_names) == len(plan.mesh_shape)


def test_the_switch_keeps_the_specs_fsdp_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WRAPPER_ENV, "fsdp")
    assert plan_sharding(fsdp(), 1, 1).wrapper is Wrapper.FSDP2
    assert plan_sharding(fsdp(shardingStrategy="NO_SHARD"), 2, 2).wrapper is Wrapper.FSDP2
    assert plan_sharding(fsdp(), 1, 1, force_fsdp=False).wrapper is Wrapper.NONE
    monkeypatch.setenv(WRAPPER_ENV, "ddp")
    with pytest.raises(ValueError, match="LLAMAFT_WRAPPER='ddp': use fsdp"):
        plan_sharding(fsdp(), 1, 1)


def test_a_shard_group_that_does_not_divide_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="shardGroupSize 3 does not divide world size 8"):
        plan_sharding(fsdp(shardingStrategy="HYBRID_SHARD", hybridShard={"shardGroupSize": 3, "replicaGroupSize": 3}), 8, 4)


@pytest.mark.parametrize(("fields", "world", "local", "strategy"), [
    ({"implementation": "fsdp1"}, 4, 4, ShardingStrategy.FULL_SHARD),
    ({"implementation": "fsdp1", "shardingStrategy": "SHARD_GRAD_OP"}, 4, 4, ShardingStrategy.SHARD_GRAD_OP),
    ({"implementation": "fsdp1", "shardingStrategy": "NO_SHARD"}, 4, 2, ShardingStrategy.NO_SHARD),
    ({"implementation": "fsdp1", "shardingStrategy": "HYBRID_SHARD"}, 8, 4, ShardingStrategy.HYBRID_SHARD),
    # shard groups of one rank: FSDP1's HYBRID_SHARD would skip the replicas' all-reduce
    ({"implementation": "fsdp1", "shardingStrategy": "HYBRID_SHARD"}, 2, 1, ShardingStrategy.NO_SHARD),
    ({"implementation": "fsdp1", "shardingStrategy": "HYBRID_SHARD",
      "hybridShard": {"shardGroupSize": 1, "replicaGroupSize": 2}}, 2, 2, ShardingStrategy.NO_SHARD),
])
def test_fsdp1_gets_the_plans_strategy(fields: dict[str, Any], world: int, local: int,
                                       strategy: ShardingStrategy) -> None:
    assert plan_sharding(fsdp(**fields), world, local).fsdp1_strategy is strategy


def test_shard_grad_op_alone_keeps_parameters_gathered_after_forward() -> None:
    assert [plan_sharding(fsdp(shardingStrategy=s.value), 4, 4, force_fsdp=True).reshard_after_forward
            for s in ShardingStrategy] == [s is not ShardingStrategy.SHARD_GRAD_OP for s in ShardingStrategy]


@pytest.mark.parametrize("strategy", list(ShardingStrategy))
def test_the_planner_shards_over_the_plans_group(strategy: ShardingStrategy) -> None:
    spec = LlamaFineTuneSpec.model_validate({
        "model": {"source": "hf://meta-llama/Llama-2-7b-hf"}, "dataset": {"format": "samsum", "source": "hf://knkarthick/samsum"},
        "fsdp": {"shardingStrategy": strategy.value}, "cluster": {"workers": 2, "gpusPerWorker": 4},
    })
    plan: ShardingPlan = plan_sharding(spec.fsdp, spec.world_size, spec.cluster.gpus_per_worker)
    assert shard_group_size(spec) == plan.shard_size
