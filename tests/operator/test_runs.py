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
from tests.operator import dcgm_exporter
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


dcgm = dcgm_exporter.dcgm
"""A real Prometheus scraping a replayed dcgm-exporter (the module's)."""
OPERATOR_ENV = {"LLAMAFT_SYNC_INTERVAL": "1", "LLAMAFT_RETRY_BACKOFF_SECONDS": "1", "LLAMAFT_PROGRESS_TIMEOUT": "0.5"}


@pytest.fixture(scope="module")
def operator(world: tuple[EmulatorThread, Cluster, SimCluster, Path], etcd: LocalEtcd, dcgm: tuple[str, dict[str, str]],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    op = Operator(world[3], tmp_path_factory.mktemp("op") / "operator.log", cli=True,
                  LLAMAFT_RENDEZVOUS_ADDRESS_OVERRIDE=etcd.endpoint, LLAMAFT_PROMETHEUS_URL=dcgm[0], **OPERATOR_ENV).start()
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
def inject(sim: SimCluster, fault: str, pod: str) -> None:
    """One fault, by name, on one pod (node faults on the pod's node)."""
    actions = {
        "kill_container": lambda: sim.kill_container(pod),
        "oom_kill": lambda: sim.oom_kill(pod),
        "lose_node": lambda: sim.lose_node(str(sim.node_of(pod))),
    }
    actions[fault]()


FAULT_RUNS = [["lose_node"]]
"""The fault that runs here until it moves to the real control plane (a lost node), ending one
attempt once it has passed checkpoint EVERY (step 11 of 60); the run's loss trace spans the
recovery. A killed, OOM-killed or hung container, both evictions, the scheduler's preemption and
a GPU XID run on the real control plane with the real training operator
(tests/controlplane/test_training_operator.py)."""
EXPECTED = {"lose_node": "NodeLost"}
EXCLUDES_THE_NODE = {"lose_node"}


@pytest.mark.parametrize("faults", FAULT_RUNS, ids=["+".join(f.replace("_", "") for f in run) for run in FAULT_RUNS])
def test_faults_recover_from_the_checkpoint(cluster: Cluster, sim: SimCluster, operator: Operator,
                                            tiny_model: Path, tmp_path: Path, faults: list[str]) -> None:
    """Each fault is classified from the pod's evidence (within seconds, not a timer), the next
    attempt resumes from the newest checkpoint, off every node the evidence named, and the run ends with the trainer's own report and no orphans. The last run's
    job is removed by ttlSecondsAfterFinished after it: its final status stays as it was."""
    name = f"faults-{faults[0].replace('_', '')}"[:30]
    policy: dict[str, Any] = {}
    ttl = faults == FAULT_RUNS[-1]  # one of the runs also has its job removed by ttlSecondsAfterFinished
    if ttl:
        policy["ttlSecondsAfterFinished"] = 1
    cluster.create(name, run_spec(tiny_model, runPolicy=policy))
    excluded: list[str] = []
    for attempt, fault in enumerate(faults, start=1):
        fault_ends_attempt(cluster, sim, name, attempt, fault, excluded)
    status = finish(cluster, sim, name, attempts=len(faults) + 1)
    assert status["retriesUsed"] == len(faults)
    cluster.wait_reasons(name, *{EXPECTED[f] for f in faults})
    if ttl:
        wait_for("job removed by its TTL", lambda: cluster.job(status["jobName"]) is None, timeout=60)
        time.sleep(3)  # several sync intervals and pod/job deletion events later
        after = cluster.status(name)
        assert after["phase"] == "Succeeded" and after["progress"] == status["progress"], "the final status outlives the job"
        assert after["conditions"] == status["conditions"]
    delete_and_assert_no_orphans(cluster, sim, name)


def fault_ends_attempt(cluster: Cluster, sim: SimCluster, name: str, attempt: int, fault: str, excluded: list[str]) -> None:
    """Once `attempt` has passed checkpoint attempt x EVERY, `fault` on its non-leader pod; then the
    checks on the failure record and the next attempt (`excluded`: the nodes named so far, kept)."""
    job = cluster.job_name(name, attempt)
    stepping(cluster, sim, name, attempt * EVERY + 1, job=job)
    victim = other_pod(cluster, sim, name, job)
    node = str(sim.node_of(victim))

    started = time.monotonic()
    inject(sim, fault, victim)
    status = wait_for(f"attempt {attempt + 1}", lambda: (s := cluster.status(name)).get("attempt") == attempt + 1 and s,
                      timeout=60)
    noticed = time.monotonic() - started
    # What a failed check shows: the status the next attempt started with, and what the sim did.
    seen = f"{fault} on {victim} ({node}) in attempt {attempt}, noticed after {noticed:.1f}s; status: " + json.dumps(
        {k: status.get(k) for k in ("attempt", "phase", "message", "failures", "excludedNodes")})[:4000] \
        + "\nsim log:\n" + "\n".join((sim.workdir / "sim.log").read_text().splitlines()[-40:])
    record = status["failures"][attempt - 1]
    assert record["reason"] == EXPECTED[fault] and record["attempt"] == attempt and record["retryable"], seen
    if fault in EXCLUDES_THE_NODE:
        excluded.append(node)
        nxt = wait_for(f"attempt {attempt + 1}'s job", lambda: cluster.attempt_job(name, attempt + 1))
        terms = nxt["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["affinity"]["nodeAffinity"]
        assert node in json.dumps(terms), seen
        pods = wait_for(f"attempt {attempt + 1}'s pods scheduled", lambda: (p := sim.pods(nxt["metadata"]["name"])) and all(
            x["spec"].get("nodeName") for x in p) and p)
        assert all(p["spec"]["nodeName"] not in excluded for p in pods), seen
    assert status.get("excludedNodes", []) == excluded, "only evidence that names a node keeps later attempts off it: " + seen
    assert noticed < 15, "a failure is noticed from the pod's events, not a timer: " + seen


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


# ------------------------------------------------------------------------ the TrainJob backend
def trainjob_pods(cluster: Cluster, job: str) -> list[str]:
    from llamaft.render import trainjob

    return sorted(p.metadata.name for p in cluster.core.list_namespaced_pod("default", label_selector=trainjob.pod_selector(job)).items)


def test_trainjob_run_recovers_a_killed_container_as_a_whole_gang(cluster: Cluster, sim: SimCluster, operator: Operator,
                                                                   tiny_model: Path, tmp_path: Path) -> None:
    """backend TrainJob on the simulated Kubeflow Trainer (torch-distributed runtime, whose Job
    restarts a failed container in place): the operator reads the restarted container's last state
    as the attempt's failure and retries the whole gang from the newest checkpoint, as with
    PyTorchJobs; the run ends with the trainer's own report."""
    from tests.operator.sim import Api
    from tests.operator.sim_fixtures import torch_distributed_runtime

    api = Api(sim.api_url)
    if api.get("/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes/torch-distributed") is None:
        api.create("/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes", torch_distributed_runtime())
    spec = run_spec(tiny_model, backend="etcd-v2")
    spec["backend"] = "TrainJob"
    cluster.create("tjrun", spec)

    def logs(job: str, previous: bool = False, pods: list[str] | None = None) -> list[dict[str, Any]]:
        """Global rank 0's lines of the job's containers (previous: of the runs before a restart in place)."""
        return [line for pod in pods or trainjob_pods(cluster, job) for line in read_events(sim.logs(pod, previous=previous))]

    first = cluster.job_name("tjrun", 1)
    wait_for("step past the first checkpoint, complete", lambda: any(line.get("event") == "checkpoint" and line["step"] >= EVERY
                                                                     for line in logs(first)), timeout=180, interval=0.2)
    first_pods = trainjob_pods(cluster, first)  # their logs outlive them
    inject(sim, "kill_container", first_pods[1])
    status = phase(cluster, "tjrun", "Succeeded", "Failed", timeout=240)
    assert status["phase"] == "Succeeded" and status["backend"] == "TrainJob", json.dumps(status, indent=1)[:3000]
    assert status["attempt"] == 2 and status["failures"][0]["reason"] in ("Killed", "PeerLost", "TrainerError")
    # Attempt 1's first container runs, then whatever its restarted containers did before the
    # operator replaced the gang, then attempt 2.
    per_attempt = [logs(first, previous=True, pods=first_pods), logs(first, pods=first_pods),
                   logs(cluster.job_name("tjrun", 2))]
    assert_final_report(status, per_attempt, sim)
    assert_continuous(per_attempt)
    delete_and_assert_no_orphans(cluster, sim, "tjrun")
