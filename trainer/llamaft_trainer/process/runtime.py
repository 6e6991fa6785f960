"""The distributed runtime: who am I, which device and backend, which device mesh.

torchrun (and the Kubeflow training operator through PET_* variables) sets RANK, LOCAL_RANK,
WORLD_SIZE and LOCAL_WORLD_SIZE; CUDA/NCCL is chosen when GPUs are visible, CPU/gloo otherwise.

Every process group gets `training.collectiveTimeoutSeconds`: a peer that died or hangs (SIGSTOP,
a wedged GPU, a lost node) turns a blocked collective into an error in bounded time, which the
trainer reports as CollectiveTimeout or PeerLost (termination.classify_exception) instead of holding the job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from llamaft.api.sharding import ShardingPlan, plan_sharding
from llamaft.api.spec import FsdpSpec
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    timeout_s: float = 600.0
    """Timeout of every collective (training.collectiveTimeoutSeconds)."""

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def is_local_leader(self) -> bool:
        return self.local_rank == 0


def init_runtime(timeout_s: float = 600.0) -> Runtime:
    """Initialise the default process group (a single process works too: world size 1) with the
    spec's collective timeout (main passes `training.collectiveTimeoutSeconds`; 600 s is its default).
    gloo fails the blocked operation after it; NCCL's watchdog aborts the communicator."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return Runtime(rank, local_rank, world, local_world, device, float(timeout_s))


def sharding_plan(fsdp: FsdpSpec, rt: Runtime, *, force_fsdp: bool | None = None) -> ShardingPlan:
    """This run's sharding plan (llamaft.api.sharding): the wrapper, the mesh, the gradient sync.
    `force_fsdp`: the spec's FSDP wrapper even where none is needed (the benchmarks that measure
    FSDP itself)."""
    return plan_sharding(fsdp, rt.world_size, rt.local_world_size, force_fsdp=force_fsdp)


def build_mesh(plan: ShardingPlan, rt: Runtime) -> DeviceMesh | None:
    """The mesh FSDP shards over (None when the plan has no FSDP wrapper: DDP and a plain module
    use the default group).

    FULL_SHARD / SHARD_GRAD_OP: 1-D, shard over every rank. HYBRID_SHARD: shard inside groups of
    shardGroupSize (default: the ranks of one node), replicate across them. NO_SHARD under FSDP:
    replicate over every rank with shard groups of one, i.e. DDP semantics with FSDP's
    mixed-precision policy.
    """
    if not plan.fsdp:
        return None
    mesh = init_device_mesh(rt.device.type, plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
    # DeviceMesh creates the groups of a 2-D mesh with new_group's default timeout (30 min for
    # gloo, torch 2.13), not the default group's: give every group the spec's timeout.
    for name in mesh.mesh_dim_names or ():
        mesh.get_group(name).set_timeout(timedelta(seconds=rt.timeout_s))
    return mesh
