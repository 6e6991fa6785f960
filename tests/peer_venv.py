"""The peers' venv (.venv-peers: HF Trainer, accelerate, TRL, pinned in bench/peers-requirements.txt),
for the tests that run a peer itself. bench/peers.py makes it when it is missing or its versions
differ from the pins (minutes, once; under a lock, as tests needing it run in parallel), so every
such test runs on a fresh clone too; it skips only where no package index can be reached."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PEERS = REPO / "bench" / "peers.py"


def peer_python() -> Path:
    """.venv-peers' python, made now if missing; skip when it cannot be made."""
    spec = importlib.util.spec_from_file_location("bench_peers", PEERS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    try:
        python: Path = module.ensure_venv()
    except module.VenvError as exc:
        pytest.skip(f".venv-peers cannot be created here (no package index?): {exc}")
    return python
