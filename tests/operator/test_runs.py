"""Whole runs on a simulated cluster: the real kopf operator, the API emulator, a simulated Kubeflow
training operator and kubelets that run the real `torchrun -m llamaft_trainer` on a tiny Llama, a
real etcd. Each scenario asserts what a user relies on:

- the final phase, and a final status equal to the trainer's own last report;
- exactly one live PyTorchJob per run;
- a continuous loss trace: every step of the run was trained, at most one checkpoint interval of
  steps was redone after a failure, and a redone step reproduced its loss (exact resume);
- no orphans: deleting the LlamaFineTune leaves no job, pod, etcd, config or process behind.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llamaft_trainer.process.local_etcd import LocalEtcd
from llamaft_trainer.report.logline import read_events

from tests.conftest import REPO
from tests.operator.conftest import Cluster, Operator, close_rendezvous, wait_for
from tests.operator.emulator import EmulatorThread, write_kubeconfig
from tests.operator.sim import SimCluster, pod_port
from tests.operator.sim_fixtures import CHECKPOINT_CLAIM, checkpoint_folder, checkpointing, on_claim

DATASET = REPO / "examples" / "data" / "samsum-tiny.jsonl"
STEPS, EVERY = 60, 10
"""A tiny-model step takes 50-100 ms here: 60 steps leave a window of seconds to inject a fault after
the first checkpoint (step 10) and before the end; the faults land within a poll (0.1 s) of it."""
LABEL = "llamaft.io/finetune"
RUN = "run"
"""The runs' checkpoint directory is /checkpoints/run, where their pods mount CHECKPOINT_CLAIM."""


# ------------------------------------------------------------------------------------ world
@pytest.fixture(scope="module")
def world(etcd: LocalEtcd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatorThread, Cluster, SimCluster, Path]]:
    from kubernetes import client

    emulator = EmulatorThread().start()
    tmp = tmp_path_factory.mktemp("world")
    kubeconfig = write_kubeconfig(emulator.url, tmp / "kubeconfig")
    config = client.Configuration()
    config.host = emulator.url
    cluster = Cluster(client.ApiClient(config))
    sim = SimCluster(emulator.url, etcd.endpoint, nodes=4, workdir=tmp / "sim").start()
    try:
        yield emulator, cluster, sim, kubeconfig
    finally:
        sim.stop()
        emulator.stop()


OPERATOR_ENV = {"LLAMAFT_SYNC_INTERVAL": "1", "LLAMAFT_RETRY_BACKOFF_SECONDS": "1", "LLAMAFT_PROGRESS_TIMEOUT": "0.5"}


@pytest.fixture(scope="module")
def operator(world: tuple[EmulatorThread, Cluster, SimCluster, Path], etcd: LocalEtcd,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    op = Operator(world[3], tmp_path_factory.mktemp("op") / "operator.log", cli=True,
                  LLAMAFT_RENDEZVOUS_ADDRESS_OVERRIDE=etcd.endpoint, **OPERATOR_ENV).start()
    yield op
    op.stop()


@pytest.fixture
def cluster(world: tuple[EmulatorThread, Cluster, SimCluster, Path]) -> Cluster:
    return world[1]


@pytest.fixture
def sim(world: tuple[EmulatorThread, Cluster, SimCluster, Path], tmp_path: Path) -> SimCluster:
    """The module's cluster, its claim CHECKPOINT_CLAIM bound to this test's folder (a fresh
    volume per test): the runs keep their checkpoints and export there, not in their containers."""
    world[2].claims[CHECKPOINT_CLAIM] = checkpoint_folder(tmp_path)
    return world[2]


def run_spec(model: Path, *, backend: str = "etcd-v2", **overrides: Any) -> dict[str, Any]:
    """A run whose checkpoints and export are on CHECKPOINT_CLAIM, at /checkpoints/run."""
    spec: dict[str, Any] = {
        "model": {"source": str(model), "dtype": "float32"},
        "dataset": {"format": "samsum", "source": str(DATASET), "maxSeqLength": 64, "packing": True, "validationSplit": 0.1},
        "training": {"maxSteps": STEPS, "perDeviceBatchSize": 2, "learningRate": 2e-3, "evalInterval": 0, "seed": 7,
                     "collectiveTimeoutSeconds": 30},
        "fsdp": {"mixedPrecision": "fp32", "activationCheckpointing": {"mode": "none"}},
        "checkpointing": checkpointing(RUN, everyNSteps=EVERY, keepLast=2, exportHuggingFace=True),
        "cluster": {"workers": 2, "gpusPerWorker": 0, "image": "llamaft/trainer:test", "terminationGracePeriodSeconds": 5},
        "rendezvous": {"backend": backend, "maxRestarts": 0},
        "monitoring": {"metricsPort": pod_port()},
        "runPolicy": {"retryBudget": 3, "progressDeadlineSeconds": 60, "startupGraceSeconds": 120},
    }
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


# ------------------------------------------------------------------------------- assertions
def attempt_logs(cluster: Cluster, sim: SimCluster, name: str, attempts: int, workers: int = 2) -> list[list[dict[str, Any]]]:
    """The JSON lines of global rank 0 (whichever pod ran it), per attempt."""
    per_attempt = []
    for attempt in range(1, attempts + 1):
        job = cluster.job_name(name, attempt)
        lines: list[dict[str, Any]] = []
        for index in range(workers):
            lines += read_events(sim.logs(f"{job}-worker-{index}"))
        per_attempt.append(lines)
    return per_attempt


def assert_continuous(per_attempt: list[list[dict[str, Any]]], total: int = STEPS, every: int = EVERY) -> None:
    losses: dict[int, float] = {}
    reached = 0
    for lines in per_attempt:
        steps = [line for line in lines if line.get("event") == "step"]
        if not steps:
            continue
        first = steps[0]["step"]
        assert first >= reached - every + 1 or reached == 0, f"redid more than one checkpoint interval: {reached} -> {first}"
        assert [s["step"] for s in steps] == list(range(first, first + len(steps))), "steps within an attempt are contiguous"
        for s in steps:
            if s["step"] in losses:
                assert abs(losses[s["step"]] - s["loss"]) < 1e-4, f"step {s['step']} redone with another loss"
            losses[s["step"]] = s["loss"]
        reached = max(reached, steps[-1]["step"])
    assert sorted(losses) == list(range(1, total + 1)), f"steps trained: {sorted(losses)}"


def assert_final_report(status: dict[str, Any], per_attempt: list[list[dict[str, Any]]], sim: SimCluster) -> None:
    done = [line for line in per_attempt[-1] if line.get("event") == "done"]
    assert done, "the last attempt's leader printed its done line"
    report = done[-1]
    progress = status["progress"]
    assert progress["step"] == report["step"] == STEPS and progress["stepOfTotal"] == f"{STEPS}/{STEPS}"
    assert progress["loss"] == pytest.approx(report["loss"], abs=1e-9)
    assert status["exportPath"] == report["exportPath"]
    assert (on_claim(sim.claims[CHECKPOINT_CLAIM], RUN, report["exportPath"]) / "config.json").exists(), "exported onto the claim"
    expected = {k: v for k, v in report["performance"].items() if v is not None}
    assert status["performance"] == expected and expected["worldSize"] == 2


def live_jobs(cluster: Cluster, name: str) -> list[str]:
    return [j["metadata"]["name"] for j in cluster.jobs(f"{LABEL}={name}") if not j["metadata"].get("deletionTimestamp")]


def assert_one_live_job(cluster: Cluster, name: str) -> None:
    expected = [cluster.status(name)["jobName"]]
    wait_for("exactly one live job", lambda: live_jobs(cluster, name) == expected, timeout=30)


def delete_and_assert_no_orphans(cluster: Cluster, sim: SimCluster, name: str) -> None:
    pods_before = [p.metadata.name for p in cluster.core.list_namespaced_pod("default", label_selector=f"{LABEL}={name}").items]
    cluster.delete_finetune(name)
    wait_for(f"{name} gone", lambda: all(i["metadata"]["name"] != name for i in cluster.custom.list_namespaced_custom_object(
        "llamaft.io", "v1alpha1", "default", "llamafinetunes")["items"]), timeout=60)

    def leftovers() -> list[str]:
        left = [f"PyTorchJob/{j['metadata']['name']}" for j in cluster.jobs(f"{LABEL}={name}")]
        left += [f"Pod/{p.metadata.name}" for p in cluster.core.list_namespaced_pod("default", label_selector=f"{LABEL}={name}").items]
        left += [f"ConfigMap/{c.metadata.name}" for c in cluster.core.list_namespaced_config_map("default", label_selector=f"{LABEL}={name}").items]
        left += [f"Service/{s.metadata.name}" for s in cluster.core.list_namespaced_service("default", label_selector=f"{LABEL}={name}").items]
        left += [f"Deployment/{d.metadata.name}" for d in cluster.apps.list_namespaced_deployment("default", label_selector=f"{LABEL}={name}").items]
        left += [f"process of {p}" for p in pods_before if sim.container_pids(p)]
        return left

    wait_for("no orphans", lambda: not leftovers(), timeout=60)
    assert leftovers() == []


def phase(cluster: Cluster, name: str, *phases: str, timeout: float = 180) -> dict[str, Any]:
    return wait_for(f"{name} in {phases}", lambda: (s := cluster.status(name)).get("phase") in phases and s, timeout=timeout)


def stepping(cluster: Cluster, sim: SimCluster, name: str, at_least: int, timeout: float = 120,
             job: str | None = None) -> dict[str, Any]:
    """Until the attempt's leader has logged step >= at_least and the checkpoint of the last
    interval before it is complete (read from the pods' logs as they are written, not from the
    status, which is refreshed once per sync interval). Checkpoints are written in the background:
    a fault while one is being written loses it (the run resumes from the one before), so a fault
    meant to cost at most one interval is injected once the interval's checkpoint is complete.
    An attempt that resumed from that checkpoint (its `resume` line) shows it complete too. On a
    timeout the run's status and the attempt's last log lines are in the message."""
    saved = (at_least - 1) // EVERY * EVERY
    seen: dict[str, Any] = {}

    def reached() -> dict[str, Any] | None:
        status = seen["status"] = cluster.status(name)
        current = job or status.get("jobName")
        if not current:
            return None
        logs = seen["logs"] = {i: read_events(sim.logs(f"{current}-worker-{i}")) for i in range(2)}
        lines = [line for pod in logs.values() for line in pod]
        steps = [line["step"] for line in lines if line.get("event") == "step"]
        complete = [line["step"] for line in lines if line.get("event") in ("checkpoint", "resume")]
        done = not saved or (complete and max(complete) >= saved)
        return status if steps and max(steps) >= at_least and done else None
    try:
        return wait_for(f"{name} at step {at_least}", reached, timeout=timeout, interval=0.1)
    except AssertionError as exc:
        tails = {i: lines[-5:] for i, lines in seen.get("logs", {}).items()}
        raise AssertionError(f"{exc}\nstatus: {seen.get('status')}\nlast log lines per worker: {tails}") from None


def leader_pod(cluster: Cluster, sim: SimCluster, name: str, job: str | None = None) -> str:
    """The pod running global rank 0 (of `job`, by default the current attempt's): the one whose
    log has the step lines."""
    job = job or cluster.status(name)["jobName"]
    return next(f"{job}-worker-{i}" for i in range(2)
                if any(line.get("event") == "step" for line in read_events(sim.logs(f"{job}-worker-{i}"))))


def other_pod(cluster: Cluster, sim: SimCluster, name: str, job: str | None = None) -> str:
    job = job or cluster.status(name)["jobName"]
    leader = leader_pod(cluster, sim, name, job)
    return next(f"{job}-worker-{i}" for i in range(2) if f"{job}-worker-{i}" != leader)


def finish(cluster: Cluster, sim: SimCluster, name: str, attempts: int) -> dict[str, Any]:
    status = phase(cluster, name, "Succeeded", "Failed")
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)[:4000]
    assert status["attempt"] == attempts, status.get("failures")
    per_attempt = attempt_logs(cluster, sim, name, attempts)
    assert_final_report(status, per_attempt, sim)
    assert_continuous(per_attempt)
    assert_one_live_job(cluster, name)
    return status


# -------------------------------------------------------------------------------- scenarios
def test_closed_rendezvous_is_reset_and_retried(cluster: Cluster, sim: SimCluster, operator: Operator, etcd: LocalEtcd,
                                                tiny_model: Path, tmp_path: Path) -> None:
    """Pods that come up after their run id was closed die of RendezvousClosedError; the operator
    resets the rendezvous and the next attempt runs. (Pods are held Pending by a node selector no
    node matches until the run id has been closed.)"""
    cluster.create("closed", run_spec(tiny_model, cluster={"nodeSelector": {"pool": "late"}}))
    status = wait_for("job", lambda: (s := cluster.status("closed")).get("rendezvousId") and s)
    close_rendezvous(etcd.endpoint, status["rendezvousId"])
    nodes = sorted(n["metadata"]["name"] for n in sim.api.list("/api/v1/nodes"))[:2]  # a lost node is gone for good
    for node in nodes:  # the sim's Node objects are minimal: do not decode them
        cluster.core.patch_node(node, {"metadata": {"labels": {"pool": "late"}}}, _preload_content=False)
    try:
        status = wait_for("attempt 2", lambda: (s := cluster.status("closed")).get("attempt") == 2 and s, timeout=90)
        assert status["failures"][0]["reason"] == "RendezvousClosed"
        status = phase(cluster, "closed", "Succeeded", "Failed")
        assert status["phase"] == "Succeeded" and status["attempt"] == 2
        cluster.wait_reasons("closed", "RendezvousClosed", "RendezvousReset")
        delete_and_assert_no_orphans(cluster, sim, "closed")
    finally:
        for node in nodes:
            cluster.core.patch_node(node, {"metadata": {"labels": {"pool": None}}}, _preload_content=False)


def test_operator_killed_at_random_points(cluster: Cluster, sim: SimCluster, operator: Operator, etcd: LocalEtcd,
                                         world: tuple[EmulatorThread, Cluster, SimCluster, Path], tiny_model: Path,
                                         tmp_path: Path) -> None:
    """SIGKILL the operator at seeded random moments through a run with a fault in it: the run
    still ends right, with one job per attempt and no duplicate decisions."""
    rng = random.Random(8)
    operator.stop()
    ops: list[Operator] = []

    def start() -> Operator:
        op = Operator(world[3], tmp_path / f"op-{len(ops)}.log", LLAMAFT_RENDEZVOUS_ADDRESS_OVERRIDE=etcd.endpoint,
                      **OPERATOR_ENV).start()
        ops.append(op)
        return op

    try:
        op = start()
        cluster.create("chaos", run_spec(tiny_model))
        time.sleep(rng.uniform(0.5, 3.0))
        op.kill()  # before, during or right after the first job's creation
        op = start()
        stepping(cluster, sim, "chaos", EVERY + 1)
        sim.kill_container(other_pod(cluster, sim, "chaos"))
        time.sleep(rng.uniform(0.0, 1.5))
        op.kill()  # around the failure's classification and the next attempt's creation
        time.sleep(rng.uniform(0.5, 2.0))
        op = start()
        status = finish(cluster, sim, "chaos", attempts=2)
        assert [f["attempt"] for f in status["failures"]] == [1] and status["retriesUsed"] == 1
        # No duplicate decision: at most one JobCreated per attempt. kopf posts events from a background
        # queue, so an operator killed right after creating a job can die before announcing it.
        created = [e for e in cluster.events("chaos") if e["reason"] == "JobCreated"]
        assert len(created) <= 2, [e["message"] for e in created]
        delete_and_assert_no_orphans(cluster, sim, "chaos")
    finally:
        for op in ops:
            op.kill()
        operator.start()
