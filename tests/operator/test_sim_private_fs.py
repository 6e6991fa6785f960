"""The simulated cluster is as strict as a real one about files, ports and names:

- every container start has a private filesystem (tests/operator/container_root.py): what it
  writes outside its volumes is gone from this machine and from the next container; a claim keeps
  its files for every pod; an emptyDir lives as long as its pod (across container restarts);
- a pod naming a claim the cluster does not have is unschedulable (kube-scheduler's VolumeBinding);
- container ports are the template's plus exactly what the controllers add, and a scrape of a named
  port the pod does not declare finds no target (`SimCluster.container_port_address`);
- generated names carry the API server's 5 random characters, as the Job controller asks;
- and the point of it all: a run whose checkpoints live outside every volume (`discardWithPod`)
  starts again from step 0 after a fault, where the old shared-filesystem sim let it resume.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from llamaft_trainer.report.logline import read_events

from tests.operator.emulator import GENERATE_NAME_ALPHABET
from tests.operator.sim import Api, SimCluster, job_path, pod_path, pod_port
from tests.operator.sim_fixtures import (  # noqa: F401 (the *_fixture imports register pytest fixtures)
    CHECKPOINT_CLAIM,
    checkpoint_folder,
    make_sim_fixture,
    sim_emulator_fixture,
    sim_etcd_fixture,
    tiny_finetune,
    torch_distributed_runtime,
)
from tests.operator.sim_trainjob import jobset_spec, pod_generate_name
from tests.operator.test_sim import python_job, worker

Obj = dict[str, Any]
NS = "default"

OBSERVE = """
import json, os, sys, time
mine = '/tmp/' + os.environ['MARK']
seen = {'own': os.path.exists(mine), 'scratch': os.path.exists('/scratch/mark'), 'claim': os.path.exists('/claim/' + os.environ['MARK'])}
print(json.dumps(seen), flush=True)
for path in (mine, '/scratch/mark', '/claim/' + os.environ['MARK']):
    open(path, 'w').write('x')
if os.environ.get('CRASH_ONCE') and not os.path.exists('/scratch/crashed'):
    open('/scratch/crashed', 'w').close()
    sys.exit(3)
time.sleep(600)
"""
"""Prints which of its three files a container finds at start, then writes them: one outside every
volume (/tmp), one on an emptyDir (/scratch), one on a claim (/claim); with CRASH_ONCE its pod's
first container exits 3 (restartPolicy OnFailure: the kubelet restarts it in place)."""


def observer_pod(name: str, mark: str, *, crash_once: bool) -> Obj:
    env = [{"name": "MARK", "value": mark}] + ([{"name": "CRASH_ONCE", "value": "1"}] if crash_once else [])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS}, "spec": {
        "restartPolicy": "OnFailure", "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "main", "image": "python", "command": ["python", "-c", OBSERVE], "env": env,
                        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}, {"name": "claim", "mountPath": "/claim"}]}],
        "volumes": [{"name": "scratch", "emptyDir": {}}, {"name": "claim", "persistentVolumeClaim": {"claimName": CHECKPOINT_CLAIM}}]}}


def seen(sim: SimCluster, pod: str, *, previous: bool = False) -> dict[str, bool] | None:
    lines = [line for line in sim.logs(pod, previous=previous).splitlines() if line.startswith("{")]
    return json.loads(lines[0]) if lines else None


def pod_dirs(sim: SimCluster, uid: str) -> list[Path]:
    return list((sim.workdir / "pods").glob(f"*_{uid[:8]}"))


# ------------------------------------------------------------------------- files and volumes
def test_container_files_die_with_the_container_claims_stay_and_empty_dirs_live_with_the_pod(
        make_sim: Any, tmp_path: Path) -> None:
    sim = make_sim(nodes=1, restart_backoff=0.2)
    mark = f"simfs-{uuid.uuid4().hex[:8]}"
    sim.api.create(pod_path(NS), observer_pod("files", mark, crash_once=True))
    sim.wait("the restarted container", lambda: seen(sim, "files", previous=True) and seen(sim, "files"), timeout=30)
    first, second = seen(sim, "files", previous=True), seen(sim, "files")
    assert first == {"own": False, "scratch": False, "claim": False}
    assert second == {"own": False, "scratch": True, "claim": True}, \
        "a restart gets a fresh writable layer, keeps the pod's emptyDir and sees the claim"
    assert not Path("/tmp", mark).exists(), "a file written outside every volume never reaches this machine"
    assert (checkpoint_folder(tmp_path) / mark).read_text() == "x", "the claim is the test's folder"
    uid = sim.pod("files")["metadata"]["uid"]  # type: ignore[index]
    [run_dir] = pod_dirs(sim, uid)
    assert (run_dir / "volumes" / "scratch" / "mark").exists()
    assert [p.name for p in (run_dir / "containers").iterdir()] == ["1"], "the replaced container's layer is deleted"

    sim.api.delete(pod_path(NS, "files"))
    sim.wait("the pod gone", lambda: sim.pod("files") is None, timeout=20)
    sim.wait("its files gone", lambda: not (run_dir / "volumes").exists() and not (run_dir / "containers").exists(), timeout=10)
    sim.api.create(pod_path(NS), observer_pod("files-2", mark, crash_once=False))
    after = sim.wait("the new pod's container", lambda: seen(sim, "files-2"), timeout=20)
    assert after == {"own": False, "scratch": False, "claim": True}, "a new pod: a new emptyDir, the same claim"


def test_a_pod_naming_an_undeclared_claim_is_unschedulable(make_sim: Any) -> None:
    sim = make_sim(nodes=2)
    pod = observer_pod("noclaim", "x", crash_once=False)
    pod["spec"]["volumes"][1]["persistentVolumeClaim"]["claimName"] = "nowhere"
    sim.api.create(pod_path(NS), pod)

    def unschedulable() -> Obj | None:
        current = sim.pod("noclaim") or {}
        return next((c for c in (current.get("status") or {}).get("conditions") or [] if c["type"] == "PodScheduled"), None)
    condition = sim.wait("PodScheduled False", unschedulable, timeout=10)
    assert (condition["status"], condition["reason"]) == ("False", "Unschedulable")
    assert condition["message"] == '0/2 nodes are available: persistentvolumeclaim "nowhere" not found.'
    time.sleep(1)
    assert not (sim.pod("noclaim") or {}).get("spec", {}).get("nodeName") and not sim.logs("noclaim"), "never runs"


def test_sim_start_refuses_without_private_filesystems(sim_emulator: Any, sim_etcd: Any, tmp_path: Path) -> None:
    """A launcher that cannot build the root (here: no interpreter for it) stops the cluster from
    starting, with a message saying what it needs, instead of running containers on the host's files."""
    sim = SimCluster(sim_emulator.url, sim_etcd.endpoint, nodes=1, workdir=tmp_path / "sim", python="/bin/false")
    with pytest.raises(RuntimeError, match=r"private filesystem .* needs root \(CAP_SYS_ADMIN\)"):
        sim.start()
    sim.stop()


# -------------------------------------------------------------------------------------- ports
def test_pods_have_exactly_the_declared_ports_and_undeclared_names_have_no_address(make_sim: Any) -> None:
    sim = make_sim(nodes=2)
    sleep = "import time\nprint('up', flush=True)\ntime.sleep(600)"
    job = python_job("ports", sleep, replicas=1)
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["ports"] = [
        {"name": "metrics", "containerPort": 9400}]
    own = python_job("ownport", sleep, replicas=1)
    own["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["ports"] = [
        {"name": "pytorchjob-port", "containerPort": 29401}]
    for created in (job, own):
        sim.api.create(job_path(NS), created)
    pod = sim.wait_pod_running("ports-worker-0", timeout=20)
    # training-operator v1.9's defaulting adds pytorchjob-port, nothing else; a declared one stays alone.
    assert [(p["name"], p["containerPort"]) for p in pod["spec"]["containers"][0]["ports"]] == [
        ("metrics", 9400), ("pytorchjob-port", 23456)]
    other = sim.wait_pod_running("ownport-worker-0", timeout=20)
    assert [(p["name"], p["containerPort"]) for p in other["spec"]["containers"][0]["ports"]] == [("pytorchjob-port", 29401)]

    ip = pod["status"]["podIP"]
    assert sim.container_port_address("ports-worker-0", "metrics") == f"{ip}:9400"
    assert sim.container_port_address("ports-worker-0", 8080) == f"{ip}:8080", "a number needs no declaration"
    with pytest.raises(LookupError, match="declares no container port named 'metrics'"):
        sim.container_port_address("ownport-worker-0", "metrics")
    with pytest.raises(LookupError, match="does not exist"):
        sim.container_port_address("nobody", "metrics")


def test_trainer_adds_only_the_master_port(tiny_model: Path) -> None:
    from llamaft.api.validation import validate_resource
    from llamaft.render import trainjob
    from llamaft.render.naming import Owner

    owner = Owner("tports", NS, str(uuid.uuid4()))
    job = trainjob.train_job(owner, validate_resource(tiny_finetune("tports", tiny_model)), 1)
    job["metadata"]["uid"] = "u"
    [rjob] = [r for r in jobset_spec(job, torch_distributed_runtime())["replicatedJobs"] if r["name"] == "node"]
    [container] = [c for c in rjob["template"]["spec"]["template"]["spec"]["containers"] if c["name"] == "node"]
    assert container["ports"] == [{"containerPort": 29500}], "torch.go EnforceMLPolicy's one unnamed port; no metrics port"


# -------------------------------------------------------------------------------------- names
def test_generated_names_have_the_api_servers_random_suffix(sim_emulator: Any) -> None:
    api = Api(sim_emulator.url)
    names = set()
    for _ in range(20):
        created = api.create(f"/api/v1/namespaces/{NS}/configmaps", {"metadata": {"generateName": "run-node-0-1-"}})
        assert created is not None
        names.add(created["metadata"]["name"])
    assert len(names) == 20 and all(re.fullmatch(f"run-node-0-1-[{GENERATE_NAME_ALPHABET}]{{5}}", n) for n in names), names
    long = api.create(f"/api/v1/namespaces/{NS}/configmaps", {"metadata": {"generateName": "x" * 70}})
    assert long is not None and len(long["metadata"]["name"]) == 63 and long["metadata"]["name"].startswith("x" * 58)


def test_indexed_job_pod_generate_name_keeps_the_index_when_cut() -> None:
    assert pod_generate_name("tj-node-0", 1) == "tj-node-0-1-"
    long = "j" * 60
    assert pod_generate_name(long, 12) == "j" * 54 + "-12-" and len(pod_generate_name(long, 12)) == 58


# ----------------------------------------------------------------- the point: no resume
def test_checkpoints_outside_any_volume_are_lost_with_the_container(make_sim: Any, tiny_model: Path) -> None:
    """One worker checkpoints every 2 steps to /checkpoints/run, on no volume (discardWithPod: the
    loss is accepted). Killed past its first complete checkpoint, the training operator replaces
    the pod (exit 137 under ExitCode) and the new container finds no checkpoint: it trains from
    step 1 again. On the old sim, which shared this machine's files, it resumed."""
    from llamaft.api.validation import validate_resource
    from llamaft.render import desired
    from llamaft.render.naming import Owner

    sim = make_sim(nodes=2)
    resource = tiny_finetune("nofs", tiny_model, training={"maxSteps": 200}, cluster={"workers": 1},
                             monitoring={"metricsPort": pod_port()})
    resource["spec"]["checkpointing"] = {"directory": "/checkpoints/run", "everyNSteps": 2, "resume": True,
                                         "exportHuggingFace": False, "discardWithPod": True}
    owner, parsed = Owner("nofs", NS, str(uuid.uuid4())), validate_resource(resource)
    job = desired.pytorch_job(owner, parsed, 1)
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] = "ExitCode"
    volumes = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"]
    assert not any("persistentVolumeClaim" in v for v in volumes), "no claim: the checkpoints are in the container"
    assert sim.api.create(f"/api/v1/namespaces/{NS}/configmaps", desired.config_map(owner, parsed)) is not None
    assert sim.api.create(job_path(NS), job) is not None
    pod = worker(job, 0)
    first_uid = sim.wait_pod_running(pod, timeout=60)["metadata"]["uid"]
    sim.wait("a complete checkpoint", lambda: read_events(sim.logs(pod), "checkpoint"), timeout=120, interval=0.1)
    sim.kill_container(pod)
    sim.wait("the replacement pod", lambda: (p := sim.pod(pod)) and p["metadata"]["uid"] != first_uid, timeout=60)
    sim.wait("the replacement's first step", lambda: sim.logs(pod, previous=True) and read_events(sim.logs(pod), "step"), timeout=120)
    before, after = sim.logs(pod, previous=True), sim.logs(pod)
    assert read_events(before, "checkpoint")[0]["step"] >= 2 and read_events(before, "step")[-1]["step"] >= 2
    assert read_events(after, "step")[0]["step"] == 1 and not read_events(after, "resume"), "nothing to resume from: it starts over"
    assert not Path("/checkpoints/run").exists(), "and the checkpoints never reached this machine"
