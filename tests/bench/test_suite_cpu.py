"""The suite's CPU profile: the plugin records a test's CPU, its children's included, and the
summary sums it per tier, directory and file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

BUSY_CHILD = """
import subprocess, sys
import pytest

@pytest.mark.slow
def test_a_child_burns_cpu():
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)

def test_idle():
    pass
"""


def test_the_profile_counts_a_reaped_child_and_the_summary_sums_per_file(tmp_path: Path) -> None:
    tests = tmp_path / "tests" / "unit"
    tests.mkdir(parents=True)
    (tests / "test_busy.py").write_text(BUSY_CHILD)
    profile = tmp_path / "profile"
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.cpu_profile", "--cpu-profile", str(profile),
                          "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tests)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    rows = {r["id"].split("::")[-1]: r for r in json.loads((profile / "main.json").read_text())}
    assert rows["test_a_child_burns_cpu"]["children"] > 0.05 > rows["test_idle"]["children"]
    assert (rows["test_a_child_burns_cpu"]["tier"], rows["test_idle"]["tier"]) == ("slow", "unit")
    summary = subprocess.run([sys.executable, str(REPO / "bench" / "suite_cpu.py"), str(profile)],
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    assert "slow tier: 1 tests" in summary.stdout and "unit tier: 1 tests" in summary.stdout
    assert "2 tests:" in summary.stdout and "test_busy.py" in summary.stdout and "tests/unit" in summary.stdout
