"""A sweep's table as text, CSV and JSON, and the files a sweep writes (the points and their
scaling: point.py; the chart: chart.py)."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from llamaft.sweep.point import Point

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
