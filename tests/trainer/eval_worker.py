"""What a run reports about its own data, measured under torchrun with the real setup (loading,
data, parallelize):

    torchrun --nproc_per_node N tests/trainer/eval_worker.py CONFIG.json OUT.json

1. `train.evaluate` on the freshly loaded model, and what every rank's validation share held
   (target tokens, sequences, batches): the eval loss must not depend on the world size.
2. One optimizer step of `train.Trainer`, and the real (non-padding) and padded token counts
   of the micro-batches that step consumed on every rank: `tokens_seen` must be the real ones.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from llamaft.api.spec import TrainingJobConfig
from llamaft_trainer import train
from llamaft_trainer.checkpoint.dcp import TrainState
from llamaft_trainer.data.encoding import IGNORE_INDEX
from llamaft_trainer.main import setup
from llamaft_trainer.process.runtime import init_runtime
from llamaft_trainer.process.shutdown import exit_process


def _sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return [float(v) for v in t.tolist()]


def main(config_path: str, out_path: str) -> None:
    cfg = TrainingJobConfig.model_validate_json(open(config_path).read())
    rt = init_runtime()
    s = setup(cfg, rt)
    eval_loss = train.evaluate(s.model, s.data, rt)
    assert s.data.validation_loader is not None
    share = s.data.validation_loader
    targets, batches, sequences = 0, len(share), len(share.indices)
    for batch in share:
        targets += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    shares = [None] * rt.world_size
    dist.all_gather_object(shares, {"batches": batches, "sequences": sequences, "targets": targets})

    accum = cfg.training.gradient_accumulation_steps
    first = [b for _, b in zip(range(accum), s.data.batches(0, 0), strict=False)]
    real, padded = _sum([float(sum(int(b["attention_mask"].sum()) for b in first)),
                         float(sum(int(b["input_ids"].numel()) for b in first))])
    state = TrainState()
    train.Trainer(s, state=state).train(stop_after=1)
    if rt.is_leader:
        with open(out_path, "w") as f:
            json.dump({"eval_loss": eval_loss, "validation_sequences": len(s.data.validation),  # type: ignore[arg-type]
                       "shares": shares, "tokens_seen": state.tokens_seen, "real_tokens": real,
                       "padded_tokens": padded}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_process(0)  # as the trainer leaves (shutdown.py): never through interpreter finalization
