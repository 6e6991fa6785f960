"""The control plane under the operator tests is Kubernetes: the pinned release, real
authentication (client certificates, ServiceAccount tokens), a real authorizer that says no,
and kube-controller-manager's controllers at work."""

from __future__ import annotations

import re
from pathlib import Path

from tests.controlplane.cluster import ControlPlane

GO_MOD = Path(__file__).resolve().parent / "kubernetes" / "go.mod"


def test_the_api_server_is_the_pinned_release(control_plane: ControlPlane) -> None:
    pinned = re.search(r"^\s*k8s\.io/kubernetes (v\S+)", GO_MOD.read_text(), re.M)
    assert pinned, "tests/controlplane/kubernetes/go.mod requires k8s.io/kubernetes"
    status, version = control_plane.request("GET", "/version")
    assert status == 200 and version["gitVersion"] == pinned.group(1), version


def test_an_anonymous_or_unknown_caller_is_refused(control_plane: ControlPlane) -> None:
    status, _ = control_plane.request("GET", "/api/v1/namespaces", token="not-a-token")
    assert status == 401


def test_a_service_account_gets_only_what_rbac_grants(control_plane: ControlPlane, namespace: str) -> None:
    """A token the API server issued authenticates; the RBAC authorizer refuses until a Role grants."""
    control_plane.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts",
                          {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}})
    token = control_plane.service_account_token(namespace, "reader")
    status, body = control_plane.request("GET", f"/api/v1/namespaces/{namespace}/configmaps", token=token)
    assert status == 403, body
    assert f"system:serviceaccount:{namespace}:reader" in body["message"]

    control_plane.request("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "read-configmaps"},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}]})
    control_plane.request("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-configmaps"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}]})
    status, body = control_plane.request("GET", f"/api/v1/namespaces/{namespace}/configmaps", token=token)
    assert status == 200, body
    status, _ = control_plane.request("GET", f"/api/v1/namespaces/{namespace}/secrets", token=token)
    assert status == 403


def test_the_controller_manager_runs_the_workload_controllers(control_plane: ControlPlane, namespace: str) -> None:
    """A Job gets its pod from kube-controller-manager's Job controller (there is no kubelet here
    to run it: the pod stays Pending, unbound or bound)."""
    import time

    status, body = control_plane.request("POST", f"/apis/batch/v1/namespaces/{namespace}/jobs", {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "one"},
        "spec": {"template": {"spec": {"restartPolicy": "Never",
                                       "containers": [{"name": "c", "image": "busybox", "command": ["true"]}]}}}})
    assert status == 201, body
    deadline = time.monotonic() + 30
    pods: list[dict[str, object]] = []
    while time.monotonic() < deadline and not pods:
        _, listing = control_plane.request("GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector=job-name%3Done")
        pods = listing["items"]
        time.sleep(0.2)
    assert pods, "the Job controller made no pod"
    owner = pods[0]["metadata"]["ownerReferences"][0]  # type: ignore[index]
    assert owner["kind"] == "Job" and owner["controller"] is True
