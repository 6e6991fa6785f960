"""Our kubelet on the real control plane: kube-scheduler binds the pods, our kubelet runs them as
process trees with the ServiceAccount token the API server issued, and kube-controller-manager's
controllers see them finish."""

from __future__ import annotations

import time
from typing import Any

from tests.controlplane.cluster import ControlPlane
from tests.controlplane.conftest import TAINT
from tests.controlplane.kubelet import Kubelet


def pod_spec(namespace: str, script: str, **extra: Any) -> dict[str, Any]:
    return {"restartPolicy": "Never",
            "tolerations": [{"key": TAINT, "operator": "Equal", "value": namespace, "effect": "NoSchedule"}],
            "containers": [{"name": "main", "image": "python:3.11-slim", "command": ["python3", "-c", script]}], **extra}


def wait_phase(plane: ControlPlane, namespace: str, name: str, phases: tuple[str, ...], timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    pod: dict[str, Any] = {}
    while time.monotonic() < deadline:
        _, pod = plane.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        if (pod.get("status") or {}).get("phase") in phases:
            return pod
        time.sleep(0.2)
    raise AssertionError(f"pod {name} not {phases} within {timeout_s} s: {pod.get('status')}")


WHOAMI = """
import json, ssl, urllib.request, urllib.error, os
d = '/var/run/secrets/kubernetes.io/serviceaccount'
ns = open(d + '/namespace').read()
ctx = ssl.create_default_context(cafile=d + '/ca.crt')
url = 'https://%s:%s/api/v1/namespaces/%s/secrets' % (os.environ['KUBERNETES_SERVICE_HOST'], os.environ['KUBERNETES_SERVICE_PORT'], ns)
req = urllib.request.Request(url, headers={'Authorization': 'Bearer ' + open(d + '/token').read()})
try:
    urllib.request.urlopen(req, context=ctx)
    status = 200
except urllib.error.HTTPError as e:
    status = e.code
    reason = json.loads(e.read())['message']
open('/dev/termination-log', 'w').write('namespace=%s status=%s %s' % (ns, status, reason))
"""


def test_a_pod_runs_with_the_token_the_api_server_issued(control_plane: ControlPlane, namespace: str, kubelet: Kubelet) -> None:
    """The scheduler binds the pod to our node; our kubelet projects the ServiceAccount token, CA and
    namespace; the API server authenticates the pod as its ServiceAccount and RBAC refuses it."""
    status, body = control_plane.request("POST", f"/api/v1/namespaces/{namespace}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "whoami"}, "spec": pod_spec(namespace, WHOAMI)})
    assert status == 201, body
    assert any(v.get("projected") for v in body["spec"]["volumes"]), "the ServiceAccount admission plugin adds the token volume"
    pod = wait_phase(control_plane, namespace, "whoami", ("Succeeded", "Failed"))
    assert pod["spec"]["nodeName"] == kubelet.name
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert pod["status"]["phase"] == "Succeeded", (terminated, kubelet.logs(namespace, "whoami"))
    assert terminated["message"].startswith(f"namespace={namespace} status=403 "), terminated
    assert f"system:serviceaccount:{namespace}:default" in terminated["message"]


def test_a_job_completes_through_the_real_controllers(control_plane: ControlPlane, namespace: str, kubelet: Kubelet) -> None:
    status, body = control_plane.request("POST", f"/apis/batch/v1/namespaces/{namespace}/jobs", {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "two"},
        "spec": {"completions": 2, "parallelism": 2, "template": {"spec": pod_spec(namespace, "print('done')")}}})
    assert status == 201, body
    deadline = time.monotonic() + 90
    conditions: dict[str, str] = {}
    while time.monotonic() < deadline and conditions.get("Complete") != "True":
        _, job = control_plane.request("GET", f"/apis/batch/v1/namespaces/{namespace}/jobs/two")
        conditions = {c["type"]: c["status"] for c in (job.get("status") or {}).get("conditions") or []}
        time.sleep(0.3)
    assert conditions.get("Complete") == "True", job.get("status")
    assert job["status"]["succeeded"] == 2


def test_deleting_a_pod_stops_its_container(control_plane: ControlPlane, namespace: str, kubelet: Kubelet) -> None:
    """SIGTERM to the container; when it has exited, the kubelet deletes the pod for good."""
    script = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\ntime.sleep(600)\n"
    control_plane.request("POST", f"/api/v1/namespaces/{namespace}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper"},
        "spec": pod_spec(namespace, script, terminationGracePeriodSeconds=30)})
    wait_phase(control_plane, namespace, "sleeper", ("Running",))
    run = next(r for r in kubelet.runs.values() if r.pod["metadata"]["name"] == "sleeper")
    assert run.process is not None
    began = time.monotonic()
    control_plane.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/sleeper")
    deadline = began + 30
    status = 200
    while time.monotonic() < deadline and status != 404:
        status, _ = control_plane.request("GET", f"/api/v1/namespaces/{namespace}/pods/sleeper")
        time.sleep(0.2)
    assert status == 404, "the pod was not deleted for good"
    assert run.process.poll() == 0, "the container did not exit on SIGTERM"
    assert time.monotonic() - began < 25, "the kubelet waited out the grace period instead of the container's exit"
