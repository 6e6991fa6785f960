"""The opt-in phase timers (llamaft_trainer/report/profiling.py): off unless asked for, exclusive time per
phase that sums to the step, and on a real 2-process run a `phases` event per step and rank with
every phase and the collectives' volume. Nothing here asserts on speed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from llamaft_trainer.report import profiling
from llamaft_trainer.report.logline import read_events

from tests.conftest import REPO
from tests.trainer.conftest import base_config, torchrun_cmd, trainer_env


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(profiling.ENV_VAR, raising=False)
    assert profiling.start() is None
    first, second = profiling.phase(None, "forward"), profiling.phase(None, "backward")
    assert first is second  # one shared no-op context: nothing is timed or allocated
    with first:
        pass


@pytest.mark.parametrize(("value", "on"), [("", False), ("0", False), ("false", False), ("off", False),
                                           ("1", True), ("true", True), ("yes", True)])
def test_env_switch(value: str, on: bool) -> None:
    assert profiling.enabled_by_env({profiling.ENV_VAR: value}) is on


def test_exclusive_times_sum_to_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(profiling.time, "perf_counter", clock)
    timers = profiling.start(enabled=True)
    assert timers is not None and timers is not profiling.start(enabled=True)  # each loop its own
    with profiling.phase(timers, "forward"):
        clock.now += 0.010
        with profiling.phase(timers, "all_gather"):  # nested: paused forward
            clock.now += 0.004
        clock.now += 0.006
    with profiling.phase(timers, "backward"):
        clock.now += 0.020
        with profiling.phase(timers, "reduce_scatter"):
            clock.now += 0.005
    timers.count("all_gather", 1000)
    out = timers.end_step(0.050)
    assert out["forward"] == pytest.approx(16.0) and out["all_gather"] == pytest.approx(4.0)
    assert out["backward"] == pytest.approx(20.0) and out["reduce_scatter"] == pytest.approx(5.0)
    assert out["other"] == pytest.approx(5.0)
    assert sum(out[p] for p in profiling.PHASES) == pytest.approx(50.0)
    assert out["all_gather_bytes"] == 1000 and out["reduce_scatter_bytes"] == 0
    # end_step resets for the next step
    assert timers.end_step(0.001)["forward"] == 0.0


def test_summarize_medians_over_steps_and_ranks() -> None:
    def event(step: int, rank: int, forward: float) -> dict[str, Any]:
        return {"event": "phases", "step": step, "rank": rank, "forward": forward, "other": 1.0, "all_gather_bytes": 8}

    events = [event(1, 0, 100.0), event(1, 1, 100.0)]  # warm-up, skipped
    events += [event(s, r, 10.0 * s + r) for s in (2, 3, 4) for r in (0, 1)]
    out = profiling.summarize(events, skip_steps=1)
    assert out["forward"] == pytest.approx(30.5)  # mean over ranks, median over steps 2..4
    assert out["step"] == pytest.approx(31.5)
    assert out["all_gather_bytes"] == 8 and out["backward"] == 0.0
    fastest = profiling.summarize(events, skip_steps=1, stat="min")  # the fastest step's figures
    assert fastest["forward"] == pytest.approx(20.5) and fastest["step"] == pytest.approx(21.5)
    with pytest.raises(ValueError):
        profiling.summarize(events, stat="mean")


def test_two_process_run_logs_every_phase(tiny_model: Path, tmp_path: Path) -> None:
    config = base_config(tiny_model, tmp_path / "ck", training={"maxSteps": 3})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    proc = subprocess.run(
        torchrun_cmd(2, "-m", "llamaft_trainer", "--config", str(path)),
        env=trainer_env(**{profiling.ENV_VAR: "1"}), capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    phases = read_events(proc.stdout, "phases")
    assert sorted((e["step"], e["rank"]) for e in phases) == [(s, r) for s in (1, 2, 3) for r in (0, 1)]
    for e in phases:
        assert all(e[p] >= 0 for p in profiling.PHASES)
        assert e["forward"] > 0 and e["backward"] > 0 and e["grad_norm"] > 0 and e["optimizer"] > 0
        # FSDP2 on 2 ranks: the whole model is gathered in forward and its gradients reduce-scattered.
        assert e["all_gather"] > 0 and e["reduce_scatter"] > 0
        assert e["all_gather_bytes"] > 0 and e["reduce_scatter_bytes"] > 0
    # Rank 0's phases add up to the step time it logs (`other` is the remainder, never negative).
    steps = {e["step"]: e for e in read_events(proc.stdout, "step")}
    for e in (e for e in phases if e["rank"] == 0 and e["step"] in steps):
        total = sum(e[p] for p in profiling.PHASES)
        assert total == pytest.approx(steps[e["step"]]["step_seconds"] * 1e3, abs=1.0)
