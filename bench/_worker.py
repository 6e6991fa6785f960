"""Worker side of the benchmarks (started by torchrun from the bench scripts; not a test)."""

from __future__ import annotations

import json
import resource
import sys
import time

import torch
import torch.distributed as dist
from llamaft.api.spec import TrainingJobConfig
from llamaft_trainer.process.runtime import build_mesh, init_runtime, sharding_plan
from llamaft_trainer.process.shutdown import exit_process


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load(mode: str, cfg: TrainingJobConfig) -> dict[str, float]:
    """Peak host RSS after putting the sharded model in place: `ours` (meta init, rank 0 reads and
    broadcasts) or `naive` (every rank calls from_pretrained, then shards)."""
    rt = init_runtime()
    from llamaft_trainer.main import build_model
    from llamaft_trainer.model import model as model_step
    from llamaft_trainer.parallel.parallelize import parallelize

    before = peak_rss_mb()
    started = time.perf_counter()
    if mode == "ours":
        model, _ = build_model(cfg, rt, model_step.load_model_config(cfg.model, rt))
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(cfg.model.source, dtype=torch.float32)
        fsdp_plan = sharding_plan(cfg.fsdp, rt, force_fsdp=True)  # FSDP itself is measured
        model = parallelize(model, cfg.fsdp, fsdp_plan, build_mesh(fsdp_plan, rt), rt.device)
    dist.barrier()
    return {"rank": rt.rank, "before_mb": before, "peak_mb": peak_rss_mb(), "seconds": time.perf_counter() - started}


def train(cfg: TrainingJobConfig) -> dict[str, float]:
    rt = init_runtime()
    from llamaft_trainer.main import run

    _, result = run(cfg, rt)
    return {"rank": rt.rank, "steps": result.state.step}


if __name__ == "__main__":
    mode, cfg_path, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    config = TrainingJobConfig.model_validate(json.loads(open(cfg_path).read()))
    result = train(config) if mode == "train" else load(mode, config)
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        with open(out_path, "w") as out:
            json.dump(gathered, out)
    dist.barrier()
    dist.destroy_process_group()
    # Never interpreter finalization: a gloo worker thread that drops a tensor then aborts the
    # process (SIGABRT, "terminate called without an active exception"; llamaft_trainer/process/shutdown.py).
    exit_process(0)
