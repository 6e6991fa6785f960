"""Peak host RAM and time per rank while putting a ~134M-parameter Llama in place on one node, for
2 and 4 ranks (FSDP2 FULL_SHARD, fp32 master weights, a bf16 safetensors checkpoint like the hub's):

  naive      every rank calls from_pretrained, then shards
  full       the previous path: rank 0 from_pretrained, set_model_state_dict(broadcast_from_rank0)
  broadcast  rank 0 reads one tensor at a time and broadcasts it (LLAMAFT_WEIGHT_LOADING=broadcast)
  sliced     every rank reads only its own rows with safetensors get_slice (the default)

Prints each rank's growth in peak RSS (ru_maxrss: anonymous memory and mapped file pages), the node
total against naive's, and rank 0's growth against what it must hold: its own shard plus the
largest single tensor. Goals (issue 12): node total <= 0.55 x naive with 2 ranks, 0.35 x with 4;
rank 0's growth <= its shard + largest tensor + 10%.

    .venv/bin/python bench/load_memory.py

Figures on the shared 2-core development machine (load average 8-10 from other jobs during the
run), MiB and seconds, one run:

  ranks  method     rank 0   budget  node total  / naive   load s
  2      naive         775      -       1,551      1.00      1.3
  2      full          783    384       1,165      0.75      2.5
  2      broadcast     314    384         647      0.42      1.9
  2      sliced        291    384         584      0.38      1.1
  4      naive         775      -       3,101      1.00      2.9
  4      full          781    244       1,558      0.50      4.8
  4      broadcast     186    244         783      0.25      2.5
  4      sliced        151    244         611      0.20      1.4

(`budget`: rank 0's shard + the largest tensor + 10%.) The memory figures repeat to the MiB from
run to run; the times vary with the machine's load. Three more runs each, slowest rank's seconds:
4 ranks sliced 1.9 / 2.2 / 2.3, broadcast 2.7 / 2.7, full 4.3-4.9; 2 ranks sliced 0.3-0.7,
broadcast 1.1, full 0.9-1.4. Every rank of `broadcast` briefly holds one whole tensor (bf16 here);
with `sliced` none does, and nothing crosses the network.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import DATASET, REPO

METHODS = ("naive", "full", "broadcast", "sliced")
GOAL = {2: 0.55, 4: 0.35}
MIB = 2**20


def shard_bytes(shapes: list[tuple[int, ...]], ranks: int, rank: int = 0, element: int = 4) -> int:
    """Bytes of one rank's FSDP2 shard (torch.chunk along dim 0, as Shard(0) splits)."""
    total = 0
    for shape in shapes:
        rows = shape[0]
        chunk = math.ceil(rows / ranks)
        mine = max(0, min(rows, (rank + 1) * chunk) - rank * chunk)
        total += mine * math.prod(shape[1:]) * element
    return total


def worker(mode: str, cfg_path: str, out_path: str) -> None:
    """One rank (under torchrun): peak RSS before and after putting the sharded model in place,
    `ours` (main.build_model, LLAMAFT_WEIGHT_LOADING picks the method) or `naive` (every rank calls
    from_pretrained, then shards). Leaves through exit_process like the trainer: gloo's threads can
    abort a process that finalizes the interpreter (llamaft_trainer/process/shutdown.py)."""
    import torch
    import torch.distributed as dist
    from llamaft.api.spec import TrainingJobConfig
    from llamaft_trainer.main import build_model
    from llamaft_trainer.model import model as model_step
    from llamaft_trainer.parallel.parallelize import parallelize
    from llamaft_trainer.process.runtime import build_mesh, init_runtime, sharding_plan
    from llamaft_trainer.process.shutdown import exit_process, teardown

    cfg = TrainingJobConfig.model_validate(json.loads(Path(cfg_path).read_text()))
    rt = init_runtime()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    if mode == "ours":
        model, _ = build_model(cfg, rt, model_step.load_model_config(cfg.model, rt))
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(cfg.model.source, dtype=torch.float32)
        fsdp_plan = sharding_plan(cfg.fsdp, rt, force_fsdp=True)  # FSDP itself is measured
        model = parallelize(model, cfg.fsdp, fsdp_plan, build_mesh(fsdp_plan, rt), rt.device)
    dist.barrier()
    result = {"rank": rt.rank, "before_mb": before, "seconds": time.perf_counter() - started,
              "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    gathered: list[Any] = [None] * rt.world_size
    dist.all_gather_object(gathered, result)
    if rt.is_leader:
        Path(out_path).write_text(json.dumps(gathered))
    teardown(rt, None, healthy=True)
    exit_process(0)


def run(nproc: int, method: str, cfg: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
    """One torchrun launch of `nproc` workers; every rank's figures, by rank."""
    from llamaft_trainer.process.local_etcd import free_port

    cfg_path, out = tmp / f"{method}-{nproc}.json", tmp / f"{method}-{nproc}.out.json"
    cfg_path.write_text(json.dumps(cfg))
    # One core per process in every run, so runs with different process counts compare fairly.
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               LLAMAFT_WEIGHT_LOADING="full" if method == "naive" else method)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "operator"), str(REPO / "trainer")])
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
         "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}", __file__, "--worker",
         "naive" if method == "naive" else "ours", str(cfg_path), str(out)],
        env=env, capture_output=True, text=True, cwd=REPO,
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-5000:])
    return sorted(json.loads(out.read_text()), key=lambda r: r["rank"])


def main() -> None:
    import torch
    from llamaft_trainer.tiny import build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = tmp / "llama-134m"
        tok = build_tokenizer(DATASET, 1024)
        config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                             num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024)
        model = LlamaForCausalLM(config)
        shapes = [tuple(p.shape) for p in model.parameters()]
        n = sum(p.numel() for p in model.parameters())
        largest = max(p.numel() for p in model.parameters()) * 4
        # Stored in bf16 like hub Llama checkpoints; training keeps fp32 master weights, so loading
        # converts (a copy) instead of just mapping the file.
        model.to(torch.bfloat16).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        del model
        cfg = {
            "model": {"source": str(model_dir), "dtype": "float32"},
            "dataset": {"format": "samsum", "source": str(DATASET)},
            "training": {"maxSteps": 1},
            "fsdp": {"mixedPrecision": "fp32", "activationCheckpointing": {"mode": "none"}},
        }
        print(f"model: {n / 1e6:.0f}M parameters (bf16 on disk, {n * 4 / MIB:,.0f} MiB as fp32 master weights), "
              f"largest tensor {largest / MIB:,.0f} MiB (fp32), one node; load average {os.getloadavg()[0]:.1f}")
        print("  ranks  method     rank 0   budget  node total  / naive   load s   rank 0 in budget")
        for nproc in (2, 4):
            budget = (shard_bytes(shapes, nproc) + largest) * 1.1 / MIB
            per_rank: dict[str, list[float]] = {}
            for method in METHODS:
                ranks = run(nproc, method, cfg, tmp)
                growth = per_rank[method] = [r["peak_mb"] - r["before_mb"] for r in ranks]
                seconds = max(r["seconds"] for r in ranks)
                ratio = sum(growth) / sum(per_rank["naive"])
                verdict = "" if method == "naive" else ("yes" if growth[0] <= budget else "no")
                goal = "" if method in ("naive", "full") else (" ok" if ratio <= GOAL[nproc] else " MISSED")
                print(f"  {nproc:<6} {method:<10} {growth[0]:>6,.0f}   {'-' if method == 'naive' else f'{budget:,.0f}':>6}"
                      f"  {sum(growth):>10,.0f}  {ratio:>6.2f}{goal:<7} {seconds:>5.1f}   {verdict}", flush=True)
            print(f"  {nproc} ranks, growth per rank (MiB): "
                  + "; ".join(f"{m} " + ", ".join(f"{g:,.0f}" for g in gs) for m, gs in per_rank.items()), flush=True)
        print("  (budget: rank 0's shard + the largest tensor + 10%; growth is peak RSS after minus before loading)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:5])
    else:
        main()
