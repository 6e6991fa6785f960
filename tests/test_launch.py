"""One description of a launch (issue 13): the local run is the cluster run by construction.

- `torchrun_launch(job)` equals what a worker pod of the rendered PyTorchJob gets from the
  training operator (the simulated cluster's independent port of v1.9's setPodEnv) and runs.
- `llamaft run --local`'s agents run that launch, changed only in the machine-bound values.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from llamaft.api.documents import load_finetune
from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.launch import localize, torchrun_launch
from llamaft.local import agent, local_threads, plan
from llamaft.render import desired
from llamaft.render.naming import CONFIG_FILE, Owner

from tests.operator.sim import SimCluster

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
MACHINE_BOUND = {"PET_RDZV_ENDPOINT", "LLAMAFT_CONFIG", "LLAMAFT_SPEC", "LLAMAFT_METRICS_PORT", "LLAMAFT_TERMINATION_LOG",
                 "PET_NPROC_PER_NODE", "CUDA_VISIBLE_DEVICES",
                 "LLAMAFT_CACHE", "HF_HOME", "LLAMAFT_CACHE_SHARED",  # this machine's download caches (launch.local_cache)
                 "LLAMAFT_RUN_UID",  # a local run is its checkpoint directory (LocalPlan.run_uid)
                 "OMP_NUM_THREADS"}  # this machine's cores per process (local.local_threads)


def pod_env(job: dict) -> dict[str, str]:  # type: ignore[type-arg]
    """The `pytorch` container's env as the (simulated) training operator creates the pod."""
    rspec = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    container = next(c for c in rspec["template"]["spec"]["containers"] if c["name"] == "pytorch")
    env = [*container.get("env", []), *SimCluster._injected_env(job, rspec)]
    return {e["name"]: str(e["value"]) for e in env if "value" in e}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_launch_is_what_the_training_operator_gives_the_pod(path: Path) -> None:
    body, spec = load_finetune(path)
    owner = Owner(body["metadata"]["name"], "team-a", "0f1e2d3c-aaaa-bbbb-cccc-000000000000")
    job = desired.pytorch_job(owner, spec, 3)
    launch = torchrun_launch(job)
    assert launch.env == pod_env(job)
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert launch.argv == container["command"]
    assert launch.flag("rdzv_id") == owner.rendezvous_id(3)
    assert launch.flag("rdzv_backend") == spec.rendezvous.backend.value
    elastic = spec.cluster.elastic
    assert launch.flag("nnodes") == (f"{elastic.min_workers}:{elastic.max_workers}" if elastic
                                     else f"{spec.cluster.workers}:{spec.cluster.workers}")
    assert launch.flag("max_restarts") == str(spec.rendezvous.max_restarts)
    assert ("HF_TOKEN" in launch.from_sources) == (spec.model.hf_token_secret is not None)


def test_localize_changes_only_the_machine_bound_values() -> None:
    _, spec = load_finetune(REPO / "examples" / "llama2-7b.yaml")
    launch = torchrun_launch(desired.pytorch_job(Owner("x", "ns", "u-1"), spec, 1))
    local = localize(launch, rdzv_endpoint="127.0.0.1:1", config_path="/tmp/c.json", nproc_per_node=1, metrics_port=9,
                     termination_log="/tmp/t", cpu_only=True)
    assert set(local.changed) <= MACHINE_BOUND
    assert local.launch.env["LLAMAFT_SPEC"] == "/tmp/spec.json", "the whole spec beside the config, as in the pod"
    assert {k: v for k, v in local.launch.env.items() if k not in local.changed} == \
        {k: v for k, v in launch.env.items() if k not in local.changed}
    assert local.launch.argv[-2:] == ["--config", "/tmp/c.json"] and local.launch.argv[1:3] == ["-m", "torch.distributed.run"]


@pytest.mark.parametrize("name", ["tiny", "llama2-7b-lora"])
def test_run_local_runs_the_cluster_launch(name: str, tmp_path: Path) -> None:
    """What `llamaft run --local` spawns for each agent vs the cluster's launch for the same file."""
    source = REPO / "examples" / f"{name}.yaml"
    text = source.read_text()
    if name == "tiny":  # the tiny example's model is built by the README's first command
        (tmp_path / "model").mkdir()
        text = text.replace("source: ./.local-assets/tiny-llama", f"source: {tmp_path / 'model'}")
        assert str(tmp_path / "model") in text
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    p, spec = plan(path, nproc_per_worker=None, run_dir=tmp_path / "run")
    owner = Owner(p.name, "local", "unused")
    cluster = torchrun_launch(desired.pytorch_job(owner, spec, 1))
    for index in range(p.workers):
        local = agent(p, "127.0.0.1:2379", index)
        assert set(local.changed) <= MACHINE_BOUND
        same = {k: v for k, v in local.launch.env.items() if k not in local.changed and k != "PET_RDZV_ID"}
        assert same == {k: v for k, v in cluster.env.items() if k not in local.changed and k != "PET_RDZV_ID"}
        assert local.launch.argv[3:-1] == cluster.argv[1:-1]
    assert p.config_path.read_text() == desired.config_map(owner, spec)["data"][CONFIG_FILE], \
        "the trainer reads the ConfigMap's own JSON"
    assert p.rdzv_id != plan(path, nproc_per_worker=None, run_dir=tmp_path / "run")[0].rdzv_id, "a rerun gets a new id"


# ------------------------------------------------------------------ threads per trainer process
def _spec(cluster: dict) -> LlamaFineTuneSpec:  # type: ignore[type-arg]
    return LlamaFineTuneSpec.model_validate({
        "model": {"source": "hf://meta-llama/Llama-2-7b-hf"},
        "dataset": {"format": "samsum", "source": "hf://knkarthick/samsum"}, "cluster": cluster,
    })


@pytest.mark.parametrize(("cluster", "threads"), [
    ({"workers": 2, "gpusPerWorker": 8, "resources": {"cpu": "96"}}, "12"),
    ({"workers": 1, "gpusPerWorker": 8, "resources": {"cpu": "90"}}, "11"),
    ({"workers": 1, "gpusPerWorker": 0, "resources": {"cpu": "4"}}, "4"),
    ({"workers": 1, "gpusPerWorker": 4, "resources": {"cpu": "2"}}, "1"),
    ({"workers": 1, "gpusPerWorker": 0, "resources": {"cpu": "500m"}}, "1"),
    ({"workers": 2, "gpusPerWorker": 8}, "1"),
])
def test_each_process_gets_its_share_of_the_workers_cpus(cluster: dict, threads: str) -> None:  # type: ignore[type-arg]
    spec = _spec(cluster)
    env = pod_env(desired.pytorch_job(Owner("t", "ns", "uid"), spec, 1))
    assert env["OMP_NUM_THREADS"] == threads == str(desired.threads_per_process(spec))


def test_the_users_omp_num_threads_wins_in_the_pod_and_here() -> None:
    spec = _spec({"workers": 2, "gpusPerWorker": 0, "resources": {"cpu": "8"},
                  "env": [{"name": "OMP_NUM_THREADS", "value": "3"}]})
    assert pod_env(desired.pytorch_job(Owner("t", "ns", "uid"), spec, 1))["OMP_NUM_THREADS"] == "3"
    assert local_threads(spec, "cpu", 2, {"OMP_NUM_THREADS": "5"}) is None, "the launch carries the spec's 3"
    plain = _spec({"workers": 2, "gpusPerWorker": 0})
    assert local_threads(plain, "cpu", 2, {"OMP_NUM_THREADS": "5"}) == "5", "this shell's value"


def test_a_local_cpu_run_shares_this_machines_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    spec = _spec({"workers": 2, "gpusPerWorker": 0, "resources": {"cpu": "64"}})
    assert local_threads(spec, "cpu", 2, {}) == "4"
    assert local_threads(spec, "cpu", 1, {}) == "8"
    assert local_threads(spec, "cpu", 16, {}) == "1"
    assert local_threads(spec, "cuda", 2, {}) is None, "a GPU run here keeps the pod's share"
