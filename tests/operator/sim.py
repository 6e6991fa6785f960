"""A simulated cluster around the API emulator, for end-to-end tests of the operator with the real
trainer: the Kubeflow training operator (v1.9, PyTorchJob), Kubeflow Trainer v2.3 with JobSet and the
Job controller (TrainJob, tests/operator/sim_trainjob.py), just enough of the Deployment controller
for the managed etcd, the scheduler and a kubelet per node that runs each pod's container as a real
process tree on this machine. Plus faults on demand (a killed container, node loss) and
capacity: each node's allocatable cpu, memory and GPUs bound what the scheduler places there, so a
node lost with no room left leaves its pods' replacements Pending and Unschedulable, and a node
added later (`add_node`) takes them.

Everything talks to the emulator through its HTTP API, as the real components do, so the operator
under test sees exactly the objects and transitions a cluster would show it; the one shortcut is
that all "nodes" share this machine's network (each container has a filesystem of its own):
- each pod gets its own loopback address 127.<w>.<k // 250>.<k> (status.podIP; w: the pytest-xdist
  worker's block, 0 without xdist, so simulated clusters in parallel workers never share an
  address and port), the trainer is told to bind its
  metrics server there (LLAMAFT_METRICS_HOST), and a port that a Service of a training pod names is
  mapped to a local one (pods share one port space here, so such ports and the metrics ports the
  tests choose come from `pod_port`, below the kernel's ephemeral range);
- "DNS": an endpoint host that names a Service of a pod, or a pod's `hostname.subdomain` (Indexed
  Jobs' pods, Trainer's PET_MASTER_ADDR), resolves to that pod's address; any other `*.svc` host
  (the managed etcd, an external `etcd.infra.svc`) is the one real local etcd the test passes in
  (env PET_RDZV_ENDPOINT and PET_MASTER_ADDR/PORT and torchrun's --rdzv-endpoint are resolved);
- private container filesystems: every container start runs in a mount namespace of its own with an
  overlayfs root (lowerdir `/`: this machine plays the image; a fresh writable layer per start,
  deleted when the container is replaced or its pod is gone) and real bind mounts at each
  volumeMount's mountPath (tests/operator/container_root.py): a claim the test declared
  (`claims`) is its shared host folder, an emptyDir a folder of the pod's own (kept across container
  restarts, gone with the pod; /dev/shm is a private tmpfs), a configMap volume the files the
  kubelet writes (read-only), and the kubelet's termination-log file sits at terminationMessagePath.
  So a file written outside every volume dies with the container, as on a real node. A pod naming a
  claim the test did not declare is unschedulable, as kube-scheduler's VolumeBinding plugin leaves
  it (`persistentvolumeclaim "<name>" not found`). Needs root: `start` refuses without it;
- container ports are exactly the rendered template's plus what the controllers add (PyTorchJob:
  training-operator v1.9's default `pytorchjob-port`; TrainJob: Trainer's torch plugin's 29500);
  `container_port_address` resolves a named port as a PodMonitor's `port:` does, and refuses a name
  the pod's containers do not declare.

The training operator is a port of training-operator v1.9's ReconcileJobs / ReconcilePods /
UpdateJobStatus (pkg/controller.v1/common/{job,pod}.go, pytorch/pytorchjob_controller.go), its
quirks included, because the llamaft operator must cope with the real one:
- ExitCode: a failed pod with exit code 1-127 fails the job (without a completionTime, so
  ttlSecondsAfterFinished never removes it); 128-255, or a pod that failed without a terminated
  container (node lost, evicted before start: code 0xbeef), is deleted and recreated (Restarting);
- runPolicy.backoffLimit counts container restarts of Running pods (OnFailure/Always/ExitCode) and,
  with the work queue's requeue count always 0, fails the job on the first new pod failure only
  when backoffLimit is 0: with ExitCode and backoffLimit >= 1 retryable failures are retried forever;
- an elastic job succeeds as soon as one worker succeeded; cleanPodPolicy defaults to None;
- Master replicas' env (MASTER_ADDR, RANK, ...) and its init container are not emulated (llamaft
  renders Workers only); neither are gang scheduling, HPA, activeDeadline requeues, nor the
  events of anything but the job's Restarting, Succeeded and Failed conditions.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import datetime
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from llamaft.api.quantity import quantity_value

from tests.operator.emulator import merge_diff, now_rfc3339
from tests.tiers import starts_processes

Obj = dict[str, Any]
T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
GROUP_LABEL = "training.kubeflow.org"
JOB_NAME = f"{GROUP_LABEL}/job-name"
REPLICA_TYPE = f"{GROUP_LABEL}/replica-type"
REPLICA_INDEX = f"{GROUP_LABEL}/replica-index"
JOB_ROLE = f"{GROUP_LABEL}/job-role"
OPERATOR_NAME = f"{GROUP_LABEL}/operator-name"
CONTROLLER_NAME = "pytorchjob-controller"
CONTAINER = "pytorch"
DEFAULT_PORT_NAME, DEFAULT_PORT = "pytorchjob-port", 23456


def _xdist_block() -> int:
    """The second octet of this process's pod addresses: 1 + the pytest-xdist worker number
    (PYTEST_XDIST_WORKER=gw<n>), 0 in a single-process run. Pods of parallel simulated clusters
    bind the same well-known ports (the PyTorchJob master's 23456, Trainer's 29500) on their own
    addresses, so each worker needs its own block of 127.0.0.0/8."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return 1 + int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
SCHEDULED_RESOURCES = ("cpu", "memory", "nvidia.com/gpu")
"""The resources the scheduler's NodeResourcesFit counts here (pods per node are not limited)."""
RETRYABLE_UNKNOWN = 0xBEEF
"""The training operator's exit code for a failed pod without a terminated `pytorch` container."""
TERMINATION_LOG_MAX = 4096
FALLBACK_LINES, FALLBACK_BYTES = 80, 2048
MARKER = "SIMCLUSTER_CONTAINER"
"""Env var every container process inherits, so that the sim finds (and kills) all of a container's
processes even after torchrun's workers, which run in their own sessions, lose their parent."""
LAUNCHER = Path(__file__).with_name("container_root.py")
"""Builds a container's private root and execs its command (run with `python -I`)."""
DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"

_SETPRIV = shutil.which("setpriv")


def _die_with_parent(argv: list[str]) -> list[str]:
    """Prefix argv so that the container's first process gets SIGKILL if the sim's thread vanishes
    without stop() (os._exit, a killed pytest): a last line of defence against leaked trainers.
    `setpriv --pdeathsig` execs the command (same pid); preexec_fn would run Python in a forked
    child of a threaded process, which can deadlock."""
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv] if _SETPRIV else argv


def _parse_time(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC).timestamp()


POD_PORTS_PER_WORKER = 1000
_pod_ports_lock = threading.Lock()
_next_pod_port = 0


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default floor


def pod_port() -> int:
    """A port for something a simulated pod binds on its own address (status.podIP): a Service's
    port mapped to a local one, a metrics port a test gives the spec.

    On a cluster each pod has a network namespace, so its ports collide with nobody's. Here pods
    share this machine's port space on addresses of their own, and a wildcard bind collides with
    a port held on any address: torch elastic's agent picks its workers' master port by binding
    `localhost:0` (torch/distributed/elastic/utils/distributed.py get_free_port), which never sees
    a port another pod holds on 127.x, so the worker's TCPStore then fails on 0.0.0.0 with
    EADDRINUSE (a CI run lost its fault test's last attempt that way). Such ports therefore come
    from below the kernel's ephemeral range (ip_local_port_range), which bind(0) and connect()
    never hand out: a block of POD_PORTS_PER_WORKER per pytest-xdist worker (as pod addresses are
    blocked), in turn, skipping any port something holds on any address."""
    import socket

    global _next_pod_port
    block = _xdist_block()
    base = _ephemeral_floor() - POD_PORTS_PER_WORKER * (block + 1)
    if base < 1024:
        raise RuntimeError(f"no room for pod ports of xdist block {block} below the ephemeral range")
    with _pod_ports_lock:
        for _ in range(POD_PORTS_PER_WORKER):
            port = base + _next_pod_port % POD_PORTS_PER_WORKER
            _next_pod_port += 1
            with socket.socket() as probe:
                try:
                    probe.bind(("0.0.0.0", port))  # fails while any address holds the port
                except OSError:
                    continue
            return port
    raise RuntimeError(f"every pod port in {base}..{base + POD_PORTS_PER_WORKER - 1} is taken")


# ------------------------------------------------------------------------------------ the API
class ApiError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"{status}: {str(body)[:500]}")
        self.status, self.body = status, body


class Api:
    """A plain JSON client for the emulator: what client-go does for the real controllers, minus
    types and caches (the typed kubernetes client would only cost time here)."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        parsed = urllib.parse.urlparse(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.timeout = timeout

    def call(self, method: str, path: str, body: Any = None, *, params: dict[str, Any] | None = None,
             content_type: str = "application/json") -> Any:
        if params:
            path += "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Accept": "application/json", "Authorization": "Bearer kmock"}
            if data is not None:
                headers["Content-Type"] = content_type
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        finally:
            conn.close()
        try:
            decoded = json.loads(raw) if raw else None
        except ValueError:
            decoded = raw.decode(errors="replace")
        if response.status >= 400:
            raise ApiError(response.status, decoded)
        return decoded

    def get(self, path: str) -> Obj | None:
        try:
            return dict(self.call("GET", path))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, path: str, label_selector: str | None = None, field_selector: str | None = None) -> list[Obj]:
        out = self.call("GET", path, params={"labelSelector": label_selector, "fieldSelector": field_selector})
        return list(out.get("items") or [])

    def create(self, path: str, obj: Obj) -> Obj | None:
        """None if it already exists."""
        try:
            return dict(self.call("POST", path, obj))
        except ApiError as exc:
            if exc.status == 409:
                return None
            raise

    def patch(self, path: str, patch: Any) -> Obj | None:
        """A JSON merge patch; None if the object is gone."""
        try:
            return dict(self.call("PATCH", path, patch, content_type="application/merge-patch+json"))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def delete(self, path: str, *, propagation: str | None = None, grace: int | None = None) -> bool:
        """False if it was already gone."""
        try:
            self.call("DELETE", path, params={"propagationPolicy": propagation, "gracePeriodSeconds": grace})
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise


def pod_path(namespace: str, name: str = "", sub: str = "") -> str:
    return f"/api/v1/namespaces/{namespace}/pods" + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


def job_path(namespace: str, name: str = "", sub: str = "") -> str:
    return f"/apis/kubeflow.org/v1/namespaces/{namespace}/pytorchjobs" + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


def service_path(namespace: str, name: str = "") -> str:
    return f"/api/v1/namespaces/{namespace}/services" + (f"/{name}" if name else "")


# ------------------------------------------------------------------------ job status helpers
JOB_EVENT_TYPES = {"Restarting": "Warning", "Succeeded": "Normal", "Failed": "Normal"}
"""The job conditions the training operator records an Event with, and that Event's type."""


def condition_true(status: Obj, kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True" for c in status.get("conditions") or [])


def set_condition(status: Obj, kind: str, value: str, reason: str, message: str) -> None:
    """commonutil.UpdateJobConditions, exactly: nothing changes once Failed; Running and
    Restarting replace each other; Succeeded/Failed turn Running False."""
    if condition_true(status, "Failed"):
        return
    conditions = status.get("conditions") or []
    current = next((c for c in conditions if c.get("type") == kind), None)
    if current is not None and current.get("status") == value and current.get("reason") == reason:
        return
    now = now_rfc3339()
    new = {"type": kind, "status": value, "reason": reason, "message": message, "lastUpdateTime": now, "lastTransitionTime": now}
    if current is not None and current.get("status") == value:
        new["lastTransitionTime"] = current.get("lastTransitionTime", now)
    kept = []
    for c in conditions:
        if (kind == "Restarting" and c.get("type") == "Running") or (kind == "Running" and c.get("type") == "Restarting"):
            continue
        if c.get("type") == kind:
            continue
        if kind in ("Failed", "Succeeded") and c.get("type") == "Running":
            c = {**c, "status": "False"}
        kept.append(c)
    status["conditions"] = kept + [new]


def _controller_uid(obj: Obj) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def _pod_key(pod: Obj) -> tuple[str, str]:
    return pod["metadata"].get("namespace", "default"), pod["metadata"]["name"]


# --------------------------------------------------------------------------- the kubelet's state
@dataclass
class Container:
    """One run of a pod's container: a process (tree) on this machine."""

    restart: int
    proc: subprocess.Popen[bytes] | None
    log_path: Path
    started_at: str
    marker: str
    start_error: str | None = None


@dataclass(frozen=True)
class Waiting:
    """Why a container cannot start yet (containerStatuses[0].state.waiting)."""

    reason: str
    message: str


@dataclass
class PodRun:
    """What a kubelet keeps for one pod (by uid)."""

    namespace: str
    name: str
    uid: str
    node: str
    ip: str
    dir: Path
    container: Container | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: str = ""
    kill_at: float | None = None
    """When SIGTERM was sent for a deletion: SIGKILL at this monotonic time."""
    done: bool = False
    """A terminal status is written (or the node is lost): the kubelet only deletes it now."""
    delete_at: float = 0.0
    """For a pod being deleted: when the kubelet's final DELETE (gracePeriodSeconds=0) is due."""
    last_terminated: Obj | None = None
    """The previous run's terminated state (containerStatuses[0].lastState) after an in-place restart."""


# ------------------------------------------------------------------------------- the cluster
_LIVE: weakref.WeakSet[SimCluster] = weakref.WeakSet()


def _stop_all_at_exit() -> None:
    for sim in list(_LIVE):
        with contextlib.suppress(Exception):
            sim.stop()


atexit.register(_stop_all_at_exit)


@starts_processes
class SimCluster:
    """`SimCluster(api_url, etcd_endpoint, nodes=2, workdir=...).start()` ... `.stop()`.

    The control loop runs in one thread: every `tick` seconds it lists jobs, pods and nodes and plays
    the training operator, the Deployment controller, the scheduler and the kubelets on that
    snapshot. Fault methods may be called from any thread.
    """

    def __init__(self, api_url: str, etcd_endpoint: str, nodes: int = 2, workdir: Path | str | None = None, *,
                 tick: float = 0.2, etcd_ready_delay: float = 0.5, gpus_per_node: int = 0,
                 node_labels: dict[str, dict[str, str]] | None = None, restart_backoff: float = 1.0,
                 final_delete_delay: float = 1.0, python: str = sys.executable,
                 claims: dict[str, Path] | None = None, node_cpu: str = "64", node_memory: str = "256Gi") -> None:
        """`node_labels`: extra labels per node name (e.g. {"node-1": {"gpu": "a100"}});
        `claims`: PersistentVolumeClaims backed by a local folder, bind-mounted where a pod mounts
        them (every pod of every node sees the same folder, like a ReadWriteMany volume); a pod
        naming any other claim stays Pending, unschedulable (tests may add claims later: the dict
        is read at each scheduling and container start);
        `gpus_per_node`: allocatable nvidia.com/gpu (pods asking for more stay Pending);
        `node_cpu`, `node_memory`: each node's allocatable cpu and memory: the scheduler places a pod
        only where the requests of the pods already there leave room for its own (`_scheduler`);
        `restart_backoff`: seconds before a kubelet restarts a container in place (OnFailure/Always);
        `final_delete_delay`: seconds a deleted pod stays terminal before the kubelet removes it."""
        self.api_url, self.etcd_endpoint = api_url, etcd_endpoint
        self.node_names = [f"node-{i}" for i in range(nodes)]
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="simcluster-"))
        self.tick, self.etcd_ready_delay, self.gpus_per_node = tick, etcd_ready_delay, gpus_per_node
        self.node_cpu, self.node_memory = node_cpu, node_memory
        self.node_labels = node_labels or {}
        self.claims = {name: Path(path) for name, path in (claims or {}).items()}
        self.restart_backoff, self.final_delete_delay = restart_backoff, final_delete_delay
        self.python = python
        self.api = Api(api_url)
        self.id = uuid.uuid4().hex[:12]
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._runs: dict[str, PodRun] = {}
        self._ips: dict[str, str] = {}
        self._next_ip = 2
        self._ports: dict[tuple[str, str, str], int] = {}
        self._lost: set[str] = set()
        self._history: dict[tuple[str, str], list[Obj]] = {}
        self._logs: dict[tuple[str, str], list[Path]] = {}
        self._unschedulable_written: set[str] = set()
        self._deployment_seen: dict[str, float] = {}
        self._procs: list[subprocess.Popen[bytes]] = []
        self.errors: list[str] = []
        self._log_file: Any = None
        from tests.operator.sim_trainjob import TrainerController

        self.trainer = TrainerController(self)
        """Kubeflow Trainer v2.3 + JobSet + the Job controller, for TrainJobs (tests/operator/sim_trainjob.py)."""

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> SimCluster:
        """Create the nodes and start the control loop; raises RuntimeError when this machine cannot
        give containers private filesystems (see `_require_private_filesystems`)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._require_private_filesystems()
        self._log_file = (self.workdir / "sim.log").open("a", buffering=1)
        for name in self.node_names:
            self._create_node(name)
        _LIVE.add(self)
        self._thread = threading.Thread(target=self._loop, name=f"simcluster-{self.id}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the control loop and kill every process any container started. Idempotent."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(30)
        with self._lock:
            for run in self._runs.values():
                if run.container is not None:
                    self._signal_container(run.container, signal.SIGKILL)
            for proc in self._procs:
                with contextlib.suppress(Exception):
                    proc.kill()
                with contextlib.suppress(Exception):
                    proc.wait(10)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                left = self._pids_with_marker(f"{self.id}/")
                if not left:
                    break
                for pid in left:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.1)
            else:
                self._log(f"processes survived stop(): {self._pids_with_marker(f'{self.id}/')}")
            for run in self._runs.values():  # the nodes are gone: so are their containers' layers and emptyDirs
                self._remove_pod_files(run)
        _LIVE.discard(self)
        if self._log_file is not None:
            with contextlib.suppress(Exception):
                self._log_file.close()

    def _require_private_filesystems(self) -> None:
        """Run a probe container through the launcher: it must write into its own layer and nothing
        on this machine. No fallback to the shared filesystem: a test that passed there could lean
        on files a real cluster loses with the container."""
        probe = self.workdir / f"probe-{self.id}"
        inside = f"/tmp/simcluster-probe-{self.id}"
        shell = shutil.which("sh") or "/bin/sh"
        try:
            result = subprocess.run([self.python, "-I", str(LAUNCHER), "--root", str(probe), "--", shell, "-c", f"echo ok > {inside}"],
                                    capture_output=True, timeout=60, check=False)
            in_layer = (probe / "upper" / inside.lstrip("/")).is_file()
            leaked = Path(inside).exists()
        finally:
            shutil.rmtree(probe, ignore_errors=True)
        if result.returncode != 0 or not in_layer or leaked:
            raise RuntimeError(
                "SimCluster runs every container in a private filesystem (tests/operator/container_root.py: a mount "
                "namespace, an overlayfs root over /, bind-mounted volumes, chroot), which needs root (CAP_SYS_ADMIN) "
                f"and overlayfs; it does not work here (exit {result.returncode}, written in the layer: {in_layer}, "
                f"leaked to the host: {leaked}): {result.stderr.decode(errors='replace').strip()[-1000:]}. "
                "Run the simulated-cluster tests as root in the dev container.")

    def __enter__(self) -> SimCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _log(self, message: str) -> None:
        line = f"{time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d} {message}"
        if self._log_file is not None and not self._log_file.closed:
            self._log_file.write(line + "\n")

    def _loop(self) -> None:
        while not self._stopping.is_set():
            began = time.monotonic()
            try:
                self._tick()
            except Exception:  # noqa: BLE001 (the control loop must outlive any one failure)
                text = traceback.format_exc()
                self.errors.append(text)
                self._log(f"tick failed:\n{text}")
            self._stopping.wait(max(0.0, self.tick - (time.monotonic() - began)))

    def _tick(self) -> None:
        jobs = self._list_served("/apis/kubeflow.org/v1/pytorchjobs")
        trainjobs = self.trainer.trainjobs()
        pods = self.api.list("/api/v1/pods")
        nodes = self.api.list("/api/v1/nodes")
        with self._lock:
            if self._stopping.is_set():
                return
            self._deployment_controller()
            live_jobs = [j for j in jobs if not j["metadata"].get("deletionTimestamp")]
            services = self.api.list("/api/v1/services") if live_jobs or trainjobs else []
            for job in live_jobs:
                self._training_operator(job, pods, services)
            self.trainer.reconcile_all(trainjobs, pods, services)
            self._scheduler(pods, nodes)
            self._kubelets(pods, nodes)

    def _list_served(self, path: str) -> list[Obj]:
        """`path`'s objects, or none when this cluster does not serve the resource (404)."""
        try:
            return self.api.list(path)
        except ApiError as exc:
            if exc.status == 404:
                return []
            raise

    # ---------------------------------------------------------------------------- public reads
    def pods(self, job: str | None = None, namespace: str = "default") -> list[Obj]:
        """The live pods (of one PyTorchJob), by replica index."""
        selector = f"{JOB_NAME}={job}" if job else None
        pods = self.api.list(pod_path(namespace), label_selector=selector)
        return sorted(pods, key=lambda p: (p["metadata"].get("labels", {}).get(REPLICA_INDEX, ""), p["metadata"]["name"]))

    def pod(self, name: str, namespace: str = "default") -> Obj | None:
        return self.api.get(pod_path(namespace, name))

    def job(self, name: str, namespace: str = "default") -> Obj | None:
        return self.api.get(job_path(namespace, name))

    def history(self, pod: str, namespace: str = "default") -> list[Obj]:
        """Every pod object named `pod` as the kubelet (or node loss) left it when its container
        ended, oldest first: the evidence survives the pod's deletion and recreation."""
        with self._lock:
            return copy.deepcopy(self._history.get((namespace, pod), []))

    def terminated(self, pod: str, namespace: str = "default") -> Obj:
        """containerStatuses[0].state.terminated of the newest ended run of `pod`."""
        history = self.history(pod, namespace)
        if not history:
            raise AssertionError(f"{pod} has not ended (yet)")
        statuses = history[-1].get("status", {}).get("containerStatuses") or [{}]
        return dict(statuses[0].get("state", {}).get("terminated") or {})

    def logs(self, pod: str, namespace: str = "default", previous: bool = False) -> str:
        """The container log of the newest run of `pod` (previous=True: the run before it)."""
        with self._lock:
            paths = list(self._logs.get((namespace, pod), []))
        index = -2 if previous else -1
        if len(paths) < abs(index):
            return ""
        return paths[index].read_text(errors="replace")

    def pods_run(self, namespace: str = "default") -> list[str]:
        """Every pod name whose container ran here, in first-start order (deleted pods included:
        `logs` still reads them)."""
        with self._lock:
            return [name for ns, name in self._logs if ns == namespace]

    def trainer_pids(self, pod: str, namespace: str = "default") -> dict[int, int]:
        """{LOCAL_RANK: pid} of the trainer processes torchrun started in the pod's container."""
        run = self._run_of(pod, namespace)
        if run is None or run.container is None or run.container.proc is None:
            return {}
        main = run.container.proc.pid
        out: dict[int, int] = {}
        for pid in self._pids_with_marker(run.container.marker):
            env = self._environ(pid)
            if "LOCAL_RANK" in env and self._ppid(pid) == main:
                out[int(env["LOCAL_RANK"])] = pid
        return out

    def container_pids(self, pod: str, namespace: str = "default") -> list[int]:
        """Every process of the pod's current container (torchrun and all it started)."""
        run = self._run_of(pod, namespace)
        if run is None or run.container is None:
            return []
        return self._pids_with_marker(run.container.marker)

    def container_port_address(self, pod: str, port: str | int, namespace: str = "default") -> str:
        """`ip:port` where a scrape of `pod`'s container port reaches it, resolved as Prometheus
        resolves a PodMonitor endpoint: a port *name* (PodMonitor `port:`) must be declared by one
        of the pod's containers (`spec.containers[].ports[].name`), else there is no target and this
        raises LookupError, as a scrape of an undeclared name finds nothing on a real cluster; a
        port *number* (`targetPort:`) needs no declaration (declarations are informational to the
        network: the pod's address answers on any port its processes listen on). The address is
        the pod's own (status.podIP, a loopback address of its own here); raises LookupError when
        the pod does not exist or has no address yet."""
        obj = self.pod(pod, namespace)
        if obj is None:
            raise LookupError(f"pod {namespace}/{pod} does not exist")
        ip = (obj.get("status") or {}).get("podIP")
        if not ip:
            raise LookupError(f"pod {namespace}/{pod} has no address yet (not started)")
        if isinstance(port, bool) or not isinstance(port, (int, str)):
            raise TypeError(f"port must be a container port name or number, not {port!r}")
        if isinstance(port, int):
            return f"{ip}:{port}"
        declared = {p["name"]: int(p["containerPort"]) for c in obj.get("spec", {}).get("containers") or []
                    for p in c.get("ports") or [] if p.get("name")}
        if port not in declared:
            raise LookupError(f"pod {namespace}/{pod} declares no container port named {port!r} (declared: "
                              f"{sorted(declared) or 'none'}): a PodMonitor with `port: {port}` finds no target in it")
        return f"{ip}:{declared[port]}"

    def node_of(self, pod: str, namespace: str = "default") -> str | None:
        obj = self.pod(pod, namespace)
        return None if obj is None else obj.get("spec", {}).get("nodeName")

    def wait(self, what: str, fn: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.2) -> T:
        """Poll fn until it returns something truthy; the failure names what and the sim's errors."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = fn()
            except Exception as exc:  # noqa: BLE001 (the object may not exist yet)
                last = exc
            if last and not isinstance(last, Exception):
                return last  # type: ignore[no-any-return]
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {str(last)[:2000]}; "
                             f"sim errors: {self.errors[-3:]}; sim log: {self.workdir / 'sim.log'}")

    def wait_pod_running(self, name: str, namespace: str = "default", timeout: float = 60.0) -> Obj:
        """Until the pod's container runs (phase Running, containerStatuses[0].state.running)."""
        def running() -> Obj | None:
            pod = self.pod(name, namespace)
            if pod is None or pod.get("status", {}).get("phase") != "Running":
                return None
            state = (pod["status"].get("containerStatuses") or [{}])[0].get("state", {})
            return pod if "running" in state else None
        return self.wait(f"pod {name} running", running, timeout)

    def wait_job_condition(self, name: str, kind: str, namespace: str = "default", timeout: float = 120.0) -> Obj:
        """Until the PyTorchJob has condition `kind` True; returns the job."""
        def has() -> Obj | None:
            job = self.job(name, namespace)
            return job if job is not None and condition_true(job.get("status") or {}, kind) else None
        return self.wait(f"PyTorchJob {name} {kind}", has, timeout)

    def wait_job_event(self, name: str, reason: str, namespace: str = "default", timeout: float = 60.0) -> list[Obj]:
        """Until the training operator has recorded an Event `reason` for job `name`; returns them.
        What a test waits on for a condition that holds for one reconcile only (Restarting)."""
        return self.wait(f"job {name}'s {reason} event", lambda: [
            e for e in self.api.list(f"/api/v1/namespaces/{namespace}/events")
            if e["involvedObject"]["name"] == name and e["reason"] == reason], timeout)

    def wait_trainers(self, pod: str, namespace: str = "default", count: int = 1, timeout: float = 60.0) -> dict[int, int]:
        """Until torchrun in the pod has started `count` trainer processes."""
        return self.wait(f"{count} trainer(s) in {pod}", lambda: (p := self.trainer_pids(pod, namespace)) and len(p) >= count and p,
                         timeout)

    # ----------------------------------------------------------------------------------- faults
    def kill_container(self, pod: str, sig: int = signal.SIGKILL, namespace: str = "default") -> None:
        """Signal every process of the container (the runtime killing it). With SIGKILL the
        container ends with exit code 137, reason Error."""
        with self._lock:
            run = self._require_run(pod, namespace)
            assert run.container is not None
            self._log(f"fault: kill_container {pod} sig={sig}")
            self._signal_container(run.container, sig)

    def kill_trainer(self, pod: str, local_rank: int = 0, sig: int = signal.SIGKILL, namespace: str = "default") -> int:
        """Signal one trainer process (a child of torchrun); returns its pid. torchrun notices and
        restarts the worker group (up to maxRestarts) or gives up; the container lives on."""
        pids = self.trainer_pids(pod, namespace)
        if local_rank not in pids:
            raise AssertionError(f"{pod} has no trainer with LOCAL_RANK={local_rank}: {pids}")
        self._log(f"fault: kill_trainer {pod} rank={local_rank} pid={pids[local_rank]} sig={sig}")
        os.kill(pids[local_rank], sig)
        return pids[local_rank]

    def lose_node(self, node: str) -> list[str]:
        """The node dies: every process on it is SIGKILLed, the kubelet is gone, the Node object is
        deleted; its pods get DisruptionTarget (DeletionByTaintManager), a deletion, and phase
        Failed with status.reason NodeLost; PodGC (the emulator) force-deletes them shortly after.
        Returns the names of the pods that were on it."""
        with self._lock:
            self._log(f"fault: lose_node {node}")
            self._lost.add(node)
            for run in self._runs.values():
                if run.node == node and run.container is not None:
                    self._signal_container(run.container, signal.SIGKILL)
                    run.done = True
            lost = []
            for pod in self.api.list("/api/v1/pods", field_selector=f"spec.nodeName={node}"):
                ns, name = _pod_key(pod)
                lost.append(name)
                self._add_condition(pod, "DisruptionTarget", "True", "DeletionByTaintManager",
                                    "Taint manager: deleting due to NoExecute taint")
                self.api.delete(pod_path(ns, name))
                status = copy.deepcopy(pod.get("status") or {})
                status.update({"phase": "Failed", "reason": "NodeLost",
                               "message": f"Node {node} which was running pod {name} is unresponsive"})
                for c in status.get("conditions") or []:
                    if c.get("type") in ("Ready", "ContainersReady"):
                        c.update({"status": "False", "lastTransitionTime": now_rfc3339()})
                written = self._write_status(pod, status)
                self._record(written or {**pod, "status": status})
            self.api.delete(f"/api/v1/nodes/{node}")
            return lost

    # --------------------------------------------------------------------------------- helpers
    def _run_of(self, pod: str, namespace: str) -> PodRun | None:
        with self._lock:
            runs = [r for r in self._runs.values() if r.name == pod and r.namespace == namespace]
            return runs[-1] if runs else None

    def _require_run(self, pod: str, namespace: str) -> PodRun:
        run = self._run_of(pod, namespace)
        if run is None or run.container is None or run.container.proc is None or run.done:
            raise AssertionError(f"pod {namespace}/{pod} has no running container here")
        return run

    def _add_condition(self, pod: Obj, kind: str, value: str, reason: str, message: str) -> None:
        status = copy.deepcopy(pod.get("status") or {})
        status["conditions"] = [c for c in status.get("conditions") or [] if c.get("type") != kind] + [
            {"type": kind, "status": value, "reason": reason, "message": message, "lastTransitionTime": now_rfc3339()}]
        written = self._write_status(pod, status)
        if written is not None:
            pod.clear()
            pod.update(written)

    def _write_status(self, pod: Obj, status: Obj) -> Obj | None:
        """PATCH pods/<name>/status to exactly `status` (a merge patch computed from the diff)."""
        old = pod.get("status") or {}
        if old == status:
            return pod
        ns, name = _pod_key(pod)
        try:
            # metadata.uid is a precondition: never write one pod's status onto its successor.
            return self.api.patch(pod_path(ns, name, "status"),
                                  {"metadata": {"uid": pod["metadata"]["uid"]}, "status": merge_diff(old, status)})
        except ApiError as exc:
            if exc.status == 409:
                return None
            raise

    def _record(self, pod: Obj) -> None:
        self._history.setdefault(_pod_key(pod), []).append(copy.deepcopy(pod))

    @staticmethod
    def _environ(pid: int) -> dict[str, str]:
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            return {}
        out = {}
        for item in raw.split(b"\0"):
            key, sep, value = item.partition(b"=")
            if sep:
                out[key.decode(errors="replace")] = value.decode(errors="replace")
        return out

    @staticmethod
    def _ppid(pid: int) -> int:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return -1
        return int(stat.rsplit(")", 1)[1].split()[1])

    @staticmethod
    def _pids_with_marker(prefix: str) -> list[int]:
        """Processes whose environment carries MARKER=<prefix...>: a container's processes (or, with
        the sim's id as prefix, all of them), wherever they were reparented."""
        needle = f"{MARKER}={prefix}".encode()
        out = []
        me = os.getpid()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            try:
                raw = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if needle in raw:
                out.append(int(entry))
        return out

    def _signal_container(self, container: Container, sig: int) -> None:
        pids = self._pids_with_marker(container.marker)
        if container.proc is not None and container.proc.poll() is None and container.proc.pid not in pids:
            pids.append(container.proc.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    @staticmethod
    def _remove_pod_files(run: PodRun) -> None:
        """Delete what dies with a pod on a real node: its containers' writable layers and its
        emptyDirs (the logs stay: `logs` reads them after the pod is gone)."""
        for part in ("containers", "volumes"):
            shutil.rmtree(run.dir / part, ignore_errors=True)

    def _ip_for(self, uid: str) -> str:
        if uid not in self._ips:
            k = self._next_ip
            self._next_ip += 1
            block = _xdist_block()
            self._ips[uid] = f"127.{block}.{k // 250}.{k % 250 + 2}" if k >= 250 or block else f"127.0.0.{k}"
        return self._ips[uid]

    # ------------------------------------------------------------------------------------ nodes
    def add_node(self, name: str, labels: dict[str, str] | None = None) -> None:
        """Capacity returns: a node registers (a repaired machine, or one the cluster autoscaler
        added) with the cluster's node shape; the scheduler places pending pods on it at its next
        pass, as kube-scheduler does when a Node add event moves them back to the active queue."""
        with self._lock:
            self._log(f"add_node {name}")
            if labels:
                self.node_labels[name] = labels
            self._lost.discard(name)
            if name not in self.node_names:
                self.node_names.append(name)
            self._create_node(name)

    def _create_node(self, name: str) -> None:
        labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                  **self.node_labels.get(name, {})}
        capacity = {"cpu": self.node_cpu, "memory": self.node_memory, "pods": "110", "nvidia.com/gpu": str(self.gpus_per_node)}
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": {}}
        self.api.create("/api/v1/nodes", node)
        self.api.patch(f"/api/v1/nodes/{name}/status", {"status": {
            "capacity": capacity, "allocatable": capacity,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status",
                            "lastTransitionTime": now_rfc3339(), "lastHeartbeatTime": now_rfc3339()}],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
            "nodeInfo": {"kubeletVersion": "v1.30.0-sim", "operatingSystem": "linux", "architecture": "amd64"},
        }})

    # ------------------------------------------------------------------- deployment controller
    def _deployment_controller(self) -> None:
        """Rendezvous Deployments (the managed etcd) become ready after etcd_ready_delay: the one
        local etcd serves them all."""
        now = time.monotonic()
        for dep in self.api.list("/apis/apps/v1/deployments", label_selector="app.kubernetes.io/component=rendezvous"):
            meta = dep["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            first = self._deployment_seen.setdefault(meta["uid"], now)
            status = dep.get("status") or {}
            if status.get("readyReplicas") == 1 or now - first < self.etcd_ready_delay:
                continue
            self._log(f"deployment {meta['name']} ready")
            self.api.patch(f"/apis/apps/v1/namespaces/{meta['namespace']}/deployments/{meta['name']}/status", {"status": {
                "observedGeneration": meta.get("generation", 1), "replicas": 1, "readyReplicas": 1, "availableReplicas": 1,
                "updatedReplicas": 1, "conditions": [{"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable",
                                                      "lastTransitionTime": now_rfc3339()}]}})

    # ---------------------------------------------------------------------- training operator
    def _training_operator(self, job: Obj, all_pods: list[Obj], all_services: list[Obj]) -> None:
        """ReconcileJobs for one PyTorchJob (see the module docstring for what it does and not)."""
        meta, spec = job["metadata"], job.get("spec") or {}
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        run_policy = spec.get("runPolicy") or {}
        if run_policy.get("managedBy") not in (None, "", "kubeflow.org/training-operator"):
            return
        replicas: dict[str, Obj] = spec.get("pytorchReplicaSpecs") or {}
        status = copy.deepcopy(job.get("status") or {})
        old = copy.deepcopy(status)
        if not status.get("conditions"):  # onOwnerCreateFunc
            set_condition(status, "Created", "True", "PyTorchJobCreated", f"PyTorchJob {name} is created.")
        pods = [p for p in all_pods if p["metadata"].get("namespace") == ns and _controller_uid(p) == uid]
        services = [s for s in all_services if s["metadata"].get("namespace") == ns and _controller_uid(s) == uid]
        clean = run_policy.get("cleanPodPolicy") or "None"
        suspended = bool(run_policy.get("suspend"))

        if condition_true(status, "Succeeded") or condition_true(status, "Failed"):
            self._delete_pods_and_services(pods, clean, finished=True)
            self._cleanup_job(job, status, suspended)
            if condition_true(status, "Succeeded"):
                for rs in (status.get("replicaStatuses") or {}).values():
                    if rs.get("active"):
                        rs["succeeded"] = rs.get("succeeded", 0) + rs.pop("active")
            self._write_job_status(job, old, status)
            return
        if suspended:
            self._delete_pods_and_services(pods, clean, finished=False)
            for rs in (status.get("replicaStatuses") or {}).values():
                rs.pop("active", None)
            message = f"PyTorchJob {name} is suspended."
            if condition_true(status, "Running"):
                set_condition(status, "Running", "False", "PyTorchJobSuspended", message)
            if not condition_true(status, "Suspended"):
                set_condition(status, "Suspended", "True", "PyTorchJobSuspended", message)
            self._write_job_status(job, old, status)
            return
        if condition_true(status, "Suspended"):
            set_condition(status, "Suspended", "False", "PyTorchJobResumed", f"PyTorchJob {name} is resumed.")
            status["startTime"] = now_rfc3339()

        active = sum(1 for p in pods if p.get("status", {}).get("phase") not in ("Succeeded", "Failed")
                     and not p["metadata"].get("deletionTimestamp"))
        failed = sum(1 for p in pods if p.get("status", {}).get("phase") == "Failed")
        total = sum(int(r.get("replicas", 1)) for r in replicas.values())
        prev_failed = sum(int(rs.get("failed", 0)) for rs in (status.get("replicaStatuses") or {}).values())
        failure = None
        limit = run_policy.get("backoffLimit")
        if limit is not None:
            exceeds = failed > prev_failed and active != total and 0 + 1 > int(limit)  # NumRequeues is always 0
            if exceeds or self._past_backoff_limit(replicas, pods, int(limit)):
                failure = f"Job {name} has failed because it has reached the specified backoff limit"
        deadline = run_policy.get("activeDeadlineSeconds")
        started = _parse_time(status.get("startTime"))
        if failure is None and deadline is not None and started is not None and time.time() - started >= int(deadline):
            failure = f"Job {name} has failed because it was active longer than specified deadline"
        if failure is not None:
            status.setdefault("completionTime", now_rfc3339())
            self._delete_pods_and_services(pods, clean, finished=False)
            self._cleanup_job(job, status, suspended)
            set_condition(status, "Failed", "True", "PyTorchJobFailed", failure)
            self._log(f"job {name}: {failure}")
            self._write_job_status(job, old, status)
            return

        for rtype, rspec in replicas.items():
            self._reconcile_pods(job, status, pods, rtype, rspec, replicas)
            self._reconcile_services(job, services, rtype, rspec)
        self._update_job_status(job, replicas, status)
        self._write_job_status(job, old, status)

    def _write_job_status(self, job: Obj, old: Obj, status: Obj) -> None:
        if status != old:
            meta = job["metadata"]
            changed = [c["type"] + "=" + c["status"] for c in status.get("conditions") or [] if c not in (old.get("conditions") or [])]
            if changed:
                self._log(f"job {meta['name']}: conditions {changed} {status.get('replicaStatuses')}")
            self.api.patch(job_path(meta["namespace"], meta["name"], "status"), {"status": merge_diff(old, status)})
            for cond in status.get("conditions") or []:
                if cond not in (old.get("conditions") or []) and cond["status"] == "True" and cond["type"] in JOB_EVENT_TYPES:
                    self._record_event(job, JOB_EVENT_TYPES[cond["type"]], cond["reason"], cond["message"])

    def _record_event(self, job: Obj, kind: str, reason: str, message: str) -> None:
        """The Event the training operator records with each Restarting, Succeeded and Failed
        condition it sets (pytorchjob_controller.go UpdateJobStatus: `r.Recorder.Event(...)` next
        to each `commonutil.UpdateJobConditions`), named as client-go's recorder names them
        (`<object>.<unix nanoseconds in hex>`, tools/record/event.go makeEvent). Once per
        transition: the recorder's correlator folds the repeats of a reconcile loop into a count."""
        meta, now = job["metadata"], now_rfc3339()
        self.api.create(f"/api/v1/namespaces/{meta['namespace']}/events", {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{time.time_ns():x}", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": job.get("apiVersion", "kubeflow.org/v1"), "kind": job.get("kind", "PyTorchJob"),
                               "name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]},
            "reason": reason, "message": message, "type": kind, "count": 1,
            "firstTimestamp": now, "lastTimestamp": now, "source": {"component": "pytorchjob-controller"},
        })

    @staticmethod
    def _past_backoff_limit(replicas: dict[str, Obj], pods: list[Obj], limit: int) -> bool:
        restarts = 0
        for rtype, rspec in replicas.items():
            if rspec.get("restartPolicy", "OnFailure") not in ("OnFailure", "Always", "ExitCode"):
                continue
            for pod in pods:
                if pod["metadata"].get("labels", {}).get(REPLICA_TYPE) != rtype.lower():
                    continue
                if pod.get("status", {}).get("phase") != "Running":
                    continue
                restarts += sum(int(c.get("restartCount", 0)) for c in (pod["status"].get("initContainerStatuses") or [])
                                + (pod["status"].get("containerStatuses") or []))
        return restarts > 0 if limit == 0 else restarts >= limit

    def _delete_pods_and_services(self, pods: list[Obj], clean: str, *, finished: bool) -> None:
        """DeletePodsAndServices: everything while running (limits, suspend); after the end as
        cleanPodPolicy says (None: nothing, Running: what still runs, All: everything)."""
        if finished and clean == "None":
            return
        for pod in pods:
            phase = pod.get("status", {}).get("phase")
            if finished and clean == "Running" and phase not in ("Running", "Pending"):
                continue
            ns, name = _pod_key(pod)
            if not pod["metadata"].get("deletionTimestamp"):
                self._log(f"training operator: delete pod {name}")
                self.api.delete(pod_path(ns, name))
            self.api.delete(service_path(ns, name))

    def _cleanup_job(self, job: Obj, status: Obj, suspended: bool) -> None:
        """CleanupJob: ttlSecondsAfterFinished after completionTime (Background deletion)."""
        ttl = (job["spec"].get("runPolicy") or {}).get("ttlSecondsAfterFinished")
        if ttl is None or suspended:
            return
        finished = _parse_time(status.get("completionTime"))
        if finished is None:
            return  # upstream: "job completion time is nil, cannot cleanup" (a failed ExitCode job)
        if time.time() > finished + int(ttl):
            meta = job["metadata"]
            self._log(f"training operator: TTL deletes job {meta['name']}")
            self.api.delete(job_path(meta["namespace"], meta["name"]))

    def _reconcile_pods(self, job: Obj, status: Obj, pods: list[Obj], rtype: str, rspec: Obj, replicas: dict[str, Obj]) -> None:
        name = job["metadata"]["name"]
        rt = rtype.lower()
        typed = [p for p in pods if p["metadata"].get("labels", {}).get(REPLICA_TYPE) == rt]
        count = int(rspec.get("replicas", 1))
        rs: Obj = {}
        status.setdefault("replicaStatuses", {})[rtype] = rs
        slices: dict[int, list[Obj]] = {i: [] for i in range(count)}
        for pod in typed:
            try:
                index = int(pod["metadata"].get("labels", {}).get(REPLICA_INDEX, ""))
            except ValueError:
                continue
            slices.setdefault(index, []).append(pod)
        policy = rspec.get("restartPolicy", "OnFailure")
        for index in sorted(slices):
            group = slices[index]
            if len(group) > 1:
                self._log(f"job {name}: too many pods for {rt} {index}")
                continue
            if not group:
                master = rtype == "Master" or (rtype == "Worker" and index == 0 and "Master" not in replicas)
                self._create_pod(job, rtype, rspec, index, master)
                continue
            pod = group[0]
            ns, pod_name = _pod_key(pod)
            if index >= count:
                self.api.delete(pod_path(ns, pod_name))
            exit_code = RETRYABLE_UNKNOWN
            for cs in pod.get("status", {}).get("containerStatuses") or []:
                terminated = (cs.get("state") or {}).get("terminated")
                if cs.get("name") == CONTAINER and terminated:
                    exit_code = int(terminated.get("exitCode", 0))
            if pod.get("status", {}).get("phase") == "Failed":
                if (policy == "ExitCode" and exit_code >= 128) or policy in ("OnFailure", "Always"):
                    if not pod["metadata"].get("deletionTimestamp"):
                        self._log(f"training operator: restart pod {pod_name} (exit {exit_code})")
                        self.api.delete(pod_path(ns, pod_name))
                    set_condition(status, "Restarting", "True", "PyTorchJobRestarting",
                                  f"job {name} is restarting because {rtype} replica(s) failed.")
                elif policy == "ExitCode":
                    set_condition(status, "Failed", "True", "PyTorchJobFailed",
                                  f'job "{name}" is failing because "{rtype}" replica(s) failed.')
            phase = pod.get("status", {}).get("phase")
            if phase == "Running":
                key = "failed" if pod["metadata"].get("deletionTimestamp") else "active"
                rs[key] = rs.get(key, 0) + 1
            elif phase == "Succeeded":
                rs["succeeded"] = rs.get("succeeded", 0) + 1
            elif phase == "Failed":
                rs["failed"] = rs.get("failed", 0) + 1

    def _create_pod(self, job: Obj, rtype: str, rspec: Obj, index: int, master: bool) -> None:
        meta = job["metadata"]
        rt = rtype.lower()
        template = copy.deepcopy(rspec.get("template") or {})
        labels = dict((template.get("metadata") or {}).get("labels") or {})
        labels.update({OPERATOR_NAME: CONTROLLER_NAME, JOB_NAME: meta["name"], REPLICA_TYPE: rt, REPLICA_INDEX: str(index)})
        if master:
            labels[JOB_ROLE] = "master"
        pod_spec = template.get("spec") or {}
        containers = pod_spec.get("containers") or []
        for container in containers:
            container["env"] = list(container.get("env") or []) + self._injected_env(job, rspec)
        # The controller's scheme defaulting (Reconcile: r.Scheme.Default(pytorchjob)) adds the one
        # port it knows, `pytorchjob-port` 23456, to the container named pytorch (else the first)
        # unless a port of that name is declared; no other port is ever added (training-operator
        # v1.9.0 pkg/apis/kubeflow.org/v1/pytorch_defaults.go setPyTorchDefaultPort,
        # defaulting_utils.go getDefaultContainerIndex/hasDefaultPort/setDefaultPort).
        default = next((c for c in containers if c.get("name") == CONTAINER), containers[0] if containers else None)
        if default is not None and not any(p.get("name") == DEFAULT_PORT_NAME for p in default.get("ports") or []):
            default["ports"] = list(default.get("ports") or []) + [{"name": DEFAULT_PORT_NAME, "containerPort": DEFAULT_PORT}]
        policy = rspec.get("restartPolicy", "OnFailure")
        pod_spec["restartPolicy"] = "Never" if policy == "ExitCode" else policy
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {**(template.get("metadata") or {}), "name": f"{meta['name']}-{rt}-{index}", "namespace": meta["namespace"],
                         "labels": labels, "ownerReferences": [self._controller_ref(job)]},
            "spec": pod_spec,
        }
        self._log(f"training operator: create pod {pod['metadata']['name']}")
        self.api.create(pod_path(meta["namespace"]), pod)

    @staticmethod
    def _controller_ref(job: Obj) -> Obj:
        return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": job["metadata"]["name"],
                "uid": job["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}

    @staticmethod
    def _injected_env(job: Obj, rspec: Obj) -> list[Obj]:
        """setPodEnv for a Master-less (elastic) job, with v1.9's defaults applied."""
        spec = job["spec"]
        env: list[Obj] = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
        elastic = spec.get("elasticPolicy")
        nproc = spec.get("nprocPerNode")
        if nproc is None and (elastic is None or elastic.get("nProcPerNode") is None):
            nproc = "auto"  # setDefaultNprocPerNode
        if nproc is not None:
            env.append({"name": "PET_NPROC_PER_NODE", "value": str(nproc)})
        if elastic is None:
            total = sum(int(r.get("replicas", 1)) for r in (spec.get("pytorchReplicaSpecs") or {}).values())
            env.append({"name": "PET_NNODES", "value": str(total)})
            return env
        workers = int(((spec.get("pytorchReplicaSpecs") or {}).get("Worker") or {}).get("replicas", 1))
        low, high = elastic.get("minReplicas"), elastic.get("maxReplicas")
        low = low if low is not None else high if high is not None else workers
        high = high if high is not None else low
        host = elastic.get("rdzvHost") or f"{job['metadata']['name']}-worker-0"
        port = elastic.get("rdzvPort")
        if port is None:
            containers = ((rspec.get("template") or {}).get("spec") or {}).get("containers") or []
            port = next((p.get("containerPort") for c in containers if c.get("name") == CONTAINER
                         for p in c.get("ports") or [] if p.get("name") == DEFAULT_PORT_NAME), DEFAULT_PORT)
        env += [
            {"name": "PET_RDZV_ENDPOINT", "value": f"{host}:{port}"},
            {"name": "PET_RDZV_BACKEND", "value": elastic.get("rdzvBackend") or "c10d"},
            {"name": "PET_NNODES", "value": f"{low}:{high}"},
        ]
        if elastic.get("maxRestarts") is not None:
            env.append({"name": "PET_MAX_RESTARTS", "value": str(elastic["maxRestarts"])})
        if elastic.get("nProcPerNode") is not None:
            env.append({"name": "PET_NPROC_PER_NODE", "value": str(elastic["nProcPerNode"])})
        if elastic.get("rdzvId") is not None:
            env.append({"name": "PET_RDZV_ID", "value": str(elastic["rdzvId"])})
        if elastic.get("rdzvConf"):
            env.append({"name": "PET_RDZV_CONF", "value": ",".join(f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])})
        if elastic.get("standalone"):
            env.append({"name": "PET_STANDALONE", "value": ""})
        return env

    def _reconcile_services(self, job: Obj, services: list[Obj], rtype: str, rspec: Obj) -> None:
        """One headless Service per replica (what makes `<job>-worker-0` resolvable)."""
        meta = job["metadata"]
        rt = rtype.lower()
        count = int(rspec.get("replicas", 1))
        existing = {s["metadata"]["name"]: s for s in services}
        for index in range(count):
            name = f"{meta['name']}-{rt}-{index}"
            if name in existing:
                continue
            labels = {OPERATOR_NAME: CONTROLLER_NAME, JOB_NAME: meta["name"], REPLICA_TYPE: rt, REPLICA_INDEX: str(index)}
            ports = [{"name": DEFAULT_PORT_NAME, "port": DEFAULT_PORT}]
            for container in ((rspec.get("template") or {}).get("spec") or {}).get("containers") or []:
                if container.get("name") == CONTAINER:
                    ports = [{"name": p["name"], "port": p["containerPort"]} for p in container.get("ports") or [] if p.get("name")] \
                        or ports
            self.api.create(service_path(meta["namespace"]), {
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name, "namespace": meta["namespace"], "labels": labels, "ownerReferences": [self._controller_ref(job)]},
                "spec": {"clusterIP": "None", "selector": labels, "ports": ports},
            })
        for name, service in existing.items():
            labels = service["metadata"].get("labels") or {}
            if labels.get(REPLICA_TYPE) == rt and labels.get(REPLICA_INDEX, "").isdigit() and int(labels[REPLICA_INDEX]) >= count:
                self.api.delete(service_path(meta["namespace"], name))

    def _update_job_status(self, job: Obj, replicas: dict[str, Obj], status: Obj) -> None:
        meta, spec = job["metadata"], job["spec"]
        name, ns = meta["name"], meta["namespace"]
        status.setdefault("startTime", now_rfc3339())
        for rtype, rspec in replicas.items():
            rs = status.setdefault("replicaStatuses", {}).setdefault(rtype, {})
            rs["selector"] = f"{JOB_NAME}={name},{OPERATOR_NAME}={CONTROLLER_NAME},{REPLICA_TYPE}={rtype.lower()}"
            succeeded, running, failed = rs.get("succeeded", 0), rs.get("active", 0), rs.get("failed", 0)
            count = int(rspec.get("replicas", 1))
            expected = count - succeeded
            if "Master" in replicas:
                if rtype == "Master":
                    if running > 0:
                        set_condition(status, "Running", "True", "PyTorchJobRunning", f"PyTorchJob {name} is running.")
                    if expected == 0:
                        status.setdefault("completionTime", now_rfc3339())
                        set_condition(status, "Succeeded", "True", "PyTorchJobSucceeded", f"PyTorchJob {name} is successfully completed.")
                        return
            elif rtype == "Worker":
                if expected == 0 or (spec.get("elasticPolicy") is not None and succeeded > 0):
                    status.setdefault("completionTime", now_rfc3339())
                    set_condition(status, "Succeeded", "True", "PyTorchJobSucceeded", f"PyTorchJob {ns}/{name} successfully completed.")
                elif running > 0:
                    set_condition(status, "Running", "True", "PyTorchJobRunning", f"PyTorchJob {ns}/{name} is running.")
            if failed > 0 and count > succeeded + running:
                if rspec.get("restartPolicy", "OnFailure") != "Never":
                    set_condition(status, "Restarting", "True", "PyTorchJobRestarting",
                                  f"PyTorchJob {name} is restarting because {failed} {rtype} replica(s) failed.")
                else:
                    status.setdefault("completionTime", now_rfc3339())
                    set_condition(status, "Failed", "True", "PyTorchJobFailed",
                                  f"PyTorchJob {name} is failed because {failed} {rtype} replica(s) failed.")

    # -------------------------------------------------------------------------------- scheduler
    def _scheduler(self, pods: list[Obj], nodes: list[Obj]) -> None:
        """Bind each pending pod without scheduling gates to a feasible node, spreading by the
        number of pods per node; an unschedulable pod gets PodScheduled=False, reason Unschedulable.

        Feasible is kube-scheduler's filters in their order, each node failing at the first that
        rejects it, with the plugins' own reasons: NodeUnschedulable ("node(s) were
        unschedulable"), NodeAffinity (nodeSelector and required node affinity: "node(s) didn't
        match Pod's node affinity/selector"), NodeResourcesFit (the requests of the pods bound to
        the node plus this pod's against the node's allocatable cpu, memory and nvidia.com/gpu:
        "Insufficient <resource>" per resource short; pkg/scheduler/framework/plugins/noderesources/
        fit.go, fitsRequest, v1.30). The message is FitError.Error's histogram of those reasons,
        sorted (pkg/scheduler/framework/types.go), without the PostFilter's preemption postscript."""
        live_nodes = [n for n in nodes if n["metadata"]["name"] not in self._lost and not n["metadata"].get("deletionTimestamp")]
        load: dict[str, int] = {n["metadata"]["name"]: 0 for n in live_nodes}
        used: dict[str, dict[str, float]] = {name: dict.fromkeys(SCHEDULED_RESOURCES, 0.0) for name in load}
        for pod in pods:
            node = pod.get("spec", {}).get("nodeName")
            if node in load and pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
                load[node] += 1
                for resource, amount in self._requests(pod).items():
                    used[node][resource] += amount
        for pod in pods:
            spec, meta = pod.get("spec", {}), pod["metadata"]
            if spec.get("nodeName") or meta.get("deletionTimestamp") or spec.get("schedulerName", "default-scheduler") != "default-scheduler":
                continue
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                continue
            if spec.get("schedulingGates"):
                continue  # kube-scheduler leaves a gated pod Pending (SchedulingGated) until its gates are gone
            ns, name = _pod_key(pod)
            missing = self._undeclared_claim(pod)
            if missing is not None:
                self._unschedulable(pod, f'0/{len(live_nodes)} nodes are available: persistentvolumeclaim "{missing}" not found.')
                continue
            wanted = self._requests(pod)
            reasons: dict[str, int] = {}
            feasible = []
            for n in live_nodes:
                why = self._filter(pod, n, used[n["metadata"]["name"]], wanted)
                if why:
                    for reason in why:
                        reasons[reason] = reasons.get(reason, 0) + 1
                else:
                    feasible.append(n)
            if not feasible:
                histogram = ", ".join(sorted(f"{count} {reason}" for reason, count in reasons.items()))
                self._unschedulable(pod, f"0/{len(live_nodes)} nodes are available" + (f": {histogram}." if histogram else "."))
                continue
            node = min(feasible, key=lambda n: (load[n["metadata"]["name"]], n["metadata"]["name"]))["metadata"]["name"]
            try:
                self.api.call("POST", pod_path(ns, name, "binding"), {
                    "apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "namespace": ns},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node}})
            except ApiError as exc:
                self._log(f"scheduler: bind {name} -> {node} failed: {exc}")
                continue
            self._log(f"scheduler: {name} -> {node}")
            load[node] += 1
            for resource, amount in wanted.items():
                used[node][resource] += amount

    def _filter(self, pod: Obj, node: Obj, used: dict[str, float], wanted: dict[str, float]) -> list[str]:
        """The reasons the first failing filter gives for `node` (empty: the pod fits there)."""
        if node.get("spec", {}).get("unschedulable"):
            return ["node(s) were unschedulable"]
        if not self._fits(pod, node):
            return ["node(s) didn't match Pod's node affinity/selector"]
        allocatable = node.get("status", {}).get("allocatable") or {}
        short = []
        for resource in SCHEDULED_RESOURCES:
            if wanted[resource] and used[resource] + wanted[resource] > quantity_value(str(allocatable.get(resource) or 0)):
                short.append(f"Insufficient {resource}")
        return short

    @staticmethod
    def _requests(pod: Obj) -> dict[str, float]:
        """The pod's requests of SCHEDULED_RESOURCES (its containers' requests, a limit standing in
        for an absent request as the API server's defaulting does)."""
        total = dict.fromkeys(SCHEDULED_RESOURCES, 0.0)
        for container in pod.get("spec", {}).get("containers") or []:
            resources = container.get("resources") or {}
            for resource in SCHEDULED_RESOURCES:
                value = (resources.get("requests") or {}).get(resource) or (resources.get("limits") or {}).get(resource)
                if value:
                    total[resource] += quantity_value(str(value))
        return total

    def _undeclared_claim(self, pod: Obj) -> str | None:
        """The first persistentVolumeClaim the pod's volumes name that this cluster does not have
        (`claims`). kube-scheduler's VolumeBinding plugin rejects such a pod in PreFilter as
        UnschedulableAndUnresolvable with the lister's NotFound error, `persistentvolumeclaim
        "<name>" not found` (kubernetes pkg/scheduler/framework/plugins/volumebinding/
        volume_binding.go: PreFilter -> podHasPVCs, v1.30), which FitError.Error prefixes with
        "0/<n> nodes are available: " (pkg/scheduler/framework/types.go): the pod stays Pending."""
        for volume in pod.get("spec", {}).get("volumes") or []:
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim is not None and claim not in self.claims:
                return str(claim)
        return None

    def _unschedulable(self, pod: Obj, message: str) -> None:
        """PodScheduled False, reason Unschedulable, once per pod."""
        meta = pod["metadata"]
        if meta["uid"] in self._unschedulable_written:
            return
        self._unschedulable_written.add(meta["uid"])
        status = copy.deepcopy(pod.get("status") or {})
        status["conditions"] = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"] + [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
            "lastTransitionTime": now_rfc3339()}]
        self._log(f"scheduler: {meta['name']} unschedulable: {message}")
        self._write_status(pod, status)

    @staticmethod
    def _fits(pod: Obj, node: Obj) -> bool:
        if node.get("spec", {}).get("unschedulable"):
            return False
        labels = node["metadata"].get("labels") or {}
        spec = pod.get("spec", {})
        if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
            return False
        required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                    .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
        terms = required.get("nodeSelectorTerms")
        if terms:
            return any(SimCluster._term_matches(term, labels, node["metadata"]["name"]) for term in terms)
        return True

    @staticmethod
    def _term_matches(term: Obj, labels: dict[str, str], node_name: str) -> bool:
        """One nodeSelectorTerm: all matchExpressions and matchFields (metadata.name) hold."""
        checks = [(e, labels) for e in term.get("matchExpressions") or []]
        checks += [(e, {"metadata.name": node_name}) for e in term.get("matchFields") or []]
        if not checks:
            return False  # an empty term matches nothing
        for expr, source in checks:
            key, op, values = expr.get("key"), expr.get("operator"), [str(v) for v in expr.get("values") or []]
            present, value = key in source, source.get(key)
            if op == "In" and not (present and value in values):
                return False
            if op == "NotIn" and present and value in values:
                return False
            if op == "Exists" and not present:
                return False
            if op == "DoesNotExist" and present:
                return False
            if op in ("Gt", "Lt"):
                try:
                    number, bound = int(str(value)), int(values[0])
                except (TypeError, ValueError, IndexError):
                    return False
                if (op == "Gt" and not number > bound) or (op == "Lt" and not number < bound):
                    return False
        return True

    # -------------------------------------------------------------------------------- kubelets
    def _kubelets(self, pods: list[Obj], nodes: list[Obj]) -> None:
        mine = {n["metadata"]["name"] for n in nodes} & (set(self.node_names) - self._lost)
        present = set()
        for pod in pods:
            meta, spec = pod["metadata"], pod.get("spec", {})
            node = spec.get("nodeName")
            present.add(meta["uid"])
            if node not in mine:
                continue
            try:
                self._kubelet(pod)
            except ApiError as exc:
                self._log(f"kubelet {node}: {meta['name']}: {exc}")
        # Pods removed behind the kubelet's back (force deletion, PodGC): kill what is left.
        for uid, run in list(self._runs.items()):
            if uid in present:
                continue
            if run.container is not None and not run.done:
                self._log(f"kubelet {run.node}: {run.name} is gone from the API: killing its container")
                self._signal_container(run.container, signal.SIGKILL)
            if run.container is None or run.container.proc is None or run.container.proc.poll() is not None:
                del self._runs[uid]
                self._remove_pod_files(run)

    def _kubelet(self, pod: Obj) -> None:
        meta, spec = pod["metadata"], pod.get("spec", {})
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        deleting = bool(meta.get("deletionTimestamp"))
        run = self._runs.get(uid)
        if run is None:
            if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                return
            if deleting:
                self._log(f"kubelet {spec['nodeName']}: {name} deleted before it started")
                self.api.delete(pod_path(ns, name), grace=0)
                return
            run = PodRun(ns, name, uid, spec["nodeName"], self._ip_for(uid), self.workdir / "pods" / f"{ns}_{name}_{uid[:8]}")
            run.started_at = now_rfc3339()
            self._runs[uid] = run
        if run.done:
            if deleting and time.monotonic() >= run.delete_at:
                self.api.delete(pod_path(ns, name), grace=0)
            return
        container = run.container
        if container is None:
            if deleting:
                run.done = True
                self._terminal(pod, run, None)
                self.api.delete(pod_path(ns, name), grace=0)
                return
            if time.monotonic() >= run.next_start:
                self._start_container(pod, run)
            return
        code = container.proc.poll() if container.proc is not None else 128
        if code is None:
            if deleting:
                self._terminate(pod, run)
            return
        self._container_exited(pod, run, code)

    def _terminate(self, pod: Obj, run: PodRun) -> None:
        """Graceful stop: SIGTERM to the container's first process (what the runtime signals),
        SIGKILL to all of it after the grace period."""
        assert run.container is not None and run.container.proc is not None
        now = time.monotonic()
        if run.kill_at is None:
            meta = pod["metadata"]
            grace = int(meta.get("deletionGracePeriodSeconds") if meta.get("deletionTimestamp")
                        else pod.get("spec", {}).get("terminationGracePeriodSeconds", 30))
            run.kill_at = now + grace
            self._log(f"kubelet {run.node}: SIGTERM {run.name} (grace {grace}s)")
            with contextlib.suppress(ProcessLookupError):
                os.kill(run.container.proc.pid, signal.SIGTERM)
        else:
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):  # a second DELETE may have shortened the grace period
                run.kill_at = min(run.kill_at, (_parse_time(meta["deletionTimestamp"]) or 0) - time.time() + now + 1)
        if now >= run.kill_at:
            self._log(f"kubelet {run.node}: SIGKILL {run.name} (grace period over)")
            self._signal_container(run.container, signal.SIGKILL)

    def _container_exited(self, pod: Obj, run: PodRun, code: int) -> None:
        assert run.container is not None
        container = run.container
        if container.proc is not None:
            self._signal_container(container, signal.SIGKILL)  # the PID namespace dies with PID 1
        exit_code = code if code >= 0 else 128 - code
        if container.start_error is not None:
            reason, exit_code = "StartError", 128
        else:
            reason = "Completed" if exit_code == 0 else "Error"
        terminated = {"exitCode": exit_code, "reason": reason, "startedAt": container.started_at, "finishedAt": now_rfc3339(),
                      "containerID": f"sim://{container.proc.pid if container.proc else 0}"}
        message = container.start_error or self._termination_message(pod, run, exit_code)
        if message:
            terminated["message"] = message
        self._log(f"kubelet {run.node}: {run.name} exited {exit_code} ({reason})")
        restart = pod.get("spec", {}).get("restartPolicy", "Always")
        deleting = bool(pod["metadata"].get("deletionTimestamp"))
        if not deleting and (restart == "Always" or (restart == "OnFailure" and exit_code != 0)):
            run.last_terminated = terminated
            run.restarts += 1
            run.container = None
            run.next_start = time.monotonic() + self.restart_backoff
            status = self._base_status(pod, run)
            status["containerStatuses"] = [self._container_status(pod, run, {"waiting": {"reason": "CrashLoopBackOff",
                                                                                        "message": f"back-off restarting failed container {CONTAINER}"}},
                                                                  ready=False)]
            written = self._write_status(pod, status)
            self._record({**(written or pod), "status": {**status, "containerStatuses": [
                self._container_status(pod, run, {"terminated": terminated}, ready=False)]}})
            return
        run.done = True
        # The real kubelet deletes the pod only after it has cleaned up (volumes, cgroups): for a
        # moment the API shows it terminal *and* being deleted, and controllers do react to that.
        run.delete_at = time.monotonic() + self.final_delete_delay
        self._terminal(pod, run, terminated)

    def _terminal(self, pod: Obj, run: PodRun, terminated: Obj | None) -> None:
        """Write the pod's last status: a terminal phase with the container's terminated state."""
        status = self._base_status(pod, run)
        ok = terminated is not None and terminated["exitCode"] == 0
        status["phase"] = "Succeeded" if ok else "Failed"
        for c in status["conditions"]:
            if c["type"] in ("Ready", "ContainersReady"):
                c.update({"status": "False", "reason": "PodCompleted" if ok else "PodFailed"})
        state = {"terminated": terminated} if terminated is not None else {
            "terminated": {"exitCode": 137, "reason": "ContainerStatusUnknown", "finishedAt": now_rfc3339(),
                           "message": "The container could not be located when the pod was terminated"}}
        status["containerStatuses"] = [self._container_status(pod, run, state, ready=False)]
        written = self._write_status(pod, status)
        self._record({**(written or pod), "status": status})

    def _termination_message(self, pod: Obj, run: PodRun, exit_code: int) -> str:
        path = run.dir / "termination-log"
        try:
            message = path.read_bytes()[:TERMINATION_LOG_MAX].decode(errors="replace")
        except OSError:
            message = ""
        container = (pod.get("spec", {}).get("containers") or [{}])[0]
        if not message and exit_code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError" and run.container:
            try:
                lines = run.container.log_path.read_bytes().splitlines()[-FALLBACK_LINES:]
            except OSError:
                lines = []
            message = b"\n".join(lines)[-FALLBACK_BYTES:].decode(errors="replace")
        return message

    def _base_status(self, pod: Obj, run: PodRun) -> Obj:
        status = copy.deepcopy(pod.get("status") or {})
        status.update({"hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}], "podIP": run.ip, "podIPs": [{"ip": run.ip}],
                       "startTime": run.started_at})
        status.setdefault("phase", "Pending")
        status.setdefault("qosClass", "BestEffort")
        conditions = {c["type"]: c for c in status.get("conditions") or []}
        for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready"):
            conditions.setdefault(kind, {"type": kind, "status": "True" if kind in ("PodScheduled", "Initialized") else "False",
                                         "lastTransitionTime": now_rfc3339()})
        status["conditions"] = list(conditions.values())
        return status

    @staticmethod
    def _container_status(pod: Obj, run: PodRun, state: Obj, *, ready: bool) -> Obj:
        container = (pod.get("spec", {}).get("containers") or [{}])[0]
        out = {"name": container.get("name", CONTAINER), "image": container.get("image", ""), "imageID": "sim://image",
               "containerID": f"sim://{run.container.proc.pid}" if run.container and run.container.proc else "",
               "ready": ready, "started": "running" in state, "restartCount": run.restarts, "state": state}
        if run.last_terminated is not None:
            out["lastState"] = {"terminated": run.last_terminated}
        return out

    def _set_ready(self, status: Obj, ready: bool) -> None:
        for c in status["conditions"]:
            if c["type"] in ("Ready", "ContainersReady"):
                value = "True" if ready else "False"
                if c.get("status") != value:
                    c.update({"status": value, "lastTransitionTime": now_rfc3339()})
                    c.pop("reason", None)

    # ------------------------------------------------------------------------ starting a container
    def _start_container(self, pod: Obj, run: PodRun) -> None:
        meta, spec = pod["metadata"], pod.get("spec", {})
        container = (spec.get("containers") or [{}])[0]
        run.dir.mkdir(parents=True, exist_ok=True)
        prepared = self._prepare(pod, run, container)
        status = self._base_status(pod, run)
        if isinstance(prepared, Waiting):
            reason, message = prepared.reason, prepared.message
            status["containerStatuses"] = [self._container_status(pod, run, {"waiting": {"reason": reason, "message": message}},
                                                                  ready=False)]
            if status != pod.get("status"):
                self._log(f"kubelet {run.node}: {run.name} waiting: {reason}: {message}")
            self._write_status(pod, status)
            run.next_start = time.monotonic() + 0.5
            return
        argv, env, binds = prepared
        log_path = run.dir / f"{run.restarts}-{meta['uid'][:8]}.log"
        termination_log = run.dir / "termination-log"
        termination_log.write_bytes(b"")
        # The kubelet bind-mounts its own file at terminationMessagePath and reads it after the exit.
        binds.append((termination_log, container.get("terminationMessagePath") or DEFAULT_TERMINATION_MESSAGE_PATH, False))
        marker = f"{self.id}/{run.uid}/{run.restarts}"
        env[MARKER] = marker
        for old in (run.dir / "containers").glob("*"):  # the replaced container's writable layer goes with it
            shutil.rmtree(old, ignore_errors=True)
        launch = [self.python, "-I", str(LAUNCHER), "--root", str(run.dir / "containers" / str(run.restarts)),
                  "--cwd", container.get("workingDir") or "/"]
        for source, target, read_only in binds:
            launch += ["--bind-ro" if read_only else "--bind", str(source), target]
        self._logs.setdefault((run.namespace, run.name), []).append(log_path)
        started = now_rfc3339()
        proc: subprocess.Popen[bytes] | None
        start_error: str | None
        with log_path.open("wb") as log:
            if not (os.path.isfile(argv[0]) and os.access(argv[0], os.X_OK)):
                proc, start_error = None, f'exec: "{argv[0]}": executable file not found in $PATH'
            else:
                try:
                    proc = subprocess.Popen(
                        _die_with_parent([*launch, "--", *argv]), env=env, cwd=run.dir, stdout=log, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, start_new_session=True)
                    start_error = None
                except OSError as exc:
                    proc, start_error = None, f"failed to start container: {exc}"
        run.container = Container(run.restarts, proc, log_path, started, marker, start_error=start_error)
        if proc is not None:
            self._procs.append(proc)
        self._log(f"kubelet {run.node}: started {run.name} ip={run.ip} pid={proc.pid if proc else None}: {' '.join(argv)[:300]}")
        if proc is None:
            return
        status["phase"] = "Running"
        self._set_ready(status, True)
        status["containerStatuses"] = [self._container_status(pod, run, {"running": {"startedAt": started}}, ready=True)]
        self._write_status(pod, status)

    def _volume_binds(self, pod: Obj, run: PodRun, container: Obj) -> list[tuple[Path, str, bool]] | Waiting:
        """(host source, mountPath, read-only) for each of the container's volumeMounts, as the
        kubelet's volume manager sets them up, or why the container waits (MountVolume.SetUp):
        - persistentVolumeClaim: the folder the test declared for the claim (`claims`), shared by
          every pod on every node (ReadWriteMany); an undeclared claim never gets here (the
          scheduler leaves the pod Pending) unless the pod was bound by hand;
        - emptyDir: a folder of the pod's own, kept across container restarts and deleted with the
          pod; with medium Memory at /dev/shm nothing (the launcher gives every container a
          private tmpfs there);
        - configMap: its keys (or items) written into a folder of the pod's, mounted read-only (the
          kubelet's atomic writer makes them so on a real node);
        - any other source (secret, hostPath, ...): the sim has none, the container waits."""
        meta, spec = pod["metadata"], pod.get("spec", {})
        binds: list[tuple[Path, str, bool]] = []
        volumes = {v.get("name"): v for v in spec.get("volumes") or []}
        for mount in container.get("volumeMounts") or []:
            name, mount_path = str(mount.get("name")), str(mount.get("mountPath"))
            read_only = bool(mount.get("readOnly"))
            volume = volumes.get(name) or {}
            if "persistentVolumeClaim" in volume:
                pvc = volume["persistentVolumeClaim"]
                claim = pvc.get("claimName")
                if claim not in self.claims:
                    return Waiting("ContainerCreating", f'MountVolume.SetUp failed for volume "{name}": '
                                                        f'persistentvolumeclaim "{claim}" not found')
                self.claims[claim].mkdir(parents=True, exist_ok=True)
                binds.append((self.claims[claim], mount_path, read_only or bool(pvc.get("readOnly"))))
            elif "emptyDir" in volume:
                if (volume["emptyDir"] or {}).get("medium") == "Memory" and mount_path.rstrip("/") == "/dev/shm":
                    continue
                target = run.dir / "volumes" / name
                target.mkdir(parents=True, exist_ok=True)
                binds.append((target, mount_path, read_only))
            elif "configMap" in volume:
                source = volume["configMap"] or {}
                cm = self.api.get(f"/api/v1/namespaces/{meta['namespace']}/configmaps/{source.get('name')}")
                if cm is None and not source.get("optional"):
                    return Waiting("ContainerCreating", f'MountVolume.SetUp failed for volume "{name}": configmap "{source.get("name")}" not found')
                target = run.dir / "volumes" / name
                target.mkdir(parents=True, exist_ok=True)
                data = (cm or {}).get("data") or {}
                items = source.get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    if item["key"] in data:
                        path = target / item["path"]
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_text(data[item["key"]])
                binds.append((target, mount_path, True))
            else:
                kind = next((k for k in volume if k != "name"), "unknown")
                return Waiting("ContainerCreating", f'MountVolume.SetUp failed for volume "{name}": the sim has no {kind} volumes')
        return binds

    def _prepare(self, pod: Obj, run: PodRun, container: Obj) -> tuple[list[str], dict[str, str], list[tuple[Path, str, bool]]] | Waiting:
        """(argv, env, volume binds) to run, or (waiting reason, message) if the container cannot
        start yet. Paths in argv and env are the container's: its volumes are real mounts."""
        meta, spec = pod["metadata"], pod.get("spec", {})
        binds = self._volume_binds(pod, run, container)
        if isinstance(binds, Waiting):
            return binds
        env: dict[str, str] = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/root"),
            "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "trainer")]),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        for var in container.get("env") or []:
            if "value" in var:
                env[var["name"]] = _expand(str(var["value"]), env)
                continue
            source = var.get("valueFrom") or {}
            if "fieldRef" in source:
                path = source["fieldRef"].get("fieldPath", "")
                keyed = re.fullmatch(r"metadata\.(labels|annotations)\['([^']*)'\]", path)
                env[var["name"]] = str((meta.get(keyed.group(1)) or {}).get(keyed.group(2), "")) if keyed else {
                    "metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                    "metadata.uid": meta["uid"], "status.podIP": run.ip, "status.hostIP": "127.0.0.1",
                    "spec.nodeName": run.node, "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
                }.get(path, "")
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                cm = self.api.get(f"/api/v1/namespaces/{meta['namespace']}/configmaps/{ref.get('name')}")
                value = ((cm or {}).get("data") or {}).get(ref.get("key"))
                if value is None and not ref.get("optional"):
                    return Waiting("CreateContainerConfigError", f'configmap "{ref.get("name")}" or its key "{ref.get("key")}" not found')
                if value is not None:
                    env[var["name"]] = value
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                if not ref.get("optional"):
                    return Waiting("CreateContainerConfigError", f'secret "{ref.get("name")}" not found')
        env.update({"HOSTNAME": spec.get("hostname") or meta["name"], "LLAMAFT_METRICS_HOST": run.ip,
                    # Every simulated node shares this machine's few cores: one thread per
                    # trainer, whatever CPU share the pod's spec gives it.
                    "OMP_NUM_THREADS": "1"})
        if "PET_RDZV_ENDPOINT" in env:
            resolved = self._resolve(meta["namespace"], env["PET_RDZV_ENDPOINT"])
            if resolved is None:
                return Waiting("ContainerCreating", f"cannot resolve the rendezvous endpoint {env['PET_RDZV_ENDPOINT']} yet")
            env["PET_RDZV_ENDPOINT"] = resolved
        if "PET_MASTER_ADDR" in env:  # Kubeflow Trainer's torch plugin: `<job>-node-0-0.<job>`, port 29500
            resolved = self._resolve(meta["namespace"], f"{env['PET_MASTER_ADDR']}:{env.get('PET_MASTER_PORT', '29500')}")
            if resolved is None:
                return Waiting("ContainerCreating", f"cannot resolve the master address {env['PET_MASTER_ADDR']} yet")
            env["PET_MASTER_ADDR"], _, env["PET_MASTER_PORT"] = resolved.rpartition(":")
        command = [_expand(str(a), env) for a in (container.get("command") or []) + (container.get("args") or [])]
        if not command:
            return Waiting("CreateContainerError", "the sim cannot run an image's entrypoint: set command")
        argv = list(command)
        for i, arg in enumerate(argv):  # torchrun's explicit --rdzv-endpoint (the TrainJob's command carries it)
            flag, eq, value = arg.partition("=")
            if flag not in ("--rdzv-endpoint", "--rdzv_endpoint") or (not eq and i + 1 >= len(argv)):
                continue
            resolved = self._resolve(meta["namespace"], value if eq else argv[i + 1])
            if resolved is None:
                return Waiting("ContainerCreating", f"cannot resolve the rendezvous endpoint {value or argv[i + 1]} yet")
            if eq:
                argv[i] = f"{flag}={resolved}"
            else:
                argv[i + 1] = resolved
        if argv[0] == "torchrun":
            argv = [self.python, "-m", "torch.distributed.run", *argv[1:]]
        elif argv[0] in ("python", "python3"):
            argv = [self.python, *argv[1:]]
        elif not os.path.isabs(argv[0]):
            found = shutil.which(argv[0], path=env["PATH"])
            argv[0] = found or argv[0]
        return argv, env, binds

    def _resolve(self, namespace: str, endpoint: str) -> str | None:
        """Cluster DNS for an endpoint `host:port`, or None while it has no record yet:
        - `name`, `name.ns`, `name.ns.svc[.cluster.local]` naming a Service that selects a scheduled
          pod -> that pod's address, with a local port of its own for (Service, port);
        - other `name.ns[.svc...]` names (the managed etcd, whose pods the sim does not run; an etcd
          in another namespace) -> the one local etcd;
        - `hostname.subdomain[.ns[.svc[.cluster.local]]]` where `subdomain` is a Service of the
          namespace: the pod with that spec.hostname and spec.subdomain (an Indexed Job's pod, e.g.
          Trainer's `<job>-node-0-0.<job>`) -> its address and a local port of its own; None until
          that pod is scheduled;
        - a bare `name` without such a Service -> None (the container waits, as DNS would fail);
        - IP addresses and outside names -> unchanged."""
        host, sep, port = endpoint.rpartition(":")
        if not sep:
            host, port = endpoint, ""
        parts = host.split(".")
        if not all(p.isdigit() for p in parts) and (len(parts) == 2 or (len(parts) == 3 and parts[2] != "svc")
                                                    or (len(parts) >= 4 and parts[3] == "svc")):
            pod_ns = parts[2] if len(parts) >= 3 else namespace
            if self.api.get(service_path(pod_ns, parts[1])) is not None:
                for pod in self.api.list(pod_path(pod_ns)):
                    pod_spec = pod.get("spec", {})
                    if (pod_spec.get("hostname"), pod_spec.get("subdomain")) == (parts[0], parts[1]) \
                            and pod_spec.get("nodeName") and not pod["metadata"].get("deletionTimestamp"):
                        local = self._ports.setdefault((pod_ns, f"{parts[0]}.{parts[1]}", port), pod_port())
                        return f"{self._ip_for(pod['metadata']['uid'])}:{local}"
                if len(parts) == 2 or len(parts) >= 4:
                    return None
        if all(p.isdigit() for p in parts) or (len(parts) >= 3 and parts[2] != "svc"):
            return endpoint
        svc_ns = parts[1] if len(parts) >= 2 else namespace
        service = self.api.get(service_path(svc_ns, parts[0]))
        selector = ((service or {}).get("spec") or {}).get("selector")
        if selector:
            for pod in self.api.list(pod_path(svc_ns), label_selector=",".join(f"{k}={v}" for k, v in selector.items())):
                if pod.get("spec", {}).get("nodeName") and not pod["metadata"].get("deletionTimestamp"):
                    local = self._ports.setdefault((svc_ns, parts[0], port), pod_port())
                    return f"{self._ip_for(pod['metadata']['uid'])}:{local}"
        return self.etcd_endpoint if len(parts) >= 2 else None

def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in env values and command arguments ($$ escapes)."""
    return re.sub(r"\$\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: m.group(0)[1:] if m.group(0).startswith("$$") else env.get(m.group(2), m.group(0)), value)

