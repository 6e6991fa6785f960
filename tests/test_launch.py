"""One description of a launch (issue 13): the local run is the cluster run by construction.

- `torchrun_launch(job)` equals what a worker pod of the rendered PyTorchJob gets from the
  training operator (the simulated cluster's independent port of v1.9's setPodEnv) and runs.
- `llamaft run --local`'s agents run that launch, changed only in the machine-bound values.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from llamaft import local
from llamaft.api.documents import load_finetune
from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.cli import main as cli
from llamaft.launch import localize, torchrun_launch
from llamaft.local import agent, device_for, local_threads, plan
from llamaft.render import desired
from llamaft.render.naming import CONFIG_FILE, Owner
from llamaft_trainer.process.errors import ConfigError

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
    else:  # its pvc:// data is the cluster's: here, a local file (run --local checks its inputs first)
        (tmp_path / "train.jsonl").write_text("{}\n")
        text = text.replace("source: pvc://datasets/support-tickets/train.jsonl", f"source: {tmp_path / 'train.jsonl'}")
        assert str(tmp_path / "train.jsonl") in text
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    p, spec = plan(path, nproc_per_worker=None, run_dir=tmp_path / "run", cpu=True)  # the 8-GPU example, on any machine
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
    assert p.rdzv_id != plan(path, nproc_per_worker=None, run_dir=tmp_path / "run", cpu=True)[0].rdzv_id, \
        "a rerun gets a new id"


# ------------------------------------------------------------------ what run --local refuses before launching
def _no_launch(*args: object, **kwargs: object) -> None:
    raise AssertionError("torchrun was started")


def test_a_gpu_spec_on_a_machine_without_gpus_is_refused_unless_cpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """examples/llama2-7b.yaml asks for 8 GPUs per worker: without GPUs, run --local says so (the
    field, the flag) instead of training it on the CPU unannounced; --cpu runs it there, saying so."""
    monkeypatch.setattr(local, "visible_gpus", lambda: 0)
    monkeypatch.setattr(local, "_spawn", _no_launch)
    source = REPO / "examples" / "llama2-7b.yaml"
    assert cli(["run", "--local", str(source), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "spec.cluster.gpusPerWorker: the file asks for 8 GPU(s) per worker" in err and "--cpu" in err, err
    assert "has 0 visible" in err

    p, _ = plan(source, nproc_per_worker=None, run_dir=tmp_path / "run", cpu=True)
    assert (p.device, p.nproc_per_worker) == ("cpu", 1)
    assert "--cpu: running on the CPU" in capsys.readouterr().out


@pytest.mark.parametrize(("gpus", "device", "nproc"), [(32, "cuda", 8), (8, "cuda", 2), (3, None, None)])
def test_fewer_gpus_than_asked_run_on_those_with_a_note(gpus: int, device: str | None, nproc: int | None) -> None:
    spec = _spec({"workers": 4, "gpusPerWorker": 8})
    if device is None:  # fewer than one per worker
        with pytest.raises(ConfigError, match="spec.cluster.gpusPerWorker"):
            device_for(spec, gpus, cpu=False)
        return
    found, per_worker, note = device_for(spec, gpus, cpu=False)
    assert (found, per_worker) == (device, nproc)
    assert (note is None) == (gpus == 32)


@pytest.mark.parametrize("case", ["dataset missing", "dataset is a directory", "tokenizer missing", "dataset on a pvc",
                                  "model is a file"])
def test_missing_local_inputs_are_refused_before_torchrun_starts(
    case: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Every local path the trainer reads (api.sources' LOCAL and PVC sources) is checked by the CLI:
    the error names the field and the path at once, not ~17 s later from a worker."""
    monkeypatch.setattr(local, "_spawn", _no_launch)
    model, data = tmp_path / "model", tmp_path / "train.jsonl"
    model.mkdir()
    data.write_text('{"dialogue": "a", "summary": "b"}\n')
    fields: dict[str, dict[str, str]] = {"model": {"source": str(model)}, "dataset": {"format": "samsum", "source": str(data)}}
    expected = {
        "dataset missing": ("spec.dataset.source", str(tmp_path / "nowhere.jsonl"), "does not exist"),
        "dataset is a directory": ("spec.dataset.source", str(tmp_path), "is a directory"),
        "tokenizer missing": ("spec.model.tokenizer", str(tmp_path / "tok"), "does not exist"),
        "dataset on a pvc": ("spec.dataset.source", "pvc://claim/train.jsonl", "for llamaft run --local use a local path"),
        "model is a file": ("spec.model.source", str(data), "must name a model directory"),
    }[case]
    field, value, says = expected
    section, key = field.split(".")[1:]
    fields[section][key] = value
    path = tmp_path / "ft.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune",
                                    "metadata": {"name": "inputs"},
                                    "spec": {**fields, "cluster": {"workers": 1, "gpusPerWorker": 0}}}))
    assert cli(["run", "--local", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    line = next((x for x in err.splitlines() if field in x), "")
    assert line.startswith(f"llamaft: configuration error: {field}: {value}") and says in line, err


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
