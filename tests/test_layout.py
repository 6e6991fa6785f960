"""The operator/ folder is a source root, never the stdlib's `operator`; pytest and mypy agree."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from tests.conftest import REPO


def test_stdlib_operator_wins_from_the_repository_root() -> None:
    code = "import operator, llamaft; print(operator.or_.__module__, llamaft.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    module, path = out.stdout.split()
    assert module == "_operator"
    assert path == str(REPO / "operator" / "llamaft" / "__init__.py")


def test_operator_folder_is_not_a_package() -> None:
    assert not (REPO / "operator" / "__init__.py").exists()
    assert not (REPO / "trainer" / "__init__.py").exists()


def test_pytest_and_mypy_use_the_same_source_roots() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    tool = config["tool"]
    assert tool["pytest"]["ini_options"]["pythonpath"] == tool["mypy"]["mypy_path"] == ["operator", "trainer"]
    assert config["tool"]["setuptools"]["packages"]["find"]["where"] == ["operator", "trainer"]
