"""bench/_operator_probe.py times functions by name where the operator looks them up: a name that
moved (a refactor) would stop the probed operator at start-up, so every one must still exist."""

from __future__ import annotations

import importlib


def test_every_function_the_probe_times_exists_where_it_looks() -> None:
    probe = importlib.import_module("bench._operator_probe")
    for module, name, _ in probe.TIMED:
        assert callable(getattr(module, name, None)), f"{module.__name__}.{name} is gone: update bench/_operator_probe.py"
