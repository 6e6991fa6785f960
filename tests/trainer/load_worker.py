"""Loads the pretrained weights for many configurations inside ONE torchrun launch (start-up costs
~10 s per launch), with the real trainer code (main.build_model).

    torchrun --nproc_per_node N tests/trainer/load_worker.py CASES.json OUT.json

CASES.json: [{"name": ..., "config": <TrainingJobConfig camelCase>, "method": "sliced" | "broadcast" |
"full", optional "cache": a folder (each simulated node gets <cache>/node<k>, ranks_per_node ranks
per node), "count_log": the fetch log of countingfs, "touch": files rank 0 gives a new mtime first}].
Rank 0 writes per case either the digests of the full (gathered) state dict or the ConfigError's
message, plus every rank's torch RNG state digest after loading.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from llamaft.api.spec import TrainingJobConfig
from llamaft_trainer.checkpoint.dcp import full_model_state_dict
from llamaft_trainer.main import build_model
from llamaft_trainer.model import loading
from llamaft_trainer.model import model as model_step
from llamaft_trainer.process.errors import ConfigError
from llamaft_trainer.process.runtime import Runtime, init_runtime
from llamaft_trainer.process.shutdown import exit_process, teardown
from llamaft_trainer.sources import downloads

from tests.trainer import countingfs


def digest(tensor: torch.Tensor) -> str:
    """dtype, shape and the exact bytes: equal digests mean bit-identical tensors."""
    t = tensor.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:20]


def run_case(case: dict[str, Any], rt: Runtime) -> dict[str, Any]:
    os.environ[loading.METHOD_ENV] = case["method"]
    os.environ[countingfs.LOG_ENV] = case.get("count_log", "")
    if case.get("cache"):
        downloads.CACHE_ROOT = Path(case["cache"]) / f"node{rt.rank // case.get('ranks_per_node', rt.world_size)}"
    if rt.is_leader:
        for path in case.get("touch", []):
            stat = os.stat(path)
            os.utime(path, (stat.st_atime, stat.st_mtime + 60))
    dist.barrier()
    cfg = TrainingJobConfig.model_validate(case["config"])
    torch.manual_seed(cfg.training.seed)  # as main.setup does
    try:
        model, _ = build_model(cfg, rt, model_step.load_model_config(cfg.model, rt))
    except ConfigError as exc:
        return {"error": str(exc)}
    rng = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]
    rngs: list[Any] = [None] * rt.world_size
    dist.all_gather_object(rngs, rng)
    state = full_model_state_dict(model)  # collective; full tensors on rank 0 only
    return {"digests": {k: digest(v) for k, v in state.items()}, "rng": rngs}


def launch(tmp: Path, nproc: int, cases: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """Run `cases` in one torchrun launch of this script; (rank 0's results, the launch's output)."""
    import subprocess

    from tests.conftest import REPO
    from tests.trainer.conftest import torchrun_cmd, trainer_env

    cases_file, out_file, log_file = tmp / f"cases-{nproc}.json", tmp / f"out-{nproc}.json", tmp / f"log-{nproc}.txt"
    cases_file.write_text(json.dumps(cases))
    proc = subprocess.run(
        torchrun_cmd(nproc, str(Path(__file__)), str(cases_file), str(out_file)),
        env=trainer_env(), capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    log_file.write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"torchrun failed, full log: {log_file}\n" + proc.stderr[-3000:]
    return dict(json.loads(out_file.read_text())), proc.stdout


def main(cases_path: str, out_path: str) -> None:
    countingfs.register()
    cases = json.loads(Path(cases_path).read_text())
    rt = init_runtime()
    results = {case["name"]: run_case(case, rt) for case in cases}
    if rt.is_leader:
        Path(out_path).write_text(json.dumps(results))
    # Like the trainer: no interpreter finalization, which gloo's threads can abort (shutdown.py).
    teardown(rt, None, healthy=True)
    exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
