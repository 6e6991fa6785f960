"""How close is the capacity planner to what the trainer really holds? Measured on this CPU machine.

    .venv/bin/python bench/plan_accuracy.py [--case NAME ...] [--verbose]

For tiny-to-small Llama shapes and a spread of settings (FULL_SHARD / SHARD_GRAD_OP /
HYBRID_SHARD / NO_SHARD, bf16 / fp16 / fp32 / pure-bf16, activation checkpointing none / full /
selective, LoRA with and without dropout, gradient accumulation, eager vs sdpa, packing vs
padding, batch and sequence length), each case runs the trainer's own code under torchrun (gloo,
1, 2 or 4 processes): `model.build_meta_model` (+ `apply_lora`) -> `parallelize.parallelize`
-> `train.build_optimizer`, then optimizer steps made of `train.token_loss_sum`, `micro_step_sync`
(no gradient sync between micro-steps), `clip_gradients` and AdamW, exactly as `Trainer.train` does.
It prints, per case, the measured per-rank peak, the planner's estimate (`device="cpu"`) and the
error; the target is within +-15%.

How it measures, and why that is fair: torch's `FSDPMemTracker`
(torch.distributed._tools.fsdp2_mem_tracker) is a TorchDispatchMode that sees every tensor an
operator returns (below DTensor, so local shards), registers each storage's size, and drops it
through a weakref callback when the storage dies (resize_ is tracked too, which is how FSDP2
frees unsharded parameters). Its running total is therefore the bytes of live tensor storage,
and its peak is the CPU counterpart of `torch.cuda.max_memory_allocated`, which is what the
planner's "tensor peak" estimates (the CUDA context and allocator fragmentation are a separate,
stated allowance and are excluded here). RSS would not be comparable: it includes the Python
heap, shared libraries and freed-but-cached pages. Steady state: the peak is reset after the first
optimizer step (AdamW creates its state lazily), so it covers a step with optimizer state, as
every step after the first is. The estimate is asked for with `device="cpu"`, which differs from
the CUDA estimate in two documented ways (no forward all-gather prefetch, no reduce-scatter
buffer held across units: both consequences of CUDA streams), plus
the CPU sdpa kernel's extra output copy. The tracker supports FSDP2 only, so `fsdp1` is not
measured. `bench/gpu_plan_check.py` does the same on a GPU with torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for _root in ("operator", "trainer"):
    if str(REPO / _root) not in sys.path:
        sys.path.insert(0, str(REPO / _root))

SHAPES: dict[str, dict[str, Any]] = {
    # about 0.3M parameters (the size of the tests' tiny model)
    "tiny": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2},
    # about 4M parameters, grouped-query attention
    "small": {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4},
    # about 13M parameters with a small vocabulary: the peak is in the layers, not the loss
    "wide": {"vocab_size": 512, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
             "num_attention_heads": 8, "num_key_value_heads": 8},
    # about 14M parameters, multi-head attention, six layers
    "small-mha": {"vocab_size": 4096, "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6,
                  "num_attention_heads": 6, "num_key_value_heads": 6},
}


def _case(name: str, shape: str | dict[str, Any], world: int, batch: int, seq: int, *, fsdp: dict[str, Any] | None = None,
          training: dict[str, Any] | None = None, model: dict[str, Any] | None = None,
          packing: bool = True, shard: int | None = None) -> dict[str, Any]:
    fsdp = {"activationCheckpointing": {"mode": "none"}, **(fsdp or {})}
    strategy = fsdp.get("shardingStrategy", "FULL_SHARD")
    if shard is None:
        shard = {"FULL_SHARD": world, "SHARD_GRAD_OP": world, "NO_SHARD": 1}.get(strategy, world)
    config = {
        "model": {"source": "unused", "dtype": "float32", **(model or {})},
        "dataset": {"format": "samsum", "source": "unused.jsonl", "maxSeqLength": seq, "packing": packing},
        "training": {"maxSteps": 2, "perDeviceBatchSize": batch, **(training or {})},
        "fsdp": fsdp,
    }
    return {"name": name, "shape": shape, "world": world, "shard": shard, "config": config}


CASES: list[dict[str, Any]] = [
    _case("full-shard bf16, no AC", "small", 2, 2, 256),
    _case("full-shard bf16, full AC, batch 4", "small", 2, 4, 256, fsdp={"activationCheckpointing": {"mode": "full"}}),
    _case("full-shard bf16, selective AC 1/2", "small-mha", 2, 2, 256,
          fsdp={"activationCheckpointing": {"mode": "selective", "everyNLayers": 2}}),
    _case("shard-grad-op bf16", "small", 2, 2, 256, fsdp={"shardingStrategy": "SHARD_GRAD_OP"}),
    _case("no-shard fp32, seq 128", "small", 2, 2, 128, fsdp={"shardingStrategy": "NO_SHARD", "mixedPrecision": "fp32"}),
    _case("hybrid 2x2 bf16, full AC", "small", 4, 2, 256, shard=2,
          fsdp={"shardingStrategy": "HYBRID_SHARD", "hybridShard": {"shardGroupSize": 2, "replicaGroupSize": 2},
                "activationCheckpointing": {"mode": "full"}}),
    _case("LoRA q,v r8 dropout 0.05", "small-mha", 2, 4, 256,
          training={"lora": {"r": 8, "targetModules": ["q_proj", "v_proj"], "dropout": 0.05}}),
    _case("LoRA all r16 no dropout, full AC", "small-mha", 2, 4, 256, fsdp={"activationCheckpointing": {"mode": "full"}},
          training={"lora": {"r": 16, "dropout": 0.0, "targetModules":
                             ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}}),
    _case("pure-bf16, accumulation 2", "small", 2, 2, 256, fsdp={"mixedPrecision": "pure-bf16"},
          training={"gradientAccumulationSteps": 2}),
    _case("fp16, full AC, batch 4", "small", 2, 4, 256, fsdp={"mixedPrecision": "fp16", "activationCheckpointing": {"mode": "full"}}),
    _case("bf16 padding (sdpa mask, GQA repeat)", "small", 2, 2, 256, packing=False),
    _case("bf16, accumulation 3, selective AC", "small", 1, 2, 256, training={"gradientAccumulationSteps": 3},
          fsdp={"activationCheckpointing": {"mode": "selective", "everyNLayers": 2}}),
    _case("fp32 eager, padding, seq 128", "small", 1, 2, 128, packing=False, fsdp={"mixedPrecision": "fp32"},
          model={"attnImplementation": "eager"}),
    _case("tiny fp32, batch 8 x 128", "tiny", 1, 8, 128, fsdp={"mixedPrecision": "fp32"}),
    _case("wide bf16, small vocab, no AC", "wide", 2, 2, 256),
    _case("wide bf16, small vocab, full AC", "wide", 2, 4, 256, fsdp={"activationCheckpointing": {"mode": "full"}}),
]


# ---------------------------------------------------------------------------------- worker
class _CudaMeter:
    """The FSDPMemTracker calls run_case makes, answered from the CUDA caching allocator."""

    def __init__(self, device: Any) -> None:
        import torch

        self.device = device
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

    def __enter__(self) -> _CudaMeter:
        return self

    def __exit__(self, *args: Any) -> None:
        return None

    def reset_mod_stats(self) -> None:
        return None

    def reset_peak(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def get_tracker_snapshot(self, kind: str = "peak") -> dict[Any, dict[str, int]]:
        import torch

        torch.cuda.synchronize(self.device)
        peak = int(torch.cuda.max_memory_allocated(self.device))
        return {self.device: {"Total": peak, "max_memory_reserved": int(torch.cuda.max_memory_reserved(self.device))}}


def _reset_peak(tracker: Any) -> None:
    """Start the peak afresh (MemTracker keeps it in private fields; reset_mod_stats does not)."""
    if isinstance(tracker, _CudaMeter):
        tracker.reset_peak()
        return
    snap = tracker.get_tracker_snapshot()
    tracker._peak_mem_snap = snap
    tracker._peak_mem = {dev: dev_snap["Total"] for dev, dev_snap in snap.items()}


def shape_config(case: dict[str, Any]) -> dict[str, Any]:
    shape = case["shape"]
    return dict(SHAPES[shape]) if isinstance(shape, str) else dict(shape)


def run_case(case: dict[str, Any], rt: Any, steps: int = 2, meter: str = "tracker") -> dict[str, Any]:
    """Train `steps` optimizer steps of the case with the trainer's code; the peak of the last one,
    from FSDPMemTracker (`tracker`) or torch.cuda.max_memory_allocated (`cuda`)."""
    import torch
    from llamaft.api.spec import MixedPrecision, TrainingJobConfig
    from llamaft_trainer.model import model as model_step
    from llamaft_trainer.parallel.parallelize import parallelize
    from llamaft_trainer.process.runtime import build_mesh, sharding_plan
    from llamaft_trainer.train import build_optimizer, micro_step_sync, optimizer_step, token_loss_sum
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from transformers import LlamaConfig

    cfg = TrainingJobConfig.model_validate(case["config"])
    batch, seq = cfg.training.per_device_batch_size, cfg.dataset.max_seq_length
    torch.manual_seed(1234 + rt.rank)
    config = LlamaConfig(**shape_config(case), max_position_embeddings=max(seq, 256))
    dtype = model_step.master_dtype(cfg.fsdp.mixed_precision)
    lora = cfg.training.lora if cfg.training.lora is not None and cfg.training.lora.enabled else None
    model = model_step.build_meta_model(config, cfg.model, dtype)
    if lora is not None:
        model = model_step.apply_lora(model, lora)
    fsdp_plan = sharding_plan(cfg.fsdp, rt, force_fsdp=True)  # FSDP itself is measured
    model = parallelize(model, cfg.fsdp, fsdp_plan, build_mesh(fsdp_plan, rt), rt.device)
    # FSDP2 wants offloaded shards materialised on the CPU (the trainer's build_model calls
    # to_empty(rt.device), which FSDP2's lazy init rejects on CUDA with cpuOffload)
    offload_cpu = cfg.fsdp.cpu_offload and rt.device.type == "cuda"
    model.to_empty(device="cpu" if offload_cpu else rt.device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    if offload_cpu:
        for module in model.modules():
            for key, buf in list(module._buffers.items()):
                if buf is not None:
                    module._buffers[key] = buf.to(rt.device)
    model_step.rebuild_rotary_buffers(model, rt.device)
    optimizer = build_optimizer(model, cfg)
    scaler = None
    if cfg.fsdp.mixed_precision is MixedPrecision.FP16:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device=rt.device.type)
    accum = cfg.training.gradient_accumulation_steps
    batches = []
    for _ in range(accum):
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        mask = torch.ones_like(ids)
        labels = ids.clone()
        if not cfg.dataset.packing:
            mask[:, seq * 3 // 4:] = 0  # right padding, as data.pad makes it
            labels[:, seq * 3 // 4:] = -100
        batches.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    if meter == "cuda":
        batches = [{k: v.to(rt.device) for k, v in b.items()} for b in batches]
        tracker: Any = _CudaMeter(rt.device)
    else:
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs(tuple(batches))
    with tracker:
        for step in range(steps):
            for index, b in enumerate(batches):
                with micro_step_sync(model, index == accum - 1, fsdp_plan):
                    loss, _ = token_loss_sum(model, b, rt.device)
                    scaled = loss / 1000.0
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
                tracker.reset_mod_stats()  # per-module stats are per forward; the global peak stays
            optimizer_step(model, optimizer, scaler, cfg)
            if step == steps - 2:
                _reset_peak(tracker)
        peak = tracker.get_tracker_snapshot("peak")
    del model, optimizer
    snap = next(iter(peak.values()))
    return {
        "rank": rt.rank,
        "peak": int(snap["Total"]),
        "categories": {str(getattr(k, "value", k)): int(v) for k, v in snap.items() if k != "Total"},
    }


def worker(cases_path: str, out_path: str) -> None:
    import torch.distributed as dist
    from llamaft_trainer.process.runtime import init_runtime

    rt = init_runtime()
    cases = json.loads(Path(cases_path).read_text())
    results = [run_case(case, rt) for case in cases]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rt.rank == 0:
        merged = []
        for index in range(len(cases)):
            per_rank = [g[index] for g in gathered]
            top = max(per_rank, key=lambda r: r["peak"])
            merged.append({"peak": top["peak"], "categories": top["categories"],
                           "per_rank": [r["peak"] for r in per_rank]})
        Path(out_path).write_text(json.dumps(merged))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ launcher
def measure(cases: list[dict[str, Any]], world: int, tmp: Path) -> list[dict[str, Any]]:
    from llamaft_trainer.process.local_etcd import free_port

    cases_file, out_file = tmp / f"cases-{world}.json", tmp / f"out-{world}.json"
    cases_file.write_text(json.dumps(cases))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "operator"), str(REPO / "trainer")])
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(world),
         "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}",
         str(Path(__file__).resolve()), "--worker", str(cases_file), str(out_file)],
        env=env, capture_output=True, text=True, cwd=REPO, timeout=1800,
    )
    if proc.returncode != 0 and not out_file.exists():
        raise SystemExit(f"torchrun ({world} processes) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    if proc.returncode != 0:
        # every case was measured and written; only the teardown failed (seen once with gloo)
        print(f"note: torchrun ({world} processes) exited {proc.returncode} after writing its results", file=sys.stderr)
    return list(json.loads(out_file.read_text()))


def estimate(case: dict[str, Any], device: str = "cpu") -> Any:
    from llamaft.api.spec import TrainingJobConfig
    from llamaft.planner.memory import setup_from_spec
    from llamaft.planner.replay import estimate_memory
    from llamaft.planner.shapes import shape_from_config

    cfg = TrainingJobConfig.model_validate(case["config"])
    setup = setup_from_spec(cfg, world_size=case["world"], shard_size=case["shard"], device=device)
    return estimate_memory(shape_from_config(shape_config(case), str(case["shape"])[:20]), setup)


def compare(cases: list[dict[str, Any]], verbose: bool = False) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="llamaft-plan-accuracy-") as tmp_name:
        for world in sorted({c["world"] for c in cases}):
            group = [c for c in cases if c["world"] == world]
            for case, measured in zip(group, measure(group, world, Path(tmp_name)), strict=True):
                est = estimate(case)
                error = (est.peak_bytes - measured["peak"]) / measured["peak"]
                rows.append({"case": case["name"], "world": world, "measured": measured["peak"],
                             "estimated": est.peak_bytes, "error": error, "peak_event": est.peak_event,
                             "categories": measured["categories"], "components": est.components})
    return rows


def print_rows(rows: list[dict[str, Any]], verbose: bool = False) -> None:
    mib = 2**20
    print(f"{'case':<40} {'ranks':>5} {'measured MiB':>13} {'estimate MiB':>13} {'error':>7}  estimated peak at")
    for r in rows:
        print(f"{r['case']:<40} {r['world']:>5} {r['measured'] / mib:>13.2f} {r['estimated'] / mib:>13.2f} "
              f"{r['error'] * 100:>+6.1f}%  {r['peak_event']}")
        if verbose:
            measured = ", ".join(f"{k} {v / mib:.2f}" for k, v in r["categories"].items() if v)
            estimated = ", ".join(f"{k} {v / mib:.2f}" for k, v in r["components"].items() if v)
            print(f"    measured:  {measured}\n    estimated: {estimated}")
    worst = max(abs(r["error"]) for r in rows)
    mean = sum(abs(r["error"]) for r in rows) / len(rows)
    print(f"{len(rows)} cases: mean |error| {mean * 100:.1f}%, worst {worst * 100:.1f}% (target: within 15%)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=2, metavar=("CASES", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--case", action="append", help="run only cases whose name contains this (repeatable)")
    parser.add_argument("--verbose", action="store_true", help="print measured categories and estimated components")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    cases = [c for c in CASES if not args.case or any(s in c["name"] for s in args.case)]
    if not cases:
        print("no case matches", file=sys.stderr)
        return 2
    rows = compare(cases, args.verbose)
    print_rows(rows, args.verbose)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(abs(r["error"]) <= 0.15 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
