"""The download cache on a simulated cluster: a LlamaFineTune whose model and dataset are Hub ids
(served by the Hub server on loopback, tests/hub) runs with the real operator and trainer; its first
attempt dies with the nodes it ran on and the second runs on two other nodes.

- With `spec.cache.volumeClaim` (a folder every pod of every node mounts, like a ReadWriteMany
  claim) each model and dataset file is fetched from the Hub exactly once for the whole run: by
  one of the two ranks racing for it in attempt 1, and never again by attempt 2's new pods.
- Without it every pod has an emptyDir cache of its own, so each pod of each attempt fetches the
  files again, and the SharedCache condition says so.

The checkpoints go to a `file://` URI, as a run that checkpoints to an object store would: the
token store then lives in the download cache too (data.store_root), so without a claim each node
tokenizes, and fetches the dataset, again. The URI is local to each container (the simulated
cluster gives every container a private filesystem), so the spec says `discardWithPod`: no
checkpoint outlives a pod here, and the test reads none.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from llamaft_trainer.process.local_etcd import LocalEtcd
from llamaft_trainer.report.logline import read_events

from tests.hub.fixture import HubServer
from tests.operator.conftest import Cluster, Operator, wait_for
from tests.operator.emulator import EmulatorThread, write_kubeconfig
from tests.operator.sim import SimCluster, pod_port
from tests.operator.sim_fixtures import (  # noqa: F401 (the *_fixture imports register pytest fixtures)
    DATASET,
    make_sim_fixture,
    sim_emulator_fixture,
    sim_etcd_fixture,
    tiny_finetune,
)
from tests.operator.test_runs import phase

CLAIM = "hf-cache"
STEPS = 30
"""A tiny-model step takes ~0.1 s here (2 ranks on 2 cores): the window in which attempt 1 has fetched everything and
trains, and the fault hits it."""
ESSENTIAL = {"config.json", "model.safetensors", "tokenizer.json", "data/train.jsonl"}
"""Files every attempt needs from the Hub (the model's config, weights and tokenizer, the data)."""


@pytest.fixture
def hub_operator(sim_emulator: EmulatorThread, sim_etcd: LocalEtcd, tmp_path: Path) -> Iterator[Cluster]:
    """The real operator on this test's emulator; a client for it."""
    from kubernetes import client

    config = client.Configuration()
    config.host = sim_emulator.url
    kubeconfig = write_kubeconfig(sim_emulator.url, tmp_path / "kubeconfig")
    op = Operator(kubeconfig, tmp_path / "operator.log", cli=True, LLAMAFT_RENDEZVOUS_ADDRESS_OVERRIDE=sim_etcd.endpoint).start()
    try:
        yield Cluster(client.ApiClient(config))
    finally:
        op.stop()


def hub_spec(hub: HubServer, model: str, dataset: str, workdir: Path, name: str, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = tiny_finetune(
        name, Path(),
        dataset={"source": dataset},
        training={"maxSteps": STEPS},
        cluster={"env": [{"name": "HF_ENDPOINT", "value": hub.endpoint}, {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}],
                 "terminationGracePeriodSeconds": 5},
        rendezvous={"maxRestarts": 0},
        monitoring={"metricsPort": pod_port()},
        runPolicy={"retryBudget": 2, "startupGraceSeconds": 120},
        **overrides,
    )["spec"]
    spec["model"]["source"] = model
    spec["checkpointing"] = {"directory": f"file://{workdir / name / 'checkpoints'}", "everyNSteps": 1000,
                             "exportHuggingFace": False, "resume": False, "discardWithPod": True}
    return spec


def scheduled(sim: SimCluster, job: str) -> dict[str, str]:
    """Pod -> node, once every pod of the job is bound."""
    return wait_for(f"{job}'s pods scheduled", lambda: (pods := sim.pods(job)) and all(p["spec"].get("nodeName") for p in pods)
                    and {p["metadata"]["name"]: p["spec"]["nodeName"] for p in pods}, timeout=60)


def trained(sim: SimCluster, pods: list[str]) -> bool:
    return any(line.get("event") == "step" for pod in pods for line in read_events(sim.logs(pod)))


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions") or [] if c["type"] == kind)


@pytest.mark.parametrize("shared", [True, False], ids=["volumeClaim", "emptyDir"])
def test_hub_files_are_fetched_once_per_run_with_a_shared_cache(
    hub_server: HubServer, hub_operator: Cluster, make_sim: Callable[..., SimCluster], tiny_model: Path, tmp_path: Path,
    shared: bool,
) -> None:
    case = "claim" if shared else "nocl"
    model, dataset = f"cache-{case}/tiny-llama", f"cache-{case}/samsum-tiny"
    hub_server.add_model(model, tiny_model)
    hub_server.add_dataset(dataset, {"data/train.jsonl": DATASET})
    cluster = hub_operator
    sim = make_sim(nodes=4, claims={CLAIM: tmp_path / "claim"})
    name = f"hub-{case}"
    cache = {"cache": {"volumeClaim": CLAIM}} if shared else {}
    cluster.create(name, hub_spec(hub_server, model, dataset, tmp_path, name, **cache))

    # Attempt 1 fetches, trains; then both of its nodes are lost.
    first = wait_for("attempt 1's job", lambda: cluster.attempt_job(name, 1), timeout=60)["metadata"]["name"]
    nodes_1 = scheduled(sim, first)
    wait_for("attempt 1 training", lambda: trained(sim, list(nodes_1)), timeout=120, interval=0.1)
    for node in sorted(set(nodes_1.values())):
        sim.lose_node(node)
    status = wait_for("attempt 2", lambda: (s := cluster.status(name)).get("attempt") == 2 and s, timeout=60)
    assert status["failures"][0]["reason"] == "NodeLost", status["failures"]
    assert set(status["excludedNodes"]) & set(nodes_1.values()), status.get("excludedNodes")

    # Attempt 2 runs on the two other nodes and to the end.
    second = wait_for("attempt 2's job", lambda: cluster.attempt_job(name, 2), timeout=60)["metadata"]["name"]
    nodes_2 = scheduled(sim, second)
    assert not set(nodes_2.values()) & set(nodes_1.values()), (nodes_1, nodes_2)
    status = phase(cluster, name, "Succeeded", "Failed", timeout=180)
    assert status["phase"] == "Succeeded" and status["attempt"] == 2, json.dumps(status, indent=1)[:4000]
    assert trained(sim, list(nodes_2)), "attempt 2 trained from its own fetch or the shared cache"

    fetched = {(repo, file): n for (repo, file), n in hub_server.downloads().items() if repo in (model, dataset)}
    assert ESSENTIAL <= {file for _, file in fetched}, f"files fetched: {fetched}"
    cond = condition(status, "SharedCache")
    if shared:
        assert fetched == dict.fromkeys(fetched, 1), f"one GET per file for the whole run: {fetched}"
        assert (cond["status"], cond["reason"]) == ("True", "VolumeClaim"), cond
    else:
        # Each pod's own emptyDir: every attempt fetches again (in fact every pod: 2 x 2).
        assert all(n >= 2 for n in fetched.values()), f"each attempt fetched again: {fetched}"
        assert (cond["status"], cond["reason"]) == ("False", "NoVolumeClaim"), cond
