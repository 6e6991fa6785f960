"""LocalEtcd (`llamaft run --local`'s and the tests' rendezvous server) against ports taken
between `free_port` and etcd's bind: a real etcd each time."""

from __future__ import annotations

import json
import socket
import urllib.request

from llamaft_trainer.process.local_etcd import LocalEtcd

from tests.tiers import starts_processes


@starts_processes
def local_etcd() -> LocalEtcd:
    """A LocalEtcd (not started: its ports are picked, its server starts on `with`)."""
    return LocalEtcd()


def members(endpoint: str) -> list[dict[str, object]]:
    with urllib.request.urlopen(f"http://{endpoint}/v2/members", timeout=5) as resp:
        return list(json.load(resp)["members"])


def test_a_client_port_taken_in_between_moves_etcd_to_fresh_ports() -> None:
    etcd = local_etcd()
    taken = etcd.client_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with etcd:
            assert etcd.client_port != taken and etcd.endpoint == f"127.0.0.1:{etcd.client_port}"
            assert [m["peerURLs"] for m in members(etcd.endpoint)] == [[f"http://127.0.0.1:{etcd.peer_port}"]]


def test_another_etcd_on_the_port_is_not_taken_for_this_one() -> None:
    with local_etcd() as first:
        second = local_etcd()
        second.client_port, second.endpoint = first.client_port, first.endpoint  # as if free_port raced
        with second:
            assert second.endpoint != first.endpoint
            ours = members(second.endpoint)
            assert [m["peerURLs"] for m in ours] == [[f"http://127.0.0.1:{second.peer_port}"]]
            assert members(first.endpoint) != ours, "the first etcd is untouched and still its own"
