"""Run TRL's own code (tests/trainer/trl_peer.py) in .venv-peers, where bench/peers-requirements.txt
installs TRL; the project's venv never gets TRL. Tests that call `run_trl` start a process, so
they are in the slow tier (tests/tiers.py), and skip with the reason when .venv-peers has no TRL."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.tiers import starts_processes

PEER_PYTHON = REPO / ".venv-peers" / "bin" / "python"
PEER_SCRIPT = Path(__file__).with_name("trl_peer.py")


def trl_missing() -> str | None:
    """Why TRL cannot be run, or None when .venv-peers has it."""
    if not PEER_PYTHON.exists():
        return f"{PEER_PYTHON} is missing: bench/peers.py creates it (pip install -r bench/peers-requirements.txt)"
    if not list((REPO / ".venv-peers" / "lib").glob("python*/site-packages/trl/trainer/dpo_trainer.py")):
        return ".venv-peers has no TRL: .venv-peers/bin/pip install -r bench/peers-requirements.txt"
    return None


@starts_processes
def run_trl(job: dict[str, Any]) -> dict[str, Any]:
    """TRL's answer to `job` (see trl_peer.py), or a skip naming what is missing."""
    reason = trl_missing()
    if reason:
        pytest.skip(reason)
    done = subprocess.run([str(PEER_PYTHON), str(PEER_SCRIPT)], input=json.dumps(job), capture_output=True,
                          text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                                                       "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
