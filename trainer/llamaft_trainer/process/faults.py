"""Test-only fault injection: a retryable failure, or a SIGKILL, of one rank after a given step.

Restart behaviour (torchrun's agent restarting the worker group, the next attempt resuming from
the newest checkpoint) can only be tested with a failure at a known point of a real run. Nothing
in a rendered job sets these variables; with LLAMAFT_TEST_FAULT unset `after_step` does nothing.

    LLAMAFT_TEST_FAULT="<kind>:<step>[:<rank>]"   kind: raise | sigkill; no rank: every rank
    LLAMAFT_TEST_FAULT_ONCE=<path>                optional: fire only while <path> does not exist

`raise`: a RuntimeError after optimizer step <step> on global rank <rank>, which the trainer
reports as a retryable failure (termination.classify_exception) like any unexpected error. `sigkill`: the
rank SIGKILLs itself there, as the kernel's OOM killer or a crashed worker would end it (no
handler, no termination message). With LLAMAFT_TEST_FAULT_ONCE the fault fires on the first
attempt that reaches the step and creates the file, so the restart trains on; without it, every
attempt fails the same way (a persistent fault). On every rank, each rank has its own file
(<path>.rank<r>). The file, not TORCHELASTIC_RESTART_COUNT, says
whether it fired: each agent counts its own restarts, and ranks may move between agents.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

FAULT_ENV = "LLAMAFT_TEST_FAULT"
ONCE_ENV = "LLAMAFT_TEST_FAULT_ONCE"
KINDS = ("raise", "sigkill")


class InjectedFault(RuntimeError):
    """The failure LLAMAFT_TEST_FAULT asked for (a RuntimeError: retryable, as a crash would be)."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None
    """None: every rank."""


def parse(text: str) -> Fault:
    """`<kind>:<step>[:<rank>]`; a ValueError naming the variable and its form otherwise."""
    parts = text.split(":")
    if (len(parts) not in (2, 3) or parts[0] not in KINDS or not parts[1].isdigit()
            or (len(parts) == 3 and not parts[2].isdigit())):
        raise ValueError(f"{FAULT_ENV}={text!r}: expected <kind>:<step>[:<rank>] with kind one of "
                         f"{', '.join(KINDS)}, e.g. raise:3:1 (rank 1) or raise:3 (every rank)")
    return Fault(parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else None)


def _claim(path: str | None) -> bool:
    """Whether this attempt fires: always without a marker file, else only the first to create it."""
    if not path:
        return True
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def after_step(step: int, rank: int) -> None:
    """The train loop's hook after each optimizer step (a no-op unless LLAMAFT_TEST_FAULT is set)."""
    text = os.environ.get(FAULT_ENV)
    if not text:
        return
    fault = parse(text)
    if fault.step != step or fault.rank not in (None, rank):
        return
    once = os.environ.get(ONCE_ENV)
    if not _claim(f"{once}.rank{rank}" if once and fault.rank is None else once):
        return
    if fault.kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"injected failure ({FAULT_ENV}={text}) on rank {rank} after step {step}")
