"""Rendezvous reset through etcd's v2 HTTP API: delete one run's state, never bounce etcd.

Key layouts (produced by real torchrun runs, torch 2.13):
  backend `etcd`:    /torchelastic/p2p/run_<id>/...            (one directory per run id)
  backend `etcd-v2`: /torch/elastic/rendezvous/<id>             (pickled state incl. `closed`)
                     /torch/elastic/store/<base64("torch.rendezvous.<id>.<n>/<key>")>
A run id whose state says closed fails every later join with RendezvousClosedError; deleting the
keys of that id (and only that id) makes it usable again without touching other jobs.
"""

from __future__ import annotations

import base64
import binascii
import urllib.parse
from typing import Any

from llamaft.api.spec import LlamaFineTuneSpec, RendezvousBackend
from llamaft.operator.http import HttpClient, HttpError
from llamaft.operator.operator_metrics import RENDEZVOUS_RESETS
from llamaft.operator.settings import OperatorSettings
from llamaft.render import desired
from llamaft.render.naming import Owner

ETCD_PREFIX = "/torchelastic/p2p"
ETCD_V2_STATE = "/torch/elastic/rendezvous"
ETCD_V2_STORE = "/torch/elastic/store"


class RendezvousResetError(RuntimeError):
    """etcd could not be reached or refused a delete; the caller retries later."""


class EtcdV2:
    """The few v2-API calls a reset needs, through the operator's HTTP client (llamaft.operator.http)."""

    def __init__(self, endpoint: str, http: HttpClient | None = None) -> None:
        self.base = f"http://{endpoint}/v2/keys"
        self.http = http or HttpClient()

    def _request(self, method: str, key: str, query: str = "") -> dict[str, Any] | None:
        url = f"{self.base}{urllib.parse.quote(key)}{query}"
        try:
            body = self.http.request(method, url, missing_ok=True)
        except HttpError as exc:
            if exc.status is None:
                raise RendezvousResetError(f"etcd at {self.base} unreachable: {exc}") from exc
            raise RendezvousResetError(f"etcd {method} {key}: {exc}") from exc
        # etcd answers every found key with a JSON document; 404 (None here) is "not there".
        return None if body is None else dict(body)

    def delete(self, key: str, recursive: bool = False) -> bool:
        """True when something was deleted."""
        return self._request("DELETE", key, "?recursive=true" if recursive else "") is not None

    def children(self, key: str) -> list[str]:
        body = self._request("GET", key)
        if body is None:
            return []
        return [str(node["key"]) for node in body.get("node", {}).get("nodes", [])]

    def exists(self, key: str) -> bool:
        return self._request("GET", key) is not None


def store_key_belongs_to(key: str, rdzv_id: str) -> bool:
    """Whether an etcd-v2 store key (base64 of "torch.rendezvous.<id>.<n>/<key>") is this run's."""
    name = key.rsplit("/", 1)[-1]
    try:
        decoded = base64.b64decode(name, validate=True).decode("utf-8", errors="replace")
    except (binascii.Error, ValueError):
        return False
    return decoded.startswith(f"torch.rendezvous.{rdzv_id}.")


def reset(endpoint: str, backend: RendezvousBackend, rdzv_id: str, http: HttpClient | None = None) -> list[str]:
    """Delete every key of run `rdzv_id`; returns what was deleted (empty: nothing was there)."""
    if backend is RendezvousBackend.C10D:
        return []
    etcd = EtcdV2(endpoint, http)
    deleted: list[str] = []
    if backend is RendezvousBackend.ETCD:
        key = f"{ETCD_PREFIX}/run_{rdzv_id}"
        if etcd.delete(key, recursive=True):
            deleted.append(key)
        return deleted
    state = f"{ETCD_V2_STATE}/{rdzv_id}"
    if etcd.delete(state):
        deleted.append(state)
    for key in etcd.children(ETCD_V2_STORE):
        if store_key_belongs_to(key, rdzv_id) and etcd.delete(key, recursive=True):
            deleted.append(key)
    return deleted


def reset_attempts(settings: OperatorSettings, http: HttpClient | None, owner: Owner, spec: LlamaFineTuneSpec, attempts: list[int],
                     announce: Any) -> None:
    """Remove the rendezvous state of the given attempts' ids (never by restarting etcd)."""
    if spec.rendezvous.backend is RendezvousBackend.C10D or not attempts:
        return
    host, port = desired.rendezvous_endpoint(owner, spec, attempts[-1])
    address = settings.rendezvous_address_override or f"{host}:{port}"
    for attempt in attempts:
        rdzv_id = owner.rendezvous_id(attempt)
        try:
            deleted = reset(address, spec.rendezvous.backend, rdzv_id, http)
        except RendezvousResetError:
            RENDEZVOUS_RESETS.labels("error").inc()
            raise
        RENDEZVOUS_RESETS.labels("deleted" if deleted else "clean").inc()
        if deleted:
            announce("RendezvousReset", f"removed stale state of rendezvous {rdzv_id}: {len(deleted)} key(s)")
