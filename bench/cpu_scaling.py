"""Throughput and weak-scaling efficiency of the real trainer on CPU: 1 vs 2 processes, and where
the time goes.

Same per-process batch (weak scaling), FULL_SHARD fp32, a small Llama; all runs in this one
invocation. Prints tokens/s (median over steps after warm-up) and efficiency = tps(2) / (2 x tps(1)),
then a per-phase breakdown (ms per step) from the trainer's phase timers (LLAMAFT_PHASE_TIMERS=1,
llamaft_trainer/report/profiling.py):

  1 proc     one trainer process, one thread, one core
  2x1 conc.  two independent 1-process trainers at once (no communication at all): what running
             two processes on the machine's cores costs by itself (shared caches, memory bandwidth,
             the hypervisor's vCPUs), i.e. the ceiling any communication scheme could reach
  2 procs    one FSDP2 job on 2 processes (gloo on loopback), with parallelize.overlap_on_cpu
  2 procs (dflt)  the same with FSDP2's defaults (--compare; LLAMAFT_FSDP_CPU_OVERLAP=0)

With FSDP2's defaults on CPU every all-gather and reduce-scatter blocks the training thread (the
CUDA streams FSDP2 overlaps with are no-ops there), so `all_gather` + `reduce_scatter` is the
exposed communication; overlap_on_cpu runs the decoder layers' all-gathers one unit ahead on gloo's
thread and reduce-scatters with all-to-all (gloo's reduce-scatter is an all-reduce), which leaves
the root's all-gathers and the reduce-scatters exposed.

Reading it on a 2-vCPU machine: a 2-process job has no spare core, the 1-process baseline has one
(for the OS, gloo's threads, and anything else running), so other load on the machine lowers the
efficiency far more than it lowers tokens/s of the baseline; the `2x1 conc.` ceiling shows how much.
Compare efficiencies within one invocation, run several rounds, and note the load average printed.

    .venv/bin/python bench/cpu_scaling.py                 # one round: 1 proc, 2x1 concurrent, 2 procs
    .venv/bin/python bench/cpu_scaling.py --runs 3        # three rounds, every efficiency and the median table
    .venv/bin/python bench/cpu_scaling.py --compare       # also 2 procs with FSDP2's CPU defaults, each round
    .venv/bin/python bench/cpu_scaling.py --stat min      # per run the fastest step (a busy shared machine)
    .venv/bin/python bench/cpu_scaling.py --no-phases     # timers off (efficiency only)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import DATASET, torchrun

STEPS, WARMUP = 12, 3


@dataclass
class Run:
    tps: float
    """Job tokens/s over the steps after warm-up: their median, or the fastest's (--stat min)."""
    phases: dict[str, float] = field(default_factory=dict)
    """ms per step per phase (over steps, of the mean over ranks), see profiling.summarize."""
    parameters: int = 0
    threads: list[int] = field(default_factory=list)
    """torch intra-op threads seen on the ranks."""


def config(model: Path, checkpoints: Path, steps: int) -> dict[str, Any]:
    return {
        "model": {"source": str(model), "dtype": "float32"},
        "dataset": {"format": "samsum", "source": str(DATASET), "maxSeqLength": 256, "packing": True, "validationSplit": 0},
        "training": {"maxSteps": steps, "perDeviceBatchSize": 2, "evalInterval": 0},
        "fsdp": {"mixedPrecision": "fp32", "activationCheckpointing": {"mode": "none"}},
        # Only the final step saves, after the measured ones; synchronously, so no background
        # writer is alive when the workers tear down.
        "checkpointing": {"directory": str(checkpoints), "everyNSteps": 1000, "exportHuggingFace": False, "resume": False,
                          "async": False},
    }


def train(nproc: int, model: Path, tmp: Path, steps: int, phases: bool, overlap: bool = True, stat: str = "median") -> Run:
    """`overlap`: parallelize.overlap_on_cpu (False: FSDP2's defaults, as before it existed).
    `stat`: over the steps after warm-up, "median" or "min" (the fastest step: tokens/s and phases)."""
    from llamaft_trainer.parallel.parallelize import CPU_OVERLAP_ENV
    from llamaft_trainer.report.logline import read_events
    from llamaft_trainer.report.profiling import ENV_VAR, summarize

    tmp.mkdir(parents=True, exist_ok=True)
    env = {ENV_VAR: "1" if phases else "0", CPU_OVERLAP_ENV: "1" if overlap else "0"}
    _, stdout = torchrun(nproc, "train", config(model, tmp / "checkpoints", steps), tmp, env=env)
    events = read_events(stdout)
    step_events = [e for e in events if e.get("event") == "step"]
    rates = [e["tokens_per_second"] for e in step_events[WARMUP:]]
    tps = max(rates) if stat == "min" else statistics.median(rates)
    parameters = next(e["parameters"] for e in events if e.get("event") == "setup")
    timed = [e for e in events if e.get("event") == "phases"]
    threads = sorted({int(e["threads"]) for e in timed if "threads" in e})
    return Run(tps, summarize(timed, skip_steps=WARMUP, stat=stat) if timed else {}, parameters, threads)


def concurrent_pair(model: Path, tmp: Path, steps: int, phases: bool, stat: str = "median") -> Run:
    """Two independent 1-process trainers at the same time: per-process figures, averaged."""
    runs: list[Run] = []
    errors: list[BaseException] = []

    def one(index: int) -> None:
        try:
            runs.append(train(1, model, tmp / f"pair{index}", steps, phases, stat=stat))
        except BaseException as exc:  # noqa: B036 (SystemExit from torchrun: report it in the caller)
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    names = runs[0].phases.keys()
    return Run(
        statistics.mean(r.tps for r in runs),
        {k: statistics.mean(r.phases[k] for r in runs) for k in names},
        runs[0].parameters,
    )


def load_average() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def median_phases(runs: list[Run]) -> dict[str, float]:
    names = runs[0].phases.keys()
    return {k: statistics.median(r.phases[k] for r in runs) for k in names}


def print_table(columns: dict[str, dict[str, float]], stat: str) -> None:
    """Phases x runs, then `delta`: the last column (2 procs) minus the first (1 proc)."""
    from llamaft_trainer.report.profiling import PHASES

    names = list(columns)
    first, last = columns[names[0]], columns[names[-1]]
    head = f"{'phase':<15}" + "".join(f"{n:>16}" for n in names) + f"{'delta':>9}"
    print(head)
    print("-" * len(head))
    for phase in (*PHASES, "step"):
        cells = "".join(f"{columns[n][phase]:>16.1f}" for n in names)
        print(f"{phase:<15}{cells}{last[phase] - first[phase]:>+9.1f}")
    over = "median over steps" if stat == "median" else "the fastest step"
    print(f"(ms per step, per process; {over} after warm-up, mean over ranks; median over rounds)")


def limits(columns: dict[str, dict[str, float]], parameters: int) -> None:
    """Where the 2-process step's extra time goes, the communication volume, and what the machine
    allows: `2x1 conc.` is the step with no communication at all (see the module docstring)."""
    one, two = columns["1 proc"], columns["2 procs"]
    pair, default = columns.get("2x1 conc."), columns.get("2 procs (dflt)")
    comm = two["all_gather"] + two["reduce_scatter"]
    ag_mb, rs_mb = two["all_gather_bytes"] / 1e6, two["reduce_scatter_bytes"] / 1e6
    print(f"collectives per step and rank: all-gather {ag_mb:.1f} MB of full buffers ({ag_mb / (parameters * 4e-6):.2f}x "
          f"the fp32 model), reduce-scatter {rs_mb:.1f} MB; on 2 ranks each moves half of that per rank")
    for name, col in (("FSDP2 CPU defaults (blocking)", default), ("2 procs", two)):
        if col is not None:
            ag, rs = col["all_gather"], col["reduce_scatter"]
            print(f"  {name}: all-gather {ag:.1f} ms ({ag_mb / 2 / max(ag, 1e-9):.2f} GB/s), reduce-scatter {rs:.1f} ms "
                  f"({rs_mb / 2 / max(rs, 1e-9):.2f} GB/s) exposed per step")
    extra = two["step"] - one["step"]
    print(f"2-process step {two['step']:.1f} ms vs 1 process {one['step']:.1f} ms: {extra:+.1f} ms, of which")
    shared = 0.0
    if pair is not None:
        shared = pair["step"] - one["step"]
        print(f"  {shared:+7.1f} ms  two processes sharing the machine, no communication (2x1 conc. - 1 proc)")
    print(f"  {comm:+7.1f} ms  exposed all-gather + reduce-scatter")
    print(f"  {two['sync'] - one['sync']:+7.1f} ms  sync: the loop's small all-reduces, where a rank waits for the slower one")
    rest = extra - shared - comm - (two["sync"] - one["sync"])
    print(f"  {rest:+7.1f} ms  the rest (FSDP copy-in/out and gradient copies, optimizer on half the parameters, ...)")
    if pair is not None:
        print(f"ceiling with free communication (1 proc / 2x1 conc. step): {one['step'] / pair['step']:.2f}")
        print(f"best with this exposed communication and nothing else lost (1 proc / (2x1 step + comm)): "
              f"{one['step'] / (pair['step'] + comm):.2f}")
        if default is not None:
            blocking = default["all_gather"] + default["reduce_scatter"]
            print(f"best with FSDP2's blocking CPU collectives (1 proc / (2x1 step + {blocking:.1f} ms)): "
                  f"{one['step'] / (pair['step'] + blocking):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1, help="rounds of (1 proc, 2x1 concurrent, 2 procs)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps per run ({WARMUP} of them warm-up)")
    parser.add_argument("--no-phases", action="store_true", help="phase timers off: efficiency only")
    parser.add_argument("--stat", choices=("median", "min"), default="median",
                        help="per run: the median step, or the fastest (min: least disturbed by other load)")
    parser.add_argument("--no-pair", action="store_true", help="skip the 2x1 concurrent baseline")
    parser.add_argument("--compare", action="store_true",
                        help="also run 2 processes with FSDP2's CPU defaults (LLAMAFT_FSDP_CPU_OVERLAP=0) each round")
    args = parser.parse_args()
    from llamaft_trainer.tiny import build_tiny_llama

    phases = not args.no_phases
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = build_tiny_llama(tmp / "model", DATASET, hidden_size=256, layers=4, heads=8, kv_heads=4, vocab_size=1024)
        ones: list[Run] = []
        twos: list[Run] = []
        pairs: list[Run] = []
        defaults: list[Run] = []
        for index in range(args.runs):
            before = load_average()
            one = train(1, model, tmp / f"r{index}-1", args.steps, phases, stat=args.stat)
            pair = None if args.no_pair else concurrent_pair(model, tmp / f"r{index}-pair", args.steps, phases, args.stat)
            if args.compare:
                default = train(2, model, tmp / f"r{index}-2d", args.steps, phases, overlap=False, stat=args.stat)
                defaults.append(default)
                print(f"run {index + 1}: 2 processes, FSDP2 CPU defaults: {default.tps:,.0f} tokens/s, "
                      f"efficiency {default.tps / (2 * one.tps):.2f}")
            two = train(2, model, tmp / f"r{index}-2", args.steps, phases, stat=args.stat)
            ones.append(one)
            twos.append(two)
            print(f"run {index + 1}: 1 process {one.tps:,.0f} tokens/s; 2 processes {two.tps:,.0f} tokens/s "
                  f"({two.tps / 2:,.0f} per process), {one.parameters:,} parameters"
                  + (f", torch threads per process {two.threads}" if two.threads else ""))
            if pair is not None:
                pairs.append(pair)
                print(f"       2x1 concurrent (no communication): {pair.tps:,.0f} tokens/s per process "
                      f"(ceiling {pair.tps / one.tps:.2f})")
            print(f"       weak-scaling efficiency 1 -> 2 processes: {two.tps / (2 * one.tps):.2f} "
                  f"({before} before, {load_average()} after)")
        efficiencies = [t.tps / (2 * o.tps) for o, t in zip(ones, twos, strict=True)]
        listed = ", ".join(f"{e:.2f}" for e in efficiencies)
        if defaults:
            old = [d.tps / (2 * o.tps) for o, d in zip(ones, defaults, strict=True)]
            print(f"weak-scaling efficiency with FSDP2's CPU defaults: {statistics.median(old):.2f} "
                  f"(median of {len(old)}: {', '.join(f'{e:.2f}' for e in old)})")
        print(f"weak-scaling efficiency 1 -> 2 processes: {statistics.median(efficiencies):.2f} (median of {len(efficiencies)}: {listed})")
        if phases:
            one_p, two_p = median_phases(ones), median_phases(twos)
            pair_p = median_phases(pairs) if pairs else None
            columns = {"1 proc": one_p}
            if pair_p is not None:
                columns["2x1 conc."] = pair_p
            if defaults:
                columns["2 procs (dflt)"] = median_phases(defaults)
            columns["2 procs"] = two_p
            print()
            print_table(columns, args.stat)
            limits(columns, ones[0].parameters)


if __name__ == "__main__":
    main()
