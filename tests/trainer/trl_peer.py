"""TRL's own DPOTrainer code on given inputs, printed as JSON: run with .venv-peers' python (TRL
1.16.0, bench/peers-requirements.txt), never imported by the suite (the project's venv has no TRL).

Reads one JSON object on stdin:

* `{"do": "tokenize", "tokenizer": DIR, "records": [...], "max_length": N}`: the dataset
  `DPOTrainer._prepare_dataset` makes of the records (prompt_ids, chosen_ids, rejected_ids, the
  fully truncated ones dropped), and `DataCollatorForPreference`'s batch of all of them.
* `{"do": "loss", "model": DIR, "examples": [...], "ref_chosen": [...], "ref_rejected": [...],
  "beta": B, "loss": "sigmoid"|"ipo", "max_length": N}`: `DPOTrainer._compute_loss` on the
  collated examples with precomputed reference log-probabilities (`precompute_ref_log_probs`), the
  policy being the saved model with TRL's fused LM head: the loss, the logged metrics, and the
  per-row summed log-probabilities.
* `{"do": "train", "model": DIR, "records": [...], "max_length": N, "beta": B, "loss": ..., "lr": LR,
  "steps": S, "batch_size": N}`: TRL's DPOTrainer itself trained for S steps (AdamW, constant lr,
  clip 1.0, no weight decay, fp32 (bf16=False: TrainingArguments defaults to bf16 autocast, on CPU
  too), one batch of `batch_size` pairs per step, a log every step): its logged loss and metrics
  per step. The model directory's tokenizer (and chat template) tokenizes the records. Optional:
  `"reference": "precomputed"` (the default: `precompute_ref_log_probs`) or `"live"` (TRL's
  `ref_model`, loaded again from the model directory, run on every batch); `"lora": {"r", "alpha",
  "targets", "adapters": FILE}`: a peft LoraConfig (dropout 0) given to DPOTrainer as
  `peft_config`, its adapters then set to the safetensors FILE's tensors (the trainer's own
  initial adapters, so both sides start identical), the reference being the base model with the
  adapters disabled (TRL's `use_adapter(..., adapter_name=None)`).

`_prepare_dataset` and `_compute_loss` are called unbound on a stand-in for the trainer that
holds just the attributes they read (a single process: gather is the identity), so the code that
runs is TRL's, without a Trainer's optimizer, accelerator state or output directory.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig
from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer
from trl.trainer.utils import add_fused_lm_head


def _config(max_length: int | None, **kw: Any) -> DPOConfig:
    return DPOConfig(output_dir=tempfile.mkdtemp(), max_length=max_length, report_to=[], use_cpu=True, **kw)


def tokenize(job: dict[str, Any]) -> dict[str, Any]:
    tokenizer = AutoTokenizer.from_pretrained(job["tokenizer"])
    args = _config(job["max_length"])
    fake = SimpleNamespace(_tokenizer=tokenizer)
    dataset = DPOTrainer._prepare_dataset(fake, Dataset.from_list(job["records"]), tokenizer, args, "train")
    examples = [{k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in dataset]
    collator = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=job["max_length"])
    batch = collator(examples) if examples else {}
    return {"examples": examples, "batch": {k: v.tolist() for k, v in batch.items()}}


def loss(job: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    model.train()  # _compute_loss logs under "train" when the model trains; dropout is 0 in a LlamaConfig
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    examples = [dict(e, ref_chosen_logps=c, ref_rejected_logps=r)
                for e, c, r in zip(job["examples"], job["ref_chosen"], job["ref_rejected"], strict=True)]
    collator = DataCollatorForPreference(pad_token_id=job["pad_token_id"], max_length=job["max_length"])
    inputs = collator(examples)
    identity = lambda t: t  # noqa: E731 (one process: gathering is the identity)
    fake = SimpleNamespace(
        model=model, accelerator=SimpleNamespace(device=torch.device("cpu"), gather=identity, gather_for_metrics=identity),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=[job["loss"]], loss_weights=[1.0], beta=job["beta"], use_weighting=False, label_smoothing=0.0,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
        args=_config(job["max_length"]),
    )
    with torch.no_grad():
        value = DPOTrainer._compute_loss(fake, model, inputs, False)
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels, fused_lm_head=True)
    return {
        "loss": float(value),
        "metrics": {k: v[0] for k, v in fake._metrics["train"].items()},
        "logps": out.log_probs.sum(dim=1).tolist(),
    }


def train(job: dict[str, Any]) -> dict[str, Any]:
    from transformers import TrainerCallback

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    lora = job.get("lora")
    live = job.get("reference", "precomputed") == "live"
    args = _config(
        job["max_length"], per_device_train_batch_size=job["batch_size"], max_steps=job["steps"],
        learning_rate=job["lr"], lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0,
        beta=job["beta"], loss_type=[job["loss"]], precompute_ref_log_probs=not live and lora is None, logging_steps=1,
        optim="adamw_torch", save_strategy="no", bf16=False, disable_tqdm=True, seed=0, gradient_accumulation_steps=1,
    )
    peft_config = None
    if lora is not None:
        from peft import LoraConfig

        peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                                 target_modules=lora["targets"], task_type="CAUSAL_LM")
    steps: list[dict[str, Any]] = []

    class Keep(TrainerCallback):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                steps.append({"step": state.global_step, **logs})

    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(job["records"]),
                         processing_class=tokenizer, callbacks=[Keep()], peft_config=peft_config)
    if lora is not None:
        _set_adapters(trainer.model, lora["adapters"])
    trainer.train()
    return {"steps": steps, "reference_model": type(trainer.ref_model).__name__ if trainer.ref_model is not None else None}


def _set_adapters(model: Any, path: str) -> None:
    """The peft model's adapters := the file's tensors (same names: the same peft on the same model)."""
    from safetensors.torch import load_file

    adapters = load_file(path)
    params = dict(model.named_parameters())
    trainable = {name for name, p in params.items() if p.requires_grad}
    if set(adapters) != trainable:
        raise SystemExit(f"adapter names differ: ours only {sorted(set(adapters) - trainable)[:4]}, "
                         f"TRL's only {sorted(trainable - set(adapters))[:4]}")
    with torch.no_grad():
        for name, value in adapters.items():
            params[name].copy_(value)


def main() -> None:
    job = json.load(sys.stdin)
    result = {"tokenize": tokenize, "loss": loss, "train": train}[job["do"]](job)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
