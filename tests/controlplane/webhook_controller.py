"""A Kubeflow-style controller manager on the test control plane: a controller-runtime process with
webhooks whose serving certificate its own rotator (open-policy-agent/cert-controller) makes, as the
Kubeflow training operator, Kubeflow Trainer v2 and JobSet each ship. The subclasses say what is
installed and how the binary is started; this class runs it the way each project's Deployment does,
with the differences a pod-less test cluster needs:

- the process runs on this machine, not as a pod of our kubelet (there is no image of it here),
  with a token of its ServiceAccount from the TokenRequest API: the API server authenticates and
  authorizes it as it would the Deployment's pod;
- each webhook's clientConfig is a URL at the Service's name (`<service>.<namespace>.svc`, the name
  in the rotator's certificate) instead of a Service reference, and the API server resolves that
  name to this machine (ControlPlane.add_host), where a cluster routes the Service to the pod;
- the rotator writes its certificate into the Secret and waits for the files in CERT_DIR, which
  kubelet fills from the Secret volume the Deployment mounts there; here the process has a mount
  namespace of its own with a folder of the test's at that path, and a thread copies the Secret
  into it as kubelet's secret volume does;
- leader election is off (one replica; each upstream Deployment turns it on for its rolling update).
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

Obj = dict[str, Any]
CERT_DIR = "/tmp/k8s-webhook-server/serving-certs"
"""Where each project's rotator waits for its certificate: a constant upstream (pkg/cert or
pkg/util/cert of each module)."""
TOKEN_SECONDS = 24 * 3600
"""The controller's token outlives any test session (a pod's projected token is refreshed by kubelet;
this process's is not)."""
READY_TIMEOUT_S = 60.0
"""The rotators back off 1, 2, 4, ... s while the certificate files are missing; they are copied
within a second of the Secret's update, so readiness takes a few seconds."""
_PATHS = {
    "Namespace": "/api/v1/namespaces/{name}",
    "ServiceAccount": "/api/v1/namespaces/{namespace}/serviceaccounts/{name}",
    "Secret": "/api/v1/namespaces/{namespace}/secrets/{name}",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles/{name}",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{name}",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles/{name}",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings/{name}",
    "CustomResourceDefinition": "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}",
    "ValidatingWebhookConfiguration": "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{name}",
    "MutatingWebhookConfiguration": "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{name}",
    "ClusterTrainingRuntime": "/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes/{name}",
}


def object_path(obj: Obj) -> str:
    """The REST path of `obj` (one of the kinds a controller's manifests hold)."""
    meta = obj["metadata"]
    return _PATHS[obj["kind"]].format(name=meta["name"], namespace=meta.get("namespace", ""))


class WebhookController:
    """One controller manager (module doc). Subclasses set the class attributes and `install` and
    `argv`; `start()`, then `stop()`."""

    name: str
    """The component's name in logs and errors."""
    namespace: str
    service_account: str
    secret: str
    """The Secret the rotator fills (it updates it, never creates it)."""
    service: str
    """The webhook Service's name: the rotator's certificate is for `<service>.<namespace>.svc`."""
    webhook_configurations: tuple[str, ...] = ()
    """Kind/name of each webhook configuration whose CA bundle the rotator injects."""

    def __init__(self, plane: ControlPlane, root: Path) -> None:
        self.plane = plane
        self.root = root
        self.certs = root / "serving-certs"
        self.webhook_port, self.probe_port = free_port(), free_port()
        self.component: Component | None = None
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None

    @property
    def service_host(self) -> str:
        return f"{self.service}.{self.namespace}.svc"

    @property
    def manifests(self) -> Path:
        """The folder of upstream manifests the build copied beside the binary (with its VERSION)."""
        raise NotImplementedError

    @property
    def version(self) -> str:
        return (self.manifests / "VERSION").read_text(encoding="utf-8").strip()

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        raise NotImplementedError

    def argv(self) -> list[str]:
        """The binary and its flags."""
        raise NotImplementedError

    @staticmethod
    def manifest(folder: Path, name: str) -> list[Obj]:
        return [d for d in yaml.safe_load_all((folder / name).read_text(encoding="utf-8")) if d]

    def apply(self, obj: Obj) -> None:
        apply(self.plane, object_path(obj), obj, manager="kustomize")

    def apply_crd(self, crd: Obj) -> None:
        self.apply(crd)
        wait_established(self.plane, crd["metadata"]["name"])

    def install_identity(self, cluster_roles: list[Obj], roles: list[Obj] = (), labels: dict[str, str] | None = None) -> None:  # type: ignore[assignment]
        """The namespace, the ServiceAccount, each ClusterRole bound to it cluster-wide and each Role
        bound to it in the namespace, and the empty Secret the rotator fills."""
        labels = labels or {}
        meta = {"namespace": self.namespace, "labels": labels}
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}})
        self.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": self.service_account, **meta}})
        subject = [{"kind": "ServiceAccount", "name": self.service_account, "namespace": self.namespace}]
        for role in cluster_roles:
            self.apply(role)
            self.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                        "metadata": {"name": role["metadata"]["name"], "labels": labels},
                        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                    "name": role["metadata"]["name"]}, "subjects": subject})
        for role in roles:
            role = {**role, "metadata": {**role["metadata"], "namespace": self.namespace}}
            self.apply(role)
            self.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                        "metadata": {"name": role["metadata"]["name"], **meta},
                        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                    "name": role["metadata"]["name"]}, "subjects": subject})
        status, _ = self.plane.request("GET", f"/api/v1/namespaces/{self.namespace}/secrets/{self.secret}")
        if status == 404:
            self.apply({"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": self.secret, **meta}})

    def install_webhooks(self, configuration: Obj, name: str, keep: Any = None) -> Obj:
        """`configuration` (an upstream Validating/MutatingWebhookConfiguration) named `name`, the
        webhooks for which `keep(webhook)` holds (all by default), each Service reference turned into
        the URL that reaches this process (module doc); applied, and returned."""
        configuration = copy.deepcopy(configuration)
        configuration["metadata"] = {"name": name}
        webhooks = [w for w in configuration["webhooks"] if keep is None or keep(w)]
        for webhook in webhooks:
            path = webhook["clientConfig"].pop("service")["path"]
            webhook["clientConfig"]["url"] = f"https://{self.service_host}:{self.webhook_port}{path}"
        configuration["webhooks"] = webhooks
        self.apply(configuration)
        self.plane.add_host(self.service_host)
        return configuration

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> WebhookController:
        self.install()
        self.certs.mkdir(parents=True, exist_ok=True)
        config = self.plane.kubeconfig_for_service_account(self.namespace, self.service_account, seconds=TOKEN_SECONDS)
        argv = [
            "unshare", "--mount", "--propagation", "private",
            "sh", "-c", 'mkdir -p "$1" && mount --bind "$0" "$1" && shift && exec "$@"', str(self.certs), CERT_DIR,
            "env", f"KUBECONFIG={config}", *self.argv(),
        ]
        self.component = Component(self.name, argv, self.root / f"{self.name}.log")
        self.component.start()
        self._syncer = threading.Thread(target=self._sync_certificates, name=f"{self.name}-certs", daemon=True)
        self._syncer.start()
        self._wait(f"{self.name}'s /readyz (certificates mounted, webhook server up)", self._ready)
        self._wait(f"the CA bundle in {self.name}'s webhook configurations", self._ca_injected)
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
            try:
                status, secret = self.plane.request("GET", f"/api/v1/namespaces/{self.namespace}/secrets/{self.secret}")
            except OSError:  # the API server restarting (an outage test) or gone (the session's end)
                continue
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
        for kind_name in self.webhook_configurations:
            kind, name = kind_name.split("/")
            _, configuration = self.plane.request("GET", object_path({"kind": kind, "metadata": {"name": name}}))
            if not all(w["clientConfig"].get("caBundle") for w in (configuration or {}).get("webhooks") or [{"clientConfig": {}}]):
                return False
        return True

    def _wait(self, what: str, ready: Any, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.component is not None and not self.component.alive():
                raise ControlPlaneError(f"{self.name} exited while waiting for {what}:\n{self.component.tail()}")
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
