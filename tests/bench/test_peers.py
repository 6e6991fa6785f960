"""bench/peers.py end to end on two short pairs: both tools measured, the loss traces on identical
batches agree (the HF side runs in .venv-peers, which the bench creates on first use), and the
FSDP2 pair's HF side really ran accelerate's FSDP2 (every parameter sharded) on this CPU; both
sides time their phases (--phases)."""

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
def test_peers_one_and_fsdp2_pair(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    python = peer_python()
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, str(PEERS), "--steps", "8", "--rounds", "1", "--pairs", "1p1t,2p-fsdp2", "--phases", "--hf-python", str(python),
         "--work-dir", str(tmp_path / "work"), "--json", str(out)],
        env=trainer_env(), capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for pair in ("1p1t", "2p-fsdp2"):
        (run,) = report["pairs"][pair]["rounds"]
        for tool in ("llamaft", "hf"):
            assert run[tool]["tps"] > 0 and run[tool]["cadence_tps"] > 0, run[tool]
            assert run[tool]["startup_s"] > 0 and run[tool]["peak_rss_mb"] > 0, run[tool]
            assert len(run[tool]["losses"]) == 8
        assert f"| {pair} |" in proc.stdout
    # --phases: every phase of llamaft's timers and of the HF peer's, summing to the step
    phases = {tool: report["pairs"]["2p-fsdp2"]["rounds"][0][tool]["extra"]["phases"] for tool in ("llamaft", "hf")}
    assert phases["llamaft"]["all_gather"] > 0 and phases["llamaft"]["reduce_scatter"] > 0, phases
    assert "all_gather" not in phases["hf"] and phases["hf"]["forward"] > 0 and phases["hf"]["optimizer"] > 0, phases
    assert "| 2p-fsdp2 | hf |" in proc.stdout
    fsdp2 = report["pairs"]["2p-fsdp2"]["rounds"][0]["hf"]["extra"]
    assert fsdp2["sharded_parameters"] == fsdp2["parameters"] > 0, fsdp2  # accelerate's FSDP2, not DDP
    assert fsdp2["wrapper"] != "DistributedDataParallel", fsdp2
    assert report["parity"]["passed"] is True and report["parity"]["max_abs_loss_diff"] <= 1e-5
    assert set(report["parity"]["max_abs_loss_diff_by_pair"]) == {"1p1t", "2p-fsdp2"}
    assert report["versions"]["hf_side"]["transformers"]
