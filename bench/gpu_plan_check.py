"""The capacity planner against torch.cuda.max_memory_allocated on one GPU (sized for one H200,
about 3 minutes):

    python bench/gpu_plan_check.py [--case NAME ...]
    python bench/gpu_plan_check.py --smoke      # tiny model on the CPU: checks the script runs

Each case builds a Llama-shaped model (about 1.2B parameters) with the trainer's own code
(`model.build_meta_model`, `apply_lora`, `parallelize`, `build_optimizer`) on one GPU (world size
1, so FULL_SHARD shards over one rank), trains two optimizer steps exactly as `Trainer.train` does
(token_loss_sum, no gradient sync between micro-steps, clipping, AdamW), resets the CUDA peak
after the first step and prints the second step's torch.cuda.max_memory_allocated next to the
planner's tensor-peak estimate (`device="cuda"`) and the error; max_memory_reserved is printed
too, to show what the planner's fragmentation allowance stands for. Target: within +-15%. Needs
CUDA; exits with a message otherwise. `--smoke` runs two tiny cases on the CPU, measured with
FSDPMemTracker as bench/plan_accuracy.py does.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_accuracy import _case, estimate, run_case  # noqa: E402

# A Llama-shaped ~1.2B model (TinyLlama-like width, 16 layers, Llama 2 vocabulary).
ONE_B: dict[str, Any] = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
                         "num_attention_heads": 32, "num_key_value_heads": 4}
TINY: dict[str, Any] = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2}

GPU_CASES: list[dict[str, Any]] = [
    _case("bf16, no AC, 2 x 2048", ONE_B, 1, 2, 2048),
    _case("bf16, full AC, 8 x 4096", ONE_B, 1, 8, 4096, fsdp={"activationCheckpointing": {"mode": "full"}}),
    _case("bf16, selective AC 1/2, 4 x 2048", ONE_B, 1, 4, 2048,
          fsdp={"activationCheckpointing": {"mode": "selective", "everyNLayers": 2}}),
    _case("bf16, accumulation 2, full AC", ONE_B, 1, 4, 2048, fsdp={"activationCheckpointing": {"mode": "full"}},
          training={"gradientAccumulationSteps": 2}),
    _case("pure-bf16, no AC, 2 x 2048", ONE_B, 1, 2, 2048, fsdp={"mixedPrecision": "pure-bf16"}),
    _case("fp32, full AC, 2 x 1024", ONE_B, 1, 2, 1024, fsdp={"mixedPrecision": "fp32", "activationCheckpointing": {"mode": "full"}}),
    _case("LoRA q,v r16 dropout 0.05, 4 x 2048", ONE_B, 1, 4, 2048,
          training={"lora": {"r": 16, "targetModules": ["q_proj", "v_proj"], "dropout": 0.05}}),
    _case("LoRA all r8, full AC, 8 x 2048", ONE_B, 1, 8, 2048, fsdp={"activationCheckpointing": {"mode": "full"}},
          training={"lora": {"r": 8, "dropout": 0.0, "targetModules":
                             ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}}),
    _case("bf16 padding (sdpa mask), 2 x 2048", ONE_B, 1, 2, 2048, packing=False),
    _case("bf16 eager, 2 x 1024", ONE_B, 1, 2, 1024, model={"attnImplementation": "eager"}),
    _case("bf16 CPU offload, full AC, 4 x 2048", ONE_B, 1, 4, 2048,
          fsdp={"cpuOffload": True, "activationCheckpointing": {"mode": "full"}}),
]

SMOKE_CASES: list[dict[str, Any]] = [
    _case("smoke bf16, no AC", TINY, 1, 2, 64),
    _case("smoke LoRA, full AC", TINY, 1, 2, 64, fsdp={"activationCheckpointing": {"mode": "full"}},
          training={"lora": {"r": 4, "targetModules": ["q_proj", "v_proj"]}}),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", help="run only cases whose name contains this")
    parser.add_argument("--smoke", action="store_true", help="two tiny cases on the CPU (FSDPMemTracker)")
    args = parser.parse_args(argv)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_plan_check: no CUDA device here; run it on a GPU machine (or --smoke)", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    from llamaft_trainer.process.runtime import init_runtime

    rt = init_runtime()
    cases = SMOKE_CASES if args.smoke else GPU_CASES
    cases = [c for c in cases if not args.case or any(s in c["name"] for s in args.case)]
    meter, device = ("tracker", "cpu") if args.smoke else ("cuda", "cuda")
    name = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(rt.device)
    print(f"device: {name}; measured: {'FSDPMemTracker peak' if args.smoke else 'torch.cuda.max_memory_allocated'}")
    mib = 2**20
    print(f"{'case':<40} {'measured MiB':>13} {'estimate MiB':>13} {'error':>7} {'reserved MiB':>13}  estimated peak at")
    errors = []
    for case in cases:
        measured = run_case(case, rt, meter=meter)
        est = estimate(case, device=device)
        error = (est.peak_bytes - measured["peak"]) / measured["peak"]
        errors.append(error)
        reserved = measured["categories"].get("max_memory_reserved")
        print(f"{case['name']:<40} {measured['peak'] / mib:>13.1f} {est.peak_bytes / mib:>13.1f} {error * 100:>+6.1f}% "
              f"{(reserved or 0) / mib:>13.1f}  {est.peak_event}", flush=True)
        if not args.smoke:
            torch.cuda.empty_cache()
    worst = max(abs(e) for e in errors)
    print(f"{len(errors)} cases: mean |error| {sum(abs(e) for e in errors) / len(errors) * 100:.1f}%, "
          f"worst {worst * 100:.1f}% (target: within 15%)")
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0 if args.smoke or worst <= 0.15 else 1


if __name__ == "__main__":
    raise SystemExit(main())
