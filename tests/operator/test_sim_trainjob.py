"""The simulated cluster's Kubeflow Trainer v2.3 (tests/operator/sim_trainjob.py), without the llamaft
operator: a TrainJob rendered by `trainjob.train_job` on the vendored `torch-distributed`
ClusterTrainingRuntime becomes JobSet-named pods with the torch plugin's PET_* env, runs the real
trainer (`torchrun -m llamaft_trainer`) to completion with the c10d rendezvous on the master's
address (pods resolve each other's names here, which our kubelet on the real control plane does not
offer: no cluster DNS), fails as upstream fails it (a killed container is restarted in place until the Job's backoffLimit),
Plus the emulator's TrainJob admission and the JobSet spec
Trainer derives, without any process.

These tests hold the sim to Trainer's, JobSet's and the Job controller's behaviour, so that operator
tests on top of it can trust what they see.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llamaft.api.validation import validate_resource
from llamaft.render import desired, trainjob
from llamaft.render.naming import Owner
from llamaft_trainer.process.local_etcd import LocalEtcd

from tests.operator.emulator import EmulatorThread
from tests.operator.sim import ApiError, SimCluster, pod_port, service_path
from tests.operator.sim_fixtures import (  # noqa: F401 (the *_fixture imports register pytest fixtures)
    CHECKPOINT_CLAIM,
    SIM_GC_DELAY,
    checkpoint_folder,
    make_sim_fixture,
    sim_emulator_fixture,
    sim_etcd_fixture,
    sim_fixture,
    tiny_finetune,
    torch_distributed_runtime,
    torch_runtime_fixture,
    trainer_binds_metrics_host,
)
from tests.operator.sim_trainjob import (
    COMPLETION_INDEX,
    jobset_spec,
    runtime_path,
    strategic_merge,
    trainjob_path,
)

Obj = dict[str, Any]
NS = "default"


# ----------------------------------------------------------------------------------- helpers
def render(model: Path, name: str, **spec: Any) -> tuple[Owner, Any, Obj]:
    """(owner, parsed spec, TrainJob) for a tiny fine-tune's attempt 1, as the operator renders it."""
    owner = Owner(name, NS, str(uuid.uuid4()))
    spec.setdefault("monitoring", {"metricsPort": pod_port()})
    parsed = validate_resource(tiny_finetune(name, model, **spec))
    job = trainjob.train_job(owner, parsed, 1)
    if not trainer_binds_metrics_host():  # two pods on one machine would collide on the port; see sim_fixtures
        for var in job["spec"]["trainer"]["env"]:
            if var["name"] == "LLAMAFT_METRICS_PORT":
                var["value"] = "0"
    return owner, parsed, job


def submit(sim: SimCluster, model: Path, name: str, **spec: Any) -> Obj:
    """Create the ConfigMap and the TrainJob the operator would; returns the stored TrainJob."""
    owner, parsed, job = render(model, name, **spec)
    assert sim.api.create(f"/api/v1/namespaces/{NS}/configmaps", desired.config_map(owner, parsed)) is not None
    created = sim.api.create(trainjob_path(NS), job)
    assert created is not None
    return created


def env_of(pod: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0].get("env") or []}


def condition(obj: Obj, kind: str) -> Obj:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def jobs_status(obj: Obj) -> Obj:
    """The `node` entry of status.jobsStatus, without its name."""
    entry = next(j for j in (obj.get("status") or {}).get("jobsStatus") or [] if j["name"] == "node")
    return {k: v for k, v in entry.items() if k != "name"}


def two_pods(sim: SimCluster, name: str, timeout: float = 30) -> list[Obj]:
    """The TrainJob's two pods, once both exist, by completion index."""
    def both() -> list[Obj] | None:
        pods = sim.trainer.pods(name)
        return pods if len(pods) == 2 else None
    return sim.wait(f"two pods of {name}", both, timeout)


def restart_count(pod: Obj | None) -> int:
    return int(((pod or {}).get("status", {}).get("containerStatuses") or [{}])[0].get("restartCount", 0))


@pytest.fixture(name="trainer_only_sim")
def trainer_only_sim_fixture(sim_etcd: LocalEtcd, tmp_path: Path) -> Iterator[SimCluster]:
    """A 2-node cluster that serves TrainJobs but no PyTorchJobs (a Trainer v2 install), with the
    stock `torch-distributed` runtime; every process it started is checked gone afterwards."""
    emulator = EmulatorThread(without=("kubeflow.org/v1/pytorchjobs",), gc_delay=SIM_GC_DELAY).start()
    sim = SimCluster(emulator.url, sim_etcd.endpoint, nodes=2, workdir=tmp_path / "sim",
                     claims={CHECKPOINT_CLAIM: checkpoint_folder(tmp_path)})
    try:
        sim.api.create(runtime_path("ClusterTrainingRuntime", NS), torch_distributed_runtime())
        yield sim.start()
    finally:
        sim.stop()
        emulator.stop()
    left = SimCluster._pids_with_marker(f"{sim.id}/")
    assert not left, f"processes survived SimCluster.stop(): {left}"


# ------------------------------------------------------------------ no processes: admission
def test_the_emulator_admits_a_rendered_trainjob_with_the_crd_defaults_and_rejects_reserved_env(
        sim_emulator: EmulatorThread, tmp_path: Path) -> None:
    from tests.operator.sim import Api

    api = Api(sim_emulator.url)
    _, _, job = render(tmp_path / "model", "admit")
    del job["spec"]["runtimeRef"]["kind"]
    stored = api.create(trainjob_path(NS), job)
    assert stored is not None and "status" not in stored
    assert stored["spec"]["managedBy"] == "trainer.kubeflow.org/trainjob-controller", "the CRD's default"
    assert stored["spec"]["runtimeRef"]["kind"] == "ClusterTrainingRuntime"

    reserved = {**job, "metadata": {"name": "reserved"}}
    reserved["spec"] = {**job["spec"], "trainer": {**job["spec"]["trainer"], "env": [{"name": "PET_NODE_RANK", "value": "0"}]}}
    with pytest.raises(ApiError) as rejected:
        api.create(trainjob_path(NS), reserved)
    assert rejected.value.status == 422 and "must not have reserved envs" in str(rejected.value.body)

    unknown = {**job, "metadata": {"name": "unknown"}, "spec": {**job["spec"], "trainer": {**job["spec"]["trainer"], "nodes": 2}}}
    with pytest.raises(ApiError) as rejected:
        api.create(trainjob_path(NS), unknown)
    assert rejected.value.status == 422 and "nodes" in str(rejected.value.body)
    with pytest.raises(ApiError) as rejected:
        api.create(trainjob_path(NS), {**job, "metadata": {"name": "Not_A_Label"}})
    assert rejected.value.status == 422 and "RFC 1035" in str(rejected.value.body)


def test_the_jobset_spec_is_the_runtime_patched_with_the_trainer_and_the_torch_env(tmp_path: Path) -> None:
    _, _, job = render(tmp_path / "model", "spec", cluster={"workers": 3})
    job["metadata"]["uid"] = "u"
    name = job["metadata"]["name"]
    spec = jobset_spec(job, torch_distributed_runtime(backoffLimit=0))
    [rjob] = spec["replicatedJobs"]
    assert rjob["name"] == "node" and rjob["count"] == 3 and rjob["replicas"] == 1
    job_spec = rjob["template"]["spec"]
    assert (job_spec["parallelism"], job_spec["completions"], job_spec["completionMode"], job_spec["backoffLimit"]) == (3, 3, "Indexed", 0)
    pod = job_spec["template"]
    assert pod["spec"]["restartPolicy"] == "OnFailure", "JobSet's webhook default"
    assert pod["metadata"]["labels"]["llamaft.io/finetune"] == "spec", "the runtimePatch's pod labels"
    [container] = pod["spec"]["containers"]
    assert container["name"] == "node" and container["image"] == job["spec"]["trainer"]["image"]
    assert container["command"] == job["spec"]["trainer"]["command"] and container["ports"] == [{"containerPort": 29500}]
    assert [m["name"] for m in container["volumeMounts"]] == ["dshm", "config", "llamaft-cache", "checkpoints"], \
        "the runtimePatch's mounts, the checkpoint claim's included"
    names = [e["name"] for e in container["env"]]
    trainer_env = [e["name"] for e in job["spec"]["trainer"]["env"]]
    assert names == [*trainer_env, "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PET_NNODES"] == "3" and env["PET_NPROC_PER_NODE"] == "1" and env["PET_MASTER_ADDR"] == f"{name}-node-0-0.{name}"
    assert spec["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True} and spec["suspend"] is False
    assert jobset_spec(job, torch_distributed_runtime())["replicatedJobs"][0]["template"]["spec"]["backoffLimit"] == 6

    # numProcPerNode unset: "auto" with a GPU, else the CPU count (at least 1).
    del job["spec"]["trainer"]["numProcPerNode"]
    job["spec"]["trainer"]["resourcesPerNode"] = {"limits": {"nvidia.com/gpu": 8}}
    auto = jobset_spec(job, torch_distributed_runtime())["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in auto["env"]}["PET_NPROC_PER_NODE"] == "auto"
    assert auto["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    job["spec"]["trainer"]["resourcesPerNode"] = {"requests": {"cpu": "1500m"}}
    cpus = jobset_spec(job, torch_distributed_runtime())["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in cpus["env"]}["PET_NPROC_PER_NODE"] == "2"


def test_strategic_merge_merges_lists_by_their_keys() -> None:
    base = {"containers": [{"name": "node", "image": "a", "volumeMounts": [{"name": "x", "mountPath": "/x"}]}],
            "volumes": [{"name": "x", "emptyDir": {}}], "tolerations": [{"key": "a"}], "nodeSelector": {"a": "1"}}
    patch = {"containers": [{"name": "node", "volumeMounts": [{"name": "y", "mountPath": "/x", "readOnly": True}]}, {"name": "side"}],
             "volumes": [{"name": "x", "configMap": {"name": "c"}}], "tolerations": [{"key": "b"}], "nodeSelector": {"b": "2", "a": None}}
    assert strategic_merge(base, patch) == {
        "containers": [{"name": "node", "image": "a", "volumeMounts": [{"name": "y", "mountPath": "/x", "readOnly": True}]}, {"name": "side"}],
        "volumes": [{"name": "x", "configMap": {"name": "c"}}],  # retainKeys: the emptyDir goes
        "tolerations": [{"key": "b"}], "nodeSelector": {"b": "2"},
    }


# ------------------------------------------------------------------------ the real trainer
@pytest.mark.parametrize("backend", ["c10d"])  # etcd-v2: on the real Trainer, tests/controlplane/test_trainjob.py
def test_trainjob_runs_the_trainer_to_completion(sim: SimCluster, torch_runtime: Obj, tiny_model: Path, tmp_path: Path,
                                                 backend: str) -> None:
    job = submit(sim, tiny_model, f"tj-{backend[:4]}", rendezvous={"backend": backend})
    name, uid = job["metadata"]["name"], job["metadata"]["uid"]
    pods = two_pods(sim, name)

    # What JobSet and the Job controller make of the `node` replicated job.
    assert [p["metadata"]["annotations"][COMPLETION_INDEX] for p in pods] == ["0", "1"]
    for index, pod in enumerate(pods):
        meta, spec = pod["metadata"], pod["spec"]
        assert meta["name"].startswith(f"{name}-node-0-{index}-") and len(meta["name"]) == len(f"{name}-node-0-{index}-") + 5
        assert (spec["hostname"], spec["subdomain"]) == (f"{name}-node-0-{index}", name)
        labels = meta["labels"]
        assert labels["jobset.sigs.k8s.io/jobset-name"] == name and labels["jobset.sigs.k8s.io/replicatedjob-name"] == "node"
        assert labels["jobset.sigs.k8s.io/job-index"] == "0" and labels[COMPLETION_INDEX] == str(index)
        assert labels["batch.kubernetes.io/job-name"] == f"{name}-node-0" and labels["llamaft.io/finetune"] == job["metadata"]["labels"]["llamaft.io/finetune"]
        assert labels["app.kubernetes.io/component"] == "trainer"
        owner = meta["ownerReferences"][0]
        assert (owner["kind"], owner["uid"], owner["controller"], owner["blockOwnerDeletion"]) == ("TrainJob", uid, True, True)
        assert spec["restartPolicy"] == "OnFailure" and spec["containers"][0]["name"] == "node"
        assert {"containerPort": 29500} in spec["containers"][0]["ports"]
        # (b) the torch plugin's env, as torch.go injects it, and the Job controller's index.
        env = env_of(pod)
        index_ref = {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}
        assert (env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == ("2", "1")
        assert env["PET_NODE_RANK"] == index_ref and env["JOB_COMPLETION_INDEX"] == index_ref
        assert (env["PET_MASTER_ADDR"], env["PET_MASTER_PORT"]) == (f"{name}-node-0-0.{name}", "29500")
    assert {p["metadata"]["name"] for p in sim.api.list(f"/api/v1/namespaces/{NS}/pods", label_selector=trainjob.pod_selector(name))} \
        == {p["metadata"]["name"] for p in pods}, "the operator's selector finds exactly the trainer's pods"
    headless = sim.api.get(service_path(NS, name))
    assert headless is not None and headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": name}

    # Each container sees its own PET_NODE_RANK (the downward API) and the master's address.
    seen = {}
    for pod in pods:
        pod_name = pod["metadata"]["name"]
        sim.wait_pod_running(pod_name, timeout=60)
        pids = sim.wait(f"{pod_name}'s processes", functools.partial(sim.container_pids, pod_name), timeout=30)
        seen[pod_name] = SimCluster._environ(pids[0])
    assert [seen[p["metadata"]["name"]]["PET_NODE_RANK"] for p in pods] == ["0", "1"]
    assert [seen[p["metadata"]["name"]]["HOSTNAME"] for p in pods] == [f"{name}-node-0-0", f"{name}-node-0-1"]
    assert {e["PET_MASTER_ADDR"] for e in seen.values()} == {pods[0]["status"].get("podIP") or sim.pod(pods[0]["metadata"]["name"])["status"]["podIP"]}  # type: ignore[index]

    running = sim.wait("the Job active", lambda: (j := sim.trainer.job(name)) and jobs_status(j)["active"] == 1 and j)
    assert not condition(running, "Complete") and not condition(running, "Failed") and not condition(running, "Suspended")

    done = sim.trainer.wait_condition(name, "Complete", timeout=150)
    assert condition(done, "Complete")["reason"] == "AllJobsCompleted" and condition(done, "Complete")["message"] == "jobset completed successfully"
    assert not condition(done, "Failed")
    assert jobs_status(done) == {"active": 0, "failed": 0, "ready": 0, "succeeded": 1, "suspended": 0}
    assert trainjob.job_phase(done)[0].value == "Succeeded"
    ended = [sim.pod(p["metadata"]["name"]) for p in pods]
    assert all(p is not None and p["status"]["phase"] == "Succeeded" for p in ended), "the Job keeps its succeeded pods"
    terminated = [p["status"]["containerStatuses"][0]["state"]["terminated"] for p in ended]  # type: ignore[index]
    assert all(t["exitCode"] == 0 and t["reason"] == "Completed" for t in terminated), terminated
    assert len({p["status"]["podIP"] for p in ended}) == 2 and len({p["spec"]["nodeName"] for p in ended}) == 2  # type: ignore[index]
    # Global rank 0 (the master's pod under the static c10d rendezvous) writes the trainer's summary.
    messages = {i: json.loads(t["message"]) for i, t in enumerate(terminated) if t.get("message")}
    assert len(messages) == 1 and next(iter(messages.values()))["phase"] == "Succeeded" and next(iter(messages.values()))["step"] == 3, terminated
    if backend == "c10d":
        assert list(messages) == [0]


def test_a_killed_container_restarts_in_place_until_the_jobs_backoff_limit_fails_the_trainjob(
        sim: SimCluster, torch_runtime: Obj, tiny_model: Path, tmp_path: Path) -> None:
    job = submit(sim, tiny_model, "tj-kill", training={"maxSteps": 10_000})
    name = job["metadata"]["name"]
    pods = two_pods(sim, name)
    victim, uid = pods[1]["metadata"]["name"], pods[1]["metadata"]["uid"]
    for pod in pods:
        sim.wait_pod_running(pod["metadata"]["name"], timeout=60)

    def failed() -> Obj | None:
        current = sim.trainer.job(name)
        return current if condition(current or {}, "Failed").get("status") == "True" else None

    def restarted(times: int) -> Obj | None:
        pod = sim.pod(victim)
        return pod if pod is not None and restart_count(pod) >= times and "running" in pod["status"]["containerStatuses"][0]["state"] else None

    # torch-distributed: restartPolicy OnFailure (JobSet's default), so the kubelet restarts the
    # container in place: same pod, restartCount 1, and the TrainJob runs on.
    sim.kill_container(victim)
    again = sim.wait("the container restarted in place", functools.partial(restarted, 1), timeout=30)
    assert again["metadata"]["uid"] == uid
    assert sim.history(victim)[-1]["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137
    current = sim.trainer.job(name)
    assert current is not None and failed() is None and jobs_status(current)["failed"] == 0

    # The Job fails once the restarts add up to its backoffLimit (6): BackoffLimitExceeded, its pods
    # deleted, then the JobSet and the TrainJob Failed.
    kills = 1
    while kills < 10:
        sim.wait(f"restart {kills} or the failure", functools.partial(lambda k: failed() or restarted(k), kills), timeout=30)
        if failed() is not None:
            break
        try:
            sim.kill_container(victim)
        except AssertionError:  # the Job deleted the pod meanwhile (the other pod's restarts count too)
            break
        kills += 1
    done = sim.trainer.wait_condition(name, "Failed", timeout=60)
    assert 1 < kills <= 6, kills
    assert condition(done, "Failed")["reason"] == "FailedJobs"
    assert condition(done, "Failed")["message"] == f"jobset failed due to one or more job failures (first failed job: {name}-node-0)"
    assert jobs_status(done) == {"active": 0, "failed": 1, "ready": 0, "succeeded": 0, "suspended": 0}
    assert trainjob.job_phase(done)[0].value == "Failed"
    assert all(p["status"]["phase"] == "Failed" for p in sim.trainer.pods(name)), "the Job fails after its pods have stopped"
    sim.wait("pods removed", lambda: not sim.trainer.pods(name), timeout=30)
    victim_last = sim.history(victim)[-1]
    assert victim_last["metadata"]["deletionTimestamp"] and restart_count(victim_last) == kills


def test_a_runtime_with_backoff_limit_0_fails_the_trainjob_on_the_first_container_failure(
        sim: SimCluster, tiny_model: Path, tmp_path: Path) -> None:
    """What a failed pod ending the job takes under Trainer: a (Cluster)TrainingRuntime whose `node`
    Job has backoffLimit 0 (no runtimePatch can set it); here a namespaced TrainingRuntime."""
    runtime = {**torch_distributed_runtime("llamaft-no-retry", backoffLimit=0), "kind": "TrainingRuntime"}
    runtime["metadata"]["namespace"] = NS
    assert sim.api.create(runtime_path("TrainingRuntime", NS), runtime) is not None
    job = submit(sim, tiny_model, "tj-once", training={"maxSteps": 10_000},
                 trainJob={"runtimeRef": {"kind": "TrainingRuntime", "name": "llamaft-no-retry"}})
    name = job["metadata"]["name"]
    pods = two_pods(sim, name)
    for pod in pods:
        sim.wait_pod_running(pod["metadata"]["name"], timeout=60)
    sim.kill_container(pods[0]["metadata"]["name"])
    done = sim.trainer.wait_condition(name, "Failed", timeout=30)
    assert condition(done, "Failed")["reason"] == "FailedJobs"
    assert jobs_status(done) == {"active": 0, "failed": 1, "ready": 0, "succeeded": 0, "suspended": 0}
    sim.wait("pods removed", lambda: not sim.trainer.pods(name), timeout=30)
    first = sim.history(pods[0]["metadata"]["name"])
    assert first[0]["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137
    assert all(h["metadata"]["uid"] == pods[0]["metadata"]["uid"] for h in first), "no replacement pod"
