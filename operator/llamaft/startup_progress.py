"""What `llamaft run --local` shows between the launch and the first training step.

Before the first `step` line a run is silent for tens of seconds on a CPU (torchrun and the
workers' Python start, the rendezvous, torch and transformers imports, the tokenizer, the data, the
model): a new user cannot tell a slow start from a hang. This shows the phase and the seconds since
the launch, from global rank 0's structured log lines (docs/progress-contract.md section 1:
`phase`, `data`, `setup`): `starting workers` until the first of them arrives. On a terminal the
line is rewritten every second; elsewhere (a log file, a pipe) a line is printed when the phase
changes. It ends at the first `step` (or `done` / `error`) line.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

STARTING = "starting workers"
"""The phase before rank 0 has said anything: torchrun, the rendezvous, the imports."""
FIRST_STEPS = "training: the first steps"
ENDS = frozenset({"step", "done", "error"})


def phase_of(event: Mapping[str, Any]) -> str | None:
    """The start-up phase a rank-0 log line begins (None: it begins none)."""
    kind = event.get("event")
    if kind == "phase":
        return str(event.get("phase"))
    if kind == "setup":
        return FIRST_STEPS
    return None


class StartupProgress:
    """The phase and the elapsed seconds until training shows its first step. `event` is called
    from the log readers' threads, `tick` from the main loop; `write` prints an event's own line
    without tearing the live one."""

    def __init__(self, out: TextIO, *, live: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self.out, self.live, self.clock = out, live, clock
        self.started = clock()
        self.phase: str | None = STARTING
        """None once training has shown a step (or the run ended)."""
        self._shown = False
        """A live line is on the screen (it must be cleared before another line is printed)."""
        self._drawn_at = -1
        self._lock = threading.Lock()
        if not live:
            self._print_line()

    def elapsed(self) -> int:
        return int(self.clock() - self.started)

    def line(self) -> str:
        return f"llamaft: {self.phase} {self.elapsed()} s"

    def event(self, event: Mapping[str, Any]) -> None:
        with self._lock:
            if self.phase is None:
                return
            if event.get("event") in ENDS:
                self._clear()
                self.phase = None
                return
            phase = phase_of(event)
            if phase is None or phase == self.phase:
                return
            if self._shown:  # the last phase's line stays on the screen with its time
                self.out.write("\n")
                self._shown = False
            self.phase = phase
            if self.live:
                self._draw()
            else:
                self._print_line()

    def tick(self) -> None:
        """On a terminal, redraw the line when its seconds changed (or it was cleared)."""
        with self._lock:
            if self.live and self.phase is not None and (not self._shown or self.elapsed() != self._drawn_at):
                self._draw()

    def write(self, text: str) -> None:
        """An event's own line (step, data, setup, ...), printed above the live line."""
        with self._lock:
            self._clear()
            self.out.write(text + "\n")
            self.out.flush()

    def close(self) -> None:
        with self._lock:
            if self._shown:
                self.out.write("\n")
                self.out.flush()
                self._shown = False
            self.phase = None

    def _draw(self) -> None:
        self._drawn_at = self.elapsed()
        self.out.write("\r\x1b[K" + self.line())
        self.out.flush()
        self._shown = True

    def _clear(self) -> None:
        if self._shown:
            self.out.write("\r\x1b[K")
            self._shown = False

    def _print_line(self) -> None:
        self.out.write(self.line() + "\n")
        self.out.flush()
