"""kube.py: the client's credential refresh, at most once per interval."""

from __future__ import annotations

from typing import Any

from llamaft.operator.kube import refresh_at_most_every


def test_the_refresh_hook_runs_at_most_once_per_interval() -> None:
    now = [100.0]
    calls: list[Any] = []
    refresh = refresh_at_most_every(30.0, calls.append, clock=lambda: now[0])
    assert refresh is not None
    for t in (100.0, 100.5, 129.9):
        now[0] = t
        refresh("config")
    assert len(calls) == 1, "the first request refreshes, the next ones within 30 s do not"
    now[0] = 130.0
    refresh("config")
    assert calls == ["config", "config"], "a request after the interval refreshes again"
    assert refresh_at_most_every(30.0, None) is None, "no hook (a static token): nothing to wrap"
