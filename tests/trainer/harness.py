"""Runs many trainer configurations inside ONE torchrun launch (start-up costs ~10 s per launch).

    torchrun --nproc_per_node N tests/trainer/harness.py CASES.json OUT.json

CASES.json: [{"name": ..., "config": <TrainingJobConfig camelCase>, "steps": int, "env": {optional:
environment variables set for this case only, e.g. LLAMAFT_FSDP_CPU_OVERLAP}}]. For each case
every rank runs `steps` optimizer steps with the real trainer modules; rank 0 writes per-case losses
and, from every rank, a checksum of the full (unsharded) parameters.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from llamaft.api.spec import TrainingJobConfig
from llamaft_trainer.checkpoint.dcp import full_model_state_dict
from llamaft_trainer.main import run
from llamaft_trainer.process.runtime import init_runtime
from llamaft_trainer.process.shutdown import exit_process


def checksum(model: torch.nn.Module) -> str:
    state = full_model_state_dict(model)
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].float().numpy().tobytes())
    return digest.hexdigest()[:16]


def main(cases_path: str, out_path: str) -> None:
    cases = json.loads(open(cases_path).read())
    rt = init_runtime()
    results = {}
    for case in cases:
        cfg = TrainingJobConfig.model_validate(case["config"])
        saved = {key: os.environ.get(key) for key in case.get("env", {})}
        os.environ.update(case.get("env", {}))
        try:
            session, result = run(cfg, rt, stop_after=case.get("steps"))
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        # Each rank's copy of the full parameters: a replicated strategy must agree across ranks.
        own = checksum(session.model)  # collective: every rank gathers
        local = {}
        for name, param in session.model.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            local[name] = float(full.detach().float().sum())
        gathered: list[object] = [None] * rt.world_size
        dist.all_gather_object(gathered, local)
        results[case["name"]] = {
            "losses": result.losses,
            "grad_norms": result.grad_norms,
            "eval_losses": result.eval_losses,
            "param_sums": gathered,
            "checksum": own,
            "step": result.state.step,
            "wrapper": type(session.model).__name__,
        }
        del session
    if rt.is_leader:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # As the trainer leaves (shutdown.py): never through interpreter finalization, which a gloo
    # worker thread (of any group: the default, the mesh's, the checkpoint group) can abort.
    exit_process(0)
