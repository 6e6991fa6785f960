"""Recovery time per fault, with the chart's defaults: the real operator (kopf, default sync
interval and retry backoff), the API emulator, the simulated Kubeflow training operator and
kubelets running the real trainer on a tiny Llama, and a real etcd.

For each fault it prints: seconds from the fault to the failure being recorded, to the new
attempt's PyTorchJob existing, and to the new attempt's first training step (its leader's `step`
line), and how many steps were redone. Targets (issue 8): <= 10 s to the new job, <= 30 s to its
first step on the tiny model.

    .venv/bin/python bench/recovery.py                     # every fault once
    .venv/bin/python bench/recovery.py kill_container hang # some of them

The hang fault uses runPolicy.progressDeadlineSeconds 20 (the default is 900: a hang is found by
the deadline, so its figure is deadline + reaction, reported separately).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llamaft.operator.settings import OperatorSettings  # noqa: E402
from llamaft_trainer.process.local_etcd import LocalEtcd  # noqa: E402
from llamaft_trainer.tiny import build_tiny_llama  # noqa: E402

from tests.operator.conftest import Cluster, Operator, wait_for  # noqa: E402
from tests.operator.emulator import EmulatorThread, write_kubeconfig  # noqa: E402
from tests.operator.sim import SimCluster  # noqa: E402
from tests.operator.test_runs import DATASET, EVERY, inject, other_pod, run_spec, stepping, steps_of  # noqa: E402

FAULTS = ["kill_container", "oom_kill", "kubelet_eviction", "preemption", "lose_node", "hang"]
"""Names understood by tests.operator.test_runs.inject."""


def first_step(sim: SimCluster, job: str) -> tuple[float, int] | None:
    """(wall time, step) of the attempt's first `step` line, from its leader's log."""
    for index in range(2):
        for line in steps_of(sim.logs(f"{job}-worker-{index}")):
            if line.get("event") == "step":
                return datetime.fromisoformat(str(line["ts"]).replace("Z", "+00:00")).timestamp(), int(line["step"])
    return None


def measure(cluster: Cluster, sim: SimCluster, model: Path, tmp: Path, fault: str) -> dict[str, Any]:
    name = f"rec-{fault.replace('_', '')}"[:30]
    policy = {"progressDeadlineSeconds": 20} if fault == "hang" else {}
    cluster.create(name, run_spec(model, tmp / name, runPolicy=policy))
    stepping(cluster, sim, name, EVERY + 2, timeout=300)
    victim = other_pod(cluster, sim, name)
    reached = EVERY + 2
    t0 = time.time()
    inject(sim, fault, victim)
    recorded = wait_for("failure recorded", lambda: cluster.status(name).get("failures"), timeout=300)
    t_recorded = time.time()
    job2 = wait_for("attempt 2's job", lambda: cluster.attempt_job(name, 2), timeout=300, interval=0.05)
    created = time.time()  # creationTimestamp has whole seconds only: poll instead
    first = wait_for("attempt 2's first step", lambda: first_step(sim, job2["metadata"]["name"]), timeout=300)
    last_before = max((int(line["step"]) for i in range(2) for line in steps_of(sim.logs(f"{cluster.job_name(name, 1)}-worker-{i}"))
                       if line.get("event") == "step"), default=reached)
    result = {
        "fault": fault, "reason": recorded[0]["reason"], "to_recorded_s": round(t_recorded - t0, 1),
        "to_new_job_s": round(max(0.0, created - t0), 1), "to_first_step_s": round(first[0] - t0, 1),
        "steps_redone": max(0, last_before - first[1] + 1),
    }
    cluster.delete_finetune(name)
    return result


def main() -> None:
    from kubernetes import client

    faults = sys.argv[1:] or FAULTS
    defaults = OperatorSettings()
    print(f"operator defaults: sync interval {defaults.sync_interval_s:.0f}s, retry backoff {defaults.retry_backoff_s:.0f}s "
          "(first retry at once)")
    with tempfile.TemporaryDirectory() as tmp_name, LocalEtcd() as etcd:
        tmp = Path(tmp_name)
        model = build_tiny_llama(tmp / "tiny", DATASET, hidden_size=64, layers=4, vocab_size=512)
        emulator = EmulatorThread().start()
        sim = SimCluster(emulator.url, etcd.endpoint, nodes=4, workdir=tmp / "sim").start()
        config = client.Configuration()
        config.host = emulator.url
        cluster = Cluster(client.ApiClient(config))
        operator = Operator(write_kubeconfig(emulator.url, tmp / "kubeconfig"), tmp / "operator.log", cli=True,
                            LLAMAFT_RENDEZVOUS_ADDRESS_OVERRIDE=etcd.endpoint,
                            LLAMAFT_SYNC_INTERVAL=str(defaults.sync_interval_s),
                            LLAMAFT_RETRY_BACKOFF_SECONDS=str(defaults.retry_backoff_s)).start()
        results = []
        try:
            for fault in faults:
                result = measure(cluster, sim, model, tmp, fault)
                results.append(result)
                print(json.dumps(result), flush=True)
        finally:
            operator.stop()
            sim.stop()
            emulator.stop()
        print(f"{'fault':<18}{'cause':<12}{'recorded':>10}{'new job':>10}{'1st step':>10}{'redone':>8}")
        for r in results:
            print(f"{r['fault']:<18}{r['reason']:<12}{r['to_recorded_s']:>9.1f}s{r['to_new_job_s']:>9.1f}s"
                  f"{r['to_first_step_s']:>9.1f}s{r['steps_redone']:>8}")
        fast = [r for r in results if r["fault"] != "hang"]
        if fast:
            print(f"worst (without hang): new job {max(r['to_new_job_s'] for r in fast):.1f}s (target 10), "
                  f"first step {max(r['to_first_step_s'] for r in fast):.1f}s (target 30)")


if __name__ == "__main__":
    main()
