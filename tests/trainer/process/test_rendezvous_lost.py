"""etcd lost mid-run: torchrun's agent fails with RendezvousConnectionError and SIGTERMs its workers.
The workers' report must say so (RendezvousLost), not Preempted: `restarts.rendezvous_lost` tries the
agent's store when a SIGTERM stopped the run."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
from llamaft_trainer.process import restarts, termination


def _params(endpoint: str, backend: str = "etcd") -> SimpleNamespace:
    return SimpleNamespace(endpoint=endpoint, backend=backend, run_id="r")


@pytest.fixture
def torchrun(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
    return monkeypatch


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once it is closed: connections are refused


def test_an_unreachable_store_is_a_lost_rendezvous(torchrun: pytest.MonkeyPatch) -> None:
    port = _closed_port()
    torchrun.setattr(restarts, "rendezvous_parameters", lambda timeout_s: (_params(f"http://127.0.0.1:{port}"), ""))
    why = restarts.rendezvous_lost(0.5)
    assert why is not None and f"etcd at 127.0.0.1:{port}" in why and "RendezvousConnectionError" in why


def test_a_store_that_answers_is_a_preemption(torchrun: pytest.MonkeyPatch) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        torchrun.setattr(restarts, "rendezvous_parameters", lambda timeout_s: (_params(f"127.0.0.1:{port}"), ""))
        assert restarts.rendezvous_lost(0.5) is None


def test_nothing_to_try(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert restarts.rendezvous_lost(0.5) is None  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
    monkeypatch.setattr(restarts, "rendezvous_parameters", lambda timeout_s: (None, "torchrun --standalone"))
    assert restarts.rendezvous_lost(0.5) is None

    def broken(timeout_s: float) -> None:
        raise RuntimeError("cannot parse")

    monkeypatch.setattr(restarts, "rendezvous_parameters", broken)
    assert restarts.rendezvous_lost(0.5) is None  # the stop path never fails


def test_a_lost_rendezvous_outranks_a_preemption_in_the_shared_message() -> None:
    assert termination.PRECEDENCE[termination.RENDEZVOUS_LOST] > termination.PRECEDENCE[termination.PREEMPTED]
    assert termination.exit_code(termination.RENDEZVOUS_LOST) == termination.exit_code(termination.PREEMPTED) == 143
