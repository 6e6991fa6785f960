"""A sweep's figures for one size (Point, from the run's final report) and the scaling efficiency
against the smallest size that finished; report.py lays them out, chart.py draws them.

Scaling efficiency at n devices is the throughput per device there over the throughput per device
at the smallest size measured: 1.0 is ideal linear scaling (the reference blog's 87 % at 16 nodes
is 0.87 against one node). The ideal throughput line is the smallest size's scaled by devices.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
