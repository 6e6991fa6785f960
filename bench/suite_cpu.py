"""Where the test suite's time goes: the per-test wall and CPU seconds `pytest --cpu-profile DIR`
wrote (tests/cpu_profile.py), summed per directory and per file, with the costliest tests.

    bash .ci/run --cpu-profile /tmp/suite-cpu && .venv/bin/python bench/suite_cpu.py /tmp/suite-cpu
    bash .ci/run --fast --cpu-profile /tmp/unit-cpu && .venv/bin/python bench/suite_cpu.py /tmp/unit-cpu

On 2 cores the suite is CPU-bound (its tests wait on their own subprocesses, not on each other):
the CPU column, not the wall column, is what a change to a test saves.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def read_rows(directory: Path) -> list[dict[str, Any]]:
    return [row for path in sorted(directory.glob("*.json")) for row in json.loads(path.read_text())]


def group_of(test_id: str, level: str) -> str:
    path = test_id.split("::")[0]
    if level == "file":
        return path
    parts = path.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else "tests (top level)"


def totals(rows: Iterable[Mapping[str, Any]], level: str) -> list[tuple[str, float, float, int]]:
    """(group, wall seconds, CPU seconds, tests) per directory or file, costliest CPU first."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for row in rows:
        entry = sums[group_of(str(row["id"]), level)]
        entry[0] += float(row["wall"])
        entry[1] += float(row["self"]) + float(row["children"])
        entry[2] += 1
    return sorted(((g, w, c, int(n)) for g, (w, c, n) in sums.items()), key=lambda t: -t[2])


def tier_totals(rows: Iterable[Mapping[str, Any]]) -> dict[str, tuple[float, float, int]]:
    """(wall seconds, CPU seconds, tests) per tier (tests/tiers.py): `unit` is what
    `.ci/run --fast` runs. Profiles written before tiers were recorded count as `unknown`."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for row in rows:
        entry = sums[str(row.get("tier", "unknown"))]
        entry[0] += float(row["wall"])
        entry[1] += float(row["self"]) + float(row["children"])
        entry[2] += 1
    return {tier: (w, c, int(n)) for tier, (w, c, n) in sorted(sums.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--top", type=int, default=25, help="how many files and tests to list")
    args = parser.parse_args()
    rows = read_rows(args.directory)
    if not rows:
        raise SystemExit(f"no profile in {args.directory}: run pytest with --cpu-profile {args.directory}")
    wall, cpu = sum(float(r["wall"]) for r in rows), sum(float(r["self"]) + float(r["children"]) for r in rows)
    print(f"{len(rows)} tests: {wall:.0f} s of test time, {cpu:.0f} CPU-s")
    for tier, (w, c, n) in tier_totals(rows).items():
        print(f"  {tier} tier: {n} tests, {w:.0f} s of test time, {c:.0f} CPU-s")
    for level, limit in (("directory", None), ("file", args.top)):
        print(f"\n{'wall s':>8} {'CPU s':>8} {'tests':>5}  {level}")
        for group, w, c, n in totals(rows, level)[:limit]:
            print(f"{w:8.0f} {c:8.0f} {n:5d}  {group}")
    print(f"\n{'wall s':>8} {'CPU s':>8}  test")
    for row in sorted(rows, key=lambda r: -(float(r["self"]) + float(r["children"])))[:args.top]:
        print(f"{float(row['wall']):8.1f} {float(row['self']) + float(row['children']):8.1f}  {row['id']}")


if __name__ == "__main__":
    main()
