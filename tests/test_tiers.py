"""tests/tiers.py: what counts as a real process, how a test is found to start one, the guard."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from tests import tiers
from tests.tiers import starts_processes


@pytest.mark.parametrize(("argv", "what"), [
    ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "x.py"], "-m torch.distributed.run"),
    (["/usr/bin/torchrun", "x.py"], "/usr/bin/torchrun"),
    ([sys.executable, "-u", "/repo/tests/trainer/harness.py", "cases.json"], "/repo/tests/trainer/harness.py"),
    ([sys.executable, "-m", "llamaft_trainer", "--config", "c.json"], "-m llamaft_trainer"),
    (["/usr/bin/etcd", "--data-dir", "d"], "/usr/bin/etcd"),
    (["prometheus", "--config.file", "p.yml"], "prometheus"),
    (["mlflow", "server"], "mlflow"),
    ([".venv/bin/llamaft", "run", "--local", "examples/tiny.yaml"], "llamaft run --local"),
    ("kopf run --standalone -m llamaft.operator.handlers", "kopf"),
    ([".venv/bin/llamaft", "validate", "examples/tiny.yaml"], None),
    (["promtool", "check", "rules", "r.yml"], None),
    (["git", "init"], None),
    (["helm", "template", "chart"], None),
    ([sys.executable, "-c", "import llamaft"], None),
])
def test_real_processes_are_told_from_quick_tools(argv: Any, what: str | None) -> None:
    assert tiers.real_process(argv) == what


@starts_processes
def _launches() -> None:
    subprocess.run(["torchrun"], check=False)


def _calls_a_launcher() -> None:
    _launches()


def _quick() -> int:
    return len("nothing started")


def _test_through_a_helper() -> None:
    _calls_a_launcher()


def _test_in_a_closure() -> None:
    def inner() -> None:
        _launches()
    inner()


def _test_quick() -> None:
    _quick()


def _test_writes_out_a_launch() -> None:
    subprocess.run([sys.executable, "-m", "llamaft_trainer", "--config", "c.json"], check=False)


def _test_runs_a_bench_script() -> None:
    subprocess.run([sys.executable, "bench/gpu_suite.py", "--cpu-smoke"], check=False)


def _test_runs_locally() -> None:
    subprocess.run(["llamaft", "run", "--local", "spec.yaml"], check=False)


def _test_validates() -> None:
    subprocess.run(["llamaft", "validate", "spec.yaml"], check=False)


def _test_compares_a_rendered_command() -> None:
    assert ["torchrun", "-m", "llamaft_trainer"] == ["torchrun", "-m", "llamaft_trainer"]


@contextlib.contextmanager
def _cluster() -> Iterator[None]:
    _launches()
    yield


def _test_through_a_context_manager() -> None:
    with _cluster():
        pass


# Reached through a dict: a test naming these functions would itself be found slow by the walk.
FAKE = {f.__name__: f for f in (_launches, _calls_a_launcher, _quick, _test_through_a_helper, _test_in_a_closure,
                                _test_quick, _test_writes_out_a_launch, _test_runs_a_bench_script,
                                _test_compares_a_rendered_command, _test_through_a_context_manager,
                                _test_runs_locally, _test_validates)}


def _item(function: Any, fixtures: dict[str, Any] | None = None, marked: bool = False) -> Any:
    defs = {name: [SimpleNamespace(func=func)] for name, func in (fixtures or {}).items()}
    return SimpleNamespace(function=function, _fixtureinfo=SimpleNamespace(name2fixturedefs=defs),
                           nodeid=f"t::{function.__name__}",
                           get_closest_marker=lambda name: object() if marked and name == "slow" else None)


def test_a_test_is_slow_through_the_helpers_and_fixtures_it_names() -> None:
    assert tiers.why_slow(_item(FAKE["_test_through_a_helper"])) == "_calls_a_launcher -> _launches"
    assert tiers.why_slow(_item(FAKE["_test_in_a_closure"])) == "_launches"
    assert tiers.why_slow(_item(FAKE["_test_quick"])) is None
    assert tiers.why_slow(_item(FAKE["_test_quick"], {"server": FAKE["_launches"]})) == "fixture _launches"
    assert tiers.why_slow(_item(FAKE["_test_quick"], {"wrapper": FAKE["_calls_a_launcher"]})) == \
        "fixture _calls_a_launcher -> _launches"
    assert tiers.why_slow(_item(FAKE["_test_quick"], {"plain": FAKE["_quick"]})) is None


def test_a_launch_written_out_in_the_test_makes_it_slow() -> None:
    assert tiers.why_slow(_item(FAKE["_test_writes_out_a_launch"])) == "-m llamaft_trainer"
    assert tiers.why_slow(_item(FAKE["_test_runs_a_bench_script"])) == "gpu_suite.py"
    assert tiers.why_slow(_item(FAKE["_test_compares_a_rendered_command"])) is None
    assert tiers.why_slow(_item(FAKE["_test_runs_locally"])) == "llamaft run/sweep --local"
    assert tiers.why_slow(_item(FAKE["_test_validates"])) is None


def test_a_decorated_helper_is_followed_to_its_own_code() -> None:
    """contextmanager's wrapper has code of its own: the walk reads the function it wraps."""
    assert tiers.why_slow(_item(FAKE["_test_through_a_context_manager"])) == "_cluster -> _launches"


def test_the_guard_records_real_processes_of_unit_tier_tests_only() -> None:
    guard = tiers.Tiers()
    guard.current = _item(FAKE["_test_quick"])
    guard.check(["git", "status"])
    assert guard.started == {}
    guard.check(["torchrun", "x.py"])
    assert guard.started == {"t::_test_quick": ["torchrun"]}
    guard.current = _item(FAKE["_test_through_a_helper"], marked=True)
    guard.check(["torchrun", "x.py"])
    assert list(guard.started) == ["t::_test_quick"]


def test_the_guard_is_on_in_this_run() -> None:
    """conftest registers the guard: Popen goes through its check."""
    assert subprocess.Popen.__init__.__name__ == "checked_init"
