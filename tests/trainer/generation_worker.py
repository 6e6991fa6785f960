"""Generation evals under every wrapper the trainer applies, several configurations in ONE
torchrun launch (start-up costs ~10 s per launch):

    torchrun --nproc_per_node N tests/trainer/generation_worker.py CASES.json OUT.json

CASES.json: [{"name": ..., "config": <TrainingJobConfig camelCase>}]. Each case is a whole
`main.run` (train, the evals at `evalInterval` with their generations, the final eval, the export),
then every rank generates the held-out samples once more with `evaluation.generate` on the trained,
still wrapped model. Rank 0 writes, per case, the wrapper's name, the prompts' token ids and those
generations, for the test to compare with what the exported model generates on its own.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist
from llamaft.api.spec import TrainingJobConfig
from llamaft_trainer import evaluation
from llamaft_trainer.main import run
from llamaft_trainer.process.runtime import init_runtime
from llamaft_trainer.process.shutdown import exit_process


def main(cases_path: str, out_path: str) -> None:
    cases = json.loads(open(cases_path).read())
    rt = init_runtime()
    results = {}
    for case in cases:
        cfg = TrainingJobConfig.model_validate(case["config"])
        session, result = run(cfg, rt)
        evaluator = evaluation.build_evaluator(cfg.evaluation, session.data.validation, session.tokenizer)
        assert evaluator is not None and evaluator.samples, "the case needs held-out samples"
        generated = evaluation.generate(session.model, evaluator.samples, session.tokenizer, rt, cfg.evaluation.max_new_tokens)
        results[case["name"]] = {
            "wrapper": type(session.model).__name__, "step": result.state.step,
            "prompts": [s.prompt_ids for s in evaluator.samples], "generated": generated,
        }
        del session
    if rt.is_leader:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_process(0)  # as the trainer leaves (shutdown.py): never through interpreter finalization
