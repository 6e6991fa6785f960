"""bench/_operator_probe.py times functions by name where the operator looks them up: a name that
moved (a refactor) would stop the probed operator at start-up, so every one must still exist."""

from __future__ import annotations

import importlib.util

from tests.conftest import REPO


def test_every_function_the_probe_times_exists_where_it_looks() -> None:
    spec = importlib.util.spec_from_file_location("operator_probe", REPO / "bench" / "_operator_probe.py")
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)  # installs nothing: LLAMAFT_PROBE_OUT is not set
    for module, name, _ in probe.TIMED:
        assert callable(getattr(module, name, None)), f"{module.__name__}.{name} is gone: update bench/_operator_probe.py"
