"""Helpers shared by the benchmark scripts: launching torchrun and building model assets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from llamaft_trainer.process.local_etcd import free_port

REPO = Path(__file__).resolve().parent.parent
DATASET = REPO / "examples" / "data" / "samsum-tiny.jsonl"
WORKER = Path(__file__).with_name("_worker.py")



def torchrun(
    nproc: int, mode: str, config: dict[str, Any], tmp: Path, env: dict[str, str] | None = None
) -> tuple[list[dict[str, Any]], str]:
    """Run bench/_worker.py `mode` on `config` in `nproc` processes; (rank 0's result list, stdout).
    `env`: extra environment variables for the workers."""
    cfg, out = tmp / f"{mode}-{nproc}.json", tmp / f"{mode}-{nproc}.out.json"
    cfg.write_text(json.dumps(config))
    # One core per process in every run, so runs with different process counts compare fairly.
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "operator"), str(REPO / "trainer")])
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
         "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}", str(WORKER), mode, str(cfg), str(out)],
        env=env, capture_output=True, text=True, cwd=REPO,
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-5000:])
    return json.loads(out.read_text()), proc.stdout
