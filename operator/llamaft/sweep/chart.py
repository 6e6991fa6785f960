"""The scaling chart: throughput against workers beside ideal linear scaling, and scaling efficiency,
every measured point labelled with its figure (matplotlib, drawn off-screen with the Agg backend).

The PNG also carries the sweep's JSON document in a text chunk (`llamaft.sweep`), so the image
and its figures never part: PIL's `Image.open(path).text["llamaft.sweep"]` reads them back.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from llamaft.sweep.point import Point

PNG_KEY = "llamaft.sweep"


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def figure(points: list[Point], title: str) -> Figure:
    """The two panels; only measured points are drawn."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter

    measured = [p for p in points if p.measured]
    workers = [p.workers for p in measured]
    tps = [float(p.tokens_per_second or 0) for p in measured]
    ideal = [float(p.ideal_tokens_per_second or 0) for p in measured]
    efficiency = [100.0 * float(p.scaling_efficiency or 0) for p in measured]

    fig = Figure(figsize=(11, 4.6), dpi=110, layout="constrained")
    throughput, scaling = fig.subplots(1, 2)
    throughput.plot(workers, ideal, linestyle="--", color="#888888", marker="", label="ideal linear scaling")
    throughput.plot(workers, tps, color="#1f6fb4", marker="o", linewidth=2, label="measured")
    for x, y in zip(workers, tps, strict=True):
        throughput.annotate(f"{y:,.0f}", (x, y), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=9)
    throughput.set_title("Throughput")
    throughput.set_ylabel("tokens/s (all devices)")
    throughput.set_ylim(bottom=0, top=max(tps + ideal) * 1.18)
    throughput.legend(loc="upper left")

    scaling.axhline(100.0, linestyle="--", color="#888888", label="ideal (100 %)")
    scaling.plot(workers, efficiency, color="#c2571a", marker="o", linewidth=2, label="measured")
    for x, y in zip(workers, efficiency, strict=True):
        scaling.annotate(f"{y:.1f} %", (x, y), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=9)
    scaling.set_title("Scaling efficiency (per device, against the smallest size)")
    scaling.set_ylabel("%")
    scaling.set_ylim(bottom=0, top=max(efficiency + [100.0]) * 1.18)
    scaling.legend(loc="lower left")

    # Throughput on a linear axis, where ideal scaling is a straight line; efficiency on a log2
    # axis when the sizes double, so 1, 2, 4, 8, 16 are evenly spaced.
    throughput.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    if len(workers) > 1 and workers[-1] / workers[0] >= 4:
        scaling.set_xscale("log", base=2)
    for ax in (throughput, scaling):
        ax.xaxis.set_major_locator(FixedLocator(workers))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_locator(FixedLocator([]))
        ax.set_xlabel("workers")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    return fig


def save(points: list[Point], path: Path, doc: dict[str, Any]) -> Path:
    """Draw and write the PNG, with `doc` in its `llamaft.sweep` text chunk."""
    title = f"{doc['sweep']}: {doc['model']}, {doc['maxSteps']} steps per size ({doc['where']})"
    figure(points, title).savefig(path, format="png", metadata={PNG_KEY: json.dumps(doc)})
    return path
