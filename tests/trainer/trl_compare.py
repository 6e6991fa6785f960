"""Run TRL's own code (tests/trainer/trl_peer.py) in .venv-peers, where bench/peers-requirements.txt
installs TRL; the project's venv never gets TRL. Tests that call `run_trl` start a process, so
they are in the slow tier (tests/tiers.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.peer_venv import peer_python
from tests.tiers import starts_processes

PEER_SCRIPT = Path(__file__).with_name("trl_peer.py")


@starts_processes
def run_trl(job: dict[str, Any]) -> dict[str, Any]:
    """TRL's answer to `job` (see trl_peer.py); .venv-peers is made first where it is missing
    (tests/peer_venv.py), so this runs on a fresh clone too."""
    python = peer_python()
    done = subprocess.run([str(python), str(PEER_SCRIPT)], input=json.dumps(job), capture_output=True,
                          text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                                                       "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
