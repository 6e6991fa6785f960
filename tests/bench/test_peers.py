"""bench/peers.py end to end on its FSDP2 pair: both tools measured, the loss traces on identical
batches agree (the HF side runs in .venv-peers, which the bench creates on first use), HF's side
really ran accelerate's FSDP2 (every parameter sharded) on this CPU, and both sides time their
phases (--phases). One pair: each run's cost is its start-up, and this one goes through every
part of the harness the others use (torchrun on both sides, the exported batches, parity)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.peer_venv import PEERS, peer_python
from tests.trainer.conftest import trainer_env


@pytest.mark.slow
def test_peers_fsdp2_pair(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    python = peer_python()
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, str(PEERS), "--steps", "8", "--rounds", "1", "--pairs", "2p-fsdp2", "--phases", "--hf-python", str(python),
         "--work-dir", str(tmp_path / "work"), "--json", str(out)],
        env=trainer_env(), capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    (run,) = report["pairs"]["2p-fsdp2"]["rounds"]
    for tool in ("llamaft", "hf"):
        assert run[tool]["tps"] > 0 and run[tool]["cadence_tps"] > 0, run[tool]
        assert run[tool]["startup_s"] > 0 and run[tool]["peak_rss_mb"] > 0, run[tool]
        assert len(run[tool]["losses"]) == 8
    assert "| 2p-fsdp2 |" in proc.stdout
    # --phases: llamaft's timers (its FSDP2 collectives apart) and the HF peer's (inside forward/backward)
    phases = {tool: run[tool]["extra"]["phases"] for tool in ("llamaft", "hf")}
    assert phases["llamaft"]["all_gather"] > 0 and phases["llamaft"]["reduce_scatter"] > 0, phases
    assert "all_gather" not in phases["hf"] and phases["hf"]["forward"] > 0 and phases["hf"]["optimizer"] > 0, phases
    assert all(phases[tool]["step"] > 0 for tool in phases), phases
    assert "| 2p-fsdp2 | hf |" in proc.stdout
    fsdp2 = run["hf"]["extra"]
    assert fsdp2["sharded_parameters"] == fsdp2["parameters"] > 0, fsdp2  # accelerate's FSDP2, not DDP
    assert fsdp2["wrapper"] != "DistributedDataParallel", fsdp2
    assert report["parity"]["passed"] is True and report["parity"]["max_abs_loss_diff"] <= 1e-5
    assert set(report["parity"]["max_abs_loss_diff_by_pair"]) == {"2p-fsdp2"}
    assert report["versions"]["hf_side"]["transformers"]
