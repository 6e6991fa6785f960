"""The simulated cluster itself, without the llamaft operator: the API server's deletion semantics
(finalizers, propagation policies, garbage collection, graceful pod deletion, eviction), and the
fake training operator + kubelets running the real trainer (`torchrun -m llamaft_trainer`) for a
PyTorchJob rendered by `desired.pytorch_job`, with faults.

These tests hold the sim to Kubernetes' and training-operator v1.9's behaviour, so that operator
tests on top of it can trust what they see.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from llamaft.api.validation import validate_resource
from llamaft.render import desired
from llamaft.render.naming import Owner

from tests.operator.emulator import EmulatorThread
from tests.operator.sim import SimCluster, job_path, pod_path, pod_port
from tests.operator.sim_fixtures import (  # noqa: F401 (the *_fixture imports register pytest fixtures)
    CHECKPOINT_CLAIM,
    make_sim_fixture,
    sim_emulator_fixture,
    sim_etcd_fixture,
    sim_fixture,
    tiny_finetune,
    trainer_binds_metrics_host,
)

Obj = dict[str, Any]
NS = "default"


# ----------------------------------------------------------------------------------- helpers
def submit(sim: SimCluster, model: Path, name: str, *, restart_policy: str | None = None,
           ttl: int | None = None, affinity: Obj | None = None, node_selector: dict[str, str] | None = None,
           grace: int | None = None, **spec: Any) -> Obj:
    """Apply the ConfigMap and PyTorchJob the operator would render for a tiny fine-tune (attempt 1),
    with the test's changes to the job. Returns the stored job."""
    owner = Owner(name, NS, str(uuid.uuid4()))
    # Every pod binds it on its own address (sim.pod_port says why it is below the ephemeral range).
    spec.setdefault("monitoring", {"metricsPort": pod_port()})
    parsed = validate_resource(tiny_finetune(name, model, **spec))
    job = desired.pytorch_job(owner, parsed, 1)
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    pod_spec = worker["template"]["spec"]
    if restart_policy is not None:
        worker["restartPolicy"] = restart_policy
    if ttl is not None:
        job["spec"]["runPolicy"]["ttlSecondsAfterFinished"] = ttl
    if affinity is not None:
        pod_spec["affinity"] = affinity
    if node_selector is not None:
        pod_spec["nodeSelector"] = node_selector
    if grace is not None:
        pod_spec["terminationGracePeriodSeconds"] = grace
    if not trainer_binds_metrics_host():
        # Both pods would bind 0.0.0.0:<metricsPort> on this one machine; see sim_fixtures.
        for var in pod_spec["containers"][0]["env"]:
            if var["name"] == "LLAMAFT_METRICS_PORT":
                var["value"] = "0"
    assert sim.api.create(f"/api/v1/namespaces/{NS}/configmaps", desired.config_map(owner, parsed)) is not None
    created = sim.api.create(job_path(NS), job)
    assert created is not None
    return created


def worker(job: Obj, index: int) -> str:
    return f"{job['metadata']['name']}-worker-{index}"


def env_of(pod: Obj) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0].get("env") or []}


def condition(obj: Obj, kind: str) -> Obj:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def running_trainers(sim: SimCluster, job: Obj) -> None:
    """Both pods Running with their trainer process started (torchrun has rendezvoused)."""
    for index in (0, 1):
        sim.wait_pod_running(worker(job, index), timeout=60)
    for index in (0, 1):
        sim.wait_trainers(worker(job, index), timeout=90)


def pod_ips(sim: SimCluster, job: Obj) -> list[str]:
    return [p["status"]["podIP"] for p in sim.pods(job["metadata"]["name"]) if p.get("status", {}).get("podIP")]


def progress(ip: str, port: int) -> Obj | None:
    try:
        with urllib.request.urlopen(f"http://{ip}:{port}/progress", timeout=1) as response:
            return dict(json.loads(response.read()))
    except OSError:
        return None


def kube(emulator: EmulatorThread) -> tuple[client.CoreV1Api, client.CustomObjectsApi]:
    config = client.Configuration()
    config.host = emulator.url
    api = client.ApiClient(config)
    return client.CoreV1Api(api), client.CustomObjectsApi(api)


# ------------------------------------------------------------------------ the real trainer
@pytest.mark.slow
def test_pod_ports_are_ones_no_bind_probe_can_hand_out() -> None:
    """A port one pod holds on its own address blocks another pod's wildcard bind of it, and
    torch elastic's `get_free_port` (a `localhost:0` probe) cannot see it: pod ports come from
    below the ephemeral range, where such a probe never lands, and are not handed out twice."""
    import socket

    from torch.distributed.elastic.utils.distributed import get_free_port

    from tests.operator.sim import _ephemeral_floor

    ports = [pod_port() for _ in range(5)]
    assert len(set(ports)) == 5 and all(1024 <= p < _ephemeral_floor() for p in ports)
    held = socket.socket()
    held.bind(("127.0.0.9", ports[0]))  # a pod's metrics server on its own address
    held.listen()
    try:
        with socket.socket() as wildcard, pytest.raises(OSError):
            wildcard.bind(("0.0.0.0", ports[0]))  # what a worker's TCPStore does with the master port
        assert all(get_free_port() >= _ephemeral_floor() for _ in range(20))
        assert ports[0] not in {pod_port() for _ in range(20)}
    finally:
        held.close()


def test_job_runs_to_success_and_ttl_removes_it(sim: SimCluster, tiny_model: Path, tmp_path: Path) -> None:
    job = submit(sim, tiny_model, "happy", ttl=2)
    name = job["metadata"]["name"]
    pod = sim.wait_pod_running(worker(job, 0), timeout=60)
    env = env_of(pod)
    # The training operator's part of the env (its PET_* variables) next to the template's.
    assert env["PYTHONUNBUFFERED"] == "1" and env["PET_NNODES"] == "2:2" and env["PET_NPROC_PER_NODE"] == "1"
    assert env["PET_RDZV_BACKEND"] == "etcd-v2" and env["PET_RDZV_ENDPOINT"] == "happy-etcd.default.svc:2379"
    assert env["PET_RDZV_ID"] == job["spec"]["elasticPolicy"]["rdzvId"] and env["PET_RDZV_CONF"] == "protocol=http"
    labels = pod["metadata"]["labels"]
    assert labels["training.kubeflow.org/job-name"] == name and labels["training.kubeflow.org/replica-type"] == "worker"
    assert labels["training.kubeflow.org/replica-index"] == "0" and labels["training.kubeflow.org/job-role"] == "master"
    assert labels["training.kubeflow.org/operator-name"] == "pytorchjob-controller" and labels["llamaft.io/attempt"] == "1"
    owner = pod["metadata"]["ownerReferences"][0]
    assert owner["uid"] == job["metadata"]["uid"] and owner["controller"] and owner["blockOwnerDeletion"]
    assert pod["spec"]["restartPolicy"] == "Never", "ExitCode runs pods with restartPolicy Never"

    if trainer_binds_metrics_host():
        # Each pod serves /progress on its own address and the shared port.
        port = int(env["LLAMAFT_METRICS_PORT"])
        served = sim.wait("/progress on a pod's address", lambda: [ip for ip in pod_ips(sim, job) if progress(ip, port)], timeout=90)
        assert served
    done = sim.wait_job_condition(name, "Succeeded", timeout=150)
    status = done["status"]
    assert condition(done, "Succeeded")["reason"] == "PyTorchJobSucceeded" and condition(done, "Running")["status"] == "False"
    assert condition(done, "Created")["reason"] == "PyTorchJobCreated" and status["startTime"] and status["completionTime"]
    assert status["replicaStatuses"]["Worker"].get("succeeded", 0) >= 1
    ended = [sim.wait(f"{worker(job, i)} ended", lambda i=i: sim.history(worker(job, i)), timeout=30)[-1] for i in (0, 1)]
    assert {p["status"]["podIP"] for p in ended} == {p["status"]["podIP"] for p in ended if p["status"]["podIP"].startswith("127.")}
    assert len({p["status"]["podIP"] for p in ended}) == 2 and len({p["spec"]["nodeName"] for p in ended}) == 2
    terminated = [p["status"]["containerStatuses"][0]["state"]["terminated"] for p in ended]
    assert all(t["exitCode"] == 0 and t["reason"] == "Completed" for t in terminated), terminated
    assert all(p["status"]["phase"] == "Succeeded" for p in ended)
    # Global rank 0 (whichever pod hosts it) writes the trainer's summary as the termination message.
    messages = [json.loads(t["message"]) for t in terminated if t.get("message")]
    assert len(messages) == 1 and messages[0]["phase"] == "Succeeded" and messages[0]["step"] == 3, terminated
    assert '"event": "done"' in sim.logs(worker(job, 0)) + sim.logs(worker(job, 1))

    # ttlSecondsAfterFinished: the training operator deletes the job, the GC its pods and Services.
    sim.wait("job removed by its TTL", lambda: sim.job(name) is None, timeout=15)
    sim.wait("pods collected", lambda: not sim.pods(name), timeout=15)
    sim.wait("services collected", lambda: not sim.api.list(f"/api/v1/namespaces/{NS}/services",
                                                            label_selector=f"training.kubeflow.org/job-name={name}"), timeout=15)


def test_foreground_delete_stops_pods_gracefully_then_removes_the_job(sim: SimCluster, tiny_model: Path, tmp_path: Path) -> None:
    job = submit(sim, tiny_model, "fg", training={"maxSteps": 10_000})
    name = job["metadata"]["name"]
    running_trainers(sim, job)
    sim.api.delete(job_path(NS, name), propagation="Foreground")
    owner = sim.job(name)
    assert owner is not None and owner["metadata"]["deletionTimestamp"] and owner["metadata"]["finalizers"] == ["foregroundDeletion"]
    terminating = sim.wait("pods terminating", lambda: [p for p in sim.pods(name) if p["metadata"].get("deletionTimestamp")])
    assert terminating[0]["metadata"]["deletionGracePeriodSeconds"] == terminating[0]["spec"].get("terminationGracePeriodSeconds", 30)
    assert sim.job(name) is not None, "the job waits for its pods (blockOwnerDeletion)"
    sim.wait("job gone", lambda: sim.job(name) is None, timeout=60)
    assert not sim.pods(name), "the job went only after its pods"
    for index in (0, 1):
        last = sim.history(worker(job, index))[-1]
        assert last["metadata"]["deletionTimestamp"]
        # torchrun exits 1 on SIGTERM (SignalException): a graceful stop, not a SIGKILL after the grace period.
        assert last["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 1
        assert "got signal: 15" in sim.logs(worker(job, index))


def test_background_delete_removes_the_job_at_once_and_gc_collects_its_pods(sim: SimCluster, tiny_model: Path,
                                                                            tmp_path: Path) -> None:
    job = submit(sim, tiny_model, "bg", training={"maxSteps": 10_000})
    name = job["metadata"]["name"]
    running_trainers(sim, job)
    sim.api.delete(job_path(NS, name))  # no policy: Background, the API server's default
    assert sim.job(name) is None
    assert {p["metadata"]["name"] for p in sim.pods(name)} == {worker(job, 0), worker(job, 1)}, "dependents outlive the owner"
    sim.wait("pods collected", lambda: not sim.pods(name), timeout=60)
    assert all(sim.history(worker(job, i))[-1]["metadata"]["deletionTimestamp"] for i in (0, 1))
    assert not sim.api.list(f"/api/v1/namespaces/{NS}/services", label_selector=f"training.kubeflow.org/job-name={name}")


def test_kill_container_fails_a_never_job_with_the_exit_code(sim: SimCluster, tiny_model: Path, tmp_path: Path) -> None:
    job = submit(sim, tiny_model, "killed", restart_policy="Never", training={"maxSteps": 10_000})
    name = job["metadata"]["name"]
    running_trainers(sim, job)
    sim.kill_container(worker(job, 1))
    failed = sim.wait_job_condition(name, "Failed", timeout=30)
    assert condition(failed, "Failed")["reason"] == "PyTorchJobFailed"
    assert "1 Worker replica(s) failed" in condition(failed, "Failed")["message"] and failed["status"]["completionTime"]
    terminated = sim.terminated(worker(job, 1))
    assert terminated["exitCode"] == 137 and terminated["reason"] == "Error"
    pod = sim.pod(worker(job, 1))
    assert pod is not None and pod["status"]["phase"] == "Failed", "Never: the pod stays, failed"


def proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_kill_trainer_makes_torchrun_restart_its_workers_in_the_same_pod(sim: SimCluster, tiny_model: Path,
                                                                         tmp_path: Path) -> None:
    job = submit(sim, tiny_model, "trainer", training={"maxSteps": 10_000})
    running_trainers(sim, job)
    before = sim.pod(worker(job, 0))
    killed = sim.kill_trainer(worker(job, 0), local_rank=0)
    restarted = sim.wait("a new trainer process", lambda: (p := sim.trainer_pids(worker(job, 0))) and p[0] != killed and p,
                         timeout=120)
    assert restarted[0] != killed
    after = sim.pod(worker(job, 0))
    assert after is not None and before is not None and after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["status"]["containerStatuses"][0]["restartCount"] == 0, "torchrun restarted its workers, not the kubelet"
    assert not sim.history(worker(job, 0))


def test_lose_node_fails_its_pods_and_the_job_gets_replacements(sim: SimCluster, tiny_model: Path, tmp_path: Path) -> None:
    job = submit(sim, tiny_model, "lost", restart_policy="ExitCode", training={"maxSteps": 10_000})
    name = job["metadata"]["name"]
    running_trainers(sim, job)
    first = sim.pod(worker(job, 1))
    assert first is not None
    node = first["spec"]["nodeName"]
    pids = sim.container_pids(worker(job, 1))
    assert sim.lose_node(node) == [worker(job, 1)]
    assert sim.api.get(f"/api/v1/nodes/{node}") is None
    time.sleep(0.2)
    assert all(proc_state(pid) in ("", "Z") for pid in pids), "everything on the node died"
    lost = sim.history(worker(job, 1))[-1]
    assert lost["status"]["phase"] == "Failed" and lost["status"]["reason"] == "NodeLost" and lost["metadata"]["deletionTimestamp"]
    disruption = condition(lost, "DisruptionTarget")
    assert disruption["status"] == "True" and disruption["reason"] == "DeletionByTaintManager"
    sim.wait_job_event(name, "PyTorchJobRestarting", timeout=30)  # Restarting itself lasts one reconcile
    again = sim.wait_pod_running(worker(job, 1), timeout=60)  # PodGC removed the old one, the operator made a new one
    assert again["metadata"]["uid"] != first["metadata"]["uid"] and again["spec"]["nodeName"] != node


def test_node_affinity_and_selectors_place_pods(sim: SimCluster, tiny_model: Path, tmp_path: Path) -> None:
    not_node0 = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-0"]}]}]}}}
    job = submit(sim, tiny_model, "placed", affinity=not_node0, restart_policy="Never")
    nowhere = submit(sim, tiny_model, "nowhere", node_selector={"kubernetes.io/hostname": "node-9"})
    for index in (0, 1):
        pod = sim.wait_pod_running(worker(job, index), timeout=60)
        assert pod["spec"]["nodeName"] in ("node-1", "node-2")
    assert {sim.node_of(worker(job, i)) for i in (0, 1)} == {"node-1", "node-2"}, "spread over the nodes that fit"
    pending = sim.wait("unschedulable", lambda: (p := sim.pod(worker(nowhere, 0))) and condition(p, "PodScheduled").get("reason") == "Unschedulable" and p)
    assert pending["status"]["phase"] == "Pending" and not pending["spec"].get("nodeName")
    assert condition(pending, "PodScheduled")["status"] == "False" and "0/3 nodes are available" in condition(pending, "PodScheduled")["message"]


# ------------------------------------------------------- the sim with plain Python containers
def python_job(name: str, script: str, *, replicas: int = 2, restart_policy: str = "Never", backend: str = "c10d",
               grace: int = 30, run_policy: Obj | None = None, volumes: list[Obj] | None = None,
               mounts: list[Obj] | None = None) -> Obj:
    """A PyTorchJob whose container runs `python -c script` (fast: no torch, no trainer)."""
    container = {"name": "pytorch", "image": "python", "command": ["python", "-c", script],
                 "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                         {"name": "GREETING", "value": "hello $(POD_IP)"}],
                 "volumeMounts": mounts or [], "terminationMessagePolicy": "FallbackToLogsOnError"}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name, "namespace": NS},
            "spec": {"elasticPolicy": {"rdzvBackend": backend, "rdzvPort": 29400, "minReplicas": replicas, "maxReplicas": replicas},
                     "nprocPerNode": "1", "runPolicy": {"cleanPodPolicy": "None", **(run_policy or {})},
                     "pytorchReplicaSpecs": {"Worker": {"replicas": replicas, "restartPolicy": restart_policy, "template": {
                         "spec": {"terminationGracePeriodSeconds": grace, "containers": [container], "volumes": volumes or []}}}}}}


SLEEP = "import time\nprint('up', flush=True)\ntime.sleep(600)"
STUBBORN = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(600)"


def test_graceful_deletion_sigkills_after_the_grace_period(make_sim: Any) -> None:
    sim = make_sim(nodes=1)
    sim.api.create(job_path(NS), python_job("stubborn", STUBBORN, replicas=1, grace=2))
    sim.wait("up", lambda: "up" in sim.logs("stubborn-worker-0"))
    began = time.monotonic()
    sim.api.delete(pod_path(NS, "stubborn-worker-0"))
    pod = sim.pod("stubborn-worker-0")
    assert pod is not None and pod["metadata"]["deletionGracePeriodSeconds"] == 2, "graceful: still there"
    sim.wait("SIGKILL after the grace period", lambda: sim.history("stubborn-worker-0"), timeout=10)
    took = time.monotonic() - began
    assert 2.0 <= took < 5.0, took
    terminated = sim.terminated("stubborn-worker-0")
    assert terminated["exitCode"] == 137 and terminated["reason"] == "Error"
    # Never: the job fails once the training operator sees the failed pod (it stays a moment, terminal).
    sim.wait_job_condition("stubborn", "Failed", timeout=10)


def test_exit_codes_under_the_exit_code_policy(make_sim: Any) -> None:
    sim = make_sim(nodes=2)
    # 1-127: permanent; the job fails, without a completionTime (training-operator v1.9).
    sim.api.create(job_path(NS), python_job("permanent", "import sys\nprint('bad config')\nsys.exit(2)", replicas=1,
                                            restart_policy="ExitCode", run_policy={"ttlSecondsAfterFinished": 0}))
    failed = sim.wait_job_condition("permanent", "Failed", timeout=20)
    assert condition(failed, "Failed")["message"] == 'job "permanent" is failing because "Worker" replica(s) failed.'
    assert "completionTime" not in failed["status"]
    terminated = sim.terminated("permanent-worker-0")
    assert terminated["exitCode"] == 2 and terminated["message"] == "bad config", "FallbackToLogsOnError: the log's tail"
    time.sleep(1.5)
    assert sim.job("permanent") is not None, "no completionTime: ttlSecondsAfterFinished never fires"
    # 128-255: retryable; the pod is deleted and created again, the job is Restarting. The marker
    # that tells the second pod it is the second lives on a claim: a container's own files die with it.
    once = "import os, sys\nmarker = '/state/' + os.environ['HOSTNAME'] + os.environ['RUN']\n" \
           "if not os.path.exists(marker):\n    open(marker, 'w').close()\n    sys.exit(143)\nimport time\ntime.sleep(600)"
    job = python_job("retry", once, replicas=1, restart_policy="ExitCode",
                     volumes=[{"name": "state", "persistentVolumeClaim": {"claimName": CHECKPOINT_CLAIM}}],
                     mounts=[{"name": "state", "mountPath": "/state"}])
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"].append({"name": "RUN", "value": uuid.uuid4().hex})
    sim.api.create(job_path(NS), job)
    sim.wait_job_event("retry", "PyTorchJobRestarting", timeout=20)  # Restarting itself lasts one reconcile
    sim.wait_job_condition("retry", "Running", timeout=20)
    assert [p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] for p in sim.history("retry-worker-0")] == [143]


def test_a_node_lost_with_no_room_left_leaves_its_pod_unschedulable_until_a_node_joins(make_sim: Any) -> None:
    """Node capacity: with room for one worker per node, the replacement of a pod on a lost node
    stays Pending with PodScheduled False/Unschedulable and kube-scheduler's FitError message; a
    node that joins takes it at the scheduler's next pass."""
    sim = make_sim(nodes=2, node_cpu="3", node_memory="8Gi")
    job = python_job("roomy", SLEEP, grace=1, restart_policy="ExitCode")
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    container["resources"] = {"requests": {"cpu": "2", "memory": "5Gi"}, "limits": {"cpu": "2", "memory": "5Gi"}}
    sim.api.create(job_path(NS), job)
    sim.wait_job_condition("roomy", "Running", timeout=20)
    assert sorted(sim.node_of(f"roomy-worker-{i}") or "" for i in (0, 1)) == ["node-0", "node-1"], "one per node: 2 + 2 > 3 cpu"
    lost_on = sim.node_of("roomy-worker-1")
    assert lost_on is not None
    sim.lose_node(lost_on)

    def unschedulable() -> Obj | None:
        pod = sim.pod("roomy-worker-1")
        scheduled = condition(pod or {}, "PodScheduled")
        return scheduled if scheduled.get("reason") == "Unschedulable" else None
    scheduled = sim.wait("replacement unschedulable", unschedulable, timeout=20)
    assert scheduled["status"] == "False"
    assert scheduled["message"] == "0/1 nodes are available: 1 Insufficient cpu, 1 Insufficient memory."
    pod = sim.pod("roomy-worker-1")
    assert pod is not None and pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
    sim.add_node("node-9")
    sim.wait("placed on the new node", lambda: sim.node_of("roomy-worker-1") == "node-9", timeout=20)
    sim.wait_pod_running("roomy-worker-1", timeout=20)


def test_on_failure_restarts_in_place_until_the_backoff_limit(make_sim: Any) -> None:
    sim = make_sim(nodes=1, restart_backoff=0.2)
    sim.api.create(job_path(NS), python_job("flaky", "import sys\nsys.exit(3)", replicas=1, restart_policy="OnFailure",
                                            run_policy={"backoffLimit": 2}))
    failed = sim.wait_job_condition("flaky", "Failed", timeout=30)
    assert condition(failed, "Failed")["message"] == "Job flaky has failed because it has reached the specified backoff limit"
    ended = sim.history("flaky-worker-0")
    assert len(ended) >= 2 and all(p["metadata"]["uid"] == ended[0]["metadata"]["uid"] for p in ended), "restarted in place"


def test_suspend_deletes_the_pods_and_resume_recreates_them(make_sim: Any) -> None:
    sim = make_sim(nodes=2)
    sim.api.create(job_path(NS), python_job("pause", SLEEP, grace=1))
    sim.wait_job_condition("pause", "Running", timeout=20)
    first = {p["metadata"]["uid"] for p in sim.pods("pause")}
    sim.api.patch(job_path(NS, "pause"), {"spec": {"runPolicy": {"suspend": True}}})
    suspended = sim.wait_job_condition("pause", "Suspended", timeout=20)
    assert condition(suspended, "Suspended")["reason"] == "PyTorchJobSuspended" and condition(suspended, "Running")["status"] == "False"
    sim.wait("pods gone", lambda: not sim.pods("pause"), timeout=20)
    sim.api.patch(job_path(NS, "pause"), {"spec": {"runPolicy": {"suspend": False}}})
    resumed = sim.wait_job_condition("pause", "Running", timeout=20)
    assert condition(resumed, "Suspended") == {**condition(resumed, "Suspended"), "status": "False", "reason": "PyTorchJobResumed"}
    assert first.isdisjoint({p["metadata"]["uid"] for p in sim.pods("pause")})


def test_c10d_dns_config_maps_and_env_reach_the_process(make_sim: Any) -> None:
    sim = make_sim(nodes=2)
    sim.api.create(f"/api/v1/namespaces/{NS}/configmaps", {"metadata": {"name": "cfg"}, "data": {"a.txt": "from the config map"}})
    script = "import os, time\nprint(open(os.environ['CFG']).read(), flush=True)\ntime.sleep(600)"
    job = python_job("dns", script, volumes=[{"name": "cfg", "configMap": {"name": "cfg"}}],
                     mounts=[{"name": "cfg", "mountPath": "/etc/cfg"}])
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "CFG", "value": "/etc/cfg/a.txt"})
    sim.api.create(job_path(NS), job)
    zero, one = (sim.wait_pod_running(f"dns-worker-{i}", timeout=20) for i in (0, 1))
    assert sim.wait("config map content", lambda: "from the config map" in sim.logs("dns-worker-1"))
    environ = SimCluster._environ(sim.container_pids("dns-worker-1")[0])
    host, port = environ["PET_RDZV_ENDPOINT"].split(":")
    assert host == zero["status"]["podIP"] != one["status"]["podIP"], "c10d rendezvouses on worker 0's address"
    assert int(port) != 29400 and environ["GREETING"] == f"hello {one['status']['podIP']}"
    assert environ["LLAMAFT_METRICS_HOST"] == one["status"]["podIP"] and environ["HOSTNAME"] == "dns-worker-1"
    assert sim.api.get(f"/api/v1/namespaces/{NS}/services/dns-worker-0")["spec"]["clusterIP"] == "None"  # type: ignore[index]


def test_rendezvous_deployments_become_ready_and_a_missing_binary_is_a_start_error(make_sim: Any) -> None:
    sim = make_sim(nodes=1, etcd_ready_delay=0.3)
    for name, component in (("x-etcd", "rendezvous"), ("web", "frontend")):
        sim.api.create(f"/apis/apps/v1/namespaces/{NS}/deployments", {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/component": component}}, "spec": {"replicas": 1}})
    ready = sim.wait("etcd ready", lambda: (d := sim.api.get(f"/apis/apps/v1/namespaces/{NS}/deployments/x-etcd"))
                     and (d.get("status") or {}).get("readyReplicas") == 1 and d)
    assert ready["status"]["replicas"] == 1
    assert not (sim.api.get(f"/apis/apps/v1/namespaces/{NS}/deployments/web") or {}).get("status"), "only the rendezvous"
    job = python_job("nobin", "", replicas=1)
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"] = ["no-such-binary"]
    sim.api.create(job_path(NS), job)
    sim.wait_job_condition("nobin", "Failed", timeout=20)
    terminated = sim.terminated("nobin-worker-0")
    assert terminated["reason"] == "StartError" and terminated["exitCode"] == 128 and "no-such-binary" in terminated["message"]


def test_scheduling_predicates() -> None:
    node = {"metadata": {"name": "node-1", "labels": {"kubernetes.io/hostname": "node-1", "gpu": "a100", "zone": "b"}}}

    def fits(spec: Obj) -> bool:
        return SimCluster._fits({"spec": spec}, node)

    def required(*expressions: Obj, fields: list[Obj] | None = None) -> Obj:
        term: Obj = {"matchExpressions": list(expressions)}
        if fields:
            term["matchFields"] = fields
        return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}}

    assert fits({}) and fits({"nodeSelector": {"gpu": "a100"}}) and not fits({"nodeSelector": {"gpu": "h100"}})
    assert fits(required({"key": "zone", "operator": "In", "values": ["a", "b"]}))
    assert not fits(required({"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-1"]}))
    assert fits(required({"key": "gpu", "operator": "Exists"})) and not fits(required({"key": "tpu", "operator": "Exists"}))
    assert fits(required({"key": "tpu", "operator": "DoesNotExist"}))
    assert fits(required(fields=[{"key": "metadata.name", "operator": "In", "values": ["node-1"]}]))
    assert not fits(required({"key": "gpu", "operator": "Exists"}, {"key": "zone", "operator": "In", "values": ["a"]})), "terms AND"
    either = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}]}}}}
    assert fits(either), "nodeSelectorTerms OR"
    assert not SimCluster._fits({"spec": {}}, {**node, "spec": {"unschedulable": True}}), "cordoned"


# ------------------------------------------------------------------- the API server alone
def test_finalizers_hold_a_deletion_until_the_last_one_is_removed(sim_emulator: EmulatorThread) -> None:
    core, _ = kube(sim_emulator)
    core.create_namespaced_config_map(NS, {"metadata": {"name": "held", "finalizers": ["example.com/a", "example.com/b"]}})
    core.delete_namespaced_config_map("held", NS)
    held = core.read_namespaced_config_map("held", NS)
    assert held.metadata.deletion_timestamp is not None and held.metadata.finalizers == ["example.com/a", "example.com/b"]
    core.patch_namespaced_config_map("held", NS, {"metadata": {"finalizers": ["example.com/b"]}})
    assert core.read_namespaced_config_map("held", NS).metadata.finalizers == ["example.com/b"]
    core.patch_namespaced_config_map("held", NS, {"metadata": {"finalizers": None}})
    with pytest.raises(client.ApiException) as gone:
        core.read_namespaced_config_map("held", NS)
    assert gone.value.status == 404


def owned(core: client.CoreV1Api, name: str, owner: Obj, block: bool = True) -> None:
    ref = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
           "uid": owner["metadata"]["uid"], "blockOwnerDeletion": block}
    core.create_namespaced_config_map(NS, {"metadata": {"name": name, "ownerReferences": [ref]}})


def exists(core: client.CoreV1Api, name: str) -> bool:
    try:
        core.read_namespaced_config_map(name, NS)
        return True
    except client.ApiException as exc:
        assert exc.status == 404
        return False


def test_propagation_policies_and_garbage_collection(sim_emulator: EmulatorThread) -> None:
    core, custom = kube(sim_emulator)

    def owner(name: str, finalizers: list[str] | None = None) -> Obj:
        spec = {"pytorchReplicaSpecs": {"Worker": {"replicas": 1, "template": {"spec": {"containers": [{"name": "pytorch", "image": "x"}]}}}}}
        body = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name, "finalizers": finalizers or []}, "spec": spec}
        return dict(custom.create_namespaced_custom_object("kubeflow.org", "v1", NS, "pytorchjobs", body))

    def job(name: str) -> Obj | None:
        try:
            return dict(custom.get_namespaced_custom_object("kubeflow.org", "v1", NS, "pytorchjobs", name))
        except client.ApiException:
            return None

    # Foreground: the owner waits, with a finalizer, until its blocking dependents are gone.
    fg = owner("fg", finalizers=["example.com/keep"])
    owned(core, "fg-child", fg)
    custom.delete_namespaced_custom_object("kubeflow.org", "v1", NS, "pytorchjobs", "fg", propagation_policy="Foreground")
    assert job("fg")["metadata"]["finalizers"] == ["example.com/keep", "foregroundDeletion"]  # type: ignore[index]
    assert exists(core, "fg-child"), "the collector takes a moment"
    time.sleep(1.0)
    assert not exists(core, "fg-child") and job("fg")["metadata"]["finalizers"] == ["example.com/keep"]  # type: ignore[index]
    custom.patch_namespaced_custom_object("kubeflow.org", "v1", NS, "pytorchjobs", "fg", {"metadata": {"finalizers": None}})
    assert job("fg") is None

    # Background (the default): the owner goes at once, its dependents a moment later.
    bg = owner("bg")
    owned(core, "bg-child", bg)
    custom.delete_namespaced_custom_object("kubeflow.org", "v1", NS, "pytorchjobs", "bg")
    assert job("bg") is None and exists(core, "bg-child")
    time.sleep(1.0)
    assert not exists(core, "bg-child")

    # Orphan (DeleteOptions body): dependents lose the reference and stay.
    orphan = owner("orphan")
    owned(core, "orphan-child", orphan)
    custom.delete_namespaced_custom_object("kubeflow.org", "v1", NS, "pytorchjobs", "orphan", body={"propagationPolicy": "Orphan"})
    time.sleep(1.0)
    assert job("orphan") is None and exists(core, "orphan-child")
    assert core.read_namespaced_config_map("orphan-child", NS).metadata.owner_references is None

    # Owners are matched by uid: a dependent of a deleted incarnation goes even if the name is reused.
    old = owner("again")
    owned(core, "again-child", old)
    custom.delete_namespaced_custom_object("kubeflow.org", "v1", NS, "pytorchjobs", "again", body={"propagationPolicy": "Orphan"})
    time.sleep(1.0)
    assert job("again") is None and exists(core, "again-child")
    core.patch_namespaced_config_map("again-child", NS, {"metadata": {"ownerReferences": [
        {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "again", "uid": old["metadata"]["uid"]}]}})
    owner("again")
    time.sleep(1.0)
    assert not exists(core, "again-child")


def test_pod_deletion_is_graceful_only_for_bound_running_pods(sim_emulator: EmulatorThread) -> None:
    core, _ = kube(sim_emulator)

    def pod(name: str, node: str | None = None) -> None:
        core.create_namespaced_pod(NS, {"metadata": {"name": name}, "spec": {
            "terminationGracePeriodSeconds": 7, "containers": [{"name": "c", "image": "x"}]}})
        if node:
            core.create_namespaced_pod_binding(name, NS, {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                                                          "target": {"kind": "Node", "name": node}}, _preload_content=False)

    def present(name: str) -> bool:
        try:
            core.read_namespaced_pod(name, NS)
            return True
        except client.ApiException:
            return False

    core.create_node({"metadata": {"name": "n"}})
    pod("unbound")
    core.delete_namespaced_pod("unbound", NS)
    assert not present("unbound"), "nothing runs it: removed at once"
    pod("bound", node="n")
    assert core.read_namespaced_pod("bound", NS).spec.node_name == "n"
    core.delete_namespaced_pod("bound", NS)
    bound = core.read_namespaced_pod("bound", NS)
    assert bound.metadata.deletion_grace_period_seconds == 7, "the kubelet gets spec.terminationGracePeriodSeconds"
    core.patch_namespaced_pod_status("bound", NS, {"status": {"phase": "Running"}})
    assert present("bound"), "status updates do not release a terminating pod"
    core.delete_namespaced_pod("bound", NS, grace_period_seconds=0)
    assert not present("bound"), "gracePeriodSeconds=0 (the kubelet's last word, or --force) removes it"
    pod("finished", node="n")
    core.patch_namespaced_pod_status("finished", NS, {"status": {"phase": "Succeeded"}})
    core.delete_namespaced_pod("finished", NS)
    assert not present("finished"), "a finished pod has nothing to stop"
    pod("evicted", node="n")
    core.create_namespaced_pod_eviction("evicted", NS, {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "evicted"}})
    evicted = core.read_namespaced_pod("evicted", NS)
    assert evicted.metadata.deletion_timestamp is not None
    assert [(c.type, c.reason) for c in evicted.status.conditions if c.type == "DisruptionTarget"] == [("DisruptionTarget", "EvictionByEvictionAPI")]
    # PodGC: pods bound to a Node that no longer exists are force-deleted.
    pod("orphaned", node="gone-node")
    time.sleep(sim_emulator.emulator.podgc_delay + 1.5)  # type: ignore[union-attr]
    assert not present("orphaned") and present("evicted")


def test_writes_honour_preconditions(sim_emulator: EmulatorThread) -> None:
    core, _ = kube(sim_emulator)
    cm = core.create_namespaced_config_map(NS, {"metadata": {"name": "pre"}, "data": {"a": "1"}})
    with pytest.raises(client.ApiException) as stale:
        core.patch_namespaced_config_map("pre", NS, {"metadata": {"resourceVersion": "999999"}, "data": {"a": "2"}})
    assert stale.value.status == 409
    with pytest.raises(client.ApiException) as other:
        core.patch_namespaced_config_map("pre", NS, {"metadata": {"uid": "not-this-one"}, "data": {"a": "2"}})
    assert other.value.status == 409
    updated = core.patch_namespaced_config_map("pre", NS, {"metadata": {"resourceVersion": cm.metadata.resource_version}, "data": {"a": "3"}})
    assert updated.data == {"a": "3"} and int(updated.metadata.resource_version) > int(cm.metadata.resource_version)
    with pytest.raises(client.ApiException) as exists_already:
        core.create_namespaced_config_map(NS, {"metadata": {"name": "pre"}})
    assert exists_already.value.status == 409


def test_the_emulator_applies_the_crds_defaults_like_the_api_server() -> None:
    """Defaulting from the structural schema: spec defaults on create and on writes, nulls of
    non-nullable fields pruned before defaulting; the status schema has no defaults (the operator
    writes every status field it relies on)."""
    from kubernetes import client

    from tests.operator.emulator import EmulatorThread

    emulator = EmulatorThread().start()
    try:
        config = client.Configuration()
        config.host = emulator.url
        custom = client.CustomObjectsApi(client.ApiClient(config))
        body = {"apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune", "metadata": {"name": "d"},
                "spec": {"model": {"source": "m"}, "dataset": {"format": "samsum", "source": "s"}, "cluster": {"workers": None}}}
        created = custom.create_namespaced_custom_object("llamaft.io", "v1alpha1", "default", "llamafinetunes", body)
        assert created["spec"]["cluster"]["workers"] == 1 and created["spec"]["runPolicy"]["retryBudget"] == 3
        assert created["spec"]["fsdp"]["shardingStrategy"] == "FULL_SHARD"
        patched = custom.patch_namespaced_custom_object_status("llamaft.io", "v1alpha1", "default", "llamafinetunes", "d",
                                                               {"status": {"phase": "Running"}})
        assert patched["status"] == {"phase": "Running"}
        patched = custom.patch_namespaced_custom_object("llamaft.io", "v1alpha1", "default", "llamafinetunes", "d",
                                                        {"spec": {"runPolicy": {"retryBudget": None}}})
        assert patched["spec"]["runPolicy"]["retryBudget"] == 3
    finally:
        emulator.stop()
