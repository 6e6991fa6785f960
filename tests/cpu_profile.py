"""`pytest --cpu-profile DIR`: each test's wall time and CPU time, for finding where the suite's time goes.

CPU time is the worker's own (the in-process emulator, sim and servers' threads) plus that of its
children reaped during the test: torchrun agents, trainers and CLI runs, which are reaped by their
parents before the test ends. Servers a fixture keeps for a module or session are counted when they
stop. Each xdist worker writes DIR/<worker>.json; `python bench/suite_cpu.py DIR` sums them per file.
Off unless asked for: it changes nothing in what a test does.
"""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest


def cpu_seconds() -> tuple[float, float]:
    """(this process, its reaped children): user + system seconds."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


class CpuProfile:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.rows: list[dict[str, Any]] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
        started, (own, children) = time.monotonic(), cpu_seconds()
        yield
        own_after, children_after = cpu_seconds()
        self.rows.append({"id": item.nodeid, "wall": time.monotonic() - started,
                          "self": own_after - own, "children": children_after - children,
                          "tier": "slow" if item.get_closest_marker("slow") else "unit"})

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.rows:
            return  # xdist's controller runs no test itself
        self.directory.mkdir(parents=True, exist_ok=True)
        # xdist's own worker id: PYTEST_XDIST_WORKER is inherited by any pytest a test starts.
        worker = getattr(session.config, "workerinput", {}).get("workerid", "main")
        (self.directory / f"{worker}.json").write_text(json.dumps(self.rows))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-profile", metavar="DIR", default=None,
                     help="write each test's wall and CPU seconds to DIR/<worker>.json (bench/suite_cpu.py sums them)")


def pytest_configure(config: pytest.Config) -> None:
    directory = config.getoption("--cpu-profile", default=None)
    if directory:
        config.pluginmanager.register(CpuProfile(Path(directory)), "llamaft-cpu-profile")
