"""HF Trainer side of bench/peers.py (started by it in .venv-peers, directly or under torchrun; not a test).

    python bench/_hf_peer.py CONFIG.json                    # 1 process
    python -m torch.distributed.run --nproc_per_node 2 ... bench/_hf_peer.py CONFIG.json   # DDP

transformers' own Trainer (with accelerate; DDP over gloo under torchrun, or accelerate's FSDP2
plugin when the config says `fsdp2`) on the model directory and
the exported batches that llamaft trains on (bench/peers.py writes both; nothing of llamaft is
imported here, so this runs in a venv with only torch, transformers and accelerate). The batches
file holds every rank's micro-batches interleaved, global batch k*W + r being rank r's k-th, so
the sequential sampler plus accelerate's batch sharding (process r takes batches r, r+W, ...) hand
each rank exactly llamaft's batches, in llamaft's order; every batch is checked against that.

Writes (rank 0) CONFIG["out"]: per optimizer step its wall-clock end (time.time() at on_step_end),
its span (from the start of fetching the step's batch to on_step_end: the span llamaft's
step_seconds covers), the logged loss, learning rate and grad norm, and with CONFIG["phases"] the
milliseconds of each phase of the step (TimedTrainer).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import transformers
from torch.utils.data import Dataset
from transformers import (
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

NAMES = ("input_ids", "labels", "attention_mask")


class Blocks(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return int(self.tensors["input_ids"].shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: self.tensors[name][index] for name in NAMES}


PHASES = ("data", "forward", "backward", "grad_norm", "optimizer", "other")
"""The step's phases this side can time (`--phases`), named as llamaft's profiling.PHASES. FSDP2's
and DDP's collectives run inside forward and backward here: no hook of HF's separates them."""


class TimedTrainer(Trainer):
    """Trainer, plus: when each step's batch fetch starts, a check that it is llamaft's batch, and
    (`phases`) the wall time of each phase of the step through the Trainer's own methods: the
    batch fetch (get_batch_samples), forward and loss (compute_loss), backward (the rest of
    training_step: accelerator.backward), the clipping norm (_clip_grad_norm, _get_grad_norm), and
    optimizer.step + scheduler + zero_grad (on_pre_optimizer_step to on_step_end, in Record)."""

    expected: torch.Tensor
    """This rank's input_ids, (steps, batch, seq)."""
    fetch_started = 0.0
    mismatches = 0
    phases = False
    spent: dict[str, float]
    """Seconds per phase of the current step (`phases`)."""

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> Any:
        self.fetch_started = time.perf_counter()
        self.spent = dict.fromkeys(PHASES, 0.0)
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        step = self.state.global_step
        if batches and step < len(self.expected) and not torch.equal(batches[0]["input_ids"].cpu(), self.expected[step]):
            self.mismatches += 1
        self.spent["data"] += time.perf_counter() - self.fetch_started
        return batches, items

    def _timed(self, phase: str, call: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.phases:
            return call(*args, **kwargs)
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.spent[phase] += time.perf_counter() - started

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("forward", super().compute_loss, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # backward: training_step's time less the forward timed inside it
        forward_before = self.spent["forward"]
        started = time.perf_counter()
        try:
            return super().training_step(*args, **kwargs)
        finally:
            if self.phases:
                self.spent["backward"] += time.perf_counter() - started - (self.spent["forward"] - forward_before)

    def _clip_grad_norm(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("grad_norm", super()._clip_grad_norm, *args, **kwargs)

    def _get_grad_norm(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed("grad_norm", super()._get_grad_norm, *args, **kwargs)


class Record(TrainerCallback):
    def __init__(self, trainer: TimedTrainer) -> None:
        self.trainer = trainer
        self.steps: dict[int, dict[str, Any]] = {}
        self.optimizer_started = 0.0

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.optimizer_started = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now, wall = time.perf_counter(), time.time()
        seconds = now - self.trainer.fetch_started
        row: dict[str, Any] = {"step": state.global_step, "end": wall, "seconds": seconds}
        if self.trainer.phases:
            spent = self.trainer.spent
            spent["optimizer"] += now - self.optimizer_started
            spent["other"] = max(0.0, seconds - sum(v for k, v in spent.items() if k != "other"))
            row["phases"] = {k: round(v * 1e3, 3) for k, v in spent.items()}
        self.steps[state.global_step] = row

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        row = self.steps.get(state.global_step)
        if row is not None and logs and "loss" in logs:
            row.update(loss=float(logs["loss"]), lr=float(logs["learning_rate"]),
                       grad_norm=float(logs.get("grad_norm") or 0.0))


def fsdp_on_cpu() -> None:
    """Let accelerate take its own FSDP branch on a CPU.

    accelerate's AcceleratorState turns FSDP on for accelerator devices only: the branch that sets
    `distributed_type = FSDP` and keeps the plugin runs for MULTI_GPU, MULTI_XPU, ... and not for
    MULTI_CPU, which keeps DDP and drops the plugin (accelerate 1.16, state.py). This runs that
    branch's body after the state chose MULTI_CPU, so the Trainer goes through accelerate's FSDP2
    code as on a GPU (fsdp2_prepare_model: fully_shard per wrapped layer and the root, its state
    dict loading, its clipping); the collectives run over gloo, as llamaft's do here.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def __init__(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = self.distributed_type

    AcceleratorState.__init__ = __init__  # type: ignore[method-assign]


def main() -> None:
    cfg: dict[str, Any] = json.loads(open(sys.argv[1]).read())
    if cfg.get("fsdp2"):
        fsdp_on_cpu()  # does nothing where accelerate chose FSDP itself (a GPU)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    tensors: dict[str, torch.Tensor] = torch.load(cfg["batches"])
    batch, steps = int(cfg["batch_size"]), int(cfg["steps"])
    seq = int(tensors["input_ids"].shape[1])
    mine = tensors["input_ids"].view(steps, world, batch, seq)[:, rank]
    model = LlamaForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    model.config.use_cache = False  # llamaft's forward passes use_cache=False too
    args = TrainingArguments(
        output_dir=cfg["output_dir"],
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=cfg["learning_rate"],
        warmup_steps=cfg["warmup_steps"],
        lr_scheduler_type=cfg["lr_scheduler_type"],
        weight_decay=cfg["weight_decay"],
        adam_beta1=cfg["adam_beta1"],
        adam_beta2=cfg["adam_beta2"],
        adam_epsilon=cfg["adam_epsilon"],
        max_grad_norm=cfg["max_grad_norm"],
        optim=cfg["optim"],
        seed=cfg["seed"],
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        train_sampling_strategy="sequential",
        dataloader_drop_last=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        # Every parameter gets a gradient: skip DDP's search for unused ones (HF's default, True
        # without gradient checkpointing, walks the autograd graph every step).
        ddp_find_unused_parameters=False,
        ddp_backend="gloo" if world > 1 else None,
        # FSDP2 through accelerate's plugin, as llamaft's FULL_SHARD wraps: each decoder layer and
        # the root, parameters resharded after forward.
        **({"fsdp": "full_shard auto_wrap",
            "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                            "reshard_after_forward": True}} if cfg.get("fsdp2") else {}),
    )
    trainer = TimedTrainer(model=model, args=args, train_dataset=Blocks(tensors), data_collator=default_data_collator)
    trainer.expected = mine
    trainer.phases = bool(cfg.get("phases"))
    record = Record(trainer)
    trainer.add_callback(record)
    trainer.train()
    mismatches = torch.tensor([trainer.mismatches])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(mismatches)  # every rank's check, after the measured steps
    if rank == 0:
        from torch.distributed.tensor import DTensor

        # What accelerate really did: FSDP2 shards every parameter as a DTensor (DDP and one process, none).
        sharded = sum(isinstance(p, DTensor) for p in trainer.model.parameters())
        result = {
            "world_size": world, "threads": torch.get_num_threads(), "tokens_per_step": world * batch * seq,
            "wrapper": type(trainer.model_wrapped).__name__, "sharded_parameters": sharded,
            "parameters": sum(1 for _ in trainer.model.parameters()),
            "mismatched_batches": int(mismatches.item()), "steps": [record.steps[k] for k in sorted(record.steps)],
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "accelerate": __import__("accelerate").__version__},
        }
        with open(cfg["out"], "w") as out:
            json.dump(result, out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
