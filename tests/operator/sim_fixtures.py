"""Fixtures for tests on a simulated cluster (tests/operator/sim.py): an API emulator, one shared
real etcd, SimClusters that are always stopped (every process they started killed, checked), and
a small LlamaFineTune for the real trainer.

Import the fixture functions into a test module (`from tests.operator.sim_fixtures import
sim_fixture, ...`: each `*_fixture` is the fixture named without the suffix); they live outside
conftest.py so that only the modules that want a simulated cluster pay for one.

Results on a claim: the sim gives every container a private filesystem, so what a run writes
outside its volumes is gone with the container, as on a real cluster. A test that reads a run's
checkpoints, export or TensorBoard files afterwards keeps them on the claim CHECKPOINT_CLAIM
(`checkpointing(name)`: mounted at /checkpoints/<name>), which `make_sim` backs with the test's
folder `checkpoint_folder(tmp_path)`; `on_claim` maps a path the trainer reports to that folder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from llamaft_trainer.process.local_etcd import LocalEtcd

from tests.conftest import REPO, need_etcd
from tests.operator.conftest import CHECKPOINT_CLAIM as CHECKPOINT_CLAIM  # re-exported
from tests.operator.emulator import EmulatorThread
from tests.operator.sim import SimCluster
from tests.tiers import starts_processes

DATASET = REPO / "examples" / "data" / "samsum-tiny.jsonl"
TORCH_DISTRIBUTED = REPO / "tests" / "fixtures" / "upstream" / "kubeflow-trainer-v2.3" / "torch_distributed_runtime.yaml"
"""Kubeflow Trainer v2.3's `torch-distributed` ClusterTrainingRuntime (manifests/base/runtimes), vendored."""
CHECKPOINT_MOUNT = "/checkpoints"
SIM_GC_DELAY = 0.3
"""The emulator's garbage-collector latency in sim tests: long enough that a test sees dependents
outlive their owner, short against everything else a deletion takes."""


def trainer_binds_metrics_host() -> bool:
    """Whether the trainer binds its metrics server to LLAMAFT_METRICS_HOST (the pod's address).
    Until it does, two pods on this one machine collide on the metrics port, so sim tests switch
    the metrics server off (LLAMAFT_METRICS_PORT=0) instead of pretending."""
    return any("LLAMAFT_METRICS_HOST" in p.read_text() for p in (REPO / "trainer" / "llamaft_trainer").rglob("*.py"))


def checkpoint_folder(tmp_path: Path) -> Path:
    """The host folder backing CHECKPOINT_CLAIM in a test's simulated cluster (`make_sim`)."""
    return tmp_path / "ckpt"


def checkpoint_directory(name: str) -> str:
    """Where run `name`'s worker pods mount CHECKPOINT_CLAIM: its spec.checkpointing.directory."""
    return f"{CHECKPOINT_MOUNT}/{name}"


def checkpointing(name: str, **fields: Any) -> dict[str, Any]:
    """spec.checkpointing keeping run `name`'s checkpoints (and its export and TensorBoard files,
    which go under the directory) on CHECKPOINT_CLAIM; `fields` add to it (e.g. everyNSteps=2)."""
    return {"volumeClaim": CHECKPOINT_CLAIM, "directory": checkpoint_directory(name), **fields}


def on_claim(folder: Path, name: str, path: str = "") -> Path:
    """The host file behind `path` (a path in run `name`'s containers under its checkpoint
    directory, e.g. the exportPath its report names; "" for the directory itself) on the claim
    folder `folder` (`checkpoint_folder`): the claim is mounted at the directory itself."""
    directory = checkpoint_directory(name)
    path = path or directory
    if path != directory and not path.startswith(directory + "/"):
        raise ValueError(f"{path} is not under run {name}'s checkpoint directory {directory}")
    return folder / path[len(directory):].lstrip("/")


def tiny_finetune(name: str, model: Path, **overrides: Any) -> dict[str, Any]:
    """A LlamaFineTune for the tiny test model: 2 workers x 1 CPU process, a few steps, no export,
    checkpoints on CHECKPOINT_CLAIM (`checkpointing(name)`), rendezvous etcd-v2 through the managed
    etcd's name (which the sim maps to the local etcd). `overrides` merge into spec sections (e.g.
    training={"maxSteps": 6})."""
    spec: dict[str, Any] = {
        "model": {"source": str(model), "dtype": "float32"},
        "dataset": {"format": "samsum", "source": str(DATASET), "maxSeqLength": 64, "packing": True, "validationSplit": 0.1},
        "training": {"maxSteps": 3, "perDeviceBatchSize": 2, "learningRate": 2e-3, "evalInterval": 0, "seed": 7},
        "fsdp": {"mixedPrecision": "fp32", "activationCheckpointing": {"mode": "none"}},
        "checkpointing": checkpointing(name, everyNSteps=1000, exportHuggingFace=False, resume=False),
        "cluster": {"workers": 2, "gpusPerWorker": 0},
        "rendezvous": {"backend": "etcd-v2"},
    }
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return {"apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune", "metadata": {"name": name, "namespace": "default"},
            "spec": spec}


@pytest.fixture(scope="module", name="sim_etcd")
@starts_processes
def sim_etcd_fixture() -> Iterator[LocalEtcd]:
    """One real etcd (v2 API) for every "etcd" of the module's clusters; runs use unique ids."""
    need_etcd()
    with LocalEtcd() as server:
        yield server


@pytest.fixture(name="sim_emulator")
def sim_emulator_fixture() -> Iterator[EmulatorThread]:
    """A fresh API server per test: no state leaks between simulated clusters."""
    thread = EmulatorThread(gc_delay=SIM_GC_DELAY).start()
    yield thread
    thread.stop()


@pytest.fixture(name="make_sim")
@starts_processes
def make_sim_fixture(sim_emulator: EmulatorThread, sim_etcd: LocalEtcd, tmp_path: Path) -> Iterator[Callable[..., SimCluster]]:
    """make_sim(nodes=2, **SimCluster options) -> a started SimCluster on this test's emulator, with
    CHECKPOINT_CLAIM backed by `checkpoint_folder(tmp_path)` besides the `claims` given.
    Teardown stops every one, even when the test failed, and fails the test if a process survived."""
    started: list[SimCluster] = []

    def make(nodes: int = 2, **options: Any) -> SimCluster:
        options["claims"] = {CHECKPOINT_CLAIM: checkpoint_folder(tmp_path), **(options.get("claims") or {})}
        sim = SimCluster(sim_emulator.url, sim_etcd.endpoint, nodes=nodes, workdir=tmp_path / f"sim{len(started)}", **options)
        started.append(sim)
        return sim.start()

    yield make
    leaked: list[str] = []
    for sim in started:
        sim.stop()
        left = SimCluster._pids_with_marker(f"{sim.id}/")
        if left:
            leaked.append(f"{sim.workdir}: {left}")
    if leaked:
        pytest.fail(f"processes survived SimCluster.stop(): {leaked}")


@pytest.fixture(name="sim")
def sim_fixture(make_sim: Callable[..., SimCluster]) -> SimCluster:
    """A 3-node simulated cluster."""
    return make_sim(nodes=3)


def torch_distributed_runtime(name: str = "torch-distributed", **job_spec: Any) -> dict[str, Any]:
    """The vendored `torch-distributed` ClusterTrainingRuntime, renamed, with `job_spec` set on its
    `node` replicated job's Job spec (e.g. backoffLimit=0: what no runtimePatch can set)."""
    runtime: dict[str, Any] = yaml.safe_load(TORCH_DISTRIBUTED.read_text())
    runtime["metadata"]["name"] = name
    for rjob in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        if rjob["name"] == "node":
            rjob["template"]["spec"].update(job_spec)
    return runtime


@pytest.fixture(name="torch_runtime")
def torch_runtime_fixture(sim_emulator: EmulatorThread) -> dict[str, Any]:
    """The stock `torch-distributed` ClusterTrainingRuntime, created in this test's emulator (as the
    Trainer's Helm chart installs it); TrainJobs rendered by llamaft reference it by default."""
    from tests.operator.sim import Api

    created = Api(sim_emulator.url).create("/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes", torch_distributed_runtime())
    assert created is not None
    return created
