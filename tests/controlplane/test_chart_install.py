"""The chart as users install it: `helm lint`, `helm install` into the real control plane, and the
operator running as the chart's Deployment runs it (its arguments and environment), as the chart's
ServiceAccount (a token the API server issued) under the chart's RBAC, with the real authorizer:
a permission the chart lacks is a 403 in the operator's log and fails the test."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config

from tests.conftest import REFERENCE, REPO
from tests.controlplane.binaries import binaries
from tests.controlplane.cluster import ControlPlane
from tests.controlplane.conftest import apply, wait_established
from tests.operator.conftest import Cluster, Operator, tiny_spec, wait_for

CHART = REPO / "helm" / "llamaft"
RELEASE = "llamaft"
UPSTREAM_CRDS = [
    REFERENCE / "kubeflow" / "kubeflow.org_pytorchjobs.yaml",
    REFERENCE / "kubeflow-trainer-v2.3" / "trainer.kubeflow.org_trainjobs.yaml",
    REFERENCE / "prometheus-operator" / "monitoring.coreos.com_podmonitors.yaml",
    REFERENCE / "prometheus-operator" / "monitoring.coreos.com_prometheusrules.yaml",
]


def helm(plane: ControlPlane, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(binaries().helm), *args, "--kubeconfig", str(plane.admin_kubeconfig)],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={"HOME": str(plane.root), "PATH": "/usr/bin:/bin",
                               "HELM_CACHE_HOME": str(plane.root / "helm-cache"),
                               "HELM_CONFIG_HOME": str(plane.root / "helm-config"),
                               "HELM_DATA_HOME": str(plane.root / "helm-data")})
    assert done.returncode == 0, f"helm {' '.join(args)}: {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def test_helm_lint_strict() -> None:
    done = subprocess.run([str(binaries().helm), "lint", "--strict", str(CHART)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout, done.stdout


def _install_upstream_crds(plane: ControlPlane) -> None:
    for path in UPSTREAM_CRDS:
        for crd in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if crd:
                apply(plane, f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}", crd)
                wait_established(plane, crd["metadata"]["name"])


def _operator_command(deployment: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The operator container's arguments and plain environment, as the chart's Deployment gives them."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return list(container.get("args") or []), env


PER_PROCESS = ("LLAMAFT_SYNC_INTERVAL", "LLAMAFT_OPERATOR_METRICS_PORT")
"""Settings of the chart's that the test's Operator gives every process of its own: a short sync
interval, and a metrics port of its own (this machine's ports are shared by the suite's workers)."""


def install_chart(plane: ControlPlane, namespace: str, log: Path) -> tuple[Operator, str]:
    """`helm install` of helm/ watching `namespace` (release in `<namespace>-system`), and the
    operator as the chart's Deployment runs it: its arguments and environment, and the chart's
    ServiceAccount's token from the API server (the liveness probe on a port of the test's own)."""
    _install_upstream_crds(plane)
    release_ns = f"{namespace}-system"
    helm(plane, "install", RELEASE, str(CHART), "--namespace", release_ns, "--create-namespace",
         "--set", "replicas=1", "--set", f"watchNamespaces={{{namespace}}}")
    wait_established(plane, "llamafinetunes.llamaft.io")
    admin = config.new_client_from_config(str(plane.admin_kubeconfig))
    (deployment,) = admin.sanitize_for_serialization(client.AppsV1Api(admin).list_namespaced_deployment(release_ns).items)
    args, env = _operator_command(deployment)
    assert args[0] == "operator" and "--standalone" in args, args
    service_account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    flags = tuple(a for a in args[1:] if a not in ("--standalone", "--json-logs") and not a.startswith("--liveness"))
    operator = Operator(plane.kubeconfig_for_service_account(release_ns, service_account), log, cli=True, args=flags,
                        **{k: v for k, v in env.items() if k.startswith("LLAMAFT_") and k not in PER_PROCESS})
    return operator, release_ns


def test_helm_install_runs_the_operator_under_the_charts_rbac(control_plane: ControlPlane, namespace: str,
                                                               tmp_path: Path) -> None:
    operator, release_ns = install_chart(control_plane, namespace, tmp_path / "operator.log")
    admin = config.new_client_from_config(str(control_plane.admin_kubeconfig))
    operator.start()
    try:
        cluster = Cluster(admin, namespace)
        cluster.create("ft", tiny_spec())
        try:
            job = wait_for("the attempt's PyTorchJob", lambda: cluster.attempt_job("ft", 1), timeout=60)
            phase = wait_for("the fine-tune's phase", lambda: cluster.status("ft").get("phase"), timeout=30)
        finally:
            operator.stop()
            assert_never_forbidden(operator.logs())
        assert job["metadata"]["ownerReferences"][0]["kind"] == "LlamaFineTune"
        assert phase in ("Creating", "Pending", "Running"), phase
    finally:
        operator.stop()

    helm(control_plane, "uninstall", RELEASE, "--namespace", release_ns)
    rbac = client.RbacAuthorizationV1Api(admin)
    assert not rbac.list_namespaced_role(namespace).items
    assert not client.AppsV1Api(admin).list_namespaced_deployment(release_ns).items


FORBIDDEN = re.compile(r"\b403\b|forbidden", re.IGNORECASE)
"""A refusal in a log line: the status code on its own (not the digits inside a timestamp or a uid)."""


def assert_never_forbidden(log: str) -> None:
    forbidden = [line for line in log.splitlines() if FORBIDDEN.search(line)]
    assert not forbidden, "the operator was refused under the chart's RBAC:\n" + "\n".join(forbidden[:20])
