"""Rendezvous reset against a real etcd (Debian etcd-server) holding keys written by real torchrun
runs of the trainer: a rerun with the same id dies of RendezvousClosedError; after the reset the
same id trains; another job's rendezvous is left alone."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llamaft.api.spec import RendezvousBackend
from llamaft.operator import rendezvous
from llamaft_trainer.process.local_etcd import LocalEtcd

from tests.conftest import REPO, need_etcd
from tests.trainer.conftest import base_config, trainer_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    need_etcd()
    with LocalEtcd() as server:
        yield server


def train(etcd: LocalEtcd, backend: str, rdzv_id: str, config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "1",
         "--rdzv_backend", backend, "--rdzv_endpoint", etcd.endpoint, "--rdzv_id", rdzv_id, "--max_restarts", "0",
         "-m", "llamaft_trainer", "--config", str(config)],
        env=trainer_env(), capture_output=True, text=True, timeout=300, cwd=REPO,
    )


def keys(etcd: LocalEtcd, backend: RendezvousBackend) -> list[str]:
    client = rendezvous.EtcdV2(etcd.endpoint)
    if backend is RendezvousBackend.ETCD:
        return client.children(rendezvous.ETCD_PREFIX)
    return client.children(rendezvous.ETCD_V2_STATE) + client.children(rendezvous.ETCD_V2_STORE)


@pytest.mark.parametrize("backend", [RendezvousBackend.ETCD_V2, RendezvousBackend.ETCD])
def test_reset_makes_a_closed_run_id_usable_again(etcd: LocalEtcd, backend: RendezvousBackend, tiny_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    cfg: dict[str, Any] = base_config(tiny_model, tmp_path / "ck", training={"maxSteps": 2})
    config.write_text(json.dumps(cfg))
    run_id, other_id = f"job-{backend.value}", f"other-{backend.value}"
    assert train(etcd, backend.value, run_id, config).returncode == 0
    assert train(etcd, backend.value, other_id, config).returncode == 0
    before = keys(etcd, backend)
    rerun = train(etcd, backend.value, run_id, config)
    assert rerun.returncode != 0 and "RendezvousClosedError" in rerun.stdout + rerun.stderr

    deleted = rendezvous.reset(etcd.endpoint, backend, run_id)
    assert deleted, "the run's keys were there to delete"
    after = keys(etcd, backend)
    assert set(after) < set(before)
    assert any(other_id in k or rendezvous.store_key_belongs_to(k, other_id) for k in after), "the other job's state survives"
    assert not any(k.endswith(f"run_{run_id}") or k.endswith(f"/{run_id}") or rendezvous.store_key_belongs_to(k, run_id) for k in after)

    again = train(etcd, backend.value, run_id, config)
    assert again.returncode == 0, again.stderr[-3000:]
    assert '"event": "done"' in again.stdout
    assert rendezvous.reset(etcd.endpoint, backend, "never-used") == []


def test_reset_of_c10d_is_a_no_op() -> None:
    assert rendezvous.reset("127.0.0.1:1", RendezvousBackend.C10D, "x") == []


def test_unreachable_etcd_is_a_retryable_error() -> None:
    with pytest.raises(rendezvous.RendezvousResetError, match="unreachable"):
        rendezvous.reset("127.0.0.1:1", RendezvousBackend.ETCD_V2, "x")
