"""A sweep's figures, table, files and chart: efficiency against the smallest measured size, every
output saying the same thing, and a PNG that is a real picture carrying its figures."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from llamaft.sweep import chart
from llamaft.sweep.point import Point, from_performance, with_scaling
from llamaft.sweep.report import table, write_outputs


def measured(workers: int, tps: float, devices_per_worker: int = 8) -> Point:
    world = workers * devices_per_worker
    return from_performance(workers, f"blog-w{workers}", {
        "steps": 49, "worldSize": world, "tokensPerSecond": tps, "tokensPerSecondPerDevice": tps / world,
        "stepSeconds": 1.5, "mfu": 0.41, "peakMemoryBytes": 60 * 2**30})


def blog() -> list[Point]:
    """The reference blog's shape: 16 nodes at 87 % of linear."""
    return [measured(16, 16 * 8 * 2900 * 0.87), measured(1, 8 * 2900.0), measured(2, 2 * 8 * 2900 * 0.95),
            Point(4, "blog-w4", "Failed", message="OOMKilled")]


def test_efficiency_is_per_device_throughput_against_the_smallest_measured_size() -> None:
    points = with_scaling(blog())
    assert [p.workers for p in points] == [1, 2, 4, 16]
    assert [p.scaling_efficiency for p in points] == [1.0, 0.95, None, 0.87]
    assert [p.ideal_tokens_per_second for p in points] == [23200.0, 46400.0, None, 371200.0]
    # The smallest size failed: the next one is the base.
    again = with_scaling([Point(1, "w1", "Failed", message="x"), measured(2, 100.0), measured(4, 150.0)])
    assert [p.scaling_efficiency for p in again] == [None, 1.0, 0.75]


def test_a_success_without_figures_is_not_a_measurement() -> None:
    point = from_performance(2, "w2", None)
    assert point.phase == "Failed" and not point.measured and "without a performance report" in point.message


def test_the_files_and_the_picture_say_the_same(tmp_path: Path) -> None:
    points = with_scaling(blog())
    written = write_outputs(points, tmp_path, sweep="blog", source="blog.yaml", model="meta-llama/Llama-2-7b-hf",
                            max_steps=50, where="cluster")
    rows = list(csv.DictReader(written["csv"].open()))
    doc = json.loads(written["json"].read_text())
    assert [r["workers"] for r in rows] == ["1", "2", "4", "16"] == [str(p["workers"]) for p in doc["points"]]
    assert [r["scaling_efficiency"] for r in rows] == ["1.0", "0.95", "", "0.87"]
    assert rows[2]["phase"] == "Failed" and rows[2]["message"] == "OOMKilled"
    from PIL import Image

    with Image.open(written["png"]) as image:
        assert image.format == "PNG" and image.size[0] > 800 and image.size[1] > 400
        assert json.loads(image.text[chart.PNG_KEY]) == doc, "the figures travel inside the image"
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 100, "a drawing, not a blank canvas"
    text = table(points)
    assert "87.0%" in text and "OOMKilled" in text and "60.00" in text


def test_the_chart_labels_every_measured_figure() -> None:
    fig = chart.figure(with_scaling(blog()), "blog")
    texts = {t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))}
    assert {"23,200", "44,080", "322,944"} <= texts, "tokens/s of each size on the throughput panel"
    assert {"100.0 %", "95.0 %", "87.0 %"} <= texts, "efficiency of each size"
    axes = fig.get_axes()
    assert [tick.get_text() for tick in axes[0].get_xticklabels()] == ["1", "2", "16"]
    assert axes[0].get_xscale() == "linear" and axes[1].get_xscale() == "log" and {line.get_label() for line in axes[0].get_lines()} >= {"ideal linear scaling", "measured"}


@pytest.mark.parametrize("sizes", [[1], [1, 2]])
def test_a_chart_of_one_or_two_sizes(tmp_path: Path, sizes: list[int]) -> None:
    points = with_scaling([measured(n, 1000.0 * n * 0.9 ** (n - 1), 1) for n in sizes])
    written = write_outputs(points, tmp_path, sweep="tiny", source="t.yaml", model="tiny", max_steps=6, where="local")
    assert written["png"].stat().st_size > 10_000
