"""Generations and task scores (spec.evaluation): held-out loss says how well the model predicts
the references; people judge a fine-tune by what it writes. At every eval and at the end, the
first `samples` held-out examples' prompts are completed greedily by the model being trained and
scored against their references (ROUGE-1/2/L with rouge-score, as summarisation work reports it).

A sample comes from the token store's validation part (or a stream's held-out head): its prompt is
every token before the first one that carries loss, its reference the first run of loss tokens
(the response, or the first assistant turn of a conversation) without the end-of-sequence token.
Under FSDP each forward is a collective, so every rank generates the same prompts in the same
order (transformers' `generate(synced_gpus=True)` keeps the ranks stepping together until all
are done); rank 0 scores and reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from llamaft.api.spec import EvalMetric, EvaluationSpec
from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from llamaft_trainer import store as store_mod
from llamaft_trainer.parallelize import unwrapped
from llamaft_trainer.runtime import Runtime


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    prompt: str
    reference: str


def held_out_samples(part: store_mod.Part | None, tokenizer: PreTrainedTokenizerBase, n: int) -> list[Sample]:
    """The first `n` held-out examples that have both a prompt and a reference, in store order
    (the same on every rank and every attempt)."""
    found: list[Sample] = []
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
        found.append(Sample(ids[:start], _text(tokenizer, ids[:start], False), _text(tokenizer, reference_ids, True)))
    return found


def _text(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special: bool) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=skip_special)).strip()


def generate(model: nn.Module, samples: list[Sample], tokenizer: PreTrainedTokenizerBase, rt: Runtime,
             max_new_tokens: int) -> list[str]:
    """Greedy completions of the samples' prompts (collective: every rank calls this)."""
    outputs: list[str] = []
    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:
        with torch.no_grad():
            for sample in samples:
                ids = torch.tensor([sample.prompt_ids], device=rt.device)
                out = unwrapped(model).generate(  # type: ignore[operator]
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
    samples: list[Sample]
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
