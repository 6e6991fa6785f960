"""Reconcile latency of the real operator (kopf runtime) against the kmock emulator on loopback:
for 1, 50 and 200 LlamaFineTunes created at once, the time from each create to its PyTorchJob
existing (p50/p99), and the operator's resident memory, printed in one run.

    .venv/bin/python bench/operator_latency.py

c10d rendezvous is used so that no etcd is involved: this measures the operator and API round
trips, not etcd. The emulator runs in this process; the operator is a separate process.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.operator.conftest import Cluster, Operator, tiny_spec  # noqa: E402
from tests.operator.emulator import EmulatorThread, write_kubeconfig  # noqa: E402

COUNTS = tuple(int(c) for c in sys.argv[1:]) or (1, 50, 200)


def main() -> None:
    from kubernetes import client

    emulator = EmulatorThread().start()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        kubeconfig = write_kubeconfig(emulator.url, tmp / "config")
        config = client.Configuration()
        config.host = emulator.url
        config.connection_pool_maxsize = 32
        cluster = Cluster(client.ApiClient(config))
        operator = Operator(kubeconfig, tmp / "operator.log", LLAMAFT_SYNC_INTERVAL="3600").start()
        time.sleep(4)  # let the operator start watching
        proc = psutil.Process(operator.proc.pid)  # type: ignore[union-attr]
        print(f"operator RSS at idle: {proc.memory_info().rss / 2**20:,.0f} MiB")
        try:
            for count in COUNTS:
                names = [f"lat{count}-{i}" for i in range(count)]
                created: dict[str, float] = {}
                seen: dict[str, float] = {}

                def create(name: str, created: dict[str, float] = created) -> None:
                    created[name] = time.perf_counter()
                    cluster.create(name, tiny_spec())

                threads = [threading.Thread(target=create, args=(n,)) for n in names]
                for t in threads:
                    t.start()
                deadline = time.perf_counter() + 600
                while len(seen) < count and time.perf_counter() < deadline:
                    now = time.perf_counter()
                    for job in cluster.jobs():
                        owner = job["metadata"]["labels"]["llamaft.io/finetune"]
                        if owner in created and owner not in seen:
                            seen[owner] = now
                    time.sleep(0.25)
                for t in threads:
                    t.join()
                latencies = sorted(seen[n] - created[n] for n in seen)
                p50 = statistics.median(latencies)
                p99 = latencies[min(len(latencies) - 1, int(round(0.99 * (len(latencies) - 1))))]
                me = psutil.Process()
                print(f"      cpu so far: operator {sum(proc.cpu_times()[:2]):.1f}s, emulator+client {sum(me.cpu_times()[:2]):.1f}s")
                print(f"{count:>4} CRs at once: {len(seen)}/{count} PyTorchJobs, create->job p50 {p50 * 1000:,.0f} ms, "
                      f"p99 {p99 * 1000:,.0f} ms; operator RSS {proc.memory_info().rss / 2**20:,.0f} MiB")
        finally:
            operator.stop()
            emulator.stop()


if __name__ == "__main__":
    main()
