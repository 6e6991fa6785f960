"""Reconcile latency of the real operator (kopf runtime) against the kmock emulator on loopback:
for N LlamaFineTunes created at once (default 1, 50 and 200; e.g. `... 1 50 200 1000`), the time
from each create to its PyTorchJob existing (p50/p99) and the operator's resident memory.

    .venv/bin/python bench/operator_latency.py [COUNT ...] [--probe [--memory]] [--pyspy COUNT]

Three processes: the emulator (tests/operator/emulator_server.py, timing its own requests), the
operator (`kopf run`), and this one (the client that creates the CRs and watches the PyTorchJobs).
The latency is measured from the create's response (the CR exists in the API server; "sent"
also shows it from the create's request) to the PyTorchJob's ADDED event on a watch. Batches are
cumulative: the 200 CRs meet the 52 before them, as an operator meets the CRs that already exist
(one unmeasured CR goes first, so that the emulator's own first-create cost is not in the figures).
Per batch it prints the emulator's own request latency (arrival to response, watches excluded),
CPU seconds of the operator (and per CR) and the emulator, the emulator's event-loop lag (how long
a request can wait before the emulator reads it), the operator's peak and final RSS, the API requests
per CR by who made them (llamaft's client, kopf), the load average, and the machine's speed just
before the batch (a fixed Python workload's time on the operator's core): a shared machine's speed
drifts between runs, and the p99 follows it.

--probe loads bench/_operator_probe.py into the operator: the time each lifecycle step waited for
a worker thread, its duration, its API round trips and pure work by kind, and the event loop's lag.
--pyspy COUNT records py-spy profiles of the operator and the emulator during that batch
($TMPDIR/llamaft-operator-latency/{operator,emulator}-COUNT.txt: collapsed stacks of the threads
holding the GIL, i.e. where the CPU goes; `pip install py-spy`).
c10d rendezvous is used so that no etcd is involved: this measures the operator and API round
trips, not etcd.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.operator.conftest import Cluster, Operator, tiny_spec  # noqa: E402
from tests.operator.emulator import write_kubeconfig  # noqa: E402
from tests.operator.emulator_server import EmulatorProcess  # noqa: E402

OPERATOR_AGENT = "llamaft-operator"
BENCH_AGENT = "llamaft-bench"


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def request_kind(method: str, path: str, params: dict[str, str]) -> str:
    """`verb resource[/subresource]` of one recorded request, as an audit log would name it."""
    parts = path.strip("/").split("/")
    if parts[:1] == ["api"]:
        rest = parts[2:]
    elif parts[:1] == ["apis"]:
        rest = parts[3:]
    else:
        return f"{method} {path}"
    if len(rest) >= 3 and rest[0] == "namespaces":
        rest = rest[2:]
    if not rest:
        return f"{method.lower()} discovery"
    plural, name, sub = rest[0], rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None
    verb = {"POST": "create", "DELETE": "delete", "PUT": "update"}.get(method)
    if method == "GET":
        verb = "get" if name else ("watch" if params.get("watch") in ("true", "1") else "list")
    elif method == "PATCH":
        verb = "apply" if params.get("fieldManager") and sub is None else "patch"
    return f"{verb} {plural}{'/' + sub if sub else ''}"


REFERENCE_WORKLOAD = """
import copy, json, time
obj = {"metadata": {"name": "x", "labels": {f"k{i}": f"v{i}" for i in range(20)}},
       "spec": {"items": [{"a": i, "b": [i, str(i)], "c": {"d": float(i)}} for i in range(200)]}}
times = []
for _ in range(9):
    began = time.perf_counter()
    for _ in range(5):
        json.loads(json.dumps(copy.deepcopy(obj), indent=2, sort_keys=True))
    times.append(time.perf_counter() - began)
print(sorted(times)[len(times) // 2])
"""
"""Dict copies and the pure-Python JSON encoder, as an operator's work is: its time says how fast
the machine runs now. A shared machine's speed drifts (the same burst cost the operator 14 to 24
ms of CPU per fine-tune on one evening), so each batch reports it, and runs compare by it."""


def reference_ms(cores: set[int]) -> float:
    """The median time of REFERENCE_WORKLOAD's rounds on `cores`, in ms (lower: a faster machine)."""
    done = subprocess.run([sys.executable, "-c", REFERENCE_WORKLOAD], capture_output=True, text=True, check=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, cores))
    return float(done.stdout.strip()) * 1000


class JobWatch:
    """A watch on PyTorchJobs from this process: when each owner's first job appeared."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="job-watch")

    def start(self) -> JobWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        from kubernetes import watch

        version = self.cluster.custom.list_namespaced_custom_object(
            "kubeflow.org", "v1", self.cluster.ns, "pytorchjobs")["metadata"]["resourceVersion"]
        while not self._stop.is_set():
            stream = watch.Watch().stream(self.cluster.custom.list_namespaced_custom_object, "kubeflow.org", "v1",
                                          self.cluster.ns, "pytorchjobs", resource_version=version)
            try:
                for event in stream:
                    now = time.perf_counter()
                    obj = event["object"]
                    version = obj["metadata"].get("resourceVersion", version)
                    owner = (obj["metadata"].get("labels") or {}).get("llamaft.io/finetune")
                    if owner and owner not in self.seen:
                        self.seen[owner] = now
            except Exception:  # noqa: BLE001 (the stream ended: watch again from the last version)
                time.sleep(0.05)


class Sampler:
    """The operator's peak RSS while a batch runs."""

    def __init__(self, proc: psutil.Process) -> None:
        self.proc, self.peak = proc, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()


def cpu(proc: psutil.Process) -> float:
    return float(sum(proc.cpu_times()[:2]))


def loop_cpu(proc: psutil.Process) -> float:
    """CPU seconds of the operator's main thread: kopf's event loop (watch streams, the per-object
    workers, its patches and event posts, llamaft's async event handlers), apart from the threads
    that run the lifecycle steps and kopf's sync handlers."""
    return float(sum(t.user_time + t.system_time for t in proc.threads() if t.id == proc.pid))


def settle(*procs: psutil.Process, quiet_s: float = 2.0, timeout: float = 300.0) -> None:
    """Wait until the processes stop working (each under 3% CPU for quiet_s): the operator waiting
    for the emulator's answers is not done."""
    deadline, quiet_since, last = time.monotonic() + timeout, time.monotonic(), [cpu(p) for p in procs]
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = [cpu(p) for p in procs]
        if any(b - a > 0.015 for a, b in zip(last, now, strict=True)):
            quiet_since = time.monotonic()
        last = now
        if time.monotonic() - quiet_since >= quiet_s:
            return


def critical_path(steps: list[dict[str, Any]], acked: dict[str, float], seen: dict[str, float],
                  received: dict[str, float]) -> None:
    """Where each CR's create->job time went, from its first lifecycle step (perf_counter is the
    machine's monotonic clock, the same in every process): kopf delivering the create to a handler,
    the step waiting for a thread, the step running until the job was created, the job reaching
    this process's watch."""
    first: dict[str, dict[str, Any]] = {}
    for step in steps:
        if step["name"] not in first or step["start"] < first[step["name"]]["start"]:
            first[step["name"]] = step
    parts: dict[str, list[float]] = collections.defaultdict(list)
    for name, step in first.items():
        if name not in acked or name not in seen or not step.get("submitted"):
            continue
        if name in received:
            parts["create -> on kopf's watch stream"].append(received[name] - acked[name])
            parts["stream -> step submitted"].append(step["submitted"] - received[name])
        else:
            parts["create -> step submitted"].append(step["submitted"] - acked[name])
        parts["waiting for a thread"].append(step["start"] - step["submitted"])
        parts["step until the job is seen"].append(seen[name] - step["start"])
    print("      critical path (first step of each CR): " + "; ".join(
        f"{what} p50 {ms(statistics.median(v))}, p99 {ms(pct(v, 0.99))}" for what, v in parts.items()))


def probe_report(path: Path, names: set[str], count: int, since: float,
                 acked: dict[str, float] | None = None, seen: dict[str, float] | None = None) -> None:
    """Per-step figures from bench/_operator_probe.py for the CRs of one batch."""
    steps, lags, received = [], [], {}
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if "received" in record:
            received[record["received"]] = record["at"]
        elif "lag" in record:
            if record["at"] >= since:
                lags.append(record["lag"])
        elif record["name"] in names:
            steps.append(record)
    if not steps:
        print("      probe: no steps recorded")
        return
    waits = [s["start"] - s["submitted"] for s in steps if s.get("submitted")]
    durations = [s["end"] - s["start"] for s in steps]
    threads = len({s["thread"] for s in steps})
    print(f"      probe: {len(steps) / count:.1f} steps per CR on {threads} threads; step {ms(statistics.median(durations))} "
          f"p50, {ms(pct(durations, 0.99))} p99; waited for a thread {ms(statistics.median(waits) if waits else 0)} p50, "
          f"{ms(pct(waits, 0.99) if waits else 0)} p99; event loop lag max {ms(max(lags, default=0))}")
    totals: dict[str, list[float]] = collections.defaultdict(list)
    for step in steps:
        for what, seconds in step["calls"]:
            totals[what].append(seconds)
    if acked is not None and seen is not None:
        critical_path(steps, acked, seen, received)
    print("      per CR (calls, time in the step; nested parts overlap):")
    for what, values in sorted(totals.items(), key=lambda kv: -sum(kv[1])):
        print(f"        {what:<28} {len(values) / count:5.1f} calls {ms(sum(values) / count):>9}/CR, "
              f"p50 {ms(statistics.median(values))}, p99 {ms(pct(values, 0.99))}")


def requests_report(requests: list[dict[str, Any]], count: int) -> None:
    by_agent: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for request in requests:
        agent = request["user_agent"]
        who = "llamaft" if agent.startswith(OPERATOR_AGENT) else ("bench" if agent.startswith(BENCH_AGENT) else "kopf")
        by_agent[who][request_kind(request["method"], request["path"], request["params"])] += 1
    for who in ("llamaft", "kopf"):
        kinds = by_agent.get(who, collections.Counter())
        total = sum(kinds.values())
        detail = ", ".join(f"{kind} {n / count:.1f}" for kind, n in kinds.most_common())
        print(f"      requests per CR by {who}: {total / count:.1f} ({detail})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("counts", nargs="*", type=int, default=[1, 50, 200])
    parser.add_argument("--probe", action="store_true", help="per-step timings from inside the operator")
    parser.add_argument("--memory", action="store_true", help="with --probe: the operator's live objects by type at "
                        "idle and after each batch, and the change")
    parser.add_argument("--pyspy", type=int, action="append", default=[], help="py-spy the operator and the emulator "
                        "during this batch")
    parser.add_argument("--gc-delay", type=float, default=2.0, help="the emulator's garbage collector delay (s)")
    parser.add_argument("--workers", type=int, help="the operator's lifecycle threads (LLAMAFT_WORKERS)")
    parser.add_argument("--pin", action="store_true", help="give the operator a core of its own (the last one; the "
                        "emulator and this client share the others), as a pod with a CPU of its own has: the "
                        "emulator's and the client's CPU is then not taken from the operator's")
    args = parser.parse_args()
    from kubernetes import client

    # Nothing is deleted here: the emulator's garbage collector (a pass over every object after
    # each change) need not run every 50 ms, taking CPU from the operator on a small machine.
    cores = sorted(os.sched_getaffinity(0))
    if args.pin and len(cores) < 2:
        parser.error("--pin needs at least 2 cores")
    others, own = (set(cores[:-1]), {cores[-1]}) if args.pin else (set(cores), set(cores))
    os.sched_setaffinity(0, others)  # the emulator (and this client) inherit it
    emulator = EmulatorProcess(record=True, timed=True, gc_delay=args.gc_delay).start()
    emulator_proc = psutil.Process(emulator.pid)
    out_dir = Path(tempfile.gettempdir()) / "llamaft-operator-latency"
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        kubeconfig = write_kubeconfig(emulator.url, tmp / "config")
        config = client.Configuration()
        config.host = emulator.url
        config.connection_pool_maxsize = 64
        api = client.ApiClient(config)
        api.user_agent = BENCH_AGENT
        cluster = Cluster(api)
        probe = tmp / "probe.jsonl"
        os.sched_setaffinity(0, own)  # the operator inherits it, every thread it starts too
        operator = Operator(kubeconfig, tmp / "operator.log", args=("-m", "bench._operator_probe") if args.probe else (),
                            LLAMAFT_SYNC_INTERVAL="3600", LLAMAFT_PROBE_OUT=str(probe) if args.probe else "",
                            **({"LLAMAFT_WORKERS": str(args.workers)} if args.workers else {})).start()
        os.sched_setaffinity(0, others)
        if args.pin:
            print(f"cores: operator {sorted(own)}, emulator and client {sorted(others)}")
        watch = JobWatch(cluster).start()
        time.sleep(4)  # let the operator start watching
        proc = psutil.Process(operator.proc.pid)  # type: ignore[union-attr]
        settle(proc)
        print(f"operator RSS at idle: {proc.memory_info().rss / 2**20:,.0f} MiB; load average {load()}")
        # One LlamaFineTune first, not measured: the emulator loads its PyTorchJob admission schemas
        # on the first create (about a second), which is not the operator's latency.
        cluster.create("warm-up", tiny_spec())
        while "warm-up" not in watch.seen:
            if operator.proc.poll() is not None:  # type: ignore[union-attr]
                tail = operator.log_path.read_text(errors="replace").splitlines()[-15:]
                sys.exit("the operator exited before its first fine-tune:\n" + "\n".join(tail))
            time.sleep(0.1)
        settle(proc, emulator_proc)
        memory = Path(f"{probe}.mem")

        def dump_memory(when: str) -> None:
            if not (args.probe and args.memory):
                return
            size = memory.stat().st_size if memory.exists() else 0
            os.kill(proc.pid, signal.SIGUSR1)
            deadline = time.monotonic() + 30
            while (memory.stat().st_size if memory.exists() else 0) == size and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(0.5)
            print(f"      live objects {when} (change, total, type):")
            print("\n".join("        " + line for line in memory.read_text()[size:].strip().splitlines()[:16]))

        dump_memory("at idle")
        try:
            for count in args.counts:
                names = [f"lat{count}-{i}" for i in range(count)]
                sent: dict[str, float] = {}
                acked: dict[str, float] = {}

                def create(name: str, sent: dict[str, float] = sent, acked: dict[str, float] = acked) -> None:
                    sent[name] = time.perf_counter()
                    cluster.create(name, tiny_spec())
                    acked[name] = time.perf_counter()

                speed = reference_ms(own)
                emulator.stats(reset=True)
                load_before, cpu_op, cpu_emu, cpu_me = load(), cpu(proc), cpu(emulator_proc), cpu(psutil.Process())
                cpu_loop = loop_cpu(proc)
                began = time.perf_counter()
                spies = []
                if count in args.pyspy:
                    out_dir.mkdir(exist_ok=True)
                    for who, pid in (("operator", proc.pid), ("emulator", emulator.pid)):
                        spies.append(subprocess.Popen(
                            [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid), "--format", "raw",
                             "--output", str(out_dir / f"{who}-{count}.txt"), "--rate", "1000", "--nonblocking", "--gil"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                with Sampler(proc) as sampler:
                    threads = [threading.Thread(target=create, args=(n,)) for n in names]
                    for t in threads:
                        t.start()
                    deadline = time.perf_counter() + 60 + count * 0.1  # a job not there by then is lost
                    while any(n not in watch.seen for n in names) and time.perf_counter() < deadline:
                        time.sleep(0.05)
                    for t in threads:
                        t.join()
                    done = [n for n in names if n in watch.seen and n in acked]
                    settle(proc, emulator_proc)
                missing = sorted(set(names) - set(done))
                if missing:
                    out_dir.mkdir(exist_ok=True)
                    kept = out_dir / "operator.log"
                    kept.write_bytes(operator.log_path.read_bytes())
                    print(f"      NO PyTorchJob for {len(missing)}: {', '.join(missing[:10])}; the operator's log: {kept}")
                for spy in spies:
                    spy.send_signal(2)
                    spy.wait(30)
                stats = emulator.stats(reset=True)
                from_ack = [watch.seen[n] - acked[n] for n in done]
                from_sent = [watch.seen[n] - sent[n] for n in done]
                print(f"{count:>4} CRs at once: {len(done)}/{count} PyTorchJobs, create->job p50 {ms(statistics.median(from_ack))}, "
                      f"p99 {ms(pct(from_ack, 0.99))} (from the request: p50 {ms(statistics.median(from_sent))}, "
                      f"p99 {ms(pct(from_sent, 0.99))}); operator RSS {proc.memory_info().rss / 2**20:,.0f} MiB "
                      f"(peak {sampler.peak / 2**20:,.0f} MiB)")
                timings = [t for _, t in stats["timings"]]
                lags = stats.get("lags") or [0.0]
                operator_cpu, operator_loop = cpu(proc) - cpu_op, loop_cpu(proc) - cpu_loop
                print(f"      emulator: {len(timings)} requests, own latency p50 {ms(statistics.median(timings))}, "
                      f"p99 {ms(pct(timings, 0.99))}, max {ms(max(timings))}; its loop's lag p50 {ms(statistics.median(lags))}, "
                      f"max {ms(max(lags))}; CPU s: operator {operator_cpu:.1f} ({ms(operator_cpu / count)} per CR: its event loop "
                      f"{ms(operator_loop / count)}, threads {ms((operator_cpu - operator_loop) / count)}), "
                      f"emulator {cpu(emulator_proc) - cpu_emu:.1f}, this client {cpu(psutil.Process()) - cpu_me:.1f}; "
                      f"load average {load_before} -> {load()}")
                print(f"      machine speed: the reference workload took {speed:.1f} ms on the operator's core before "
                      f"the batch, {reference_ms(own):.1f} ms after (REFERENCE_WORKLOAD; compare runs by it)")
                requests_report(stats["requests"], count)
                dump_memory(f"after {count}")
                if args.probe:
                    time.sleep(1.5)  # the probe flushes every second
                    probe_report(probe, set(names), count, began, acked, watch.seen)
        finally:
            operator.stop()
            emulator.stop()


if __name__ == "__main__":
    main()
