"""`llamaft sweep` against the real control plane (the fixtures of test_training_operator.py):
the CLI creates one LlamaFineTune per size through the real API server with the admin's
kubeconfig, the operator runs them one after another through the real training operator, and
the table is their status.performance."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from llamaft_trainer.process.local_etcd import LocalEtcd

from tests.controlplane import runs
from tests.controlplane import test_training_operator as plane_runs
from tests.controlplane.cluster import ControlPlane
from tests.controlplane.kubelet import Kubelet
from tests.operator.conftest import Cluster, Operator

rendezvous, admin = runs.rendezvous, runs.admin
checkpoint_claim, nodes, operator, dcgm = runs.checkpoint_claim, runs.nodes, plane_runs.operator, plane_runs.dcgm
"""test_training_operator's fixtures."""


def test_a_sweep_runs_each_size_on_the_cluster(
        control_plane: ControlPlane, namespace: str, nodes: list[Kubelet], operator: Operator, rendezvous: LocalEtcd,
        tiny_model: Path, admin: client.ApiClient, checkpoint_claim: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """One LlamaFineTune per size (1 and 2 workers), each to Succeeded before the next is created;
    the CSV holds their status.performance and the scaling efficiency; a second sweep of the same
    name creates nothing (the API server's 409 names the run)."""
    from llamaft.cli import main as cli

    cluster = Cluster(admin, namespace)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune", "metadata": {"name": "sw"},
                                    "spec": runs.run_spec(tiny_model, namespace, rendezvous)}))
    args = ["sweep", str(path), "--workers", "1,2", "--max-steps", "6", "--namespace", namespace,
            "--kubeconfig", str(control_plane.admin_kubeconfig), "--poll-seconds", "0.5", "--timeout", "240",
            "--output", str(tmp_path / "out")]
    assert cli(args) == 0, capsys.readouterr().out[-3000:]
    printed = capsys.readouterr().out
    assert printed.index(f"size 1/2: created {namespace}/sw-w1") < printed.index("sw-w1: Succeeded") < printed.index("size 2/2")
    rows = {int(r["workers"]): r for r in csv.DictReader((tmp_path / "out" / "sweep.csv").open())}
    for workers in (1, 2):
        status = cluster.status(f"sw-w{workers}")
        performance = status["performance"]
        assert status["phase"] == "Succeeded" and status["attempt"] == 1, status
        assert performance["worldSize"] == workers == int(rows[workers]["world_size"]) and performance["steps"] == 5
        assert float(rows[workers]["tokens_per_second"]) == performance["tokensPerSecond"]
        assert cluster.finetune(f"sw-w{workers}")["metadata"]["labels"]["llamaft.io/sweep"] == "sw"
        ran = sorted(pod for pod in runs.events(nodes, namespace, status["jobName"]))
        assert len(ran) == workers, f"one pod per worker: {ran}"
    assert float(rows[2]["scaling_efficiency"]) == pytest.approx(
        float(rows[2]["tokens_per_second"]) / 2 / float(rows[1]["tokens_per_second"]), abs=1e-4)
    assert (tmp_path / "out" / "scaling.png").stat().st_size > 10_000
    assert cli(args) == 2, "the names are taken: nothing is created"
    assert "exists already (an earlier sweep?)" in capsys.readouterr().err
