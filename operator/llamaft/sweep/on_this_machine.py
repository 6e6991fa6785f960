"""The sizes of a sweep run here, one after another, each by `llamaft run --local` (so each is the
cluster's launch, localized). Only the sizes this machine holds run: with GPUs, workers x
gpusPerWorker of them must be visible; on CPU every worker is one process, and more processes than
cores would measure the machine's contention, not the sharding.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from llamaft.sweep.point import Point, from_performance
from llamaft.sweep.runs import SizedRun, SweepPlan


def capacity(plan: SweepPlan) -> tuple[int, str]:
    """(most workers a size may have here, what limits it)."""
    gpus_per_worker = plan.runs[0].spec.cluster.gpus_per_worker if plan.runs else 0
    cores = os.cpu_count() or 1
    if gpus_per_worker:
        from llamaft.local import visible_gpus

        gpus = visible_gpus()
        if gpus >= gpus_per_worker:
            return gpus // gpus_per_worker, f"{gpus} GPU(s), {gpus_per_worker} per worker"
    return cores, f"{cores} CPU core(s), one process per worker"


def run_size(run: SizedRun, directory: Path) -> Point:
    """One size, run to the end here; its figures from the leader's termination message."""
    from llamaft_trainer.public import termination

    from llamaft.local import run_local, visible_gpus

    directory.mkdir(parents=True, exist_ok=True)
    manifest = directory / f"{run.name}.yaml"
    manifest.write_text(yaml.safe_dump(run.body, sort_keys=False), encoding="utf-8")
    run_dir = directory / run.name
    wanted = run.spec.cluster.gpus_per_worker  # without them, capacity() sized the sweep for the CPU
    code = run_local(manifest, run_dir=run_dir, cpu=bool(wanted) and visible_gpus() < wanted)
    reports = [termination.read(str(run_dir / f"termination-{i}.json")) for i in range(run.workers)]
    done = next((r for r in reports if r and r.get("phase") == "Succeeded"), None)
    if code != 0 or done is None:
        failed = next((r for r in reports if r and r.get("phase") == "Failed"), None)
        message = f"{failed.get('reason')}: {failed.get('message')}" if failed else f"exit {code}; logs in {run_dir}"
        return Point(run.workers, str(run_dir), "Failed", message=str(message).splitlines()[0][:300])
    return from_performance(run.workers, str(run_dir), done.get("performance"))


def run(plan: SweepPlan, directory: Path) -> list[Point]:
    """Every size that fits, smallest first; the others as Skipped points saying why."""
    most, limit = capacity(plan)
    points = []
    for index, sized in enumerate(plan.runs, start=1):
        if sized.workers > most:
            points.append(Point(sized.workers, sized.name, "Skipped",
                                message=f"this machine holds at most {most} worker(s) ({limit})"))
            print(f"llamaft sweep: {sized.workers} worker(s): skipped, this machine holds at most {most} ({limit})",
                  flush=True)
            continue
        print(f"llamaft sweep: size {index}/{len(plan.runs)}: {sized.workers} worker(s) ({sized.name})", flush=True)
        points.append(run_size(sized, directory))
    return points
