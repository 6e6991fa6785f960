"""Queueing by the real Kueue on the real control plane (tests/controlplane/kueue.py), with the real
training operator: a ClusterQueue whose CPU quota holds one fine-tune's workers, a LocalQueue in the
test's namespace, and two fine-tunes that name it (spec.scheduling.queueName).

Kueue's webhook suspends each PyTorchJob at creation; its scheduler admits the first (the job is
unsuspended, the training operator creates its pods) and holds the second, whose fine-tune is
Queued with its queue, never failed or stalled; when the first finishes, Kueue releases its quota
and admits the second, which trains in its first attempt. The operator never writes the job's
suspend: the field's manager is Kueue's (managedFields).

An elastic fine-tune whose workers need more than the ClusterQueue's quota: Kueue reserves its
Workload nothing; after shrinkAfterSeconds the operator asks for fewer workers (the suspended
job's replicas), Kueue rewrites the Workload to the new count (jobframework's reconciler), admits
it, and the run trains on 1 worker in its first attempt.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from llamaft_trainer.process.local_etcd import LocalEtcd

from tests.controlplane import runs
from tests.controlplane.cluster import ControlPlane
from tests.controlplane.kubeflow_trainer import TrainerController
from tests.controlplane.kubelet import Kubelet
from tests.controlplane.kueue import KueueController
from tests.controlplane.training_operator import TrainingOperator
from tests.operator.conftest import Cluster, Operator, wait_for
from tests.tiers import starts_processes

rendezvous, admin = runs.rendezvous, runs.admin
checkpoint_claim, nodes = runs.checkpoint_claim, runs.nodes
"""The shared fixtures (tests/controlplane/runs.py)."""

KUEUE = "/apis/kueue.x-k8s.io/v1beta2"
QUEUE = "team"
WORKER_CPU = "1"
"""Each worker requests a CPU: Kueue counts requests against the ClusterQueue's quota."""


@pytest.fixture(scope="session")
@starts_processes
def kueue(control_plane: ControlPlane, training_operator: TrainingOperator, trainer: TrainerController,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[KueueController]:
    """Kueue, after the job kinds it integrates with are served (it sets an integration up only for
    a CRD that exists)."""
    controller = KueueController(control_plane, tmp_path_factory.mktemp("kueue")).start()
    yield controller
    controller.stop()


@pytest.fixture
def queue(control_plane: ControlPlane, namespace: str, kueue: KueueController) -> Iterator[str]:
    """A ResourceFlavor and a ClusterQueue of the test's own (2 CPUs: one fine-tune of 2 workers),
    and the LocalQueue QUEUE in `namespace` that points at it; returns the ClusterQueue's name."""
    objects: list[tuple[str, dict[str, Any]]] = [
        (f"{KUEUE}/resourceflavors", {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                                      "metadata": {"name": namespace}}),
        (f"{KUEUE}/clusterqueues", {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": namespace},
                                    "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                                             "resourceGroups": [{"coveredResources": ["cpu"], "flavors": [
                                                 {"name": namespace, "resources": [{"name": "cpu", "nominalQuota": "2"}]}]}]}}),
        (f"{KUEUE}/namespaces/{namespace}/localqueues", {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                                                         "metadata": {"name": QUEUE}, "spec": {"clusterQueue": namespace}}),
    ]
    for path, body in objects:
        status, answer = control_plane.request("POST", path, body)
        assert status == 201, (path, status, answer)
    wait_for("the ClusterQueue active", lambda: any(
        c["type"] == "Active" and c["status"] == "True"
        for c in (control_plane.request("GET", f"{KUEUE}/clusterqueues/{namespace}")[1].get("status") or {}).get("conditions") or []),
        timeout=30)
    yield namespace
    for path, body in reversed(objects):
        control_plane.request("DELETE", f"{path}/{body['metadata']['name']}")


@pytest.fixture
def operator(control_plane: ControlPlane, namespace: str, training_operator: TrainingOperator, tmp_path: Path) -> Iterator[Operator]:
    with runs.chart_operator(control_plane, namespace, tmp_path / "operator.log") as op:
        yield op


def test_an_elastic_fine_tune_kueue_cannot_admit_asks_for_fewer_workers(
        control_plane: ControlPlane, namespace: str, nodes: list[Kubelet], queue: str, operator: Operator,
        rendezvous: LocalEtcd, tiny_model: Path, admin: client.ApiClient) -> None:
    cluster = Cluster(admin, namespace)
    elastic = {"minWorkers": 1, "maxWorkers": 2, "shrinkAfterSeconds": 3, "growBackAfterSeconds": 3600}
    cluster.create("kq", runs.run_spec(tiny_model, namespace, rendezvous, scheduling={"queueName": QUEUE},
                                       cluster={"resources": {"cpu": "2"}, "elastic": elastic}))
    shrunk = wait_for("Shrunk", lambda: (s := cluster.status("kq")).get("workers", {}).get("reason") == "Shrunk" and s,
                      timeout=90)
    workers = shrunk["workers"]
    assert workers["current"] == 1 and workers["desired"] == 2, workers
    assert "insufficient quota for cpu" in workers["message"] and "shrinking to 1 worker" in workers["message"], workers
    event = wait_for("Shrunk event", lambda: [e for e in cluster.events("kq") if e["reason"] == "Shrunk"])
    assert event[0]["type"] == "Warning" and "Kueue has reserved no quota for 2 worker(s)" in event[0]["message"], event
    job = cluster.attempt_job("kq", 1)
    assert job is not None and job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    status = runs.end(cluster, "kq", nodes, operator, timeout=240)
    assert status["phase"] == "Succeeded" and status["attempt"] == 1 and status.get("retriesUsed", 0) == 0, status
    assert status["workers"]["current"] == 1 and status["workers"]["reason"] == "Shrunk", status["workers"]
    pods = cluster.core.list_namespaced_pod(namespace, label_selector=f"training.kubeflow.org/job-name={job['metadata']['name']}")
    assert len(pods.items) == 1, [p.metadata.name for p in pods.items]


def _suspend_managers(job: dict[str, Any]) -> set[str]:
    """The field managers that own the PyTorchJob's spec.runPolicy.suspend."""
    return {entry["manager"] for entry in job["metadata"].get("managedFields") or []
            if "f:suspend" in (((entry.get("fieldsV1") or {}).get("f:spec") or {}).get("f:runPolicy") or {})}


def test_kueue_admits_one_fine_tune_at_a_time_and_holds_the_other_queued(
        control_plane: ControlPlane, namespace: str, nodes: list[Kubelet], queue: str, operator: Operator,
        rendezvous: LocalEtcd, tiny_model: Path, admin: client.ApiClient) -> None:
    cluster = Cluster(admin, namespace)
    spec = runs.run_spec(tiny_model, namespace, rendezvous, scheduling={"queueName": QUEUE},
                         cluster={"resources": {"cpu": WORKER_CPU}})
    cluster.create("first", spec)
    first = wait_for("first's job admitted", lambda: (j := cluster.attempt_job("first", 1)) and
                     j["spec"]["runPolicy"].get("suspend") is False and j, timeout=60)
    assert first["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == QUEUE
    cluster.create("second", spec)
    held = wait_for("second Queued", lambda: (s := cluster.status("second")).get("phase") == "Queued" and s, timeout=60)
    assert held["queue"] == QUEUE and QUEUE in held["message"], held
    second = cluster.attempt_job("second", 1)
    assert second is not None and second["spec"]["runPolicy"]["suspend"] is True, "Kueue's webhook suspends it at creation"
    wait_for("Queued event", lambda: "Queued" in [e["reason"] for e in cluster.events("second")], timeout=30)
    assert cluster.status("first")["phase"] in ("Creating", "Running", "Succeeded"), cluster.status("first")

    done = runs.end(cluster, "first", nodes, operator, timeout=240)
    assert done["phase"] == "Succeeded", done
    status = runs.end(cluster, "second", nodes, operator, timeout=300)
    assert status["phase"] == "Succeeded" and status["attempt"] == 1 and status.get("retriesUsed", 0) == 0, status
    assert next(c for c in status["conditions"] if c["type"] == "Queued")["reason"] == "Admitted", status["conditions"]
    for name in ("first", "second"):
        job = cluster.attempt_job(name, 1)
        assert job is not None
        managers = _suspend_managers(job)
        assert managers and not any("llamaft" in m for m in managers), (name, managers)
