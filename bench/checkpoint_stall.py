"""Training stall per checkpoint: synchronous vs asynchronous DCP saves (issue 12), same run and model.

A ~100M-parameter Llama (fp32 weights, FULL_SHARD over 2 CPU processes, AdamW: ~1.2 GB of
checkpoint, ~0.6 GB per rank) trains --steps steps with a checkpoint every --every steps, once with
`checkpointing.async: false` and once with `true`, into a checkpoint directory on the same local
disk (DCP fsyncs every file). The real trainer (`torchrun -m llamaft_trainer`) runs; the figures come
from its own log lines:

- stall: how long the training loop was blocked by the save (`checkpoint` `stall_seconds` for sync,
  the whole save; `checkpoint_staged` `stall_seconds` for async: waiting for the previous save, if
  still running, plus the staging copy);
- write: the write until COMPLETE (`checkpoint` `write_seconds`, in the background for async);
- the median step time of the steps that ran while a background write was going on, against the
  others (on 2 cores the write competes with training for CPU: not a stall, but not free either).

Only the checkpoints before the last step count (the last one is awaited at the end of training in
both modes). Goal: median async stall <= 20% of the median sync stall.

    .venv/bin/python bench/checkpoint_stall.py                      # ~100M parameters
    .venv/bin/python bench/checkpoint_stall.py --hidden 256 --layers 4 --steps 7 --every 2  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import DATASET, REPO


def run(mode: str, model: Path, tmp: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from llamaft_trainer.process.local_etcd import free_port
    from llamaft_trainer.report.logline import read_events

    config = {
        "model": {"source": str(model), "dtype": "float32"},
        "dataset": {"format": "samsum", "source": str(DATASET), "maxSeqLength": args.seq, "packing": True,
                    "validationSplit": 0},
        "training": {"maxSteps": args.steps, "perDeviceBatchSize": 1, "evalInterval": 0, "logInterval": 1},
        "fsdp": {"mixedPrecision": "fp32", "activationCheckpointing": {"mode": "none"}},
        "checkpointing": {"directory": str(tmp / f"ck-{mode}"), "everyNSteps": args.every, "keepLast": 2,
                          "exportHuggingFace": False, "resume": False, "async": mode == "async"},
    }
    path = tmp / f"{mode}.json"
    path.write_text(json.dumps(config))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               LLAMAFT_TERMINATION_LOG=str(tmp / f"{mode}-termination.json"))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "operator"), str(REPO / "trainer")])
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
         "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}",
         "-m", "llamaft_trainer", "--config", str(path)],
        env=env, capture_output=True, text=True, cwd=REPO,
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-5000:])
    return read_events(proc.stdout)


def figures(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    done = {e["step"]: e for e in events if e["event"] == "checkpoint"}
    staged = {e["step"]: e for e in events if e["event"] == "checkpoint_staged"}
    step_times = {e["step"]: e["step_seconds"] for e in events if e["event"] == "step"}
    rows = []
    busy: set[int] = set()  # steps that ran while a background write was going on
    for step in sorted(done):
        stall = staged[step]["stall_seconds"] if step in staged else done[step]["stall_seconds"]
        rows.append({"step": step, "stall": stall, "write": done[step]["write_seconds"],
                     "waited": staged[step]["waited_seconds"] if step in staged else 0.0})
        if step in staged:
            # The write started after step `step`; it was complete by the step whose poll saw it.
            after = [e for e in events if e["event"] in ("step", "checkpoint")]
            seen = next(i for i, e in enumerate(after) if e["event"] == "checkpoint" and e["step"] == step)
            busy |= {e["step"] for e in after[:seen] if e["event"] == "step" and e["step"] > step}
    mid = [r for r in rows if r["step"] < steps]
    quiet = [t for s, t in step_times.items() if s not in busy and s > 1]
    return {
        "rows": rows, "mid": mid,
        "median_stall": statistics.median(r["stall"] for r in mid),
        "median_write": statistics.median(r["write"] for r in mid),
        "step_busy": statistics.median(step_times[s] for s in busy) if busy else None,
        "step_quiet": statistics.median(quiet) if quiet else None,
        "wall": sum(step_times.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=3)
    args = parser.parse_args()
    from llamaft_trainer.tiny import build_tiny_llama

    with tempfile.TemporaryDirectory(dir=os.environ.get("LLAMAFT_BENCH_DIR")) as tmp_name:
        tmp = Path(tmp_name)
        model = build_tiny_llama(tmp / "model", DATASET, hidden_size=args.hidden, layers=args.layers,
                                 heads=args.hidden // 64, kv_heads=max(1, args.hidden // 256), vocab_size=1024)
        results = {}
        for mode in ("sync", "async"):
            started = time.perf_counter()
            events = run(mode, model, tmp, args)
            results[mode] = figures(events, args.steps)
            params = next(e for e in events if e["event"] == "setup")["parameters"]
            print(f"{mode}: {time.perf_counter() - started:.0f} s for the launch, {params / 1e6:.0f}M parameters", flush=True)
            for r in results[mode]["rows"]:
                print(f"  checkpoint step {r['step']:>3}: stall {r['stall']:7.3f} s (waited for the previous "
                      f"{r['waited']:.3f} s), write {r['write']:7.3f} s", flush=True)
        sync, asyn = results["sync"], results["async"]
        ratio = asyn["median_stall"] / sync["median_stall"]
        print(f"\nmedian stall per checkpoint (steps < {args.steps}): sync {sync['median_stall']:.3f} s, "
              f"async {asyn['median_stall']:.3f} s = {100 * ratio:.1f}% of sync (goal <= 20%)")
        print(f"median write: sync {sync['median_write']:.3f} s, async {asyn['median_write']:.3f} s (in the background)")
        if asyn["step_busy"] is not None:
            print(f"async run, median step time: {asyn['step_busy']:.3f} s while a write runs in the background, "
                  f"{asyn['step_quiet']:.3f} s otherwise (sync run: {sync['step_quiet']:.3f} s)")
        print(f"sum of step times (training only, stalls excluded): sync {sync['wall']:.1f} s, async {asyn['wall']:.1f} s")
        print("PASS" if ratio <= 0.2 else "FAIL", f"async stall {100 * ratio:.1f}% of sync")


if __name__ == "__main__":
    main()
