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
from llamaft.operator import kube, peering

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
    "standalone": {"replicas": 1},
    "namespaced-standalone": {"replicas": 1, "watchNamespaces": ["team-a"]},
    "three-replicas": {"replicas": 3, "peering": {"lifetimeSeconds": 20}, "affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "role", "operator": "In", "values": ["system"]}]}]}}}},
}
KOPF_CRDS = {"KopfPeering": REPO / "crds" / "kopfpeerings.kopf.dev.yaml",
             "ClusterKopfPeering": REPO / "crds" / "clusterkopfpeerings.kopf.dev.yaml"}


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
    shipped = {crd["name"] for crd in chart.crds}
    # the LlamaFineTune CRD and kopf's peering CRDs (vendored from kopf's peering.yaml)
    assert shipped == {"crds/llamafinetunes.llamaft.io.yaml", "crds/kopfpeerings.kopf.dev.yaml",
                       "crds/clusterkopfpeerings.kopf.dev.yaml"}
    for kind, path in KOPF_CRDS.items():
        crd = yaml.safe_load(path.read_text())
        assert (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == ("kopf.dev", kind)
        assert crd["spec"]["scope"] == ("Cluster" if kind.startswith("Cluster") else "Namespaced")
        status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
        assert status["x-kubernetes-preserve-unknown-fields"] is True, "kopf keeps its keep-alives in .status"
        assert "subresources" not in crd["spec"], "kopf patches .status through the main endpoint"


@pytest.mark.parametrize("case", list(VALUES))
def test_rendered_objects_are_valid(case: str, tmp_path: Path) -> None:
    docs = render(VALUES[case])
    builtin = [d for d in docs if d["apiVersion"] not in ("monitoring.coreos.com/v1", "kopf.dev/v1")]
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
        if doc["kind"] in KOPF_CRDS:
            # kopf's schema lists only .status; the API server adds apiVersion, kind and metadata.
            body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind")}
            assert schema_errors(body, KOPF_CRDS[doc["kind"]], "v1") == [] and "spec" not in doc


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
    with pytest.raises(Exception, match="replicas|minimum"):
        chart.render({"replicas": -1}, name="lft", namespace="llamaft")
    with pytest.raises(Exception, match="lifetimeSeconds|minimum"):
        chart.render({"peering": {"lifetimeSeconds": 2}}, name="lft", namespace="llamaft")


def test_operator_settings_follow_the_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chart's env is read back by the operator's own settings parser."""
    import json

    from llamaft.operator.settings import OperatorSettings

    values = {"grafana": {"dashboardLabels": {"dashboards": "llm"}}, "prometheus": {"url": "http://p:9090"},
              "operator": {"syncIntervalSeconds": 7, "retryBackoffSeconds": 2, "etcdImage": "quay.io/coreos/etcd:v3.5.21"}}
    deployment = next(d for d in render(values) if d["kind"] == "Deployment")
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e}
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
            # A server-side apply is a PATCH, authorized as create as well when it creates the object.
            verbs = {verb, "create"} if verb == "patch" and "APPLY_PATCH" in source else {verb}
            for verb in verbs:
                if what in ("custom_object", "custom_object_status"):
                    suffix = "/status" if what.endswith("_status") else ""
                    if "PYTORCHJOBS" in source:
                        found.add(("kubeflow.org", "pytorchjobs" + suffix, verb))
                    if "JOBS[" in source:  # the job of either backend
                        found |= {(group, plural + suffix, verb) for group, _, plural in kube.JOBS.values()}
                    if "LLAMAFINETUNES" in source:
                        found.add(("llamaft.io", "llamafinetunes" + suffix, verb))
                    if "WORKLOADS" in source:
                        found.add(("kueue.x-k8s.io", "workloads" + suffix, verb))
                    if "MONITORING" in source:
                        found |= {("monitoring.coreos.com", r, verb) for r in kube.MONITORING.values()}
                else:
                    group, resource = KINDS[what]
                    found.add((group, resource, verb))
    return found


def granted(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def calls(declared: list[tuple[str, str, tuple[str, ...]]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for g, r, verbs in declared for v in verbs}


# kopf's peering between replicas (llamaft/operator/peering.py): in the scope the operator runs in,
# and only when there are several replicas (one runs --standalone and never touches them).
CLUSTER_PEERING = calls(peering.CLUSTER_PEERING_CALLS)
NAMESPACED_PEERING = calls(peering.NAMESPACED_PEERING_CALLS)


def test_api_calls_declare_what_kube_py_calls() -> None:
    """kube.API_CALLS (the operator's own calls, by reading kube.py) is current; the chart's RBAC
    is compared with them and with kopf's recorded calls in tests/operator/test_rbac.py."""
    assert calls_in_code() == calls(kube.API_CALLS), "kube.API_CALLS is out of date with the calls in kube.py"


def test_peering_calls_are_kopfs() -> None:
    """The peering calls granted are the ones kopf makes: its observer lists and watches the
    peering resource of the operator's scope, its keep-alive and clean-up merge-patch the object
    (kopf/_core/engines/peering.py: touch and clean call patching.patch_obj; guess_selectors picks
    the resource)."""
    import inspect

    from kopf._cogs.structs import references
    from kopf._core.engines import peering as kopf_peering

    settings = __import__("kopf").OperatorSettings()
    settings.peering.clusterwide = True
    assert next(iter(kopf_peering.guess_selectors(settings))) == references.CLUSTER_PEERINGS_K
    settings.peering.clusterwide = False
    assert next(iter(kopf_peering.guess_selectors(settings))) == references.NAMESPACED_PEERINGS_K
    # kopf.dev first (zalando.org is the legacy group, used only when kopf.dev is not served).
    for selector, declared in ((references.CLUSTER_PEERINGS_K, peering.CLUSTER_PEERING_CALLS),
                               (references.NAMESPACED_PEERINGS_K, peering.NAMESPACED_PEERING_CALLS)):
        assert (selector.group, selector.version, selector.any_name) == (declared[0][0], "v1", declared[0][1])
    for fn in (kopf_peering.touch, kopf_peering.clean):
        source = inspect.getsource(fn)
        assert "patching.patch_obj" in source and "get_obj" not in source and "read_obj" not in source


def test_several_replicas_peer_with_a_budget_and_spread() -> None:
    from llamaft.cli import build_parser

    docs = render({})
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}, "an upgrade from a standalone release never overlaps"
    parsed = build_parser().parse_args(args)  # what `llamaft operator` makes of the chart's arguments
    assert not parsed.standalone and parsed.peering_lifetime == 60 and parsed.priority is None
    [peering_object] = [d for d in docs if d["apiVersion"] == "kopf.dev/v1"]
    assert peering_object["kind"] == "ClusterKopfPeering" and peering_object["metadata"]["name"] == parsed.peering
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", "kopf's peering identity"
    [pdb] = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert pdb["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    [term] = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]

    # Namespaced: a KopfPeering of that name in every watched namespace (kopf peers per namespace).
    docs = render(VALUES["namespaced"])
    parsed = build_parser().parse_args(next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"])
    assert parsed.namespace == ["team-a", "team-b"]
    peerings = [d for d in docs if d["apiVersion"] == "kopf.dev/v1"]
    assert [(d["kind"], d["metadata"]["namespace"], d["metadata"]["name"]) for d in peerings] == [
        ("KopfPeering", "team-a", parsed.peering), ("KopfPeering", "team-b", parsed.peering)]

    # A user's own affinity wins; the lifetime reaches the operator.
    docs = render(VALUES["three-replicas"])
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["template"]["spec"]["affinity"] == VALUES["three-replicas"]["affinity"]
    assert build_parser().parse_args(deployment["spec"]["template"]["spec"]["containers"][0]["args"]).peering_lifetime == 20


def test_one_replica_runs_standalone() -> None:
    from llamaft.cli import build_parser

    for case in ("standalone", "namespaced-standalone"):
        docs = render(VALUES[case])
        deployment = next(d for d in docs if d["kind"] == "Deployment")
        pod = deployment["spec"]["template"]["spec"]
        assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
        parsed = build_parser().parse_args(pod["containers"][0]["args"])
        assert parsed.standalone and parsed.peering is None
        assert "POD_ID" not in {e["name"] for e in pod["containers"][0]["env"]} and "affinity" not in pod
        assert not [d for d in docs if d["kind"] == "PodDisruptionBudget" or d["apiVersion"] == "kopf.dev/v1"]
