"""The emulator's watches behave as the API server's where kopf depends on it: nothing written
while a watch starts is lost (kopf re-watches a stream silent for 70 s; an event missed then is a
LlamaFineTune never reconciled), and quiet streams get BOOKMARKs."""

from __future__ import annotations

import json
import time
from typing import Any

import urllib3

from tests.operator.emulator import EmulatorThread

CM = "/api/v1/namespaces/default/configmaps"


def create(http: urllib3.PoolManager, url: str, name: str, size: int = 200) -> None:
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"x": "y" * size}}
    response = http.request("POST", url + CM, body=json.dumps(body), headers={"Content-Type": "application/json"})
    assert response.status == 201, response.data


def events(response: Any, until: float) -> Any:
    buffer = b""
    while time.monotonic() < until:
        chunk = response.read1(65536) if hasattr(response, "read1") else response.read(65536)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)


def test_objects_created_while_a_watch_starts_are_all_delivered() -> None:
    """The watch's replay of what exists (16 MB here) fills the socket while this client does not
    read yet, so the emulator is still writing it when the new objects are created."""
    emulator = EmulatorThread()
    emulator.start()
    http = urllib3.PoolManager(maxsize=4)
    try:
        for i in range(160):
            create(http, emulator.url, f"old-{i}", size=100_000)
        response = http.request("GET", emulator.url + CM + "?watch=true", preload_content=False, timeout=urllib3.Timeout(read=10))
        fresh = [f"new-{i}" for i in range(20)]
        for name in fresh:
            create(http, emulator.url, name)
        seen: set[str] = set()
        for event in events(response, time.monotonic() + 30):
            seen.add(event["object"]["metadata"]["name"])
            if set(fresh) <= seen:
                break
        response.close()
        assert set(fresh) <= seen, f"lost: {sorted(set(fresh) - seen)}"
        assert {f"old-{i}" for i in range(160)} <= seen
    finally:
        http.clear()
        emulator.stop()


def test_a_quiet_watch_with_bookmarks_gets_them_and_one_without_does_not() -> None:
    emulator = EmulatorThread().start()
    assert emulator.emulator is not None
    emulator.emulator.bookmark_period = 0.3
    http = urllib3.PoolManager()
    try:
        create(http, emulator.url, "a")
        response = http.request("GET", emulator.url + CM + "?watch=true&allowWatchBookmarks=true&resourceVersion=1",
                                preload_content=False, timeout=urllib3.Timeout(read=5))
        got = []
        for event in events(response, time.monotonic() + 5):
            got.append(event)
            if event["type"] == "BOOKMARK":
                break
        response.close()
        assert [e["type"] for e in got] == ["ADDED", "BOOKMARK"]
        assert got[1]["object"]["kind"] == "ConfigMap" and int(got[1]["object"]["metadata"]["resourceVersion"]) >= 2
        plain = http.request("GET", emulator.url + CM + "?watch=true", preload_content=False, timeout=urllib3.Timeout(read=1.5))
        types = []
        try:
            for event in events(plain, time.monotonic() + 1.2):
                types.append(event["type"])
        except urllib3.exceptions.ReadTimeoutError:
            pass
        plain.close()
        assert types == ["ADDED"]
    finally:
        http.clear()
        emulator.stop()
