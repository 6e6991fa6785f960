"""Does a finished run exit 0 every time? Runs the short LoRA and full-parameter configs (the
tests' shapes: tiny Llama, 2 processes under torchrun, c10d on loopback, a few steps, a mid-run
checkpoint and the export) N times each and counts non-zero exits.

A teardown race (a C++ thread destroyed while joinable at interpreter exit: "terminate called
without an active exception", SIGABRT, torchrun exits 1) shows up only in some runs, so one green
run proves nothing; this prints every failure's log tail and a summary line:

    .venv/bin/python bench/stress_exit.py --runs 30
    stress_exit: lora 0/30 failed, full 0/30 failed (60 runs, 512 s)

Runs are sequential (each torchrun start costs seconds of CPU) and every worker gets
PYTHONFAULTHANDLER=1, so a crash prints every Python thread's stack.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import DATASET, REPO, free_port

CONFIGS = ("lora", "full")


def config(kind: str, model: Path, directory: Path) -> dict[str, Any]:
    """The tests' short configs: a checkpoint mid-run and the export at the end."""
    training: dict[str, Any] = {"maxSteps": 6, "perDeviceBatchSize": 2, "learningRate": 2e-3, "evalInterval": 0, "seed": 7}
    if kind == "lora":
        training.update(learningRate=1e-2, lora={"r": 4, "alpha": 8, "dropout": 0.0, "targetModules": ["q_proj", "v_proj"]})
    return {
        "model": {"source": str(model), "dtype": "float32"},
        "dataset": {"format": "samsum", "source": str(DATASET), "maxSeqLength": 64, "packing": True, "validationSplit": 0.1},
        "training": training,
        "fsdp": {"mixedPrecision": "fp32", "activationCheckpointing": {"mode": "none"}},
        "checkpointing": {"directory": str(directory), "everyNSteps": 3, "exportHuggingFace": True, "resume": False},
    }


def run_once(kind: str, model: Path, tmp: Path, index: int) -> tuple[int, float, str]:
    """One torchrun launch: (exit code, seconds, combined log)."""
    path = tmp / f"{kind}-{index}.json"
    path.write_text(json.dumps(config(kind, model, tmp / f"ck-{kind}-{index}")))
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
        "LLAMAFT_TERMINATION_LOG": str(tmp / f"termination-{kind}-{index}.json"),
        "PYTHONPATH": ":".join([str(REPO / "operator"), str(REPO / "trainer")]),
    }
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
         "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}",
         "-m", "llamaft_trainer", "--config", str(path)],
        env=env, capture_output=True, text=True, cwd=REPO, timeout=600,
    )
    return proc.returncode, time.perf_counter() - started, proc.stdout + proc.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30, help="launches per config (default 30)")
    parser.add_argument("--only", choices=CONFIGS, help="run one config only")
    parser.add_argument("--tail", type=int, default=4000, help="characters of each failure's log to print")
    args = parser.parse_args()
    from llamaft_trainer.tiny import build_tiny_llama

    kinds = [args.only] if args.only else list(CONFIGS)
    failures: dict[str, int] = dict.fromkeys(kinds, 0)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="llamaft-stress-") as name:
        tmp = Path(name)
        model = build_tiny_llama(tmp / "tiny-llama", DATASET, hidden_size=64, layers=4, vocab_size=512)
        for index in range(args.runs):
            for kind in kinds:
                code, seconds, log = run_once(kind, model, tmp, index)
                print(f"{kind} run {index + 1}/{args.runs}: exit {code} ({seconds:.1f} s)", flush=True)
                if code != 0:
                    failures[kind] += 1
                    print(f"----- {kind} run {index + 1} log tail -----\n{log[-args.tail:]}\n-----", flush=True)
    parts = ", ".join(f"{kind} {failures[kind]}/{args.runs} failed" for kind in kinds)
    total = args.runs * len(kinds)
    print(f"stress_exit: {parts} ({total} runs, {time.perf_counter() - started:.0f} s)", flush=True)
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
