"""How a trainer process ends: an explicit teardown, then `os._exit`, never interpreter finalization.

Why (a run that had printed `done` died with "terminate called without an active exception",
SIGABRT, and torchrun exited 1): gloo runs every collective on its own C++ worker threads
(`pt_gloo_runloop`), and such a thread often drops the *last* reference to a finished operation
after the Python caller has moved on (gdb: `~AsyncWork` -> `TensorImpl::decref_pyobject` ->
`gil_scoped_acquire`, several times per run). Dropping a tensor that has a Python object needs the
GIL. If that thread asks for the GIL while the main thread is about to finalize the interpreter,
Python 3.11 ends it with `pthread_exit` once finalization has begun; the forced unwind reaches the
`noexcept` destructor and C++ calls std::terminate, with no exception active. The rank most
exposed is the one that finishes first, rank 1: it only joins the export's gather and exits while
rank 0 still writes the files. tests/trainer/process/test_clean_exit.py forces the schedule and aborts
every time.

Joining those threads first is not possible with torch 2.13's public API: destroy_process_group()
shuts the backends down but the ProcessGroupGloo object, and with it its threads, lives on as long
as anything refers to it, and FSDP2 / DeviceMesh keep references we cannot drop (measured: after
destroy_process_group and gc.collect the runloop threads are still there). So the process never
enters finalization: it tears down what it started, in an order that is safe, flushes its output
and leaves with os._exit. The kernel then ends all threads at once, none of them unwinding.
"""

from __future__ import annotations

import os
import sys
import traceback
from http.server import ThreadingHTTPServer
from typing import NoReturn

import torch.distributed as dist

from llamaft_trainer.process.runtime import Runtime


def teardown(rt: Runtime | None, server: ThreadingHTTPServer | None, *, healthy: bool) -> None:
    """Stop what this process started.

    healthy (the run finished or every rank agreed to stop): a barrier first, so no rank leaves
    while a peer still talks to it, then destroy_process_group. After a failure there is no
    barrier or destroy: a peer may be dead and NCCL's destroy can block on a broken communicator;
    the exit closes the connections anyway. The metrics server stops last, so /progress shows the
    final phase for as long as the process lives. Errors here are reported, not raised: the run's
    outcome was decided (and written) before."""
    if healthy and rt is not None and dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # a peer died after the run's outcome was written
            traceback.print_exc()
    if server is not None:
        server.shutdown()
        server.server_close()


def exit_process(code: int) -> NoReturn:
    """End the process with `code` without finalizing the interpreter (see the module docstring).
    Only stdio is buffered by this program: every file it writes is closed by a `with` block.

    The code is also logged: torchrun does not pass its workers' codes on (it exits 1 for any
    failure and for its own SIGTERM), so the log line is where a person finds it."""
    print(f"llamaft_trainer: rank {os.environ.get('RANK', '0')} exits with code {code}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
