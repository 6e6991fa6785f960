"""Shared fixtures: repository paths and small helpers used across the suites."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
# Upstream schemas (Kubeflow, Prometheus Operator, dcgm-exporter) vendored unmodified; see SOURCES.md.
REFERENCE = REPO / "tests" / "fixtures" / "upstream"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Llama + trained tokenizer, saved with save_pretrained (built once)."""
    from llamaft_trainer.tiny import build_tiny_llama

    # Small enough that a 2-process CPU step takes milliseconds.
    dataset = REPO / "examples" / "data" / "samsum-tiny.jsonl"
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", dataset, hidden_size=64, layers=4, vocab_size=512)


def need_binary(name: str, package: str) -> str:
    """The path of a Debian-provided server/tool. Skips on a developer machine without it; fails in
    CI, whose .ci/setup installs it (a silently skipped suite would look green)."""
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide {name} (.ci/setup installs {package})")
        pytest.skip(f"{name} is not installed (apt-get install {package})")
    return found


def need_etcd() -> str:
    return need_binary("etcd", "etcd-server")


# `--cpu-profile DIR`: each test's wall and CPU seconds (tests/cpu_profile.py, bench/suite_cpu.py);
# the Hugging Face Hub API server on loopback (tests/hub): `hub_server` (session) and `hub_env`.
from tests import cpu_profile, tiers  # noqa: E402
from tests.cpu_profile import pytest_addoption  # noqa: E402, F401
from tests.hub.fixture import hub_env, hub_server  # noqa: E402, F401


def pytest_configure(config: pytest.Config) -> None:
    cpu_profile.pytest_configure(config)
    tiers.register(config)  # the slow tier, marked by what starts processes (tests/tiers.py)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The control plane's tests run last. `.ci/run` builds their binaries beside the tests (on a
    fresh machine a cold build takes a quarter of an hour of both cores), and a test that needs
    them waits for that build on its lock: run first, the wait would count against the test's
    timeout (pytest-timeout times fixtures too); run last, the build is done by then."""
    items.sort(key=lambda item: item.nodeid.startswith("tests/controlplane/"))


@pytest.fixture
def served_progress(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, str]]:
    """The trainer's real metrics.ProgressPublisher serving on a local port: (progress, base URL); its
    /progress is the operator's contract, its /metrics Prometheus' exposition."""
    from llamaft_trainer.report.metrics import ProgressPublisher

    monkeypatch.setenv("LLAMAFT_METRICS_HOST", "127.0.0.1")
    progress = ProgressPublisher()
    server = progress.serve(0)
    try:
        yield progress, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
