"""Start-up: what `warm_up` leaves behind for the first burst of LlamaFineTunes."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator

import kopf
import pytest
from llamaft.operator import startup


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # this test process's objects go back to the collector


def test_warm_up_validates_once_and_freezes_what_it_loaded(unfrozen: None) -> None:
    """The schemas and CEL programs it loads live as long as the operator: frozen out of the
    collector's generations, a full collection during a burst does not walk them again."""
    assert gc.get_freeze_count() == 0
    startup.warm_up(kopf.Memo(), logging.getLogger("test"))
    assert gc.get_freeze_count() > 10_000, "the loaded heap is in the permanent generation"
    assert gc.get_count()[0] < 100, "collected before freezing: no garbage kept alive for good"
