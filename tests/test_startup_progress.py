"""What `llamaft run --local` shows before the first step: the phase and the seconds since launch."""

from __future__ import annotations

import io

from llamaft.local import format_event
from llamaft.startup_progress import StartupProgress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_off_a_terminal_each_phase_is_one_line_with_the_seconds_since_launch() -> None:
    out, clock = io.StringIO(), Clock()
    progress = StartupProgress(out, live=False, clock=clock)
    clock.now += 4.2
    progress.tick()  # no redraws in a log file
    progress.event({"event": "phase", "phase": "loading the tokenizer and preparing the data"})
    clock.now += 1
    progress.event({"event": "data_progress", "records": 10})
    progress.event({"event": "phase", "phase": "loading the model"})
    clock.now += 5
    progress.event({"event": "setup", "parameters": 1})
    progress.event({"event": "step", "step": 5})
    progress.event({"event": "phase", "phase": "late"})  # after the first step nothing more is shown
    assert out.getvalue().splitlines() == [
        "llamaft: starting workers 0 s",
        "llamaft: loading the tokenizer and preparing the data 4 s",
        "llamaft: loading the model 5 s",
        "llamaft: training: the first steps 10 s",
    ]


def test_on_a_terminal_the_line_counts_up_and_other_lines_print_above_it() -> None:
    out, clock = io.StringIO(), Clock()
    progress = StartupProgress(out, live=True, clock=clock)
    assert out.getvalue() == "", "nothing before the first tick"
    progress.tick()
    clock.now += 0.5
    progress.tick()  # the same second: no redraw
    clock.now += 1
    progress.tick()
    progress.write("data: 320 records")
    progress.event({"event": "phase", "phase": "loading the model"})
    clock.now += 2
    progress.tick()
    progress.event({"event": "step", "step": 5})
    progress.write("step 5")
    assert out.getvalue() == (
        "\r\x1b[Kllamaft: starting workers 0 s" "\r\x1b[Kllamaft: starting workers 1 s"
        "\r\x1b[Kdata: 320 records\n"
        "\r\x1b[Kllamaft: loading the model 1 s" "\r\x1b[Kllamaft: loading the model 3 s"
        "\r\x1b[K" "step 5\n"
    )


def test_a_stop_names_its_signal_and_an_interrupt_is_no_failure() -> None:
    assert format_event({"event": "preempted", "step": 7, "save": True, "detail": "d", "signal": "SIGINT"}) == \
        "SIGINT: stopping after step 7 (saving: d)"
    assert format_event({"event": "done", "phase": "Failed", "reason": "Interrupted", "step": 7, "message": "m"}) == \
        "interrupted at step 7: m"
    assert format_event({"event": "done", "phase": "Failed", "reason": "Preempted", "step": 7, "message": "m"}) == \
        "failed (Preempted) at step 7: m"
