"""A real Kubernetes control plane on loopback: Debian's etcd, and kube-apiserver,
kube-controller-manager and kube-scheduler built from k8s.io/kubernetes (tests/controlplane/build).

It is set up as envtest (sigs.k8s.io/controller-runtime pkg/internal/testing/controlplane) and
kubeadm set one up, with what envtest leaves out because its tests run no pods:
- authentication by client certificates from the cluster's CA (tests/controlplane/pki) and by
  ServiceAccount tokens that the API server signs and the TokenRequest API issues;
- authorization by the Node authorizer and RBAC (`--authorization-mode=Node,RBAC`), with the
  default admission plugins (ServiceAccount, NodeRestriction, DefaultTolerationSeconds, ...);
- kube-controller-manager with a credential per controller (`--use-service-account-credentials`,
  as kubeadm runs it), so every Job, ReplicaSet, garbage collection and pod GC request passes the
  same authorizer; kube-scheduler binding pods to the Nodes that our kubelet registers.

The admin identity of the tests is a client certificate in `system:masters`; everything else
authenticates as itself. The API server runs in a mount namespace of its own whose /etc/hosts is
`hosts` in the root: a webhook server on this machine is called at the name its serving
certificate holds (`add_host`), as the API server would reach it through a Service.
`stop_apiserver` / `start_apiserver` stop the API server process and start a new one on the same
etcd and port: an outage as a real cluster has one.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from llamaft_trainer.process.local_etcd import LocalEtcd, free_port, parent_death_signal

from tests.controlplane.binaries import Binaries
from tests.controlplane.pki import ClusterPKI, Credential
from tests.tiers import starts_processes

HOST = "127.0.0.1"
SERVICE_CIDR = "10.96.0.0/16"
"""Service ClusterIPs: allocated by the API server, never routed (our kubelet runs no kube-proxy;
pods reach Services through the names our kubelet resolves)."""
ISSUER = "https://kubernetes.default.svc.cluster.local"
START_TIMEOUT_S = 60.0
"""The slowest start seen on 2 busy cores is well under this; a start that passes it has failed
(its log's tail is in the error)."""


class ControlPlaneError(RuntimeError):
    """A component did not start or stopped; the message has the end of its log."""


@dataclass
class Component:
    """One process of the control plane: its command line, log and process."""

    name: str
    argv: list[str]
    log: Path
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, preexec_fn=parent_death_signal(signal.SIGKILL))

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


def kubeconfig(path: Path, server: str, ca: Path, *, user: str, credential: Credential | None = None,
               token: str | None = None) -> Path:
    """A kubeconfig file for `user`: a client certificate or a bearer token, the cluster's CA."""
    auth: dict[str, str] = {}
    if credential is not None:
        auth = {"client-certificate": str(credential.cert), "client-key": str(credential.key)}
    if token is not None:
        auth = {"token": token}
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": auth}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
    }), encoding="utf-8")
    path.chmod(0o600)
    return path


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler, in `root`."""

    def __init__(self, root: Path, binaries: Binaries, *, controller_manager_flags: Sequence[str] = ()) -> None:
        self.root = root
        self.binaries = binaries
        root.mkdir(parents=True, exist_ok=True)
        self.pki = ClusterPKI(root / "pki")
        self.port = free_port()
        self.server = f"https://{HOST}:{self.port}"
        serving = self.pki.serving("apiserver", (HOST, "localhost", "kubernetes", "kubernetes.default",
                                                 "kubernetes.default.svc", "kubernetes.default.svc.cluster.local",
                                                 "10.96.0.1"))
        self.admin = self.pki.client("llamaft-test-admin", ("system:masters",))
        self.admin_kubeconfig = kubeconfig(root / "admin.kubeconfig", self.server, self.pki.ca,
                                           user="llamaft-test-admin", credential=self.admin)
        self.etcd = LocalEtcd()
        self.hosts = root / "hosts"
        self.hosts.write_text(Path("/etc/hosts").read_text(encoding="utf-8"), encoding="utf-8")
        self.apiserver = Component("kube-apiserver", self._private_hosts(self._apiserver_argv(serving)),
                                   root / "kube-apiserver.log")
        self.controller_manager = self._controller("kube-controller-manager", "system:kube-controller-manager", [
            f"--service-account-private-key-file={self.pki.service_account_key}",
            f"--root-ca-file={self.pki.ca}",
            "--use-service-account-credentials=true",
            "--controllers=*",
            *controller_manager_flags,
        ])
        self.scheduler = self._controller("kube-scheduler", "system:kube-scheduler", [])
        self.started_in_s: float | None = None

    def _apiserver_argv(self, serving: Credential) -> list[str]:
        sa_key = self.pki.service_account_key
        return [
            str(self.binaries.kube_apiserver),
            f"--bind-address={HOST}", f"--advertise-address={HOST}", f"--secure-port={self.port}",
            f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
            f"--cert-dir={self.root / 'apiserver-certs'}",
            f"--client-ca-file={self.pki.ca}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--service-account-issuer={ISSUER}", f"--api-audiences={ISSUER}",
            f"--service-account-key-file={self.pki.service_account_public_key}",
            f"--service-account-signing-key-file={sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            # The lease reconciler refuses a loopback advertise address (the `kubernetes` Service's
            # endpoints would point every pod at itself); envtest turns it off the same way. Our
            # kubelet gives pods the API server's address in KUBERNETES_SERVICE_HOST/PORT.
            "--endpoint-reconciler-type=none",
            "--etcd-servers=http://{etcd}",  # filled in at start: the etcd's port is known then
            "--profiling=false",
            "--v=1",
        ]

    def _private_hosts(self, argv: list[str]) -> list[str]:
        """`argv` in a mount namespace of its own where /etc/hosts is `self.hosts` (unshare and sh
        exec, so the pid is the API server's)."""
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"',
                str(self.hosts), *argv]

    def add_host(self, name: str, address: str = HOST) -> None:
        """Make `name` resolve to `address` for the API server (its /etc/hosts, written in place:
        the bind mount holds the file's inode; Go rereads it when its modification time changes)."""
        with self.hosts.open("a", encoding="utf-8") as hosts:
            hosts.write(f"{address} {name}\n")

    def _controller(self, name: str, user: str, flags: list[str]) -> Component:
        credential = self.pki.client(user)
        config = kubeconfig(self.root / f"{name}.kubeconfig", self.server, self.pki.ca, user=user,
                            credential=credential)
        argv = [
            str(getattr(self.binaries, name.replace("-", "_"))),
            f"--kubeconfig={config}", f"--authentication-kubeconfig={config}", f"--authorization-kubeconfig={config}",
            "--leader-elect=false", f"--bind-address={HOST}", f"--secure-port={free_port()}",
            f"--cert-dir={self.root / (name + '-certs')}", "--v=1", *flags,
        ]
        return Component(name, argv, self.root / f"{name}.log")

    # ------------------------------------------------------------------ lifecycle
    @starts_processes
    def start(self) -> ControlPlane:
        began = time.monotonic()
        self.etcd.start()
        self.apiserver.argv = [a.replace("{etcd}", self.etcd.endpoint) for a in self.apiserver.argv]
        self.start_apiserver()
        for component in (self.controller_manager, self.scheduler):
            component.start()
        self._wait_for("kube-controller-manager and kube-scheduler", self._controllers_ready)
        self.started_in_s = time.monotonic() - began
        return self

    def start_apiserver(self) -> None:
        """Start the API server (again: after `stop_apiserver`, on the same etcd and port)."""
        self.apiserver.start()
        self._wait_for("kube-apiserver /readyz", lambda: self._get("/readyz") == 200)

    def stop_apiserver(self) -> None:
        self.apiserver.stop()

    def stop(self) -> None:
        for component in (self.scheduler, self.controller_manager, self.apiserver):
            component.stop()
        self.etcd.stop()

    def _wait_for(self, what: str, ready: Any, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for component in (self.apiserver, self.controller_manager, self.scheduler):
                if component.process is not None and not component.alive():
                    raise ControlPlaneError(f"{component.name} exited ({component.process.returncode}) while "
                                            f"waiting for {what}:\n{component.tail()}")
            with contextlib.suppress(OSError, ValueError):
                if ready():
                    return
            time.sleep(0.2)
        tails = "\n".join(f"--- {c.name}\n{c.tail(1500)}" for c in (self.apiserver, self.controller_manager, self.scheduler))
        raise ControlPlaneError(f"{what}: not ready within {timeout_s:.0f} s\n{tails}")

    def _controllers_ready(self) -> bool:
        # The ServiceAccount controller made `default`'s ServiceAccount and the root-CA publisher its
        # ConfigMap (kube-controller-manager works), and both components' /healthz answer.
        if self._get("/api/v1/namespaces/default/serviceaccounts/default") != 200:
            return False
        if self._get("/api/v1/namespaces/default/configmaps/kube-root-ca.crt") != 200:
            return False
        return all(_healthz(c) for c in (self.controller_manager, self.scheduler))

    # ------------------------------------------------------------------ requests
    def _context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        context.load_cert_chain(str(self.admin.cert), str(self.admin.key))
        return context

    def _get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.server + path, context=self._context(), timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    def request(self, method: str, path: str, body: Any = None, *, token: str | None = None,
                content_type: str = "application/json") -> tuple[int, Any]:
        """One request as the admin (or as the bearer of `token`): (status, decoded JSON body)."""
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        headers = {"Accept": "application/json"}
        if token is None:
            context.load_cert_chain(str(self.admin.cert), str(self.admin.key))
        else:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            headers["Content-Type"] = content_type
        request = urllib.request.Request(self.server + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, context=context, timeout=30) as response:
                status, payload = int(response.status), response.read()
        except urllib.error.HTTPError as exc:
            status, payload = int(exc.code), exc.read()
        return status, (json.loads(payload) if payload else None)

    def service_account_token(self, namespace: str, name: str, *, seconds: int = 3600) -> str:
        """A token for a ServiceAccount from the TokenRequest API, as kubelet projects one into a pod."""
        status, body = self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                                    {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                     "spec": {"audiences": [ISSUER], "expirationSeconds": seconds}})
        if status != 201:
            raise ControlPlaneError(f"TokenRequest for {namespace}/{name}: {status} {body}")
        return str(body["status"]["token"])

    def kubeconfig_for_service_account(self, namespace: str, name: str, *, seconds: int = 3600) -> Path:
        token = self.service_account_token(namespace, name, seconds=seconds)
        return kubeconfig(self.root / f"sa-{namespace}-{name}.kubeconfig", self.server, self.pki.ca,
                          user=f"system:serviceaccount:{namespace}:{name}", token=token)


def _healthz(component: Component) -> bool:
    port = next(a.split("=", 1)[1] for a in component.argv if a.startswith("--secure-port="))
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the component's self-signed serving certificate
    with urllib.request.urlopen(f"https://{HOST}:{port}/healthz", context=context, timeout=5) as response:
        return int(response.status) == 200


@contextlib.contextmanager
def running(root: Path, binaries: Binaries, **kwargs: Any) -> Iterator[ControlPlane]:
    plane = ControlPlane(root, binaries, **kwargs)
    try:
        yield plane.start()
    finally:
        plane.stop()
        shutil.rmtree(root / "etcd", ignore_errors=True)
