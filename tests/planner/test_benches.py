"""The planner's benchmark scripts run end to end on this machine (the GPU one in its CPU smoke
mode, so its code is exercised before a GPU is lent)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.trainer.conftest import trainer_env


def test_gpu_plan_check_smoke() -> None:
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_plan_check.py"), "--smoke"],
        env=trainer_env(MASTER_PORT="29537"), capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("smoke ")]
    assert len(rows) == 2 and all("%" in row for row in rows)
    assert "2 cases: mean |error|" in proc.stdout


@pytest.mark.slow
def test_plan_accuracy_one_case(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "plan_accuracy.py"), "--case", "tiny fp32", "--json", str(out)],
        env=trainer_env(), capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["case"] == "tiny fp32, batch 8 x 128" and abs(row["error"]) <= 0.15
    assert row["measured"] > 0 and "(target: within 15%)" in proc.stdout
