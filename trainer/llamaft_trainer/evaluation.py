"""Generations and task scores (spec.evaluation): held-out loss says how well the model predicts
the references; people judge a fine-tune by what it writes. At every eval and at the end, the
first `samples` held-out examples' prompts are completed greedily by the model being trained and
scored against their references (ROUGE-1/2/L with rouge-score, as summarisation work reports it).

A sample comes from the token store's validation part (or a stream's held-out head): its prompt is
every token before the first one that carries loss, its reference the first run of loss tokens
(the response, or the first assistant turn of a conversation) without the end-of-sequence token.
Under FSDP each forward is a collective, so every rank generates the same prompts in the same
order (transformers' `generate(synced_gpus=True)` keeps the ranks stepping together until all
are done); rank 0 scores and reports. `generate` runs transformers' generate on the causal LM (or
peft model) inside whatever wrapper the trainer applied, with the wrapper's root parameters
gathered for the whole generation (`root_gathered`, which says why).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from llamaft.api.spec import EvalMetric, EvaluationSpec
from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from llamaft_trainer.data import store as store_mod
from llamaft_trainer.process.runtime import Runtime


@dataclass(frozen=True)
class HeldOutSample:
    prompt_ids: list[int]
    prompt: str
    reference: str


def held_out_samples(part: store_mod.Part | None, tokenizer: PreTrainedTokenizerBase, n: int) -> list[HeldOutSample]:
    """The first `n` held-out examples that have both a prompt and a reference, in store order
    (the same on every rank and every attempt)."""
    found: list[HeldOutSample] = []
    if part is None:
        return found
    special = set(tokenizer.all_special_ids)
    for index in range(len(part)):
        if len(found) == n:
            break
        tokens, loss = part.example(index)
        ids, flags = [int(t) for t in tokens], [bool(f) for f in loss]
        if True not in flags:
            continue
        start = flags.index(True)
        end = flags.index(False, start) if False in flags[start:] else len(flags)
        reference_ids = [t for t in ids[start:end] if t not in special]
        if start == 0 or not reference_ids:
            continue
        found.append(HeldOutSample(ids[:start], _text(tokenizer, ids[:start], False), _text(tokenizer, reference_ids, True)))
    return found


def _text(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special: bool) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=skip_special)).strip()


def generating_module(model: nn.Module) -> nn.Module:
    """The module whose `generate` the eval calls: the causal LM or peft model inside DDP or FSDP1
    (both keep it as `.module`); FSDP2 (`fully_shard`) and an unwrapped model are that module
    themselves."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, FullyShardedDataParallel)):
        return model.module
    return model


@contextlib.contextmanager
def root_gathered(model: nn.Module) -> Iterator[None]:
    """The FSDP root's own parameters (those outside every decoder-layer unit: the embedding, the
    final norm, the LM head) gathered on every rank while the body runs; the decoder layers'
    units gather themselves, as in training, when their forwards run.

    Why: FSDP gathers a unit's parameters in hooks on that unit's *forward*, and generation never
    calls the root. transformers' `generate` calls the causal LM (`self(...)`); with LoRA or DoRA
    the FSDP root is the peft model around it, whose `generate` calls its base model's `generate`,
    so the root's forward (FSDP2: its pre-forward hook; FSDP1: its `forward`) never runs and the
    embedding is still a shard (FSDP2: a DTensor, hence "aten.embedding.default got mixed
    torch.Tensor and DTensor"; FSDP1: a flat-parameter shard). Without peft FSDP2 happened to work
    (the causal LM is the root), FSDP1 never did (its root wraps the causal LM). Gathering the
    root explicitly covers every wrapper with public calls: FSDP2 `FSDPModule.unshard()` and
    `reshard()` (not recursive: only the root's group, the memory of one forward of the root),
    FSDP1 `FullyShardedDataParallel.summon_full_params(recurse=False)` (likewise the root's own
    flat parameter; no writeback: nothing is changed). Calling the root's forward instead would
    mean a decoding loop of our own next to transformers', with its cache and stopping rules.
    FSDP2's root state is set up by the first forward through the root, which the eval loss (run
    before every generation eval) and every training step are; the root's parameters are resharded
    at the end, so training continues exactly as before. DDP and an unwrapped model hold their
    parameters whole: nothing to do."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, recurse=False, writeback=False):
            yield
    elif isinstance(model, FSDPModule):
        model.unshard()
        try:
            yield
        finally:
            model.reshard()
    else:
        yield


def generate(model: nn.Module, samples: list[HeldOutSample], tokenizer: PreTrainedTokenizerBase, rt: Runtime,
             max_new_tokens: int) -> list[str]:
    """Greedy completions of the samples' prompts (collective: every rank calls this). `model` is
    the trained model as the trainer wrapped it (FSDP1, FSDP2, DDP or none; LoRA/DoRA inside)."""
    outputs: list[str] = []
    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generator = generating_module(model)
    try:
        # Eager, as HF's Seq2SeqTrainer generates (`self.model.generate`: the model before accelerate
        # compiled it): every new length of a greedy decode is a new input shape, and a compiled layer
        # would recompile on it (up to dynamo's recompile limit, per frame) for a handful of prompts.
        # The stance leaves the compiled layers in place, so FSDP's hooks on them run as in training.
        with torch.no_grad(), root_gathered(model), torch.compiler.set_stance("force_eager"):
            for sample in samples:
                ids = torch.tensor([sample.prompt_ids], device=rt.device)
                out = generator.generate(  # type: ignore[operator]
                    input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                    do_sample=False, synced_gpus=rt.world_size > 1, pad_token_id=pad,
                    eos_token_id=tokenizer.eos_token_id,
                )
                outputs.append(_text(tokenizer, out[0, ids.shape[1]:].tolist(), True))
    finally:
        model.train(was_training)
    return outputs


def scores(metrics: list[EvalMetric], predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean task scores over the samples, by metric: rouge -> rouge1, rouge2, rougeL (F1, 0-1)."""
    out: dict[str, float] = {}
    if EvalMetric.ROUGE in metrics and predictions:
        from rouge_score import rouge_scorer

        scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
        per = [scorer.score(ref, pred) for pred, ref in zip(predictions, references, strict=True)]
        for key in ("rouge1", "rouge2", "rougeL"):
            out[key] = sum(s[key].fmeasure for s in per) / len(per)
    return out


@dataclass
class Evaluator:
    """The run's generation eval: its samples chosen once, `run(step)` at each eval."""

    spec: EvaluationSpec
    samples: list[HeldOutSample]
    tokenizer: PreTrainedTokenizerBase

    def run(self, model: nn.Module, rt: Runtime, step: int) -> dict[str, Any] | None:
        """Generate (every rank) and score; rank 0 gets the report, the others None."""
        if not self.samples:
            return None
        predictions = generate(model, self.samples, self.tokenizer, rt, self.spec.max_new_tokens)
        if not rt.is_leader:
            return None
        references = [s.reference for s in self.samples]
        return {
            "step": step, "samples": len(self.samples),
            **{k: round(v, 6) for k, v in scores(list(self.spec.metrics), predictions, references).items()},
            "generations": [{"prompt": s.prompt[-500:], "reference": s.reference, "generated": p}
                            for s, p in zip(self.samples, predictions, strict=True)],
        }


def build_evaluator(spec: EvaluationSpec, validation: Any, tokenizer: PreTrainedTokenizerBase) -> Evaluator | None:
    """None when the spec asks for no samples or there is no validation set."""
    if spec.samples == 0:
        return None
    part = getattr(validation, "part", None)
    return Evaluator(spec, held_out_samples(part, tokenizer, spec.samples), tokenizer)
