"""Packed examples against the same examples alone, and eval packed against padded, under torchrun.

    torchrun --nproc_per_node N tests/trainer/packing_worker.py CASES.json OUT.json

CASES.json: [{"name": ..., "config": <TrainingJobConfig camelCase>, "steps": int}]. For each case
every rank sets the real trainer up (main.setup: the token store with its block layout, the model
parallelized as the config says) and:
1. runs its share of the first training blocks packed (rank r: blocks r, r + W, ...), forward and
   backward, then every example of those blocks alone (a batch of one, plain attention mask), and
   compares the summed losses and target counts (all ranks) and every full gradient;
2. trains `steps` optimizer steps with the real Trainer, then evaluates the validation set packed
   (the trainer's own loader) and padded (one example per row).
Rank 0 writes the figures; the test asserts on them.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from llamaft.api.spec import TrainingJobConfig
from llamaft_trainer.data import batching, encoding
from llamaft_trainer.data import store as store_mod
from llamaft_trainer.main import setup
from llamaft_trainer.process.runtime import Runtime, init_runtime
from llamaft_trainer.process.shutdown import exit_process
from llamaft_trainer.train import Trainer, evaluate, token_loss_sum

BLOCKS_PER_RANK = 3


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter's whole gradient (collective under FSDP2: DTensor.full_tensor;
    under FSDP1: summon_full_params with the gradients)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, with_grads=True, writeback=False):
            return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    out = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad
        out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return out


def grads_and_losses(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], chunks: int,
                     device: torch.device) -> tuple[float, int, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for batch in batches:
        loss, n = token_loss_sum(model, batch, device, chunks)
        loss.backward()
        total, count = total + float(loss.detach()), count + n
    summed = torch.tensor([total, float(count)], dtype=torch.float64)
    dist.all_reduce(summed)
    return float(summed[0]), int(summed[1]), full_grads(model)


def case(cfg: TrainingJobConfig, steps: int, rt: Runtime) -> dict[str, Any]:
    s = setup(cfg, rt)
    collate = batching.Collate(int(s.tokenizer.pad_token_id))
    train = s.data.train
    assert isinstance(train, batching.PackedExamples), type(train)
    mine = [rt.rank + k * rt.world_size for k in range(BLOCKS_PER_RANK)]
    packed_batches = [collate([train[i]]) for i in mine]
    examples = [e for i in mine for e in train.block(i)]
    alone = [collate([batching.training_item(*train.part.example(e))]) for e in examples]
    # Under FSDP every rank runs as many forwards as the others: pad with batches that carry no label.
    most = torch.tensor([len(alone)])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    for _ in range(int(most) - len(alone)):
        filler = collate([batching.training_item(*train.part.example(examples[0]))])
        filler["labels"].fill_(encoding.IGNORE_INDEX)
        alone.append(filler)
    chunks = cfg.training.loss_chunks
    s.model.train()
    packed_loss, packed_n, packed_grads = grads_and_losses(s.model, packed_batches, chunks, rt.device)
    alone_loss, alone_n, alone_grads = grads_and_losses(s.model, alone, 1, rt.device)
    worst = 0.0
    for name, want in alone_grads.items():
        got = packed_grads[name]
        scale = float(want.abs().max()) or 1.0
        worst = max(worst, float((got - want).abs().max()) / scale)
    s.model.zero_grad(set_to_none=True)
    multi = sum(1 for i in mine if len(train.block(i)) > 1)

    Trainer(s).train(stop_after=steps)
    packed_eval = evaluate(s.model, s.data, rt, chunks)
    found = store_mod.open_store(s.data.store_path) if s.data.store_path is not None else None
    assert found is not None
    padded = batching.ValidationShare(batching.PaddedExamples(found.validation), rt.rank, rt.world_size,
                               cfg.training.per_device_batch_size, collate)
    padded_eval = evaluate(s.model, dataclasses.replace(s.data, validation_loader=padded), rt, chunks)
    return {
        "packed_loss": packed_loss, "alone_loss": alone_loss, "packed_targets": packed_n, "alone_targets": alone_n,
        "grad_rel_diff": worst, "grads": len(alone_grads), "blocks_with_several_examples": multi,
        "packed_eval": packed_eval, "padded_eval": padded_eval,
        "validation_items": len(s.data.validation) if s.data.validation is not None else 0,  # type: ignore[arg-type]
        "validation_examples": len(found.validation), "wrapper": type(s.model).__name__,
    }


def main(cases_path: str, out_path: str) -> None:
    rt = init_runtime()
    results = {}
    for spec in json.loads(open(cases_path).read()):
        results[spec["name"]] = case(TrainingJobConfig.model_validate(spec["config"]), spec["steps"], rt)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_process(0)
