"""The trainer's test-only fault hook (llamaft_trainer/process/faults.py): off unless set, fires at the
named step and rank, once per marker file, and a malformed value names the variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from llamaft_trainer.process import faults


def test_unset_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    for step in range(5):
        faults.after_step(step, 0)


def test_raises_at_the_step_on_the_rank_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(faults.FAULT_ENV, "raise:3:1")
    monkeypatch.setenv(faults.ONCE_ENV, str(tmp_path / "fired"))
    faults.after_step(2, 1)
    faults.after_step(3, 0)
    with pytest.raises(faults.InjectedFault, match="on rank 1 after step 3"):
        faults.after_step(3, 1)
    faults.after_step(3, 1)  # the restart: the marker exists
    assert (tmp_path / "fired").exists()


def test_every_rank_has_its_own_marker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(faults.FAULT_ENV, "raise:2")
    monkeypatch.setenv(faults.ONCE_ENV, str(tmp_path / "fired"))
    for rank in (0, 1):
        with pytest.raises(faults.InjectedFault):
            faults.after_step(2, rank)
        faults.after_step(2, rank)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fired.rank0", "fired.rank1"]


def test_without_a_marker_every_attempt_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.FAULT_ENV, "raise:1:0")
    monkeypatch.delenv(faults.ONCE_ENV, raising=False)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            faults.after_step(1, 0)


@pytest.mark.parametrize("value", ["boom:3:1", "raise", "raise:x", "raise:3:1:2", "sigkill:3:r"])
def test_a_malformed_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(faults.FAULT_ENV, value)
    with pytest.raises(ValueError, match=f"{faults.FAULT_ENV}=.*<kind>:<step>"):
        faults.after_step(1, 0)
