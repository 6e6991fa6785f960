"""One description of a launch: the torchrun invocation a rendered PyTorchJob's worker runs.

The cluster path renders a PyTorchJob (llamaft.render.desired); the Kubeflow training operator
turns its elasticPolicy and nprocPerNode into PET_* variables (torchrun reads every PET_<FLAG> as
the default of --<flag>), and the kubelet runs the `pytorch` container's command with its env.
`torchrun_launch` computes exactly that from the job, so `llamaft run --local` runs what a worker
pod runs: the same command, the same config JSON, the same rendezvous backend, id, conf, nnodes
range, restarts and env. What `localize` changes is only what cannot be the same on one machine
(the rendezvous address, the config's path, the metrics port, the device count, the termination
log), and it says so field by field.

The PET_* derivation follows training-operator v1.9 `pkg/controller.v1/pytorch/envvar.go`
(setPodEnv) and `elastic.go` for a Master-less elastic job (what llamaft renders); the simulated
cluster in tests/operator/sim.py has an independent port of the same code, and
tests/test_launch.py checks that both agree for every example.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from llamaft.api import cache_folders

CONTAINER = "pytorch"
"""The container the training operator configures (it requires this name)."""
Obj = dict[str, Any]


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    """The container's command + args, as the kubelet runs them."""
    env: dict[str, str]
    """The container's literal env, then what the training operator adds (PET_*, PYTHONUNBUFFERED)."""
    from_sources: list[str] = field(default_factory=list)
    """Env names whose values come from Secrets or fields of the pod (valueFrom): taken from the
    local environment when run locally."""

    def flag(self, name: str) -> str | None:
        """torchrun's value for --<name> (PET_<NAME>)."""
        return self.env.get("PET_" + name.upper().replace("-", "_"))


def _worker_container(job: Mapping[str, Any]) -> Obj:
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    return next(c for c in template["spec"]["containers"] if c.get("name") == CONTAINER)


def training_operator_env(job: Mapping[str, Any]) -> dict[str, str]:
    """The variables the training operator sets on every worker of an elastic, Master-less job."""
    spec = job["spec"]
    elastic = spec["elasticPolicy"]
    workers = int(spec["pytorchReplicaSpecs"]["Worker"].get("replicas", 1))
    low = elastic.get("minReplicas", elastic.get("maxReplicas", workers))
    high = elastic.get("maxReplicas", low)
    env = {
        "PYTHONUNBUFFERED": "1",
        "PET_NPROC_PER_NODE": str(elastic.get("nProcPerNode", spec.get("nprocPerNode", "auto"))),
        "PET_RDZV_ENDPOINT": f"{elastic.get('rdzvHost') or job['metadata']['name'] + '-worker-0'}:{elastic.get('rdzvPort', 23456)}",
        "PET_RDZV_BACKEND": str(elastic.get("rdzvBackend") or "c10d"),
        "PET_NNODES": f"{low}:{high}",
    }
    if elastic.get("maxRestarts") is not None:
        env["PET_MAX_RESTARTS"] = str(elastic["maxRestarts"])
    if elastic.get("rdzvId") is not None:
        env["PET_RDZV_ID"] = str(elastic["rdzvId"])
    if elastic.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in elastic["rdzvConf"])
    return env


def torchrun_launch(job: Mapping[str, Any]) -> Launch:
    """What one worker pod of `job` runs (pure: no cluster, no machine)."""
    container = _worker_container(job)
    env: dict[str, str] = {}
    from_sources: list[str] = []
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = str(var["value"])
        else:
            from_sources.append(var["name"])
    env.update(training_operator_env(job))
    return Launch([*container.get("command", []), *container.get("args", [])], env, from_sources)


@dataclass(frozen=True)
class Localized:
    launch: Launch
    changed: dict[str, tuple[str | None, str]]
    """What differs from the cluster's launch, name -> (cluster value, local value)."""


def local_cache(environ: Mapping[str, str]) -> dict[str, str]:
    """This machine's download caches: the user's own (HF_HOME, LLAMAFT_CACHE, else their
    defaults under ~/.cache), which every local agent shares, instead of the pod's mount."""
    return {
        "LLAMAFT_CACHE": str(cache_folders.llamaft_cache(environ)),
        "HF_HOME": environ.get("HF_HOME") or str(cache_folders.user_cache_root(environ) / "huggingface"),
        "LLAMAFT_CACHE_SHARED": "1",
    }


def localize(launch: Launch, *, rdzv_endpoint: str, config_path: str, nproc_per_node: int | None,
             metrics_port: int, termination_log: str, cpu_only: bool, cache: Mapping[str, str] | None = None,
             run_uid: str | None = None, threads: str | None = None) -> Localized:
    """The cluster launch on this machine: the rendezvous on a local address, the config file at
    a local path, a free metrics port per agent, the termination message in a file, the local
    download caches (`cache`: local_cache's values), the run's identity for its trackers
    (`run_uid`), this machine's threads per process (`threads`: OMP_NUM_THREADS), and (without
    enough GPUs) one CPU process per worker; `torchrun` is this interpreter's torch.distributed.run."""
    env = dict(launch.env)
    overrides = {
        "PET_RDZV_ENDPOINT": rdzv_endpoint,
        "LLAMAFT_CONFIG": config_path,
        **({"LLAMAFT_SPEC": str(Path(config_path).with_name(Path(env["LLAMAFT_SPEC"]).name))} if "LLAMAFT_SPEC" in env else {}),
        "LLAMAFT_METRICS_PORT": str(metrics_port),
        "LLAMAFT_TERMINATION_LOG": termination_log,
        **(cache or {}),
    }
    if nproc_per_node is not None:
        overrides["PET_NPROC_PER_NODE"] = str(nproc_per_node)
    if cpu_only:
        overrides["CUDA_VISIBLE_DEVICES"] = ""
    if run_uid is not None:
        overrides["LLAMAFT_RUN_UID"] = run_uid
    if threads is not None:
        overrides["OMP_NUM_THREADS"] = threads
    changed = {k: (env.get(k), v) for k, v in overrides.items() if env.get(k) != v}
    env.update(overrides)
    argv = list(launch.argv)
    cluster_config = launch.env.get("LLAMAFT_CONFIG")
    argv = [config_path if a == cluster_config else a for a in argv]
    if argv and argv[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    return Localized(replace(launch, argv=argv, env=env), changed)
