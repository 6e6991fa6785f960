"""The two test tiers: `slow` (a test that starts a real process) and the unit tier (the rest).

`bash .ci/run --fast` runs the unit tier; `bash .ci/run` runs both and is the CI gate.

Nobody marks a test `slow` by hand for what it starts. The helpers and fixtures that start real
processes (torchrun, the trainer, `llamaft run --local`, the kopf operator, etcd, Prometheus,
MLflow, the Hub server, a simulated cluster whose pods run the trainer) carry `@starts_processes`;
at collection a test is marked `slow` when its body, its fixtures, or any test-suite function they
name (followed through the functions they name in turn) refers to one, or when that code writes out
a launch of the trainer or torchrun itself (`"-m", "llamaft_trainer"`, or `llamaft run --local` as a
subprocess; called in-process, the CLI may refuse before torchrun starts, so such tests say so by
hand). A class carries the mark for its constructor.

The walk reads names, not calls made through objects, so a guard backs it: every process start is
checked against what it runs, and a test in the unit tier that starts one of the real processes
fails, naming the command and the remedy. The guard runs in both tiers, so the full run in CI
also fails a test that would slip into the fast tier.
"""

from __future__ import annotations

import inspect
import subprocess
import threading
import types
from collections.abc import Callable, Generator, Iterable
from typing import Any, TypeVar

import pytest

F = TypeVar("F", bound=Callable[..., Any])

MARK = "_llamaft_starts_processes"
SLOW = "slow"

# What a real process of the slow tier runs: an argv element equal to, or ending in, one of these.
REAL_PROGRAMS = ("torchrun", "etcd", "prometheus", "mlflow", "olah", "olah-cli", "kopf",
                 "kube-apiserver", "kube-controller-manager", "kube-scheduler")
REAL_MODULES = ("torch.distributed.run", "llamaft_trainer", "llamaft_trainer.main", "mlflow", "kopf")
REAL_SCRIPTS = (
    "harness.py", "load_worker.py",
    # bench/ scripts that start trainers, torchrun, the operator or etcd themselves: the guard sees
    # only the processes a test starts, not theirs.
    "gpu_suite.py", "peers.py", "plan_accuracy.py", "cpu_scaling.py", "recovery.py", "checkpoint_stall.py",
    "data_scale.py", "load_memory.py", "operator_latency.py", "stress_exit.py",
)
LAUNCHED_MODULES = ("torch.distributed.run", "llamaft_trainer", "llamaft_trainer.main")
LAUNCHERS = {"subprocess", "Popen", "create_subprocess_exec"}
"""Code that names a launcher and `"-m"` with one of LAUNCHED_MODULES, or one of REAL_SCRIPTS,
writes out a launch itself (a rendered command compared in a test names no launcher)."""


def starts_processes(obj: F) -> F:
    """Mark a helper, fixture function or class as one that starts real processes (see module doc)."""
    setattr(obj, MARK, True)
    return obj


def real_process(argv: Any) -> str | None:
    """The part of `argv` that makes it a slow-tier process, or None for a quick tool (helm,
    promtool, git, a `llamaft validate`)."""
    if isinstance(argv, (str, bytes)):
        words = [argv.decode() if isinstance(argv, bytes) else argv]
        words = words[0].split()
    else:
        words = [a.decode() if isinstance(a, bytes) else str(a) for a in argv]
    for i, word in enumerate(words):
        base = word.rsplit("/", 1)[-1]
        if base in REAL_PROGRAMS or base in REAL_SCRIPTS:
            return word
        if word == "-m" and i + 1 < len(words) and words[i + 1] in REAL_MODULES:
            return f"-m {words[i + 1]}"
        if base == "llamaft" and words[i + 1:i + 2] == ["run"] and "--local" in words:
            return "llamaft run --local"
    return None


# ---------------------------------------------------------------------------- collection
def _names_marked(fn: Callable[..., Any], seen: set[int]) -> str | None:
    """The first marked object `fn` refers to by name, following test-suite functions it names
    (through decorators such as contextmanager, by __wrapped__), or the module it runs with `-m`."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None or id(code) in seen:
        return None
    seen.add(id(code))
    globals_ = getattr(fn, "__globals__", {})
    for c in _codes(code):
        strings = list(_strings(c.co_consts))
        scripts = [s for s in strings if s.rsplit("/", 1)[-1] in REAL_SCRIPTS]
        modules = [s for s in strings if s in LAUNCHED_MODULES and "-m" in strings]
        if (scripts or modules) and LAUNCHERS & set(c.co_names):
            return scripts[0].rsplit("/", 1)[-1] if scripts else f"-m {modules[0]}"
        if "--local" in strings and ({"run", "sweep"} & set(strings)) and LAUNCHERS & set(c.co_names):
            return "llamaft run/sweep --local"
        for name in c.co_names:
            target = globals_.get(name)
            if target is None:
                continue
            if getattr(target, MARK, False):
                return name
            if isinstance(target, types.FunctionType) and target.__module__.startswith("tests"):
                found = _names_marked(target, seen)
                if found:
                    return f"{name} -> {found}"
            if isinstance(target, types.ModuleType) and target.__name__.startswith("tests"):
                continue  # attribute access through a module: the guard covers it
    return None


def _strings(consts: Iterable[object]) -> Iterable[str]:
    """The string constants of a code object, inside the tuples a list of constants compiles to."""
    for const in consts:
        if isinstance(const, str):
            yield const
        elif isinstance(const, tuple | frozenset):
            yield from _strings(const)


def _codes(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _fixture_functions(item: pytest.Item) -> Iterable[Callable[..., Any]]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    for defs in info.name2fixturedefs.values():
        for fixturedef in defs:
            yield fixturedef.func


def why_slow(item: pytest.Item) -> str | None:
    """What makes `item` a slow-tier test, or None."""
    seen: set[int] = set()
    for fn in _fixture_functions(item):
        if getattr(fn, MARK, False):
            return f"fixture {fn.__name__}"
        found = _names_marked(fn, seen)
        if found:
            return f"fixture {fn.__name__} -> {found}"
    function = getattr(item, "function", None)
    return _names_marked(function, seen) if function is not None else None


# ---------------------------------------------------------------------------- the plugin
class Tiers:
    """Marks slow tests at collection and fails unit-tier tests that start a real process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current: pytest.Item | None = None
        self.started: dict[str, list[str]] = {}
        self.original: Callable[..., None] | None = None

    def install(self) -> None:
        original = subprocess.Popen.__init__
        self.original = original
        tiers = self

        def checked_init(popen: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
            tiers.check(args)
            original(popen, args, *rest, **kwargs)

        subprocess.Popen.__init__ = checked_init  # type: ignore[assignment,method-assign]

    def uninstall(self) -> None:
        if self.original is not None:
            subprocess.Popen.__init__ = self.original  # type: ignore[method-assign]

    def check(self, argv: Any) -> None:
        item = self.current
        if item is None or item.get_closest_marker(SLOW) is not None:
            return
        what = real_process(argv)
        if what is not None:
            with self.lock:
                self.started.setdefault(item.nodeid, []).append(what)

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            if item.get_closest_marker(SLOW) is None and why_slow(item):
                item.add_marker(pytest.mark.slow)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
        self.current = item
        try:
            yield
        finally:
            self.current = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
        outcome = yield
        if call.when != "teardown":
            return
        with self.lock:
            started = self.started.pop(item.nodeid, [])
        report = outcome.get_result()
        if started and report.passed:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} is in the unit tier but started {sorted(set(started))}: mark the helper or "
                "fixture that starts it with tests.tiers.starts_processes (it then marks every test that "
                "uses it slow)")


def register(config: pytest.Config) -> None:
    tiers = Tiers()
    tiers.install()
    config.pluginmanager.register(tiers, "llamaft-tiers")
    config.add_cleanup(tiers.uninstall)
