"""bench/packing.py runs end to end (its smoke mode: a 1-layer model, 2 micro-batches a mode) and
reports the three modes' real-token throughput and bfd's two ratios."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO
from tests.trainer.conftest import trainer_env


def test_packing_bench_smoke() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "packing.py"), "--smoke"], env=trainer_env(),
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(next(line for line in proc.stdout.splitlines() if '"packing_bench"' in line))
    assert set(report["tokens_per_second"]) == {"bfd", "concatenate", "padding"}
    assert all(v > 0 for v in report["tokens_per_second"].values())
    assert report["fill"]["concatenate"] == 1.0 and 0.5 < report["fill"]["bfd"] < 1.0
    assert "bfd / concatenate:" in proc.stdout and "bfd / padding:" in proc.stdout
