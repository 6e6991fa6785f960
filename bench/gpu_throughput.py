"""GPU throughput and MFU of the trainer's parallelize step on one GPU (sized for < 8 min on one
H200): a Llama-shaped ~1B model, FSDP2 bf16, activation checkpointing off/full, compile off/on.

    python bench/gpu_throughput.py [--seq 2048 --batch 4 --steps 20]

Runs each configuration in this process (world size 1), random token batches, warm-up excluded,
and prints tokens/s and MFU (torchtitan's formula, llamaft_trainer.metrics.flops_per_token) against
the GPU's dense bf16 peak. Needs CUDA; exits with a message otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, compile off: checks the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.seq, args.batch, args.steps, args.warmup = 64, 2, 2, 1
    elif not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_PORT", "29517")
    from llamaft.api.spec import FsdpSpec, ModelSpec
    from llamaft_trainer.metrics import flops_per_token, peak_flops
    from llamaft_trainer.model import build_meta_model, rebuild_rotary_buffers
    from llamaft_trainer.parallelize import parallelize
    from llamaft_trainer.runtime import build_mesh, init_runtime
    from transformers import LlamaConfig

    rt = init_runtime()
    if args.smoke:
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq)
    else:
        config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                             num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=args.seq)
    cuda = rt.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    peak = peak_flops(rt.device)
    name = torch.cuda.get_device_name(rt.device) if cuda else "cpu"
    print(f"device: {name}, peak bf16 {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s")
    for ac in ("none", "full"):
        for compile_ in ((False,) if args.smoke else (False, True)):
            fsdp = FsdpSpec.model_validate({"mixedPrecision": "bf16", "activationCheckpointing": {"mode": ac}, "compile": compile_})
            model = build_meta_model(config, ModelSpec(source="unused"), torch.float32)
            n_params = sum(p.numel() for p in model.parameters())
            model = parallelize(model, fsdp, build_mesh(fsdp, rt), rt.device)
            model.to_empty(device=rt.device)
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0.0, 0.02)
            rebuild_rotary_buffers(model, rt.device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
            tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=rt.device)
            if cuda:
                torch.cuda.reset_peak_memory_stats(rt.device)
            times = []
            for step in range(args.warmup + args.steps):
                sync()
                start = time.perf_counter()
                logits = model(input_ids=tokens, use_cache=False).logits
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sync()
                if step >= args.warmup:
                    times.append(time.perf_counter() - start)
            tps = args.batch * args.seq / (sum(times) / len(times))
            fpt = flops_per_token(config, n_params, args.seq)
            mfu = tps * fpt / peak if peak else float("nan")
            mem = torch.cuda.max_memory_allocated(rt.device) / 2**30 if cuda else float("nan")
            print(f"{n_params / 1e9:.2f}B params | AC {ac:>4} | compile {str(compile_):>5} | "
                  f"{tps:,.0f} tokens/s | MFU {mfu:.1%} | peak memory {mem:.1f} GiB")
            del model, optimizer
            if cuda:
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
