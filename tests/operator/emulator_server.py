"""The emulator in a process of its own, for benches that must not count its cost as the client's
or the operator's:

    python -m tests.operator.emulator_server [--record] [--timed] [--gc-delay S] [--without v1/pods ...]

prints one JSON line, {"url": ..., "pid": ...}, once it serves, then serves until stdin closes or
SIGTERM/SIGINT. With --timed, GET <url>/_emulator/stats answers the emulator's own request timings
(and with --record, every request: method, path, params, user agent); ?reset=1 clears both.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.operator.emulator import STATS_PATH, EmulatorThread  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help="keep every request (see /_emulator/stats)")
    parser.add_argument("--timed", action="store_true", help="time every request but watches (see /_emulator/stats)")
    parser.add_argument("--without", action="append", default=[], help="a resource key this cluster does not serve")
    parser.add_argument("--gc-delay", type=float, help="seconds between a change and the garbage collector's pass "
                        "(Emulator.gc_delay; each pass looks at every object)")
    args = parser.parse_args(argv)
    emulator = EmulatorThread(tuple(args.without), record=args.record, timed=args.timed, gc_delay=args.gc_delay).start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())

    def watch_stdin() -> None:
        sys.stdin.read()  # EOF: the parent is gone
        done.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    print(json.dumps({"url": emulator.url, "pid": os.getpid()}), flush=True)
    while not done.wait(0.5):
        pass
    emulator.stop()


class EmulatorProcess:
    """`python -m tests.operator.emulator_server` as a child process: `.url`, `.pid`, `.stats()`."""

    def __init__(self, *, record: bool = False, timed: bool = False, without: tuple[str, ...] = (),
                 gc_delay: float | None = None) -> None:
        self.args = ["--record"] * record + ["--timed"] * timed + [a for w in without for a in ("--without", w)]
        self.args += ["--gc-delay", str(gc_delay)] if gc_delay is not None else []
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.pid = 0

    def start(self) -> EmulatorProcess:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.operator.emulator_server", *self.args], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the first line, once it serves (empty: it died)
        if not line:
            raise RuntimeError("the emulator process did not start")
        info = json.loads(line)
        self.url, self.pid = str(info["url"]), int(info["pid"])
        return self

    def stats(self, reset: bool = False) -> dict[str, Any]:
        """{"timings": [[method, seconds], ...], "requests": [{"method", "path", "params", "user_agent", ...}, ...]}."""
        with urllib.request.urlopen(f"{self.url}{STATS_PATH}{'?reset=1' if reset else ''}", timeout=60) as response:  # noqa: S310
            return dict(json.loads(response.read()))

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


if __name__ == "__main__":
    main()
