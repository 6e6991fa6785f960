"""What the runs on the real control plane share, whichever Kubeflow job they run in: an external
etcd for torchrun's rendezvous (spec.rendezvous.endpoint, as users may give one), the admin's
client, a claim that outlives the pods, two nodes of the test's own (our kubelets), the spec of a
short run on the tiny model, and how a test reads a run: its end, each pod's JSON event lines, the
moment its leader is past a checkpoint. A test module takes the fixtures by name
(`nodes = runs.nodes`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from llamaft.api.validation import validate_resource
from llamaft.operator import gpu_health
from llamaft.render import backends, monitoring, trainjob
from llamaft.render.naming import Owner
from llamaft_trainer.process.local_etcd import LocalEtcd
from llamaft_trainer.report.logline import read_events

from tests.conftest import REPO, need_etcd
from tests.controlplane.cluster import ControlPlane
from tests.controlplane.conftest import TAINT
from tests.controlplane.kubelet import Kubelet, NodeShape
from tests.controlplane.test_chart_install import assert_never_forbidden, install_chart
from tests.operator.conftest import CHECKPOINT_CLAIM, Cluster, Operator, wait_for
from tests.tiers import starts_processes

DATASET = REPO / "examples" / "data" / "samsum-tiny.jsonl"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
OPERATOR_ENV = {"LLAMAFT_SYNC_INTERVAL": "1", "LLAMAFT_RETRY_BACKOFF_SECONDS": "1", "LLAMAFT_PROGRESS_TIMEOUT": "0.5"}

@pytest.fixture(scope="module")
def rendezvous() -> Iterator[LocalEtcd]:
    need_etcd()
    with LocalEtcd() as server:
        yield server


@pytest.fixture
def admin(control_plane: ControlPlane) -> client.ApiClient:
    return config.new_client_from_config(str(control_plane.admin_kubeconfig))


@pytest.fixture
def checkpoint_claim(control_plane: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[Path]:
    """The claim CHECKPOINT_CLAIM in `namespace`, bound by kube-controller-manager to a hostPath
    PersistentVolume on a folder of the test's (returned): what the runs keep outlives their pods."""
    folder = tmp_path / "ckpt"
    volume = f"{namespace}-{CHECKPOINT_CLAIM}"
    status, answer = control_plane.request("POST", "/api/v1/persistentvolumes", {
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "manual",
                 "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(folder), "type": "DirectoryOrCreate"},
                 "claimRef": {"namespace": namespace, "name": CHECKPOINT_CLAIM}}})
    assert status == 201, answer
    status, answer = control_plane.request("POST", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CHECKPOINT_CLAIM},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "manual", "volumeName": volume,
                 "resources": {"requests": {"storage": "1Gi"}}}})
    assert status == 201, answer
    wait_for("the claim bound", lambda: (control_plane.request(
        "GET", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{CHECKPOINT_CLAIM}")[1].get("status") or {}
    ).get("phase") == "Bound", timeout=30)
    yield folder
    control_plane.request("DELETE", f"/api/v1/persistentvolumes/{volume}")


@pytest.fixture
@starts_processes
def nodes(control_plane: ControlPlane, namespace: str, checkpoint_claim: Path, tmp_path: Path) -> Iterator[list[Kubelet]]:
    """Two nodes of the test's own, tainted for its namespace (only its pods, which tolerate that, land there)."""
    kubelets = [Kubelet(control_plane, NodeShape(f"{namespace}-n{i}", taints=[
        {"key": TAINT, "value": namespace, "effect": "NoSchedule"}]), tmp_path / f"kubelet-{i}").start()
        for i in range(2)]
    yield kubelets
    for kubelet in kubelets:
        kubelet.stop()
        control_plane.request("DELETE", f"/api/v1/nodes/{kubelet.name}")


def run_spec(model: Path, namespace: str, etcd: LocalEtcd, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "backend": "PyTorchJob",
        "model": {"source": str(model), "dtype": "float32"},
        "dataset": {"format": "samsum", "source": str(DATASET), "maxSeqLength": 64, "packing": True},
        "training": {"maxSteps": 12, "perDeviceBatchSize": 2, "learningRate": 2e-3, "evalInterval": 0, "seed": 7,
                     "collectiveTimeoutSeconds": 30},
        "fsdp": {"mixedPrecision": "fp32", "activationCheckpointing": {"mode": "none"}},
        "checkpointing": {"volumeClaim": CHECKPOINT_CLAIM, "directory": "/checkpoints/run", "everyNSteps": 6,
                          "exportHuggingFace": True},
        "cluster": {"workers": 2, "gpusPerWorker": 0, "image": "ghcr.io/llamaft/trainer:test",
                    "terminationGracePeriodSeconds": 5,
                    "tolerations": [{"key": TAINT, "operator": "Equal", "value": namespace, "effect": "NoSchedule"}]},
        "rendezvous": {"backend": "etcd-v2", "endpoint": etcd.endpoint.removeprefix("http://"), "maxRestarts": 0},
        "runPolicy": {"retryBudget": 1, "progressDeadlineSeconds": 120, "startupGraceSeconds": 180},
    }
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


def end(cluster: Cluster, name: str, nodes: list[Kubelet], operator: Operator, timeout: float) -> dict[str, Any]:
    """The fine-tune's status once its phase is Succeeded or Failed; on a timeout, what each part said."""
    try:
        return wait_for(f"{name}'s end", lambda: (s := cluster.status(name)).get("phase") in ("Succeeded", "Failed")
                        and s, timeout=timeout)
    except AssertionError as exc:
        pods = cluster.api.sanitize_for_serialization(cluster.core.list_namespaced_pod(cluster.ns).items)
        said = [f"status: {cluster.status(name)}",
                *[f"pod {p['metadata']['name']}: {p['status'].get('phase')} {p['status'].get('conditions')}" for p in pods],
                *[f"--- {pod} on {k.name}\n{k.logs(cluster.ns, pod)[-3000:]}" for k in nodes for pod in pod_names(k, cluster.ns)],
                *[f"kubelet {k.name}: {k.errors[-5:]}" for k in nodes],
                f"--- operator\n{operator.logs()[-4000:]}"]
        raise AssertionError(f"{exc}\n" + "\n".join(said)) from None


def pod_names(kubelet: Kubelet, namespace: str) -> list[str]:
    """The pods of `namespace` that ran on `kubelet`'s node, deleted ones too (an attempt's logs)."""
    return kubelet.pods_run(namespace)


def events(nodes: list[Kubelet], namespace: str, job: str) -> dict[str, list[dict[str, Any]]]:
    """The JSON event lines of each of `job`'s pods, by pod name (its container's output so far)."""
    return {pod: read_events(k.logs(namespace, pod)) for k in nodes for pod in pod_names(k, namespace)
            if pod.startswith(f"{job}-")}


def past_checkpoint(nodes: list[Kubelet], namespace: str, job: str, step: int, workers: int = 2) -> tuple[str, str] | None:
    """(leader pod, another pod) once `job`'s leader has logged a step past `step` and the checkpoint
    of `step` is complete (checkpoints are written in the background: a fault before that loses
    it); with 1 worker, (leader, leader)."""
    by_pod = events(nodes, namespace, job)
    leader = next((pod for pod, lines in by_pod.items() if any(e.get("event") == "step" for e in lines)), None)
    if leader is None or len(by_pod) < workers:
        return None
    lines = by_pod[leader]
    steps = [e["step"] for e in lines if e.get("event") == "step"]
    saved = [e["step"] for e in lines if e.get("event") == "checkpoint"]
    if max(steps) > step and saved and max(saved) >= step:
        return leader, next((pod for pod in by_pod if pod != leader), leader)
    return None


@contextlib.contextmanager
def chart_operator(plane: ControlPlane, namespace: str, log: Path, **env: str) -> Iterator[Operator]:
    """The llamaft operator as the chart runs it (its ServiceAccount, its RBAC), watching
    `namespace`, with OPERATOR_ENV and `env`; no request of it refused by the end."""
    op, _ = install_chart(plane, namespace, log)
    op.extra_env.update({**OPERATOR_ENV, **env})
    op.start()
    try:
        yield op
    finally:
        op.stop()
    assert_never_forbidden(op.logs())


def rendered_jobs(path: Path, namespace: str, kind: str) -> list[dict[str, Any]]:
    """The `kind` (PyTorchJob, TrainJob) of attempt 1 of every LlamaFineTune in `path`, rendered in
    `namespace`: every spec becomes a PyTorchJob; a TrainJob only where that backend takes it."""
    jobs = []
    backend = backends.backend_for(kind)
    for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        if not document or document.get("kind") != "LlamaFineTune":
            continue
        spec = validate_resource(document)
        if kind == "TrainJob" and trainjob.unsupported(spec):
            continue
        owner = Owner(document["metadata"]["name"], namespace, "0b4c8a4e-3d2a-4f51-9a0e-7d4f2f7f0c11")
        jobs.append(backend.render(owner, spec, 1))
    return jobs


def running_pods(cluster: Cluster, kind: str, job: str, workers: int = 2) -> list[dict[str, Any]]:
    """`job`'s pods (a `kind` job) once `workers` of them run, as the API serves them."""
    selector = backends.backend_for(kind).pod_selector(job)
    return list(wait_for(f"{workers} pods of {job} running", lambda: (pods := [
        p for p in cluster.api.sanitize_for_serialization(cluster.core.list_namespaced_pod(cluster.ns, label_selector=selector).items)
        if p["status"].get("phase") == "Running" and p["status"].get("podIP")]) and len(pods) == workers and pods, timeout=120))


def assert_monitored(cluster: Cluster, finetune: str, job: str, pods: list[dict[str, Any]]) -> None:
    """The fine-tune's monitoring selects the pods the real controllers made for attempt `job`
    (tests/operator/test_monitoring_backends.py builds pods by the controllers' rules; these are
    theirs): the PodMonitor, as Prometheus Operator turns it into a scrape configuration, keeps one
    target per trainer pod; the dashboards' and alerts' pod regex and the GPU-health queries of
    that attempt match each of them."""
    from tests.operator.test_monitoring_backends import relabelled_addresses, scrape_configs

    cr = cluster.finetune(finetune)
    owner = Owner(finetune, cluster.ns, cr["metadata"]["uid"])
    spec = validate_resource({key: cr[key] for key in ("apiVersion", "kind", "spec")} | {"metadata": {"name": finetune}})
    kept = [pod for config in scrape_configs(monitoring.pod_monitor(owner, spec), pods) for pod, _ in relabelled_addresses(config)]
    names = sorted(p["metadata"]["name"] for p in pods)
    assert sorted(kept) == names, (kept, names)
    dashboards = re.fullmatch(r'namespace="([^"]+)", pod=~"([^"]+)"', monitoring.finetune_pod_selector(owner))
    health = re.search(r'pod=~"([^"]+)"', gpu_health.queries(owner, job)[1])
    assert dashboards is not None and dashboards[1] == cluster.ns and health is not None
    for name in names:
        assert re.fullmatch(dashboards[2], name) and re.fullmatch(health[1], name), (name, dashboards[2], health[1])
