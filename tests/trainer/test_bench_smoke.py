"""The GPU benchmark script runs end to end (tiny model on CPU), so it works when a GPU is lent."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO
from tests.trainer.conftest import trainer_env


def test_gpu_benchmark_smoke() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_throughput.py"), "--smoke"],
        env=trainer_env(MASTER_PORT="29531"), capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if "tokens/s" in line]
    assert len(rows) == 2 and "AC none" in rows[0] and "AC full" in rows[1]
