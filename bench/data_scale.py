"""Data preparation at scale: per-rank memory and time to the first batch for a large dataset,
the token store (built once, mapped by every rank, reused by a resumed attempt) and the streamed
mode beside the previous data step (every rank tokenizing record by record into padded Python
lists), in one run, on synthetic samsum-style records and the tiny tokenizer.

    .venv/bin/python bench/data_scale.py                      # 1,000,000 records, 2 ranks
    .venv/bin/python bench/data_scale.py --records 200000     # quicker

Per rank, from just before the data step to the first batch: `rss` is the growth of the resident
set, `anon` of its anonymous part (what the rank holds itself), `peak` of its peak (ru_maxrss: a
builder's batches while it tokenizes), `seconds` the time; `+N`: the same after N more batches
(training's reads). The previous code cannot hold 10^6 records on this machine (~16 GiB per rank
at maxSeqLength 512), so it runs on --baseline-records, once in one process alone and once as
every rank of the same --ranks launch (each rank preparing the whole set, as it did), and its
memory and time are scaled to --records linearly (it holds every sequence padded: linear). Its
records/s is the records over the slowest rank's time, as the store's is. Targets (issue 21): data RSS per rank <= 1 GiB at 10^6
records whatever maxSeqLength; a resumed attempt's data preparation <= 10% of the first's;
preparation >= 5x the previous code's records/s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SAMSUM = REPO / "examples" / "data" / "samsum-tiny.jsonl"


def rss_mb() -> float:
    import psutil

    return float(psutil.Process().memory_info().rss) / 2**20


def anon_mb() -> float:
    """Anonymous resident memory (RssAnon): what the rank holds itself, without the store's
    file-backed pages, which the page cache shares between a node's ranks and can drop."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synthetic(path: Path, n: int, seed: int = 0) -> None:
    """`n` samsum-style records: each dialogue 3-12 lines drawn from the shipped set's dialogues,
    each summary one of its summaries (realistic text for the tokenizer, no two records alike)."""
    base = [json.loads(line) for line in SAMSUM.read_text().splitlines() if line.strip()]
    lines = [line for r in base for line in r["dialogue"].splitlines() if line.strip()]
    summaries = [r["summary"] for r in base]
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            dialogue = "\n".join(rng.choice(lines) for _ in range(rng.randint(3, 12)))
            f.write(json.dumps({"id": str(i), "dialogue": dialogue, "summary": rng.choice(summaries)}) + "\n")


def spec_dict(source: Path, seq: int, streaming: bool) -> dict[str, Any]:
    return {"format": "samsum", "source": str(source), "maxSeqLength": seq, "packing": False,
            "validationSplit": 0.01, "streaming": streaming}


# ------------------------------------------------------------------------------------- workers
def baseline_worker(cfg: dict[str, Any], out: Path) -> None:
    """One rank of the previous code under torchrun: every rank prepares the whole set itself."""
    sys.path.insert(0, str(Path(__file__).parent))
    import _baseline_data
    import torch.distributed as dist
    from llamaft.api.spec import DatasetSpec
    from llamaft_trainer.process.runtime import init_runtime
    from transformers import AutoTokenizer

    rt = init_runtime()
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    spec = DatasetSpec.model_validate(cfg["dataset"])
    dist.barrier()
    rss0, peak0, started = rss_mb(), peak_mb(), time.perf_counter()
    train, _ = _baseline_data.prepare(spec, tok, 0)
    result = {"rank": rt.rank, "seconds": time.perf_counter() - started, "rss_mb": rss_mb() - rss0,
              "peak_mb": peak_mb() - peak0, "sequences": len(train)}
    _finish(rt, result, out)


def store_worker(cfg: dict[str, Any], out: Path) -> None:
    """One rank under torchrun: build_data (the trainer's call) and the first batch of the epoch at
    `skip` micro-batches in (a resumed attempt starts mid-epoch)."""
    import torch.distributed as dist
    from llamaft.api.spec import DatasetSpec
    from llamaft_trainer.inputs import build_data
    from llamaft_trainer.process.runtime import init_runtime
    from transformers import AutoTokenizer

    rt = init_runtime()
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    spec = DatasetSpec.model_validate(cfg["dataset"])
    dist.barrier()
    rss0, anon0, peak0, started = rss_mb(), anon_mb(), peak_mb(), time.perf_counter()
    data = build_data(spec, tok, 4, 0, rt, cfg["checkpoints"])
    prepared = time.perf_counter() - started
    batches = data.batches(epoch=0, skip=cfg["skip"])
    next(batches)
    seconds = time.perf_counter() - started
    rss, anon = rss_mb() - rss0, anon_mb() - anon0
    for _ in range(cfg["then"]):  # a stretch of training's reads: the pages it touches stay shared
        next(batches)
    result = {"rank": rt.rank, "prepare_s": prepared, "seconds": seconds, "rss_mb": rss, "anon_mb": anon,
              "peak_mb": peak_mb() - peak0, "later_rss_mb": rss_mb() - rss0, "later_anon_mb": anon_mb() - anon0}
    _finish(rt, result, out)


def _finish(rt: Any, result: dict[str, Any], out: Path) -> None:
    """Every rank's figures to rank 0's file, then leave as the trainer does (exit_process: gloo's
    threads can abort a process that finalizes the interpreter)."""
    import torch.distributed as dist
    from llamaft_trainer.process.shutdown import exit_process, teardown

    gathered: list[Any] = [None] * rt.world_size
    dist.all_gather_object(gathered, result)
    if rt.is_leader:
        out.write_text(json.dumps(gathered))
    teardown(rt, None, healthy=True)
    exit_process(0)


# ------------------------------------------------------------------------------------ launches
def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "operator"), str(REPO / "trainer")])
    return env


def launch(ranks: int, mode: str, cfg: dict[str, Any], tmp: Path, tag: str) -> Any:
    from llamaft_trainer.process.local_etcd import free_port

    cfg_path, out = tmp / f"{tag}.json", tmp / f"{tag}.out.json"
    cfg_path.write_text(json.dumps(cfg))
    prefix = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(ranks),
              "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}"]
    proc = subprocess.run([*prefix, __file__, "--worker", mode, str(cfg_path), str(out)], env=_env(),
                          capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-5000:])
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--baseline-records", type=int, default=50_000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--then", type=int, default=2000, help="batches read after the first (memory while training)")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, cfg_path, out = args.worker
        cfg = json.loads(Path(cfg_path).read_text())
        (baseline_worker if mode == "baseline" else store_worker)(cfg, Path(out))
        return

    with tempfile.TemporaryDirectory(prefix="data-scale-") as tmp_name:
        tmp = Path(tmp_name)
        t0 = time.perf_counter()
        model = tmp / "tiny"
        subprocess.run([sys.executable, "-m", "llamaft.cli", "make-tiny-model", str(model)], env=_env(), check=True,
                       capture_output=True)
        big, small = tmp / "big.jsonl", tmp / "small.jsonl"
        synthetic(big, args.records)
        synthetic(small, args.baseline_records)
        print(f"{args.records:,} synthetic records ({big.stat().st_size / 2**20:,.0f} MiB), "
              f"baseline on {args.baseline_records:,}; {args.ranks} ranks; set up in {time.perf_counter() - t0:.0f} s",
              flush=True)
        scale = args.records / args.baseline_records
        rows = []

        def row(name: str, results: list[dict[str, Any]], note: str) -> None:
            rows.append((name, *(_ranks(results, k) for k in ("rss_mb", "anon_mb", "peak_mb", "later_rss_mb",
                                                               "later_anon_mb", "seconds")), note))

        for seq in args.seq:
            base_cfg = {"model": str(model), "dataset": spec_dict(small, seq, False)}
            alone = launch(1, "baseline", base_cfg, tmp, f"base1-{seq}")[0]
            alone_rate = args.baseline_records / alone["seconds"]
            rows.append((f"previous, 1 process alone, {seq}", f"{alone['rss_mb'] * scale:,.0f}*", "-",
                         f"{alone['peak_mb'] * scale:,.0f}*", "-", "-", f"{args.records / alone_rate:,.1f}*",
                         f"{alone_rate:,.0f} records/s"))
            base = launch(args.ranks, "baseline", base_cfg, tmp, f"base-{seq}")
            base_rate = args.baseline_records / max(r["seconds"] for r in base)
            rows.append((f"previous, {args.ranks} ranks, {seq}", *(" / ".join(f"{r[k] * scale:,.0f}*" for r in base) if k else "-"
                                                                  for k in ("rss_mb", None, "peak_mb", None, None)),
                         f"{args.records / base_rate:,.1f}*", f"{base_rate:,.0f} records/s"))
            ckpt = tmp / f"ckpt-{seq}"
            cfg = {"model": str(model), "dataset": spec_dict(big, seq, False), "checkpoints": str(ckpt), "skip": 0,
                   "then": args.then}
            first = launch(args.ranks, "store", cfg, tmp, f"first-{seq}")
            rate = args.records / max(r["prepare_s"] for r in first)
            row(f"store, first attempt, {seq}", first,
                f"{rate:,.0f} records/s ({rate / base_rate:.1f}x {args.ranks} ranks, {rate / alone_rate:.1f}x 1 alone)")
            resumed = launch(args.ranks, "store", {**cfg, "skip": args.records // (8 * args.ranks * 4)}, tmp, f"again-{seq}")
            ratio = max(r["seconds"] for r in resumed) / max(r["seconds"] for r in first)
            row(f"store, resumed mid-epoch, {seq}", resumed, f"{ratio:.1%} of the first's time")
            stream_cfg = {**cfg, "dataset": spec_dict(big, seq, True), "checkpoints": str(tmp / f"stream-{seq}")}
            row(f"streaming, {seq}", launch(args.ranks, "store", stream_cfg, tmp, f"stream-{seq}"), "-")
            resumed_stream = launch(args.ranks, "store", {**stream_cfg, "skip": args.records // (2 * args.ranks * 4)},
                                    tmp, f"stream-again-{seq}")
            row(f"streaming, resumed half-way, {seq}", resumed_stream, "-")
        header = ("run", "rss", "anon", "peak", f"rss +{args.then}", f"anon +{args.then}", "seconds", "")
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        for line in [header, *rows]:
            print("  ".join(str(v).ljust(w) for v, w in zip(line, widths, strict=True)))
        print(f"MiB per rank (rank 0 / rank 1), seconds to the first batch; * the previous code on "
              f"{args.baseline_records:,} records scaled to {args.records:,}; +{args.then}: after {args.then} more batches")
        print(f"total {time.perf_counter() - t0:.0f} s")


def _ranks(results: list[dict[str, Any]], key: str) -> str:
    return " / ".join(f"{r[key]:,.1f}" if key == "seconds" else f"{r[key]:,.0f}" for r in sorted(results, key=lambda r: r["rank"]))


if __name__ == "__main__":
    main()
