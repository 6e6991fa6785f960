"""A finished trainer process exits 0 every time (shutdown.py).

The crash it prevents: a gloo worker thread drops the last reference to a finished collective's
tensor while the main thread finalizes the interpreter; Python ends a thread that asks for the GIL
then with pthread_exit, the forced unwind meets gloo's noexcept ~AsyncWork, and C++ aborts with
"terminate called without an active exception". In a real run it takes an unlucky schedule; the
script below forces that schedule, so the first test fails every time, not now and then, and the
second shows the trainer's way out is immune to it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from llamaft_trainer.process import shutdown
from llamaft_trainer.process.local_etcd import free_port
from llamaft_trainer.process.runtime import Runtime

from tests.conftest import REPO
from tests.trainer.conftest import trainer_env

# Rank 0 posts an all-reduce and lets go of its tensor, so gloo's worker thread will hold the
# last reference. It then ends; the last atexit callback (registered first: atexit runs them in
# reverse) is a C builtin that holds the GIL without running bytecode up to the moment the
# interpreter starts finalizing. Rank 1 joins the all-reduce during that callback, so the worker
# thread finishes the work, finds the interpreter initialized, and queues for the GIL; it gets
# it only once finalization has begun (a __del__ that sleeps hands it over).
SCRIPT = """
import atexit, os, sys, time
atexit.register(sum, range(150_000_000))
import torch, torch.distributed as dist
dist.init_process_group("gloo")
marker = sys.argv[2]
if dist.get_rank() == 1:
    while not os.path.exists(marker):
        time.sleep(0.01)
    time.sleep(0.3)  # rank 0 is inside the GIL-holding callback by now
    try:
        dist.all_reduce(torch.ones(1 << 16))
        time.sleep(3)  # keep the connection while rank 0 finalizes
    except Exception:
        pass  # rank 0 already left (the trainer's exit): nothing to check on this side
    os._exit(0)

work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
del work  # gloo's work now owns the only reference to a tensor that has a Python object

class SlowFinalizer:
    def __del__(self):
        time.sleep(0.5)

keep = SlowFinalizer()
open(marker, "w").close()
if sys.argv[1] == "trainer":
    from llamaft_trainer.process.shutdown import exit_process
    exit_process(0)
"""


def _race(tmp_path: Path, ending: str) -> subprocess.CompletedProcess[str]:
    """Run the two-rank script; returns rank 0's process."""
    script = tmp_path / "race.py"
    script.write_text(SCRIPT)
    marker = tmp_path / f"marker-{ending}"
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), ending, str(marker)],
            env=trainer_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        )
        for rank in (0, 1)
    ]
    try:
        out, err = procs[0].communicate(timeout=120)
        procs[1].communicate(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return subprocess.CompletedProcess(procs[0].args, procs[0].returncode, out, err)


@pytest.mark.slow
def test_a_late_gloo_work_release_aborts_a_finalizing_interpreter(tmp_path: Path) -> None:
    """The cause, reproduced: a plain interpreter exit dies of SIGABRT in this schedule. (If this
    ever stops failing, the race is gone upstream or the script no longer forces it; either way
    the next test would prove nothing, so this one says so.)"""
    proc = _race(tmp_path, "interpreter")
    assert proc.returncode == -signal.SIGABRT, proc.stderr[-2000:]
    assert "terminate called without an active exception" in proc.stderr


@pytest.mark.slow
def test_the_trainer_exit_never_finalizes_so_the_race_cannot_happen(tmp_path: Path) -> None:
    proc = _race(tmp_path, "trainer")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr
    assert "rank 0 exits with code 0" in proc.stderr


def test_the_entry_point_leaves_through_exit_process(tmp_path: Path) -> None:
    """`python -m llamaft_trainer` (what torchrun starts) never runs atexit callbacks, i.e. never
    finalizes the interpreter, here on the quickest way through it: a configuration error."""
    termination = tmp_path / "termination.json"
    code = (
        "import atexit, runpy, sys; atexit.register(print, 'FINALIZED', flush=True);"
        f"sys.argv = ['llamaft_trainer', '--config', {str(tmp_path / 'missing.json')!r}];"
        "runpy.run_module('llamaft_trainer', run_name='__main__', alter_sys=True)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=trainer_env(LLAMAFT_TERMINATION_LOG=str(termination)),
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "FINALIZED" not in proc.stdout
    doc = json.loads(termination.read_text())
    assert doc["reason"] == "ConfigError" and doc["retryable"] is False


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self.calls.append(name)


def test_teardown_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Healthy end: barrier (no rank leaves while a peer still talks to it), then
    destroy_process_group, then the metrics server. After a failure: no collective at all (a
    peer may be dead), only the server."""
    import torch

    rt = Runtime(0, 0, 2, 2, torch.device("cpu"))
    for healthy, expected in ((True, ["barrier", "destroy_process_group", "shutdown", "server_close"]),
                              (False, ["shutdown", "server_close"])):
        calls = _Recorder()
        monkeypatch.setattr(shutdown.dist, "is_initialized", lambda: True)
        monkeypatch.setattr(shutdown.dist, "barrier", calls.barrier)
        monkeypatch.setattr(shutdown.dist, "destroy_process_group", calls.destroy_process_group)
        shutdown.teardown(rt, calls, healthy=healthy)  # type: ignore[arg-type]
        assert calls.calls == expected
