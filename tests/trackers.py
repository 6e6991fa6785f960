"""Real experiment trackers for the tests: an `mlflow server` on loopback (sqlite store, its own
folder) and readers for what TensorBoard and W&B (offline) wrote, through their own libraries."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llamaft_trainer.process.local_etcd import free_port, parent_death_signal

from tests.conftest import REPO
from tests.tiers import starts_processes

START_TIMEOUT_S = 120
"""A cold `mlflow server` creates its sqlite schema (alembic migrations) before it answers."""


def need_mlflow() -> str:
    """The `mlflow` command of the server's own venv (.ci/setup makes it), else one on PATH;
    skipped without one on a developer machine, a failure in CI."""
    own = REPO / ".venv-mlflow" / "bin" / "mlflow"
    found = str(own) if own.exists() else shutil.which("mlflow")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("CI must provide the MLflow server (.ci/setup installs it into .venv-mlflow)")
        pytest.skip("no MLflow server: run .ci/setup (it installs one into .venv-mlflow)")
    return found


@starts_processes
class MlflowServer:
    """`mlflow server` on 127.0.0.1; `stop()` kills it (a tracker that disappears), `start()`
    brings it back on the same port and store."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> MlflowServer:
        mlflow = need_mlflow()
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(
            [mlflow, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--default-artifact-root", (self.root / "artifacts").as_uri()],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True,
            preexec_fn=parent_death_signal(),
            env={**os.environ, "MLFLOW_TRACKING_URI": "", "PYTHONDONTWRITEBYTECODE": ""},
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self.proc.returncode}: {(self.root / 'server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.3)
        raise RuntimeError(f"mlflow server did not answer in {START_TIMEOUT_S} s: {(self.root / 'server.log').read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its uvicorn/gunicorn workers
            self.proc.wait(30)
        self.proc = None

    # ------------------------------------------------------------------- the REST API, read back
    def get(self, path: str, **query: Any) -> Any:
        url = f"{self.url}/api/2.0/mlflow/{path}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(f"{self.url}/api/2.0/mlflow/{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())

    def runs(self, experiment: str) -> list[dict[str, Any]]:
        found = self.get("experiments/get-by-name", experiment_name=experiment)["experiment"]
        return list(self.post("runs/search", {"experiment_ids": [found["experiment_id"]]}).get("runs", []))

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        metrics = self.get("metrics/get-history", run_id=run_id, metric_key=key).get("metrics", [])
        return sorted((int(m.get("step", 0)), float(m["value"])) for m in metrics)


class Gate:
    """A TCP forwarder to a server on loopback: clients talk to `url`; `close()` refuses every
    new connection and cuts the open ones, so the server disappears for them while it keeps what
    it took (the test reads that back directly)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.open = True
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while self.open:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            except OSError:
                client.close()
                continue
            with self.lock:
                if not self.open:
                    client.close()
                    upstream.close()
                    return
                self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        with self.lock:
            self.open = False
            self.listener.close()
            for s in self.sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard shows: its own event reader over the directory (purged steps dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path: Path) -> Iterator[bytes]:
    """The records of a `.wandb` file: W&B's transaction log, LevelDB's log format (32 KiB
    blocks; records FULL or cut into FIRST, MIDDLE, LAST) after a 7-byte `:W&B` header."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left  # a block's tail too short for a header is padding
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def wandb_offline_runs(directory: Path) -> list[dict[str, Any]]:
    """Every offline run under `directory` (what `wandb sync` would upload), its records parsed
    with W&B's own protobuf schema: its id, config and history rows (step -> values)."""
    from wandb.proto import wandb_internal_pb2

    def key(item: Any) -> str:
        return item.key or "/".join(item.nested_key)

    runs = []
    for path in sorted(directory.rglob("run-*.wandb")):
        run: dict[str, Any] = {"path": str(path), "id": None, "config": {}, "history": {}}
        for data in wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                for item in record.run.config.update:
                    run["config"][key(item)] = json.loads(item.value_json)
            elif kind == "config":
                for item in record.config.update:
                    run["config"][key(item)] = json.loads(item.value_json)
            elif kind == "history":
                row = {key(item): json.loads(item.value_json) for item in record.history.item}
                step = int(record.history.step.num) if record.history.HasField("step") else int(row.get("_step", -1))
                run["history"].setdefault(step, {}).update({k: v for k, v in row.items() if not k.startswith("_")})
        runs.append(run)
    return runs
