"""A sweep's figures: one Point per size from its run's final report, the scaling efficiency
against the smallest size that finished, and the table as text, CSV and JSON (the chart: chart.py).

Scaling efficiency at n devices is the throughput per device there over the throughput per device
at the smallest size measured: 1.0 is ideal linear scaling (the reference blog's 87 % at 16 nodes
is 0.87 against one node). The ideal throughput line is the smallest size's scaled by devices.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Point:
    """One size: what its run sustained (None where the run did not report it), or why not."""

    workers: int
    run: str
    """The LlamaFineTune (cluster) or run directory (local) the figures are from."""
    phase: str
    """Succeeded; Failed, TimedOut or Skipped when there are no figures."""
    world_size: int | None = None
    tokens_per_second: float | None = None
    tokens_per_second_per_device: float | None = None
    step_seconds: float | None = None
    peak_memory_bytes: int | None = None
    mfu: float | None = None
    steps: int | None = None
    scaling_efficiency: float | None = None
    ideal_tokens_per_second: float | None = None
    message: str = ""

    @property
    def measured(self) -> bool:
        return self.tokens_per_second is not None and bool(self.world_size)


def from_performance(workers: int, run: str, performance: dict[str, Any] | None, phase: str = "Succeeded",
                     message: str = "") -> Point:
    """A Point from the trainer's `performance` (status.performance, camelCase)."""
    p = performance or {}
    if phase == "Succeeded" and not p:
        phase, message = "Failed", message or "the run succeeded without a performance report (no step was timed)"
    return Point(
        workers=workers, run=run, phase=phase, world_size=p.get("worldSize"), tokens_per_second=p.get("tokensPerSecond"),
        tokens_per_second_per_device=p.get("tokensPerSecondPerDevice"), step_seconds=p.get("stepSeconds"),
        peak_memory_bytes=p.get("peakMemoryBytes"), mfu=p.get("mfu"), steps=p.get("steps"), message=message,
    )


def with_scaling(points: list[Point]) -> list[Point]:
    """Points in ascending size, with efficiency and ideal throughput against the smallest measured."""
    points = sorted(points, key=lambda p: p.workers)
    base = next((p for p in points if p.measured), None)
    if base is None:
        return points
    assert base.tokens_per_second is not None and base.world_size
    per_device = base.tokens_per_second / base.world_size
    out = []
    for p in points:
        if p.measured:
            assert p.tokens_per_second is not None and p.world_size
            p = replace(p, scaling_efficiency=round(p.tokens_per_second / p.world_size / per_device, 4),
                        ideal_tokens_per_second=round(per_device * p.world_size, 2))
        out.append(p)
    return out


COLUMNS = ("workers", "world_size", "tokens_per_second", "tokens_per_second_per_device", "step_seconds",
           "peak_memory_bytes", "mfu", "scaling_efficiency", "ideal_tokens_per_second", "steps", "phase", "run", "message")


def _gib(value: int | None) -> str:
    return "" if value is None else f"{value / 2**30:.2f}"


def table(points: list[Point]) -> str:
    """The figures as a fixed-width table for the terminal."""
    head = ("workers", "devices", "tokens/s", "tokens/s/device", "step s", "peak GiB/device", "MFU", "efficiency",
            "ideal tokens/s", "")
    rows = [head]
    for p in points:
        if not p.measured:
            rows.append((str(p.workers), "", "", "", "", "", "", "", "", f"{p.phase}: {p.message}"))
            continue
        rows.append((
            str(p.workers), str(p.world_size), f"{p.tokens_per_second:,.0f}", f"{p.tokens_per_second_per_device:,.0f}",
            f"{p.step_seconds:.4f}" if p.step_seconds is not None else "", _gib(p.peak_memory_bytes),
            f"{p.mfu:.1%}" if p.mfu is not None else "n/a", f"{p.scaling_efficiency:.1%}" if p.scaling_efficiency is not None else "",
            f"{p.ideal_tokens_per_second:,.0f}" if p.ideal_tokens_per_second is not None else "", "",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(widths[i]) if i < len(head) - 1 else cell for i, cell in enumerate(r)).rstrip()
                     for r in rows)


def to_csv(points: list[Point]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for p in points:
        writer.writerow({k: ("" if v is None else v) for k, v in asdict(p).items()})
    return out.getvalue()


def document(points: list[Point], *, sweep: str, source: str, model: str, max_steps: int, where: str) -> dict[str, Any]:
    """The sweep as one JSON document (also embedded in the PNG)."""
    return {"sweep": sweep, "file": source, "model": model, "maxSteps": max_steps, "where": where,
            "points": [asdict(p) for p in points]}


def write_outputs(points: list[Point], directory: Path, *, sweep: str, source: str, model: str, max_steps: int,
                  where: str) -> dict[str, Path]:
    """sweep.csv, sweep.json and scaling.png (when matplotlib is there) in `directory`."""
    from llamaft.sweep import chart

    directory.mkdir(parents=True, exist_ok=True)
    doc = document(points, sweep=sweep, source=source, model=model, max_steps=max_steps, where=where)
    written = {"csv": directory / "sweep.csv", "json": directory / "sweep.json"}
    written["csv"].write_text(to_csv(points), encoding="utf-8")
    written["json"].write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    if chart.available() and any(p.measured for p in points):
        written["png"] = chart.save(points, directory / "scaling.png", doc)
    return written
