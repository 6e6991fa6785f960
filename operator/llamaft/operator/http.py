"""The operator's one HTTP client for what is not the Kubernetes API: etcd's v2 keys API
(rendezvous resets), Prometheus queries (GPU health) and the trainer leader's /progress.

urllib3 (already installed as the kubernetes client's transport, well kept) does the work: one
connection pool for all three, a timeout on every call, bounded retries with backoff on connection
errors and on 502/503/504 for idempotent methods, and one error type (`HttpError`) that callers
map to their own meaning. It lives in the operator's memo (startup.configure), not in a module
global.
"""

from __future__ import annotations

import json
from typing import Any

import urllib3
from urllib3.util import Retry, Timeout

IDEMPOTENT = frozenset({"GET", "HEAD", "DELETE", "PUT", "OPTIONS"})


class HttpError(RuntimeError):
    """A request that did not end in a 2xx answer: `status` is the HTTP status, or None when the
    server was unreachable (connection refused, timeout, DNS)."""

    def __init__(self, method: str, url: str, status: int | None, detail: str) -> None:
        self.method, self.url, self.status = method, url, status
        super().__init__(f"{method} {url}: " + (f"HTTP {status} {detail}" if status is not None else detail))


class HttpClient:
    def __init__(self, timeout_s: float = 5.0, retries: int = 2, backoff_s: float = 0.2) -> None:
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.pool = urllib3.PoolManager(num_pools=64, maxsize=4, block=False)

    def _retry(self, retries: int) -> Retry:
        return Retry(total=retries, connect=retries, read=0, status=retries, backoff_factor=self.backoff_s,
                     status_forcelist=(502, 503, 504), allowed_methods=IDEMPOTENT, raise_on_status=False,
                     redirect=0)

    def request(self, method: str, url: str, *, fields: dict[str, str] | None = None, timeout_s: float | None = None,
                retries: int | None = None, missing_ok: bool = False) -> Any:
        """The decoded JSON body (None for an empty body, or for a 404 with missing_ok)."""
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        try:
            resp = self.pool.request(method, url, fields=fields, timeout=Timeout(connect=timeout, read=timeout),
                                     retries=self._retry(self.retries if retries is None else retries))
        except urllib3.exceptions.HTTPError as exc:  # connection refused, timeouts, retries used up
            raise HttpError(method, url, None, f"unreachable: {exc}") from exc
        if resp.status == 404 and missing_ok:
            return None
        if not 200 <= resp.status < 300:
            raise HttpError(method, url, resp.status, resp.data[:200].decode(errors="replace"))
        if not resp.data:
            return None
        try:
            return json.loads(resp.data)
        except ValueError as exc:
            raise HttpError(method, url, resp.status, f"not JSON: {resp.data[:100]!r}") from exc

    def get_json(self, url: str, **kwargs: Any) -> Any:
        return self.request("GET", url, **kwargs)
