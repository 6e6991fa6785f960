"""Our kubelet on the real control plane: the one part of the test cluster that is not Kubernetes.

Each `Kubelet` is one node. It authenticates as the node (`system:node:<name>` in `system:nodes`,
a client certificate from the cluster's CA), so the Node authorizer and the NodeRestriction
admission plugin hold it to what a real kubelet may do: its own Node and Lease, the pods bound to
it, the ConfigMaps, Secrets and ServiceAccount tokens those pods use. It
- registers its Node (capacity and allocatable: cpu, memory, pods, nvidia.com/gpu; topology and
  instance-type labels) and renews its Lease in kube-node-lease (the heartbeat the node lifecycle
  controller of kube-controller-manager reads);
- runs each pod that kube-scheduler binds to it: the first container as a process tree in a
  private filesystem (tests/operator/container_root.py), with the pod's volumes (emptyDir,
  configMap, secret, the projected ServiceAccount token + kube-root-ca.crt + namespace that the
  ServiceAccount admission plugin adds, persistentVolumeClaim: the hostPath of the PersistentVolume
  kube-controller-manager bound it to, or a folder the test declares) and
  environment (values, fieldRef, configMapKeyRef, secretKeyRef, and KUBERNETES_SERVICE_HOST/PORT
  pointing at the API server, as kubelet sets them from the `kubernetes` Service);
- reports the pod's status through the API (phase, conditions, container state, exit code,
  termination message from terminationMessagePath), restarts containers as restartPolicy says,
  and on deletion stops the container (SIGTERM, then SIGKILL after the grace period), writes its
  terminal status and deletes the pod for good, as kubelet's status manager does;
- suffers a node's faults on demand: `kill` (a signal to the container's whole process tree, its
  cgroup on a real node), `oom_kill`, `hang` (SIGSTOP), `evict` (node-pressure eviction).

An image's entrypoint, where a container gives no command, is read from the Dockerfile the image is
built from (IMAGES). Pods share this machine's network (no CNI, no network namespace): each pod gets
a loopback address of its own (status.podIP, 127.<128 + pytest-xdist block>.x.y, apart from the
simulation's blocks) and the trainer is told to bind its metrics server there
(LLAMAFT_METRICS_HOST), so that two workers of a job can serve the same metrics port, as two pods
do; a port bound on the wildcard address (an etcd's 2379) is still this machine's.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.conftest import REPO
from tests.controlplane.cluster import HOST, ControlPlane

LAUNCHER = REPO / "tests" / "operator" / "container_root.py"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
IMAGES = {"ghcr.io/llamaft/operator": REPO / "Dockerfile.operator", "ghcr.io/llamaft/trainer": REPO / "Dockerfile.trainer"}
"""Images the kubelet can run without a command: the Dockerfile they are built from gives ENTRYPOINT."""
_addresses = itertools.count()


def pod_address() -> str:
    """A loopback address no other pod of this process (or worker) has had."""
    k = next(_addresses)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    block = 128 + (1 + int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0)
    return f"127.{block}.{k // 250}.{k % 250 + 1}"


def process_tree(root: int) -> list[int]:
    """`root` and every process descended from it (by parent pid, whatever session it is in)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may hold spaces and parentheses.
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


LEASE_RENEW_S = 10.0
"""kubelet's default (nodeLeaseDurationSeconds 40, renewed every quarter of it)."""
POLL_S = 0.3

Obj = dict[str, Any]


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def entrypoint(image: str) -> list[str] | None:
    """The ENTRYPOINT of the Dockerfile `image` is built from, or None for an unknown image."""
    repository = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
    dockerfile = IMAGES.get(repository)
    if dockerfile is None:
        return None
    match = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", dockerfile.read_text(), re.M)
    return list(json.loads(match.group(1))) if match else None


@dataclass
class NodeShape:
    name: str
    cpu: str = "16"
    memory: str = "64Gi"
    gpus: int = 0
    pods: int = 110
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, str]] = field(default_factory=list)
    """Registered with the Node, as kubelet's --register-with-taints."""


@dataclass
class Run:
    """One pod's container on this node."""

    pod: Obj
    folder: Path
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: str = ""
    last_terminated: Obj | None = None
    terminating_since: float | None = None
    log: Path | None = None
    address: str = field(default_factory=pod_address)
    oom: bool = False
    """The next exit is the OOM killer's (reason OOMKilled)."""
    evicted: str | None = None
    """Being evicted by this node (evict): the message its Failed status will carry."""


class ApiError(RuntimeError):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"{status}: {body}")
        self.status, self.body = status, body


class Kubelet:
    """One node of the test cluster (see module doc). `start()`, then `stop()`."""

    def __init__(self, plane: ControlPlane, shape: NodeShape, root: Path, claims: dict[str, Path] | None = None) -> None:
        self.plane, self.shape, self.root = plane, shape, root
        self.name = shape.name
        self.claims = claims or {}
        root.mkdir(parents=True, exist_ok=True)
        credential = plane.pki.client(f"system:node:{shape.name}", ("system:nodes",))
        self._context = ssl.create_default_context(cafile=str(plane.pki.ca))
        self._context.load_cert_chain(str(credential.cert), str(credential.key))
        self.runs: dict[str, Run] = {}
        self.ran: dict[tuple[str, str], Path] = {}
        """(namespace, pod name) -> the newest container log of every pod that ran here, deleted
        ones too: kubelet removes a deleted pod's logs, but a test reads what each attempt did."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    # ------------------------------------------------------------------ API
    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Accept": "application/json", **({"Content-Type": content_type} if data else {})}
        request = urllib.request.Request(self.plane.server + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, context=self._context, timeout=30) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            raise ApiError(exc.code, json.loads(raw) if raw else None) from None
        return json.loads(payload) if payload else None

    # ------------------------------------------------------------------ node
    def _register(self) -> None:
        labels = {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                  **self.shape.labels}
        try:
            self.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                                   "metadata": {"name": self.name, "labels": labels},
                                                   "spec": {"taints": self.shape.taints}})
        except ApiError as exc:
            if exc.status != 409:
                raise
        capacity = {"cpu": self.shape.cpu, "memory": self.shape.memory, "pods": str(self.shape.pods),
                    "ephemeral-storage": "500Gi"}
        if self.shape.gpus:
            capacity["nvidia.com/gpu"] = str(self.shape.gpus)
        stamp = now()
        self.request("PATCH", f"/api/v1/nodes/{self.name}/status", {"status": {
            "capacity": capacity, "allocatable": capacity,
            "addresses": [{"type": "InternalIP", "address": HOST}, {"type": "Hostname", "address": self.name}],
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "llamaft test kubelet",
                 "lastHeartbeatTime": stamp, "lastTransitionTime": stamp},
                *[{"type": t, "status": "False", "reason": f"KubeletHasNo{t}", "lastHeartbeatTime": stamp,
                   "lastTransitionTime": stamp} for t in ("MemoryPressure", "DiskPressure", "PIDPressure")],
            ],
            "nodeInfo": {"kubeletVersion": "v1.37.2", "operatingSystem": "linux", "architecture": "amd64",
                         "containerRuntimeVersion": "llamaft://container_root", "kernelVersion": os.uname().release,
                         "osImage": "llamaft test node", "machineID": "", "systemUUID": "", "bootID": "",
                         "kubeProxyVersion": ""},
        }}, content_type="application/strategic-merge-patch+json")

    def _renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}"
        spec = {"holderIdentity": self.name, "leaseDurationSeconds": 40, "renewTime": now_micro()}
        try:
            self.request("PATCH", path, {"spec": spec}, content_type="application/merge-patch+json")
        except ApiError as exc:
            if exc.status != 404:
                raise
            node = self.request("GET", f"/api/v1/nodes/{self.name}")
            self.request("POST", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": node["metadata"]["uid"]}]},
                "spec": spec})

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Kubelet:
        self._register()
        self._renew_lease()
        self._thread = threading.Thread(target=self._loop, name=f"kubelet-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """The node goes: no more status writes or Lease renewals, every container's processes
        SIGKILLed (the end of a test, or the death of the node's machine)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        for run in self.runs.values():
            self._kill(run)

    def _loop(self) -> None:
        renewed = time.monotonic()
        while not self._stop.is_set():
            try:
                if time.monotonic() - renewed >= LEASE_RENEW_S:
                    self._renew_lease()
                    renewed = time.monotonic()
                self._sync()
            except (OSError, ApiError) as exc:  # the API server may be restarting: try again next round
                self.errors.append(f"{now()} {type(exc).__name__}: {exc}")
            self._stop.wait(POLL_S)

    def _sync(self) -> None:
        selector = urllib.parse.quote(f"spec.nodeName={self.name}")
        pods = self.request("GET", f"/api/v1/pods?fieldSelector={selector}")["items"]
        seen = set()
        for pod in pods:
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            run = self.runs.get(uid)
            if run is None:
                if pod["metadata"].get("deletionTimestamp"):
                    self._delete_for_good(pod)
                    continue
                if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                run = self.runs[uid] = Run(pod, self.root / uid)
                self._start_container(run)
            run.pod = pod
            if pod["metadata"].get("deletionTimestamp"):
                self._terminate(run)
                continue
            if run.evicted is not None:
                self._evicting(run)
                continue
            self._check(run)
        for uid in [u for u in self.runs if u not in seen]:  # deleted for good elsewhere
            self._kill(self.runs.pop(uid))

    # ------------------------------------------------------------------ containers
    def _start_container(self, run: Run) -> None:
        pod = run.pod
        container = pod["spec"]["containers"][0]
        try:
            argv, env, binds = self._prepare(pod, container, run)
        except (ApiError, ValueError) as exc:
            self._patch_status(pod, {"phase": "Pending", "containerStatuses": [self._container_status(
                container, {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)[:1000]}}, run)]})
            self.runs.pop(pod["metadata"]["uid"], None)
            return
        termination = run.folder / "termination-log"
        run.folder.mkdir(parents=True, exist_ok=True)
        termination.write_bytes(b"")
        binds.append((termination, container.get("terminationMessagePath") or "/dev/termination-log", False))
        launch = [sys.executable, "-I", str(LAUNCHER), "--root", str(run.folder / "containers" / str(run.restarts)),
                  "--cwd", container.get("workingDir") or "/"]
        for source, target, read_only in binds:
            launch += ["--bind-ro" if read_only else "--bind", str(source), target]
        run.log = run.folder / f"{run.restarts}.log"
        self.ran[(pod["metadata"]["namespace"], pod["metadata"]["name"])] = run.log
        with run.log.open("wb") as log:
            run.process = subprocess.Popen([*launch, "--", *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True)
        run.started_at = now()
        self._patch_status(pod, {
            "phase": "Running", "hostIP": HOST, "hostIPs": [{"ip": HOST}], "podIP": run.address,
            "podIPs": [{"ip": run.address}],
            "startTime": (pod.get("status") or {}).get("startTime") or run.started_at,
            "conditions": self._conditions(True),
            "containerStatuses": [self._container_status(container, {"running": {"startedAt": run.started_at}}, run)]})

    def _prepare(self, pod: Obj, container: Obj, run: Run) -> tuple[list[str], dict[str, str], list[tuple[Path, str, bool]]]:
        meta, spec = pod["metadata"], pod["spec"]
        namespace = meta["namespace"]
        env: dict[str, str] = {
            "PATH": f"{REPO / '.venv' / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root", "HOSTNAME": spec.get("hostname") or meta["name"], "LLAMAFT_METRICS_HOST": run.address,
            "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "trainer")]),
            "KUBERNETES_SERVICE_HOST": HOST, "KUBERNETES_SERVICE_PORT": str(self.plane.port),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(self.plane.port),
        }
        for var in container.get("env") or []:
            if "value" in var:
                env[var["name"]] = str(var["value"])
                continue
            source = var.get("valueFrom") or {}
            if "fieldRef" in source:
                path = source["fieldRef"].get("fieldPath", "")
                keyed = re.fullmatch(r"metadata\.(annotations|labels)\['([^']+)'\]", path)
                if keyed:  # the downward API's subscripted fields (a Job's completion index)
                    env[var["name"]] = (meta.get(keyed[1]) or {}).get(keyed[2], "")
                    continue
                env[var["name"]] = {
                    "metadata.name": meta["name"], "metadata.namespace": namespace, "metadata.uid": meta["uid"],
                    "spec.nodeName": self.name, "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
                    "status.podIP": run.address, "status.hostIP": HOST,
                }.get(path, "")
            elif "configMapKeyRef" in source or "secretKeyRef" in source:
                kind = "configMapKeyRef" if "configMapKeyRef" in source else "secretKeyRef"
                ref = source[kind]
                data = self._data("configmaps" if kind == "configMapKeyRef" else "secrets", namespace, ref["name"])
                if ref.get("key") in data:
                    env[var["name"]] = data[ref["key"]]
                elif not ref.get("optional"):
                    raise ValueError(f"{kind} {ref['name']}/{ref.get('key')} not found")
        binds: list[tuple[Path, str, bool]] = []
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        for mount in container.get("volumeMounts") or []:
            volume = volumes[mount["name"]]
            folder = self._volume(pod, volume, run)
            if folder is not None:
                binds.append((folder, mount["mountPath"], bool(mount.get("readOnly"))))
        if any(REPO.is_relative_to(target) for _, target, _ in binds):
            # The image's files (this checkout and its venv play the image) are not under the pod's
            # volumes: a volume at a folder that holds the checkout (an emptyDir at /tmp, where CI may
            # clone it) would hide them, which a real image's files never are. Bound back over it.
            binds.append((REPO, str(REPO), True))
        argv = [*(container.get("command") or entrypoint(container.get("image", "")) or []), *(container.get("args") or [])]
        if not argv:
            raise ValueError(f"image {container.get('image')!r}: the test kubelet knows no entrypoint for it; set command")
        if argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        elif not os.path.isabs(argv[0]):
            found = shutil.which(argv[0], path=env["PATH"])
            if found is None:
                raise ValueError(f'exec: "{argv[0]}": executable file not found in $PATH')
            argv[0] = found
        return argv, env, binds

    def _data(self, resource: str, namespace: str, name: str) -> dict[str, str]:
        obj = self.request("GET", f"/api/v1/namespaces/{namespace}/{resource}/{name}")
        if resource == "secrets":
            import base64

            return {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
        return dict(obj.get("data") or {})

    def _volume(self, pod: Obj, volume: Obj, run: Run) -> Path | None:
        meta = pod["metadata"]
        folder = run.folder / "volumes" / volume["name"]
        if "emptyDir" in volume:
            folder.mkdir(parents=True, exist_ok=True)
            return folder
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if claim in self.claims:
                self.claims[claim].mkdir(parents=True, exist_ok=True)
                return self.claims[claim]
            return self._claimed_folder(meta["namespace"], claim)
        files: dict[str, str] = {}
        if "configMap" in volume:
            files = self._data("configmaps", meta["namespace"], volume["configMap"]["name"])
        elif "secret" in volume:
            files = self._data("secrets", meta["namespace"], volume["secret"]["secretName"])
        elif "projected" in volume:
            for source in volume["projected"].get("sources") or []:
                if "serviceAccountToken" in source:
                    files[source["serviceAccountToken"].get("path", "token")] = self._token(pod, source["serviceAccountToken"])
                elif "configMap" in source:
                    data = self._data("configmaps", meta["namespace"], source["configMap"]["name"])
                    for item in source["configMap"].get("items") or [{"key": k, "path": k} for k in data]:
                        files[item["path"]] = data[item["key"]]
                elif "downwardAPI" in source:
                    for item in source["downwardAPI"].get("items") or []:
                        files[item["path"]] = {"metadata.namespace": meta["namespace"], "metadata.name": meta["name"],
                                               "metadata.uid": meta["uid"]}.get(item.get("fieldRef", {}).get("fieldPath", ""), "")
        else:
            raise ValueError(f"volume {volume['name']}: the test kubelet mounts emptyDir, configMap, secret, projected "
                             "and persistentVolumeClaim volumes only")
        folder.mkdir(parents=True, exist_ok=True)
        for path, text in files.items():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_text(text)
        return folder

    def _claimed_folder(self, namespace: str, claim: str) -> Path:
        """The hostPath folder of the PersistentVolume bound to `claim` (kube-controller-manager's
        binder bound them; the Node authorizer lets a node read both for its pods)."""
        pvc = self.request("GET", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}")
        volume_name = (pvc.get("spec") or {}).get("volumeName")
        if not volume_name or (pvc.get("status") or {}).get("phase") != "Bound":
            raise ValueError(f'persistentvolumeclaim "{claim}" is not bound')
        pv = self.request("GET", f"/api/v1/persistentvolumes/{volume_name}")
        host_path = ((pv.get("spec") or {}).get("hostPath") or {}).get("path")
        if not host_path:
            raise ValueError(f"persistentvolume {volume_name}: the test kubelet mounts hostPath volumes only")
        folder = Path(host_path)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _token(self, pod: Obj, source: Obj) -> str:
        """A token bound to the pod (TokenRequest), as kubelet's token manager asks for one."""
        meta = pod["metadata"]
        account = pod["spec"].get("serviceAccountName") or "default"
        answer = self.request("POST", f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"audiences": [source["audience"]] if source.get("audience") else [],
                     "expirationSeconds": int(source.get("expirationSeconds") or 3607),
                     "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}})
        return str(answer["status"]["token"])

    def _check(self, run: Run) -> None:
        process = run.process
        if process is None or process.poll() is None:
            return
        pod = run.pod
        code = process.returncode
        policy = pod["spec"].get("restartPolicy", "Always")
        if policy == "Always" or (policy == "OnFailure" and code != 0):
            run.restarts += 1
            run.last_terminated = self._terminated(run, code)
            run.oom = False
            self._start_container(run)
            return
        status = self._terminal_status(run, code)
        run.process = None
        self._patch_status(pod, status)

    def _terminated(self, run: Run, code: int) -> Obj:
        """The container's terminated state: exit code (128 + signal), reason, termination message."""
        message = (run.folder / "termination-log").read_text(errors="replace")[-4096:]
        reason = "OOMKilled" if run.oom else "Completed" if code == 0 else "Error"
        return {"exitCode": code if code >= 0 else 128 - code, "reason": reason, "startedAt": run.started_at,
                "finishedAt": now(), **({"message": message} if message else {})}

    def _terminal_status(self, run: Run, code: int) -> Obj:
        container = run.pod["spec"]["containers"][0]
        return {"phase": "Succeeded" if code == 0 else "Failed", "conditions": self._conditions(False),
                "containerStatuses": [self._container_status(container, {"terminated": self._terminated(run, code)}, run)]}

    def _terminate(self, run: Run) -> None:
        """The pod is being deleted: SIGTERM to the container's process group, SIGKILL to all of it
        after the grace period (a stopped process gets SIGKILL too), its terminal status written
        (phase, the container's terminated state), then the pod deleted for good, as kubelet's
        status manager does."""
        process = run.process
        if self._stopping(run, float(run.pod["metadata"].get("deletionGracePeriodSeconds") or 30)):
            return
        if process is not None:
            with contextlib.suppress(ApiError):
                self._patch_status(run.pod, self._terminal_status(run, process.returncode))
        self._delete_for_good(run.pod)
        self.runs.pop(run.pod["metadata"]["uid"], None)

    def _stopping(self, run: Run, grace: float) -> bool:
        """Whether the container still runs after this round of stopping it: SIGTERM to its process
        group first, SIGKILL to all of it once `grace` seconds have passed."""
        process = run.process
        if process is None or process.poll() is not None:
            return False
        if run.terminating_since is None:
            run.terminating_since = time.monotonic()
            os.killpg(process.pid, signal.SIGTERM)
        elif time.monotonic() - run.terminating_since > grace:
            for pid in process_tree(process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return True

    def evict(self, namespace: str, name: str, message: str = "The node was low on resource: memory. ") -> None:
        """Node-pressure eviction, as kubelet's eviction manager does it: the DisruptionTarget
        condition (reason TerminationByKubelet), SIGTERM, SIGKILL after the pod's grace period, and
        the pod left Failed with status.reason Evicted (not deleted, never restarted)."""
        run = self._run(namespace, name)
        self._patch_status(run.pod, {"conditions": [{"type": "DisruptionTarget", "status": "True",
                                                     "reason": "TerminationByKubelet", "message": message,
                                                     "lastTransitionTime": now()}]})
        run.evicted = message

    def _evicting(self, run: Run) -> None:
        process = run.process
        if process is None or self._stopping(run, float(run.pod["spec"].get("terminationGracePeriodSeconds") or 30)):
            return
        status = self._terminal_status(run, process.returncode)
        status.update({"phase": "Failed", "reason": "Evicted", "message": run.evicted})
        run.process = None
        self._patch_status(run.pod, status)

    def _delete_for_good(self, pod: Obj) -> None:
        meta = pod["metadata"]
        try:
            self.request("DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}", {
                "apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                "preconditions": {"uid": meta["uid"]}})
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise

    def _kill(self, run: Run) -> None:
        if run.process is not None and run.process.poll() is None:
            for pid in process_tree(run.process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            run.process.wait()

    def oom_kill(self, namespace: str, name: str) -> None:
        """The kernel's OOM killer on the container's cgroup: SIGKILL to all of it; the container
        ends with exit code 137, reason OOMKilled."""
        self._run(namespace, name).oom = True
        self.kill(namespace, name)

    def hang(self, namespace: str, name: str) -> None:
        """SIGSTOP to every process of the container: alive, Running, silent (a hung collective)."""
        self.kill(namespace, name, signal.SIGSTOP)

    def _run(self, namespace: str, name: str) -> Run:
        return next(r for r in self.runs.values()
                    if (r.pod["metadata"]["namespace"], r.pod["metadata"]["name"]) == (namespace, name))

    def kill(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> list[int]:
        """`sig` to every process of the pod's container, as the OOM killer or a crash of the node's
        runtime would end them (the container's cgroup, here its process tree: torchrun's workers
        run in sessions of their own). Returns the pids signalled."""
        run = self._run(namespace, name)
        if run.process is None or run.process.poll() is not None:
            raise ProcessLookupError(f"pod {namespace}/{name} has no running container")
        pids = process_tree(run.process.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    # ------------------------------------------------------------------ status
    def _conditions(self, ready: bool) -> list[Obj]:
        stamp = now()
        value = "True" if ready else "False"
        return [{"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp},
                {"type": "Initialized", "status": "True", "lastTransitionTime": stamp},
                {"type": "ContainersReady", "status": value, "lastTransitionTime": stamp},
                {"type": "Ready", "status": value, "lastTransitionTime": stamp}]

    def _container_status(self, container: Obj, state: Obj, run: Run) -> Obj:
        status: Obj = {"name": container["name"], "image": container.get("image", ""), "imageID": "",
                       "ready": "running" in state, "started": "running" in state, "restartCount": run.restarts,
                       "state": state}
        if run.process is not None:
            status["containerID"] = f"llamaft://{run.process.pid}"
        if run.last_terminated is not None:
            status["lastState"] = {"terminated": run.last_terminated}
        return status

    def _patch_status(self, pod: Obj, status: Obj) -> None:
        meta = pod["metadata"]
        self.request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status", {"status": status},
                     content_type="application/strategic-merge-patch+json")

    def logs(self, namespace: str, name: str, *, previous: bool = False) -> str:
        """The output of the pod's newest container (what `kubectl logs` would show while the pod
        is there; a deleted pod's too), for the test's asserts; `previous`: of the container before
        it (`kubectl logs --previous`, "" if it was never restarted)."""
        log = self.ran.get((namespace, name))
        if log is not None and previous:
            log = log.with_name(f"{int(log.stem) - 1}.log")
        return log.read_text(errors="replace") if log is not None and log.exists() else ""

    def environ(self, namespace: str, name: str) -> dict[str, str]:
        """The environment the pod's running container was started with (its first process's)."""
        process = self._run(namespace, name).process
        if process is None:
            raise ProcessLookupError(f"pod {namespace}/{name} has no running container")
        raw = Path(f"/proc/{process.pid}/environ").read_bytes()
        return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)

    def pods_run(self, namespace: str) -> list[str]:
        """The names of the pods of `namespace` whose container ran here, deleted ones too, in
        first-start order."""
        return [name for ns, name in self.ran if ns == namespace]
