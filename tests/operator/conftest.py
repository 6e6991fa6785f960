"""Operator fixtures: the emulator on loopback, a kubeconfig for it, the real kopf runtime as a
subprocess (`kopf run --standalone`), and a client that plays the training operator's part."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client
from llamaft_trainer.process.local_etcd import LocalEtcd, free_port

from tests.conftest import REPO, need_etcd
from tests.operator.emulator import EmulatorThread, write_kubeconfig
from tests.tiers import starts_processes

T = TypeVar("T")
GROUP, VERSION, PLURAL = "llamaft.io", "v1alpha1", "llamafinetunes"
CHECKPOINT_CLAIM = "ckpt"
"""The PersistentVolumeClaim test specs keep their checkpoints on (on a simulated cluster, a folder of
the test's: tests/operator/sim_fixtures.py)."""



def wait_for(what: str, fn: Callable[[], T | None], timeout: float = 30.0, interval: float = 0.2) -> T:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except Exception as exc:  # the object may not exist yet
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


@starts_processes
class Operator:
    """`kopf run --standalone -A -m llamaft.operator.handlers` against the emulator."""

    def __init__(self, kubeconfig: Path, log: Path, cli: bool = False, *, peering: str | None = None,
                 args: tuple[str, ...] = (), verbose: bool = False, **env: str) -> None:
        """cli=True runs `llamaft operator` (the chart's entry point) instead of `kopf run`.
        peering: run as one of several replicas (`--peering NAME` instead of `--standalone`);
        args: more command-line options; verbose: kopf's debug log (pauses, watch streams)."""
        self.kubeconfig, self.log_path, self.extra_env, self.cli = kubeconfig, log, env, cli
        self.peering, self.args, self.verbose = peering, args, verbose
        self.proc: subprocess.Popen[bytes] | None = None
        self.metrics_port = free_port()

    def start(self) -> Operator:
        env = dict(os.environ)
        env.update({
            "KUBECONFIG": str(self.kubeconfig), "LLAMAFT_SYNC_INTERVAL": "0.5", "LLAMAFT_RETRY_BACKOFF_SECONDS": "0",
            "LLAMAFT_OPERATOR_METRICS_PORT": str(self.metrics_port), "LLAMAFT_PROGRESS_TIMEOUT": "0.5",
            "PYTHONPATH": os.pathsep.join([str(REPO / "operator"), str(REPO / "trainer")]),
        })
        env.update(self.extra_env)
        self.log = self.log_path.open("ab")
        verbose = ["--verbose"] if self.verbose or os.environ.get("LLAMAFT_TEST_VERBOSE") else []
        mode = ["--peering", self.peering] if self.peering else ["--standalone"]
        command = (
            [sys.executable, "-m", "llamaft.cli", "operator", *mode, "--json-logs",
             "--liveness", f"http://127.0.0.1:{free_port()}/healthz"]
            if self.cli else
            [sys.executable, "-m", "kopf", "run", *mode, "--all-namespaces", "--log-format", "json",
             "-m", "llamaft.operator.handlers"]
        )
        self.proc = subprocess.Popen(
            command + list(self.args) + verbose,
            env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
        )
        return self

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind (an OOM kill or a node loss)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """SIGSTOP the operator for the block, SIGCONT after it: what the block writes reaches the
        operator all at once, as events that arrive while a sync is busy elsewhere do."""
        assert self.proc is not None and self.proc.poll() is None
        os.killpg(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")


class Cluster:
    """Typed helpers over the emulator; `finish_job` etc. act as the Kubeflow training operator."""

    def __init__(self, api: client.ApiClient, namespace: str = "default") -> None:
        self.api, self.ns = api, namespace
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)

    def create(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "LlamaFineTune", "metadata": {"name": name}, "spec": spec}
        return dict(self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body))

    def finetune(self, name: str) -> dict[str, Any]:
        return dict(self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name))

    def patch_finetune(self, name: str, patch: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name, patch)

    def delete_finetune(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.finetune(name).get("status", {}))

    def job_name(self, finetune: str, attempt: int) -> str:
        """The attempt's job name: `<name>-<uid token>-<attempt>` (naming.Owner.job_name)."""
        from llamaft.render.naming import Owner

        return Owner(finetune, self.ns, self.finetune(finetune)["metadata"]["uid"]).job_name(attempt)

    def attempt_job(self, finetune: str, attempt: int) -> dict[str, Any] | None:
        """The PyTorchJob of one attempt of a LlamaFineTune, if it exists."""
        try:
            return self.job(self.job_name(finetune, attempt))
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def job(self, name: str) -> dict[str, Any] | None:
        try:
            return dict(self.custom.get_namespaced_custom_object("kubeflow.org", "v1", self.ns, "pytorchjobs", name))
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def jobs(self, selector: str = "") -> list[dict[str, Any]]:
        out = self.custom.list_namespaced_custom_object("kubeflow.org", "v1", self.ns, "pytorchjobs", label_selector=selector)
        return list(out["items"])

    def set_job_status(self, name: str, conditions: list[tuple[str, str, str]], **extra: Any) -> None:
        """Conditions as (type, reason, message), all True, like the training operator writes them."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = {
            "conditions": [
                {"type": t, "status": "True", "reason": r, "message": m, "lastUpdateTime": now, "lastTransitionTime": now}
                for t, r, m in conditions
            ],
            **extra,
        }
        self.custom.patch_namespaced_custom_object_status("kubeflow.org", "v1", self.ns, "pytorchjobs", name, {"status": status})

    def make_etcd_ready(self, name: str) -> None:
        self.apps.patch_namespaced_deployment_status(name, self.ns, {"status": {"readyReplicas": 1, "replicas": 1}})

    def create_pod(self, name: str, job: str, *, phase: str = "Running", ip: str = "127.0.0.1",
                   terminated_message: str | None = None, labels: dict[str, str] | None = None,
                   owner: dict[str, Any] | None = None) -> None:
        """A trainer pod of `job`; with `owner` (the job object) owned by it as the training
        operator's pods are, so that the garbage collector takes it with the job."""
        container: dict[str, Any] = {"name": "pytorch", "ready": phase == "Running", "restartCount": 0, "image": "x", "imageID": "x"}
        if terminated_message is not None:
            container["state"] = {"terminated": {"exitCode": 1, "message": terminated_message}}
        else:
            container["state"] = {"running": {}}
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": self.ns, "labels": {"training.kubeflow.org/job-name": job,
                                                                        "training.kubeflow.org/replica-index": name.rsplit("-", 1)[-1],
                                                                        **(labels or {})}},
            "spec": {"containers": [{"name": "pytorch", "image": "x"}]},
        }
        if owner is not None:
            pod["metadata"]["ownerReferences"] = [{
                "apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
        self.core.create_namespaced_pod(self.ns, pod)
        self.core.patch_namespaced_pod_status(name, self.ns, {"status": {"phase": phase, "podIP": ip, "containerStatuses": [container]}})

    def events(self, involved: str) -> list[dict[str, Any]]:
        out = self.core.list_namespaced_event(self.ns)
        plain = [self.api.sanitize_for_serialization(e) for e in out.items]
        return [e for e in plain if e.get("involvedObject", {}).get("name") == involved]

    def wait_reasons(self, involved: str, *reasons: str, timeout: float = 10) -> set[str]:
        """The event reasons of `involved` once they include `reasons`. kopf posts events from a
        background queue, so the status patch of the same handler can land before its events."""
        return wait_for(f"events {reasons} of {involved}",
                        lambda: (seen := {e["reason"] for e in self.events(involved)}) >= set(reasons) and seen, timeout=timeout)

    def exists(self, kind: str, name: str) -> bool:
        read = {"ConfigMap": self.core.read_namespaced_config_map, "Service": self.core.read_namespaced_service,
                "Deployment": self.apps.read_namespaced_deployment, "Pod": self.core.read_namespaced_pod}[kind]
        try:
            read(name, self.ns)
            return True
        except client.ApiException as exc:
            if exc.status == 404:
                return False
            raise


def close_rendezvous(endpoint: str, rdzv_id: str, backend: str = "etcd-v2") -> None:
    """Leave behind exactly what a finished torchrun job leaves: a closed rendezvous for the id."""
    from tests.trainer.conftest import trainer_env

    script = Path(tempfile.mkdtemp()) / "noop.py"
    script.write_text("import torch.distributed as d\nd.init_process_group('gloo')\nd.barrier()\nd.destroy_process_group()\n")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "1", "--rdzv_backend", backend,
         "--rdzv_endpoint", endpoint, "--rdzv_id", rdzv_id, "--max_restarts", "0", str(script)],
        env=trainer_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.fixture(scope="module")
@starts_processes
def etcd() -> Iterator[LocalEtcd]:
    """A real etcd (v2 API on) on loopback, for rendezvous resets and torchrun's etcd backends."""
    need_etcd()
    with LocalEtcd() as server:
        yield server


@pytest.fixture(scope="module")
def emulator() -> Iterator[EmulatorThread]:
    thread = EmulatorThread().start()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def kubeconfig(emulator: EmulatorThread, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_kubeconfig(emulator.url, tmp_path_factory.mktemp("kube") / "config")


@pytest.fixture(scope="module")
def cluster(emulator: EmulatorThread) -> Cluster:
    config = client.Configuration()
    config.host = emulator.url
    config.api_key = {"authorization": "Bearer kmock"}
    return Cluster(client.ApiClient(config))


def tiny_spec(**overrides: Any) -> dict[str, Any]:
    """A small spec; its checkpoints are on CHECKPOINT_CLAIM (mounted at /checkpoints/run), as the
    operator's admission requires of results that must outlive the pods."""
    spec: dict[str, Any] = {
        "model": {"source": "meta-llama/Llama-2-7b-hf"},
        "dataset": {"format": "samsum", "source": "knkarthick/samsum"},
        "checkpointing": {"volumeClaim": CHECKPOINT_CLAIM, "directory": "/checkpoints/run"},
        "cluster": {"workers": 2, "gpusPerWorker": 8},
        "rendezvous": {"backend": "c10d"},
    }
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)[:4000]


@contextlib.contextmanager
def own_emulator(tmp_path: Path, without: tuple[str, ...] = ()) -> Iterator[tuple[Cluster, Path]]:
    """A cluster of the test's own (serving all but `without`): its client and a kubeconfig for it."""
    emu = EmulatorThread(without=without).start()
    try:
        config = client.Configuration()
        config.host = emu.url
        yield Cluster(client.ApiClient(config)), write_kubeconfig(emu.url, tmp_path / "config")
    finally:
        emu.stop()


@contextlib.contextmanager
def own_cluster(tmp_path: Path, without: tuple[str, ...] = (), **env: str) -> Iterator[Cluster]:
    """own_emulator with an operator running on it."""
    with own_emulator(tmp_path, without) as (cluster, kubeconfig):
        op = Operator(kubeconfig, tmp_path / "operator.log", **env).start()
        try:
            yield cluster
        finally:
            op.stop()


@pytest.fixture(scope="module")
def etcd_operator(kubeconfig: Path, etcd: LocalEtcd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    """The operator on the module's emulator, reaching every managed etcd through the real local
    etcd (it runs outside the "cluster", as it would through a port-forward)."""
    op = Operator(kubeconfig, tmp_path_factory.mktemp("op") / "operator.log",
                  LLAMAFT_RENDEZVOUS_ADDRESS_OVERRIDE=etcd.endpoint).start()
    yield op
    op.stop()
