"""Throughput and weak-scaling efficiency of the real trainer on CPU: 1 vs 2 processes.

Same per-process batch (weak scaling), FULL_SHARD fp32, a small Llama; both runs in this one
invocation. Prints tokens/s (median over steps after warm-up) and efficiency = tps(2) / (2 x tps(1)).
On a 2-core machine each process gets one core (OMP_NUM_THREADS), so the ideal is 1.0 and the gap
is FSDP's all-gather / reduce-scatter over gloo.

    .venv/bin/python bench/cpu_scaling.py
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from _common import DATASET, torchrun

STEPS, WARMUP = 12, 3


def main() -> None:
    from llamaft_trainer.tiny import build_tiny_llama

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = build_tiny_llama(tmp / "model", DATASET, hidden_size=256, layers=4, heads=8, kv_heads=4, vocab_size=1024)
        figures = {}
        for nproc in (1, 2):
            config = {
                "model": {"source": str(model), "dtype": "float32"},
                "dataset": {"format": "samsum", "source": str(DATASET), "maxSeqLength": 256, "packing": True, "validationSplit": 0},
                "training": {"maxSteps": STEPS, "perDeviceBatchSize": 2, "evalInterval": 0},
                "fsdp": {"mixedPrecision": "fp32", "activationCheckpointing": {"mode": "none"}},
                "checkpointing": {"directory": str(tmp / f"ck{nproc}"), "everyNSteps": 1000, "exportHuggingFace": False, "resume": False},
            }
            _, stdout = torchrun(nproc, "train", config, tmp)
            steps = [json.loads(line) for line in stdout.splitlines() if '"event": "step"' in line]
            tps = statistics.median(s["tokens_per_second"] for s in steps[WARMUP:])
            params = [json.loads(line) for line in stdout.splitlines() if '"event": "setup"' in line][0]["parameters"]
            figures[nproc] = tps
            print(f"{nproc} process(es): {tps:,.0f} tokens/s ({tps / nproc:,.0f} per process), {params:,} parameters")
        print(f"weak-scaling efficiency 1 -> 2 processes: {figures[2] / (2 * figures[1]):.2f}")


if __name__ == "__main__":
    main()
