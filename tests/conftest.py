"""Shared fixtures: repository paths and small helpers used across the suites."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
REFERENCE = REPO.parent / "shared" / "reference"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO
