"""An elastic run on a simulated cluster shrinks instead of waiting, and grows back: the real kopf
operator, the simulated Kubeflow training operator, scheduler and kubelets (tests/operator/sim.py)
running the real `torchrun -m llamaft_trainer` on a tiny Llama, a real etcd.

Each node has room for one worker (3 cpu, a worker requests 2). A 2-worker run loses a node; no
node has room for the replacement, which stays Pending and Unschedulable (as kube-scheduler
leaves it); within `shrinkAfterSeconds` the operator runs on 1 worker, and status, events and the
Workers column say so. A node joins; at the run's next checkpoint `growBackAfterSeconds` later it
asks for 2 workers again, gets them, and the run ends Succeeded, every step trained on the items
the same spec run without a fault trains on, the losses after the shrink equal to that run's and
each step redone after a resize equal to its first run (training.globalBatchSize: the batch and
the data order do not depend on the world size, and a checkpoint resumes on any). A PyTorchJob
is resized in place (its Worker replicas; torchrun admits the node range); a TrainJob's node count
is immutable, so each resize is a new attempt from the newest checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock
from kubernetes import client
from llamaft.api import crd as crdgen
from llamaft_trainer.process.local_etcd import LocalEtcd
from llamaft_trainer.report.logline import read_events

from tests.operator.conftest import Cluster, Operator, wait_for
from tests.operator.emulator import EmulatorThread, write_kubeconfig
from tests.operator.sim import SimCluster, pod_port
from tests.operator.sim_fixtures import (
    CHECKPOINT_CLAIM,
    DATASET,
    checkpoint_folder,
    checkpointing,
    torch_distributed_runtime,
)

STEPS, EVERY = 400, 10
"""Long enough at one CPU worker that the grow-back (a pod started, torchrun admitting it) comes
before the last step; a checkpoint every 10 steps is the grow-back's boundary."""
SHRINK_AFTER, GROW_BACK_AFTER = 5, 15
SLACK = 15
"""Seconds beyond shrinkAfterSeconds the shrink may take: the operator's sync interval (1 s), a
status write and a loaded machine."""
NAME, STRAIGHT = "elastic", "straight"
GLOBAL_BATCH = 4
"""Packed blocks per optimizer step: 2 micro-steps of perDeviceBatchSize 2 on one worker, 1 on two."""
RUNTIMES = "/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes"
DRIFT_FREE = 20
"""Steps after the shrink compared to the uninterrupted run's to 1e-5. The shrink resumes from a
checkpoint both runs wrote alike (2 workers each until then); from there 1 and 2 ranks sum in a
different order, and the two traces drift apart as float rounding does (measured: within 2e-6 for
20 steps, 5e-5 by step 200, 9e-3 by step 400). The grow-back resumes from a checkpoint the 1-worker
segment wrote, already that far apart by an amount that depends on how many steps the segment ran
(the machine's speed): every step is checked by its items instead, and any step trained twice
(before a resume and after it, on the other world size, from the same checkpoint) against itself."""
STRAIGHT_CLAIM = "straight-checkpoints"
"""The uninterrupted run's own volume: the elastic run's checkpoints are not its to resume."""


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's folder that every xdist worker sees (each worker's basetemp is a folder of it)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "elastic-straight"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture
def world(etcd: LocalEtcd, tmp_path: Path) -> Iterator[tuple[Cluster, SimCluster, Operator]]:
    """A fresh cluster of two nodes with room for one worker each, Kubeflow Trainer's stock
    torch-distributed runtime installed, and the operator."""
    emulator = EmulatorThread().start()
    config = client.Configuration()
    config.host = emulator.url
    cluster = Cluster(client.ApiClient(config))
    sim = SimCluster(emulator.url, etcd.endpoint, nodes=2, workdir=tmp_path / "sim", node_cpu="3", node_memory="16Gi",
                     claims={CHECKPOINT_CLAIM: checkpoint_folder(tmp_path), STRAIGHT_CLAIM: tmp_path / "straight"})
    operator = Operator(write_kubeconfig(emulator.url, tmp_path / "kubeconfig"), tmp_path / "operator.log", cli=True,
                        LLAMAFT_RENDEZVOUS_ADDRESS_OVERRIDE=etcd.endpoint, LLAMAFT_SYNC_INTERVAL="1",
                        LLAMAFT_RETRY_BACKOFF_SECONDS="1", LLAMAFT_PROGRESS_TIMEOUT="0.5")
    try:
        sim.start()
        assert sim.api.create(RUNTIMES, torch_distributed_runtime()) is not None
        operator.start()
        yield cluster, sim, operator
    finally:
        operator.stop()
        sim.stop()
        emulator.stop()


def elastic_spec(model: Path, backend: str, name: str = NAME) -> dict[str, Any]:
    return {
        "backend": backend,
        "model": {"source": str(model), "dtype": "float32"},
        "dataset": {"format": "samsum", "source": str(DATASET), "maxSeqLength": 64, "packing": True, "validationSplit": 0.1},
        "training": {"maxSteps": STEPS, "perDeviceBatchSize": 2, "globalBatchSize": GLOBAL_BATCH, "learningRate": 2e-3,
                     "evalInterval": 0, "seed": 7, "collectiveTimeoutSeconds": 30},
        "fsdp": {"mixedPrecision": "fp32", "activationCheckpointing": {"mode": "none"}},
        "checkpointing": {**checkpointing(name, everyNSteps=EVERY, keepLast=2, exportHuggingFace=False),
                          "volumeClaim": CHECKPOINT_CLAIM if name == NAME else STRAIGHT_CLAIM},
        "cluster": {"workers": 2, "gpusPerWorker": 0, "image": "llamaft/trainer:test", "terminationGracePeriodSeconds": 5,
                    "resources": {"cpu": "2", "memory": "4Gi"},
                    "elastic": {"minWorkers": 1, "maxWorkers": 2, "shrinkAfterSeconds": SHRINK_AFTER,
                                "growBackAfterSeconds": GROW_BACK_AFTER},
                    "env": [{"name": "LLAMAFT_LOG_ITEMS", "value": "1"}]},
        "rendezvous": {"backend": "etcd-v2", "maxRestarts": 3},
        "monitoring": {"metricsPort": pod_port()},
        "runPolicy": {"retryBudget": 3, "progressDeadlineSeconds": 120, "startupGraceSeconds": 180},
    }


def column(obj: dict[str, Any], name: str) -> Any:
    """What `kubectl get` prints in printer column `name` (its simple .a.b.c jsonPath)."""
    path = next(c["jsonPath"] for c in crdgen.PRINTER_COLUMNS if c["name"] == name)
    value: Any = obj
    for part in path.strip(".").split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def moment(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def steps_logged(sim: SimCluster, name: str, event: str = "step") -> list[dict[str, Any]]:
    """Every `event` line (step, resume) of every pod of run `name` that ran (rank 0 logs them), pod by pod."""
    return [line for pod in sim.pods_run() if pod.startswith(name + "-")
            for line in read_events(sim.logs(pod)) if line.get("event") == event]


def finished(cluster: Cluster, name: str) -> dict[str, Any]:
    done = wait_for(f"{name} finished", lambda: (s := cluster.status(name)).get("phase") in ("Succeeded", "Failed") and s,
                    timeout=600, interval=1)
    assert done["phase"] == "Succeeded", json.dumps(done, indent=1)[:4000]
    return done


def trainer_pods(sim: SimCluster, job: str) -> list[dict[str, Any]]:
    """The live trainer pods of `job` (either backend's: their names start with the job's)."""
    return sorted((p for p in sim.api.list("/api/v1/pods", label_selector=f"llamaft.io/finetune={NAME}")
                   if p["metadata"]["name"].startswith(job + "-") and not p["metadata"].get("deletionTimestamp")),
                  key=lambda p: p["metadata"]["name"])


def job_workers(cluster: Cluster, backend: str, name: str) -> int | None:
    """The worker count the job `name` asks for (PyTorchJob: Worker replicas; TrainJob: numNodes)."""
    if backend == "PyTorchJob":
        job = cluster.job(name)
        return None if job is None else int(job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"])
    try:
        obj = cluster.custom.get_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", "default", "trainjobs", name)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return int(obj["spec"]["trainer"]["numNodes"])


def straight_run(cluster: Cluster, sim: SimCluster, tiny_model: Path, backend: str, shared: Path) -> dict[str, Any]:
    """The same spec without a fault, on 2 workers: per step its loss and the items it trained.
    One run serves both backends' tests: the backend decides how the worker pods are made and
    started, not what they train (the same torchrun, ranks, spec and data order), so the other
    backend's elastic run must continue it as well. The first test to need it runs it on its own
    cluster under a file lock in the session's shared folder; the other reads what it logged."""
    saved = shared / "straight.json"
    weights = hashlib.sha256((tiny_model / "model.safetensors").read_bytes()).hexdigest()
    with FileLock(shared / "straight.lock"):
        if saved.exists():
            out = dict(json.loads(saved.read_text()))
            assert out["weights"] == weights, "the reference was trained from another tiny model"
            return out
        cluster.create(STRAIGHT, elastic_spec(tiny_model, backend, STRAIGHT))
        straight = finished(cluster, STRAIGHT)
        assert straight["attempt"] == 1 and straight["workers"]["current"] == 2
        out = {"backend": backend, "weights": weights, "losses": {str(line["step"]): line["loss"] for line in steps_logged(sim, STRAIGHT)},
               "items": {str(step): items for step, items in items_of_the_last_run(sim, STRAIGHT).items()}}
        saved.write_text(json.dumps(out))
        return out


@pytest.mark.parametrize("backend", ["PyTorchJob", "TrainJob"])
def test_a_lost_node_shrinks_the_run_and_a_returning_one_grows_it_back(
        world: tuple[Cluster, SimCluster, Operator], tiny_model: Path, backend: str, shared: Path) -> None:
    cluster, sim, operator = world
    cluster.create(NAME, elastic_spec(tiny_model, backend))
    running = wait_for("2 workers training past the first checkpoint", lambda: (
        (s := cluster.status(NAME)).get("progress", {}).get("step", 0) > EVERY and s.get("workers", {}).get("active") == 2 and s),
        timeout=240, interval=0.5)
    assert running["workers"]["current"] == 2 and running["workers"]["reason"] == "AsSpecified"
    assert column(cluster.finetune(NAME), "Workers") == 2

    # A node goes, with no room left on the other one for its worker.
    lost = trainer_pods(sim, running["jobName"])[-1]["spec"]["nodeName"]  # PyTorchJob: worker-1's (scaled down in place)
    sim.lose_node(lost)

    unschedulable: dict[str, datetime] = {}  # pod -> since when the scheduler says it has no room

    def shrunk_now() -> dict[str, Any] | None:
        for pod in sim.api.list("/api/v1/pods", label_selector=f"llamaft.io/finetune={NAME}"):
            cond = next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"), {})
            if cond.get("reason") == "Unschedulable" and cond.get("lastTransitionTime"):
                unschedulable.setdefault(pod["metadata"]["name"], moment(cond["lastTransitionTime"]))
        status = cluster.status(NAME)
        print(datetime.now().time(), status.get("attempt"), status.get("workers"), flush=True)  # the trace a failure shows
        return status if status.get("workers", {}).get("reason") == "Shrunk" else None
    shrunk = wait_for("shrunk to 1 worker", shrunk_now, timeout=SHRINK_AFTER + 120, interval=0.2)
    workers = shrunk["workers"]
    assert workers["current"] == 1 and workers["desired"] == 2 and "unschedulable" in workers["message"]
    assert "Insufficient cpu" in workers["message"], "the scheduler's own words"
    # The job the shrink acted on: the same one in place; a TrainJob's shrink made the next attempt.
    acted_on = shrunk["jobName"] if backend == "PyTorchJob" else cluster.job_name(NAME, shrunk["attempt"] - 1)
    since = min(t for pod, t in unschedulable.items() if pod.startswith(acted_on + "-"))
    waited = (moment(workers["lastResizeTime"]) - since).total_seconds()
    assert SHRINK_AFTER - 1 <= waited <= SHRINK_AFTER + SLACK, f"shrunk {waited}s after its pod became unschedulable"
    finetune = cluster.finetune(NAME)
    assert column(finetune, "Workers") == 1 and column(finetune, "Desired") == 2 and column(finetune, "Sized") == "Shrunk"
    assert "Shrunk" in cluster.wait_reasons(NAME, "Shrunk", timeout=30)
    if backend == "TrainJob":  # the next attempt, on 1 worker, from the newest checkpoint
        assert shrunk["attempt"] > running["attempt"] and shrunk["jobName"] != running["jobName"]
        wait_for("the next attempt's TrainJob on 1 worker", lambda: job_workers(cluster, backend, shrunk["jobName"]) == 1,
                 timeout=60)
    else:  # in place
        assert job_workers(cluster, backend, shrunk["jobName"]) == 1
        assert cluster.status(NAME)["jobName"] == shrunk["jobName"]

    # Capacity returns: at a later checkpoint the run asks for 2 workers again, and gets them.
    sim.add_node("node-9")
    grown = wait_for("back at 2 workers", lambda: (
        (s := cluster.status(NAME)).get("workers", {}).get("reason") == "AsSpecified" and s["workers"].get("active") == 2 and s),
        timeout=240, interval=0.5)
    assert grown["workers"]["current"] == 2 and grown["workers"]["lastResizeStep"] > workers["lastResizeStep"]
    assert {"Shrunk", "GrowingBack", "GrewBack"} <= cluster.wait_reasons(NAME, "GrowingBack", "GrewBack", timeout=30)
    assert column(cluster.finetune(NAME), "Workers") == 2

    done = finished(cluster, NAME)
    assert done["retriesUsed"] <= 1, "a resize spends no retry (the node loss may)"
    if backend == "TrainJob":
        assert job_workers(cluster, backend, done["jobName"]) == 2, "the last attempt ran on 2 workers"
    trained = steps_logged(sim, NAME)
    assert {line["step"] for line in trained} == set(range(1, STEPS + 1)), "every step trained"

    # The same spec without a fault, on 2 workers: the loss trace the elastic run continued.
    straight = straight_run(cluster, sim, tiny_model, backend, shared)
    reference = {int(step): loss for step, loss in straight["losses"].items()}
    assert sorted(reference) == list(range(1, STEPS + 1))
    # What the run trained is what the uninterrupted run trained: step for step the same items, on
    # any world size (training.globalBatchSize; every rank logs its items, LLAMAFT_LOG_ITEMS).
    want_items = {int(step): sorted(items) for step, items in straight["items"].items()}
    assert items_logged(sim, NAME) == {step: set(items) for step, items in want_items.items()}
    # ... and the run that last trained each step (the one whose checkpoints the next resumed from)
    # took each of them exactly once over its ranks: nothing repeated, whatever its world size.
    assert items_of_the_last_run(sim, NAME) == want_items
    resumed = sorted({line["step"] for line in steps_logged(sim, NAME, "resume")})
    assert len(resumed) >= 2, f"resumed at {resumed}: after the shrink and after the grow-back"
    losses: dict[int, list[float]] = {}  # step -> its losses in the order they were logged (a redone step: several)
    for line in sorted(trained, key=lambda line: line["ts"]):
        losses.setdefault(line["step"], []).append(line["loss"])
    # Up to the shrink's checkpoint the two runs are alike; the shrink's resume (1 worker) continues
    # the uninterrupted run's (2 workers) losses to 1e-5 (fp32).
    off = [(step, losses[step][-1], reference[step]) for step in range(1, resumed[0] + DRIFT_FREE + 1)
           if not close(losses[step][-1], reference[step])]
    assert not off, f"{len(off)} steps up to {DRIFT_FREE} after the shrink differ from the uninterrupted run's: {off[:10]}"
    # A step trained before a resume and again after it, on the other world size from the same
    # checkpoint, has the same loss both times (the node loss leaves the steps since the newest
    # checkpoint to redo; a grow-back stops at its checkpoint and usually redoes none).
    redone = {step: values for step, values in losses.items() if len(values) > 1}
    unequal = [(step, values) for step, values in redone.items() if not all(close(value, values[0]) for value in values)]
    assert not unequal, f"{len(unequal)} of {len(redone)} redone steps differ from their first run: {unequal[:10]}"


def close(value: float, want: float) -> bool:
    """Equal to fp32 rounding over a few steps summed in another order."""
    return abs(value - want) <= 1e-5 * abs(want) + 2e-6


def items_of_the_last_run(sim: SimCluster, name: str) -> dict[int, list[int]]:
    """step -> the items the last run of that step logged, every rank's together, sorted. The last
    run of step s began at the newest `resume` (rank 0's, before any rank's first step of that run:
    each step's collectives wait for rank 0) from a step below s, or at the start if none; every
    item event of s after it is that run's (later runs resumed at s or beyond)."""
    resumes = sorted((line["ts"], line["step"]) for line in steps_logged(sim, name, "resume"))
    out: dict[int, list[int]] = {}
    for line in steps_logged(sim, name, "items"):
        began = max((ts for ts, at in resumes if at < line["step"]), default="")
        if line["ts"] > began:
            out.setdefault(line["step"], []).extend(line["items"])
    return {step: sorted(items) for step, items in out.items()}


def items_logged(sim: SimCluster, name: str) -> dict[int, set[int]]:
    """step -> the training items run `name` consumed at that step, all ranks and attempts together
    (a redone step that took other items than its first run would show more)."""
    out: dict[int, set[int]] = {}
    for line in steps_logged(sim, name, "items"):
        out.setdefault(line["step"], set()).update(line["items"])
    return out
