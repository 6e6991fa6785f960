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


def test_gpu_suite_cpu_smoke(tmp_path: Path) -> None:
    """bench/gpu_suite.py --cpu-smoke: every throughput variant (bf16, compile's row, float8 through
    torchao's emulation, selective-op AC) trains with the trainer's own code and has its planner
    estimate beside it, and `llamaft run --local` runs, checkpoints, resumes and exports."""
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_suite.py"), "--cpu-smoke", "--out", str(tmp_path)],
        env=trainer_env(), capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert report["environment"]["cpu_smoke"] is True and report["environment"]["torch"]
    rows = {row["case"]: row for row in report["rows"]}
    throughput = [row for name, row in rows.items() if name != "llamaft run --local"]
    assert [r["case"].split(", ", 1)[1] for r in throughput] == [
        "bf16", "bf16 + compile", "bf16 + compile + float8", "bf16 + selective-op AC", "bf16, packed documents",
        "bf16, padded documents"]
    for row in throughput:
        assert row["status"] == "Measured", row
        assert row["tokens_per_s_per_gpu"] > 0 and row["estimate_bytes"] > 0 and row["params"] > 0
        assert all(loss == loss and 0 < loss < 20 for loss in row["losses"]), row["losses"]  # finite, plausible
    assert "compile off in the CPU smoke" in rows["tiny shape (CPU smoke), bf16 + compile"]["notes"]
    packed, padded = rows["tiny shape (CPU smoke), bf16, packed documents"], rows["tiny shape (CPU smoke), bf16, padded documents"]
    assert packed["real_tokens_per_step"] == packed["batch"] * packed["seq"]  # whole documents fill every row
    assert padded["real_tokens_per_step"] < padded["batch"] * packed["seq"] // 4 + padded["batch"]  # one short document a row
    run = rows["llamaft run --local"]
    assert run["status"] == "Measured", run
    assert run["first"]["done"]["step"] == 6 and run["resumed"]["resume"]["step"] == 6
    assert run["resumed"]["done"]["step"] == 9 and run["export"]["params"] > 0
    assert "resumed from step 6 to 9" in proc.stdout
