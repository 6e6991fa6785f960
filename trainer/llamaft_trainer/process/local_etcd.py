"""A throw-away etcd (v2 API on) on loopback, for `llamaft run --local` and the tests.

torchrun's `etcd` and `etcd-v2` rendezvous backends speak etcd's v2 API, so it runs with
`--enable-v2` (etcd 3.4/3.5; Debian's etcd-server package).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

PR_SET_PDEATHSIG = 1


def parent_death_signal(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A Popen preexec_fn: the child gets `signum` when this process dies (Linux prctl
    PR_SET_PDEATHSIG), so a killed `llamaft run --local` leaves no etcd or torchrun agent behind.
    None where there is no prctl."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: the signal would never come
            os.kill(os.getpid(), int(signum))

    return preexec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PortTaken(RuntimeError):
    """etcd could not bind a port it was given: another process has it."""


class LocalEtcd:
    """`with LocalEtcd() as etcd: etcd.endpoint` -> "127.0.0.1:<port>"."""

    def __init__(self, binary: str | None = None) -> None:
        found = binary or shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
        if found is None:
            raise RuntimeError(
                "rendezvous backend etcd/etcd-v2 needs an etcd server: install one "
                "(Debian: apt-get install etcd-server), set spec.rendezvous.endpoint, or use backend c10d"
            )
        self.binary = found
        self.client_port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self._dir = tempfile.TemporaryDirectory(prefix="llamaft-etcd-")
        self._proc: subprocess.Popen[bytes] | None = None

    PORT_TRIES = 5
    """Starts on fresh ports after etcd found one taken: `free_port` learns a port is free and lets
    go of it before etcd binds it, and another process may bind it in between."""

    def start(self, timeout_s: float = 30.0) -> LocalEtcd:
        for _ in range(self.PORT_TRIES - 1):
            try:
                return self._start(timeout_s)
            except PortTaken:
                self.client_port, self.peer_port = free_port(), free_port()
                self.endpoint = f"127.0.0.1:{self.client_port}"
        return self._start(timeout_s)

    def _start(self, timeout_s: float) -> LocalEtcd:
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self.log_path = Path(self._dir.name) / "etcd.log"
        shutil.rmtree(Path(self._dir.name) / "data", ignore_errors=True)  # a try that lost its port leaves one
        self._proc = subprocess.Popen(
            [
                self.binary, "--name", "default", "--data-dir", str(Path(self._dir.name) / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"default={peer}", "--enable-v2",
            ],
            stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT, preexec_fn=parent_death_signal(),
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                log = self.log_path.read_text()[-2000:]
                if "address already in use" in log:
                    raise PortTaken(log)
                raise RuntimeError(f"etcd exited: {log}")
            try:
                if self._serves(client, peer):
                    return self
            except OSError:
                time.sleep(0.2)
            except PortTaken:
                self._terminate()
                raise
        self.stop()
        raise RuntimeError(f"etcd did not answer on {client} within {timeout_s:.0f}s")

    @staticmethod
    def _serves(client: str, peer: str) -> bool:
        """Whether the etcd on `client` is this one (its member's peer URL is `peer`: another
        process's etcd on a port taken in between is not) and serves the v2 keys API."""
        with urllib.request.urlopen(f"{client}/v2/members", timeout=1) as resp:
            try:
                members = json.load(resp).get("members") or []
            except ValueError as exc:
                raise PortTaken(f"{client} answers, but not as etcd") from exc
        if not any(peer in (member.get("peerURLs") or []) for member in members):
            raise PortTaken(f"another etcd answers on {client}: {members}")
        with urllib.request.urlopen(f"{client}/v2/keys/", timeout=1) as resp:
            return bool(resp.status == 200)

    def _terminate(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()

    def stop(self) -> None:
        self._terminate()
        self._dir.cleanup()

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]) -> None:
        self.stop()
