"""The Kubeflow training operator on the test control plane: the real PyTorchJob controller and its
validating webhook, built from github.com/kubeflow/training-operator (tests/controlplane/kubeflow)
and installed as its standalone overlay installs it (manifests/overlays/standalone): namespace
`kubeflow`, the ServiceAccount, the ClusterRole of manifests/base/rbac and its binding, the empty
Secret that its certificate rotator fills, the PyTorchJob CRD, and the
ValidatingWebhookConfiguration whose CA bundle the rotator injects (failurePolicy Fail: a PyTorchJob
is admitted only if the webhook says yes).

Where it differs from the Deployment of that overlay, and why:
- it runs as a process on this machine, not as a pod of our kubelet (there is no image of it here),
  with a token of its ServiceAccount from the TokenRequest API: the API server authenticates and
  authorizes it as it would the Deployment's pod;
- the webhook's clientConfig is a URL at the Service's name (`training-operator.kubeflow.svc`, the
  name in the rotator's certificate) instead of a Service reference, and the API server resolves
  that name to this machine (ControlPlane.add_host), where a cluster routes the Service to the pod;
- the rotator writes its certificate into the Secret and waits for the files in
  /tmp/k8s-webhook-server/serving-certs, which kubelet fills from the Secret volume the Deployment
  mounts there; here the process has a mount namespace of its own with a folder of the test's at
  that path, and a thread copies the Secret into it as kubelet's secret volume does;
- only the PyTorchJob scheme is enabled (`--enable-scheme=pytorchjob`): the other job kinds' CRDs
  are not installed, and so only the PyTorchJob webhook is registered.
"""

from __future__ import annotations

import base64
import copy
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from llamaft_trainer.process.local_etcd import free_port

from tests.controlplane.cluster import HOST, Component, ControlPlane, ControlPlaneError
from tests.controlplane.conftest import apply, wait_established

NAMESPACE = "kubeflow"
NAME = "training-operator"
SECRET = "training-operator-webhook-cert"
WEBHOOK_CONFIGURATION = "validator.training-operator.kubeflow.org"
CERT_DIR = "/tmp/k8s-webhook-server/serving-certs"
"""Where the rotator (pkg/cert/cert.go of the module) waits for its certificate: a constant upstream."""
SERVICE_HOST = f"{NAME}.{NAMESPACE}.svc"
"""The name in the rotator's certificate: `<--webhook-service-name>.<MY_POD_NAMESPACE>.svc`."""
TOKEN_SECONDS = 24 * 3600
"""The operator's token outlives any test session (a pod's projected token is refreshed by kubelet;
this process's is not)."""
READY_TIMEOUT_S = 60.0
"""The rotator backs off 1, 2, 4, ... s while the certificate files are missing; they are copied
within a second of the Secret's update, so readiness takes a few seconds."""


class TrainingOperator:
    """The training operator of one control plane (see module doc). `start()`, then `stop()`."""

    def __init__(self, plane: ControlPlane, root: Path) -> None:
        self.plane = plane
        self.root = root
        self.manifests = plane.binaries.training_operator_manifests
        self.version = (self.manifests / "VERSION").read_text(encoding="utf-8").strip()
        self.certs = root / "serving-certs"
        self.webhook_port, self.probe_port = free_port(), free_port()
        self.component: Component | None = None
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None

    # ------------------------------------------------------------------ install
    def _manifest(self, name: str) -> list[dict[str, Any]]:
        return [d for d in yaml.safe_load_all((self.manifests / name).read_text(encoding="utf-8")) if d]

    def _apply(self, path: str, body: dict[str, Any]) -> None:
        apply(self.plane, path, body, manager="kustomize")

    def install(self) -> None:
        labels = {"control-plane": "kubeflow-training-operator"}
        self._apply(f"/api/v1/namespaces/{NAMESPACE}",
                    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        self._apply(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{NAME}", {
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": NAME, "namespace": NAMESPACE, "labels": {"app": NAME, **labels}}})
        (role,) = self._manifest("role.yaml")
        self._apply(f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{role['metadata']['name']}", role)
        self._apply(f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{NAME}", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": NAME, "labels": {"app": NAME, **labels}},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role["metadata"]["name"]},
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]})
        # The overlay's secretGenerator: an empty Secret, which the rotator fills (it updates, never creates).
        status, _ = self.plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/{SECRET}")
        if status == 404:
            self._apply(f"/api/v1/namespaces/{NAMESPACE}/secrets/{SECRET}", {
                "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": SECRET, "namespace": NAMESPACE, "labels": labels}})
        (crd,) = self._manifest("kubeflow.org_pytorchjobs.yaml")
        self._apply(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}", crd)
        wait_established(self.plane, crd["metadata"]["name"])
        self._apply(f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{WEBHOOK_CONFIGURATION}",
                    self.webhook_configuration())
        self.plane.add_host(SERVICE_HOST)

    def webhook_configuration(self) -> dict[str, Any]:
        """manifests/base/webhook with the overlay's patch (name, Service), the PyTorchJob webhook
        only, its Service reference turned into the URL that reaches this process (module doc)."""
        (upstream,) = self._manifest("manifests.yaml")
        configuration = copy.deepcopy(upstream)
        configuration["metadata"] = {"name": WEBHOOK_CONFIGURATION}
        webhooks = [w for w in configuration["webhooks"] if "pytorchjobs" in w["rules"][0]["resources"]]
        for webhook in webhooks:
            path = webhook["clientConfig"].pop("service")["path"]
            webhook["clientConfig"]["url"] = f"https://{SERVICE_HOST}:{self.webhook_port}{path}"
        configuration["webhooks"] = webhooks
        return configuration

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> TrainingOperator:
        self.install()
        self.certs.mkdir(parents=True, exist_ok=True)
        config = self.plane.kubeconfig_for_service_account(NAMESPACE, NAME, seconds=TOKEN_SECONDS)
        argv = [
            "unshare", "--mount", "--propagation", "private",
            "sh", "-c", 'mkdir -p "$1" && mount --bind "$0" "$1" && shift && exec "$@"', str(self.certs), CERT_DIR,
            "env", f"KUBECONFIG={config}", f"MY_POD_NAMESPACE={NAMESPACE}", f"MY_POD_NAME={NAME}-0",
            str(self.plane.binaries.training_operator),
            "--enable-scheme=pytorchjob",
            f"--webhook-server-port={self.webhook_port}",
            "--metrics-bind-address=0",  # off: nothing scrapes it here
            f"--health-probe-bind-address={HOST}:{self.probe_port}",
        ]
        self.component = Component(NAME, argv, self.root / "training-operator.log")
        self.component.start()
        self._syncer = threading.Thread(target=self._sync_certificates, name="training-operator-certs", daemon=True)
        self._syncer.start()
        self._wait("the training operator's /readyz (certificates mounted, webhook server up)", self._ready)
        self._wait("the CA bundle in its ValidatingWebhookConfiguration", self._ca_injected)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.component is not None:
            self.component.stop()
        if self._syncer is not None:
            self._syncer.join(5)

    def _sync_certificates(self) -> None:
        """kubelet's secret volume, for the one Secret: its keys as files, rewritten when they change."""
        while not self._stop.wait(0.5):
            status, secret = self.plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/secrets/{SECRET}")
            if status != 200:
                continue
            for key, value in ((secret or {}).get("data") or {}).items():
                data = base64.b64decode(value)
                target = self.certs / key
                if not target.exists() or target.read_bytes() != data:
                    target.write_bytes(data)

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"http://{HOST}:{self.probe_port}/readyz", timeout=5) as response:
            return int(response.status) == 200

    def _ca_injected(self) -> bool:
        _, configuration = self.plane.request(
            "GET", f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{WEBHOOK_CONFIGURATION}")
        return all(w["clientConfig"].get("caBundle") for w in (configuration or {}).get("webhooks") or [{"clientConfig": {}}])

    def _wait(self, what: str, ready: Any, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.component is not None and not self.component.alive():
                raise ControlPlaneError(f"the training operator exited while waiting for {what}:\n{self.component.tail()}")
            try:
                if ready():
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        tail = self.component.tail() if self.component is not None else ""
        raise ControlPlaneError(f"{what}: not within {timeout_s:.0f} s\n{tail}")

    def logs(self) -> str:
        return self.component.tail(200_000) if self.component is not None else ""

