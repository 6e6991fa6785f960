"""Peak host RAM per rank while putting a ~100M-parameter Llama in place on one node, both ways in
one run, for 2 and 4 ranks: ours (meta-device model, rank 0 alone reads the weights and broadcasts)
vs every rank calling from_pretrained before sharding. Prints each rank's growth in peak RSS and the
node-level ratio. Expected shape: naive grows as ranks x model; ours as model + ranks x shard.

    .venv/bin/python bench/load_memory.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from _common import DATASET, torchrun


def main() -> None:
    import torch
    from llamaft_trainer.tiny import build_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = tmp / "llama-100m"
        tok = build_tokenizer(DATASET, 1024)
        config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                             num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024)
        model = LlamaForCausalLM(config)
        n = sum(p.numel() for p in model.parameters())
        # Stored in bf16 like hub Llama checkpoints; training keeps fp32 master weights, so loading
        # converts (a copy) instead of just mapping the file.
        model.to(torch.bfloat16).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        del model
        torch.cuda.empty_cache()
        cfg = {
            "model": {"source": str(model_dir), "dtype": "float32"},
            "dataset": {"format": "samsum", "source": str(DATASET)},
            "training": {"maxSteps": 1},
            "fsdp": {"mixedPrecision": "fp32", "activationCheckpointing": {"mode": "none"}},
        }
        print(f"model: {n / 1e6:.0f}M parameters (bf16 on disk, {n * 4 / 2**20:,.0f} MiB as fp32 master weights), one node")
        for nproc in (2, 4):
            growth = {}
            for mode in ("naive", "ours"):
                ranks, _ = torchrun(nproc, mode, cfg, tmp)
                growth[mode] = [r["peak_mb"] - r["before_mb"] for r in sorted(ranks, key=lambda r: r["rank"])]
                print(f"  {nproc} ranks, {mode:>5}: loading growth per rank (MiB) "
                      + ", ".join(f"{g:,.0f}" for g in growth[mode]) + f"; node total {sum(growth[mode]):,.0f}")
            print(f"  {nproc} ranks: node RAM for loading, ours / naive = {sum(growth['ours']) / sum(growth['naive']):.2f}; "
                  f"a non-leader rank uses {growth['naive'][1] / max(growth['ours'][1], 1.0):.1f}x less")

if __name__ == "__main__":
    main()
