"""The operator as the chart deploys it, end to end on the real control plane: `helm install`,
kube-controller-manager makes the Deployment's ReplicaSet and pod, kube-scheduler binds it to a
node, our kubelet runs the image's entrypoint (`llamaft`, Dockerfile.operator) with the chart's
arguments and environment and the ServiceAccount token the API server issued for the pod; the
operator loads its in-cluster config from that token and reconciles a LlamaFineTune under the
chart's RBAC.

Pods share this machine's network here: the chart's fixed ports (metrics 8080, liveness 8081)
are this machine's while the test runs."""

from __future__ import annotations

from pathlib import Path

import yaml
from kubernetes import client, config

from tests.controlplane.cluster import ControlPlane
from tests.controlplane.conftest import TAINT, wait_established
from tests.controlplane.kubelet import Kubelet
from tests.controlplane.test_chart_install import (
    CHART,
    RELEASE,
    _install_upstream_crds,
    assert_never_forbidden,
    helm,
)
from tests.operator.conftest import Cluster, tiny_spec, wait_for


def test_the_charts_operator_pod_reconciles_a_fine_tune(control_plane: ControlPlane, namespace: str, kubelet: Kubelet,
                                                         tmp_path: Path) -> None:
    _install_upstream_crds(control_plane)
    release_ns = f"{namespace}-system"
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({
        "replicas": 1, "watchNamespaces": [namespace],
        "tolerations": [{"key": TAINT, "operator": "Equal", "value": namespace, "effect": "NoSchedule"}],
        "operator": {"syncIntervalSeconds": 1},
    }))
    helm(control_plane, "install", RELEASE, str(CHART), "--namespace", release_ns, "--create-namespace", "-f", str(values))
    wait_established(control_plane, "llamafinetunes.llamaft.io")
    admin = config.new_client_from_config(str(control_plane.admin_kubeconfig))
    core = client.CoreV1Api(admin)

    def operator_pod() -> client.V1Pod | None:
        pods = core.list_namespaced_pod(release_ns).items
        return next((p for p in pods if p.status.phase == "Running"), None)

    pod = wait_for("the operator's pod running on our node", operator_pod, timeout=60)
    assert pod.spec.node_name == kubelet.name
    cluster = Cluster(admin, namespace)
    cluster.create("ft", tiny_spec())
    try:
        job = wait_for("the attempt's PyTorchJob", lambda: cluster.attempt_job("ft", 1), timeout=90)
    finally:
        log = kubelet.logs(release_ns, pod.metadata.name)
        assert_never_forbidden(log)
    assert job["metadata"]["ownerReferences"][0]["name"] == "ft", log[-3000:]
    helm(control_plane, "uninstall", RELEASE, "--namespace", release_ns)
    wait_for("the operator's pod gone", lambda: not core.list_namespaced_pod(release_ns).items, timeout=60)
