"""The operator's one HTTP client (llamaft.operator.http) against a local server: JSON bodies,
404 as "missing", retries on 503 for idempotent methods only, a timeout that holds, and one error
type with the status (None when unreachable)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from llamaft.operator.http import HttpClient, HttpError


class Handler(BaseHTTPRequestHandler):
    calls: list[tuple[str, str]] = []
    unavailable_left = 0

    def _answer(self) -> None:
        Handler.calls.append((self.command, self.path))
        if self.path.startswith("/flaky") and Handler.unavailable_left > 0:
            Handler.unavailable_left -= 1
            self.send_response(503)
            self.end_headers()
            return
        if self.path.startswith("/missing"):
            self.send_response(404)
            self.end_headers()
            return
        if self.path.startswith("/slow"):
            time.sleep(2)
        body = json.dumps({"path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_DELETE = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Handler.calls = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_json_query_and_missing(server: str) -> None:
    http = HttpClient()
    assert http.get_json(f"{server}/api/v1/query", fields={"query": 'up{job="a b"}'}) == \
        {"path": "/api/v1/query?query=up%7Bjob%3D%22a+b%22%7D"}
    assert http.request("DELETE", f"{server}/missing/key", missing_ok=True) is None
    with pytest.raises(HttpError) as info:
        http.get_json(f"{server}/missing/key")
    assert info.value.status == 404


def test_idempotent_requests_are_retried_on_503_others_are_not(server: str) -> None:
    http = HttpClient(retries=2, backoff_s=0.01)
    Handler.unavailable_left = 2
    assert http.request("DELETE", f"{server}/flaky/key") == {"path": "/flaky/key"}
    assert [c for c in Handler.calls if c[1] == "/flaky/key"] == [("DELETE", "/flaky/key")] * 3
    Handler.unavailable_left = 1
    with pytest.raises(HttpError) as info:
        http.request("POST", f"{server}/flaky/post")
    assert info.value.status == 503, "a POST is not repeated"


def test_timeouts_and_unreachable_servers_are_errors_without_status(server: str) -> None:
    http = HttpClient(timeout_s=0.3, retries=0)
    started = time.monotonic()
    with pytest.raises(HttpError) as info:
        http.get_json(f"{server}/slow")
    assert info.value.status is None and time.monotonic() - started < 1.5
    with pytest.raises(HttpError) as info:
        http.get_json("http://127.0.0.1:1/nothing")
    assert info.value.status is None and "unreachable" in str(info.value)
