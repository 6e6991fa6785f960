"""The Helm chart, through helm-python-sdk (Helm's Go SDK, no binary): lint, render over a matrix
of values, validate every built-in object with kubernetes-validate --strict and every monitoring
object against its CRD, and check RBAC is exactly what the code calls."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm  # noqa: E402
import pytest
import yaml
from llamaft.operator import kube

from tests.conftest import REFERENCE, REPO
from tests.operator.kubeflow_rules import schema_errors

CHART = REPO / "helm" / "llamaft"
KUBE_VERSION = "1.33.0"
VALUES = {
    "defaults": {},
    "namespaced": {"watchNamespaces": ["team-a", "team-b"]},
    "monitoring": {"metrics": {"serviceMonitor": {"enabled": True}}, "dcgm": {"serviceMonitor": {"enabled": True}},
                   "prometheus": {"url": "http://prometheus.monitoring:9090"}},
    "plain-logs": {"logging": {"json": False, "verbose": True}, "image": {"tag": "dev", "pullPolicy": "Always"},
                   "nodeSelector": {"role": "system"}, "priorityClassName": "system-cluster-critical"},
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values, name="lft", namespace="llamaft")
    return [d for name, text in out.items() if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def test_lint_strict() -> None:
    for values in VALUES.values():
        result = helm.lint(str(CHART), values, strict=True, namespace="llamaft")
        assert result["errors"] == [], result
        assert [m for m in result["messages"] if m["severity"] > 1] == [], result


def test_crds_come_from_crds_folder() -> None:
    chart = helm.Chart.load(str(CHART))
    assert (CHART / "crds").resolve() == (REPO / "crds").resolve()
    assert chart.crds, "the chart ships the LlamaFineTune CRD"


@pytest.mark.parametrize("case", list(VALUES))
def test_rendered_objects_are_valid(case: str, tmp_path: Path) -> None:
    docs = render(VALUES[case])
    builtin = [d for d in docs if d["apiVersion"] != "monitoring.coreos.com/v1"]
    files = []
    for i, doc in enumerate(builtin):
        path = tmp_path / f"{i}-{doc['kind']}.yaml"
        path.write_text(yaml.safe_dump(doc))
        files.append(str(path))
    proc = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", KUBE_VERSION, "--no-warn", *files],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            assert schema_errors(doc, REFERENCE / "prometheus-operator" / "monitoring.coreos.com_servicemonitors.yaml", "v1") == []


def test_deployment_is_hardened_and_probed() -> None:
    deployment = next(d for d in render({}) if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "--liveness=http://0.0.0.0:8081/healthz" in container["args"] and "--json-logs" in container["args"]
    assert container["image"] == "ghcr.io/llamaft/operator:0.1.0"


def test_values_schema_rejects_bad_values() -> None:
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(Exception, match="etcdImage|pattern"):
        chart.render({"operator": {"etcdImage": "quay.io/coreos/etcd:v3.6.0"}}, name="lft", namespace="llamaft")
    with pytest.raises(Exception, match="replicas|maximum"):
        chart.render({"replicas": 3}, name="lft", namespace="llamaft")


def test_operator_settings_follow_the_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart's env is read back by the operator's own settings parser."""
    import json

    from llamaft.operator.settings import OperatorSettings

    values = {"grafana": {"dashboardLabels": {"dashboards": "llm"}}, "prometheus": {"url": "http://p:9090"},
              "operator": {"syncIntervalSeconds": 7, "retryBackoffSeconds": 2, "etcdImage": "quay.io/coreos/etcd:v3.5.21"}}
    deployment = next(d for d in render(values) if d["kind"] == "Deployment")
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parsed = OperatorSettings.from_env()
    # Helm merges maps with the defaults (set grafana_dashboard: null to drop the default label).
    assert parsed.dashboard_labels == (("dashboards", "llm"), ("grafana_dashboard", "1")) and parsed.prometheus_url == "http://p:9090"
    assert (parsed.sync_interval_s, parsed.retry_backoff_s, parsed.etcd_image) == (7.0, 2.0, "quay.io/coreos/etcd:v3.5.21")
    assert json.loads(env["LLAMAFT_DASHBOARD_LABELS"]) == {"dashboards": "llm", "grafana_dashboard": "1"}


def test_dcgm_service_monitor_keeps_pod_labels() -> None:
    monitors = [d for d in render(VALUES["monitoring"]) if d["kind"] == "ServiceMonitor"]
    dcgm = next(m for m in monitors if m["metadata"]["name"] == "llamaft-dcgm-exporter")
    assert dcgm["spec"]["endpoints"][0]["honorLabels"] is True
    assert dcgm["metadata"]["labels"]["release"] == "kube-prometheus-stack"


# ------------------------------------------------------------------------------------- RBAC
KOPF_NEEDS = {
    # kopf watches and patches the custom resource (finalizer, annotations) and its status,
    # posts events, and in cluster-wide mode follows namespaces.
    ("llamaft.io", "llamafinetunes", "get"), ("llamaft.io", "llamafinetunes", "list"),
    ("llamaft.io", "llamafinetunes", "watch"), ("llamaft.io", "llamafinetunes", "patch"),
    ("llamaft.io", "llamafinetunes/status", "get"), ("llamaft.io", "llamafinetunes/status", "patch"),
    ("", "events", "create"), ("events.k8s.io", "events", "create"),
    # kopf watches the children (PyTorchJobs, trainer pods) so failures wake their owner's lifecycle.
    ("kubeflow.org", "pytorchjobs", "list"), ("kubeflow.org", "pytorchjobs", "watch"),
    ("", "pods", "list"), ("", "pods", "watch"),
}
CLUSTER_WIDE_ONLY = {("", "namespaces", "list"), ("", "namespaces", "watch")}
VERBS = {"read": "get", "get": "get", "create": "create", "patch": "patch", "delete": "delete", "list": "list", "replace": "update"}
KINDS = {"config_map": ("", "configmaps"), "service": ("", "services"), "deployment": ("apps", "deployments"), "pod": ("", "pods")}


def calls_in_code() -> set[tuple[str, str, str]]:
    """(group, resource, verb) for every Kubernetes API call in operator/llamaft/operator/kube.py."""
    tree = ast.parse((REPO / "operator" / "llamaft" / "operator" / "kube.py").read_text())
    found: set[tuple[str, str, str]] = set()
    for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
        source = ast.unparse(fn)
        for call in [n for n in ast.walk(fn) if isinstance(n, ast.Attribute)]:
            match = re.fullmatch(r"(read|get|create|patch|delete|list|replace)_namespaced_(\w+)", call.attr)
            if not match:
                continue
            verb, what = VERBS[match.group(1)], match.group(2)
            if what in ("custom_object", "custom_object_status"):
                suffix = "/status" if what.endswith("_status") else ""
                if "PYTORCHJOBS" in source:
                    found.add(("kubeflow.org", "pytorchjobs" + suffix, verb))
                if "LLAMAFINETUNES" in source:
                    found.add(("llamaft.io", "llamafinetunes" + suffix, verb))
                if "MONITORING" in source:
                    found |= {("monitoring.coreos.com", r, verb) for r in kube.MONITORING.values()}
            else:
                group, resource = KINDS[what]
                found.add((group, resource, verb))
    return found


def granted(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_rbac_is_exactly_what_the_code_calls() -> None:
    derived = calls_in_code()
    declared = {(g, r, v) for g, r, verbs in kube.API_CALLS for v in verbs}
    assert derived == declared, "kube.API_CALLS is out of date with the calls in kube.py"
    cluster_role = next(d for d in render({}) if d["kind"] == "ClusterRole")
    assert granted(cluster_role["rules"]) == derived | KOPF_NEEDS | CLUSTER_WIDE_ONLY
    roles = [d for d in render(VALUES["namespaced"]) if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert all(granted(r["rules"]) == derived | KOPF_NEEDS for r in roles)
    assert not [d for d in render(VALUES["namespaced"]) if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
