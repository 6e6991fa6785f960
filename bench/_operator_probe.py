"""Opt-in instrumentation of the operator for bench/operator_latency.py --probe: loaded after the
handlers (`kopf run ... -m llamaft.operator.handlers -m bench._operator_probe`), it does nothing
unless LLAMAFT_PROBE_OUT names a file. Then it appends one JSON line per lifecycle step to it:

    {"name", "submitted", "start", "end", "thread", "calls": [[what, seconds], ...]}

(perf_counter seconds; `start - submitted` is the time the step waited for a worker thread;
`calls` are the Kube methods, i.e. API round trips, and the costly pure parts: validation, the
capacity planner, rendering), and one {"lag": seconds} line per second: the event loop's worst
lateness in that second (the loop runs kopf's watches, daemons and event posting).

SIGUSR1 appends the live objects by type (and their change since the last SIGUSR1) to
LLAMAFT_PROBE_OUT + ".mem": what grows per LlamaFineTune; with PYTHONTRACEMALLOC=N also the
allocations that grew most, by traceback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import os
import threading
import time
from typing import Any

import kopf
from llamaft.operator import kube, specs, step
from llamaft.render import desired, objects

OUT = os.environ.get("LLAMAFT_PROBE_OUT")
# The pure work timed per step, each name where it is looked up (module, name, label): specs
# validates and checks, the step validates and plans, render builds the children and the job.
TIMED: tuple[tuple[Any, str, str], ...] = (
    (specs, "validate_spec", "validate_spec"), (specs, "checked_children", "checked_children"),
    (step, "validated", "validated"), (step, "validate_spec", "validate_spec"), (step, "admission", "admission"),
    (objects, "children", "render.children"), (desired, "pytorch_job", "render.pytorch_job"),
)
_local = threading.local()
_lines: list[str] = []
_lines_lock = threading.Lock()
_tasks: set[asyncio.Task[None]] = set()


def _emit(record: dict[str, Any]) -> None:
    with _lines_lock:
        _lines.append(json.dumps(record))


def _flush_forever() -> None:
    assert OUT is not None
    while True:
        time.sleep(1.0)
        with _lines_lock:
            lines, _lines[:] = list(_lines), []
        if lines:
            with open(OUT, "a") as out:
                out.write("\n".join(lines) + "\n")


def _timed(what: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record = getattr(_local, "record", None)
            if record is not None:
                record["calls"].append((what, time.perf_counter() - started))
    return wrapper


def _step_of(fn: Any) -> Any:
    """The Step whose bound `run` an executor is handed (directly, or as asyncio.to_thread's
    partial), or the Step itself when handed as an argument (daemon._first_step)."""
    if isinstance(fn, step.Step):
        return fn
    while isinstance(fn, functools.partial):
        fn = next((a for a in fn.args if callable(a)), fn.func) if fn.args else fn.func
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, step.Step) else None


def _install() -> None:
    submit = concurrent.futures.ThreadPoolExecutor.submit

    def submit_stamped(self: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        step = next((s for s in (_step_of(f) for f in (fn, *args)) if s is not None), None)  # fn or ctx.run(step.run)
        if step is not None:
            step._probe_submitted = time.perf_counter()
        return submit(self, fn, *args, **kwargs)

    concurrent.futures.ThreadPoolExecutor.submit = submit_stamped  # type: ignore[method-assign]

    run = step.Step.run

    def run_recorded(self: Any) -> Any:
        record = {"name": self.name, "submitted": getattr(self, "_probe_submitted", None), "start": time.perf_counter(),
                  "thread": threading.current_thread().name, "calls": []}
        _local.record = record
        try:
            return run(self)
        finally:
            record["end"] = time.perf_counter()
            _local.record = None
            _emit(record)

    step.Step.run = run_recorded  # type: ignore[method-assign]
    for name, member in list(vars(kube.Kube).items()):
        if callable(member) and not name.startswith("_"):
            setattr(kube.Kube, name, _timed(f"api.{name}", member))
    for module, name, label in TIMED:
        setattr(module, name, _timed(label, getattr(module, name)))
    kopf.event = _timed("kopf.event", kopf.event)  # type: ignore[assignment]
    from kopf._cogs.clients import watching

    watch_objs = watching.watch_objs

    async def watch_objs_stamped(**kwargs: Any) -> Any:
        """When each LlamaFineTune's ADDED event came off the watch stream (before kopf's queues)."""
        plural = kwargs["resource"].plural
        async for raw in watch_objs(**kwargs):
            if plural == "llamafinetunes" and raw.get("type") == "ADDED":
                _emit({"received": raw["object"]["metadata"]["name"], "at": time.perf_counter()})
            yield raw

    watching.watch_objs = watch_objs_stamped  # type: ignore[assignment]
    threading.Thread(target=_flush_forever, daemon=True, name="probe-flush").start()

    @kopf.on.startup()
    async def measure_loop_lag(**_: Any) -> None:
        async def lag() -> None:
            while True:
                worst, until = 0.0, time.perf_counter() + 1.0
                while time.perf_counter() < until:
                    before = time.perf_counter()
                    await asyncio.sleep(0.01)
                    worst = max(worst, time.perf_counter() - before - 0.01)
                _emit({"lag": worst, "at": time.perf_counter()})

        _tasks.add(asyncio.get_running_loop().create_task(lag()))


def _dump_memory(*_: Any) -> None:
    """SIGUSR1: live objects by type, and the change since the last dump, into LLAMAFT_PROBE_OUT + ".mem"
    (with PYTHONTRACEMALLOC set, also the traced allocations that grew most, by traceback)."""
    import collections
    import gc
    import tracemalloc

    global _last_snapshot, _last_counts
    gc.collect()
    counts = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    lines = [f"objects {sum(counts.values())}"]
    for name, n in sorted(counts.items(), key=lambda kv: -(kv[1] - _last_counts.get(kv[0], 0)))[:25]:
        lines.append(f"  {n - _last_counts.get(name, 0):+8d} {n:8d} {name}")
    _last_counts = counts
    if tracemalloc.is_tracing():
        snapshot = tracemalloc.take_snapshot()
        lines.append(f"traced {sum(s.size for s in snapshot.statistics('filename')) / 2**20:.1f} MiB")
        if _last_snapshot is not None:
            for stat in snapshot.compare_to(_last_snapshot, "traceback")[:14]:
                lines.append(f"{stat.size_diff / 2**10:+9.0f} KiB {stat.count_diff:+7d} " + " <- ".join(
                    f"{frame.filename.rsplit('site-packages/', 1)[-1]}:{frame.lineno}" for frame in list(stat.traceback)[-14:]))
        _last_snapshot = snapshot
    with open(f"{OUT}.mem", "a") as out:
        out.write("\n".join(lines) + "\n\n")


_last_counts: Any = {}
_last_snapshot: Any = None
if OUT:
    _install()
    import signal

    signal.signal(signal.SIGUSR1, _dump_memory)
