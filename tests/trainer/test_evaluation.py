"""Generations and task scores (spec.evaluation): held-out prompts completed under FSDP, scored
with ROUGE, reported at each eval and at the end; the sharded generations equal what the exported
model generates on its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from llamaft.api.spec import EvalMetric
from llamaft_trainer import evaluation
from llamaft_trainer.data import encoding
from llamaft_trainer.report.logline import read_events
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.trainer.conftest import base_config, launch_trainer


def test_a_sample_is_the_prompt_before_the_first_loss_token_and_the_first_loss_run() -> None:
    tok = _FakeTokenizer()
    part = encoding._assemble([[10, 11], [], [12]], [[20, 21], [22], []], bos=1, eos=2, max_len=64)
    samples = evaluation.held_out_samples(part, tok, 5)  # type: ignore[arg-type]
    # Record 2 has no prompt (only <bos>... then the response: the prompt is just <bos>), record 3
    # has no reference (only <eos> carries loss): one is kept with <bos> as its prompt, one is not.
    assert [(s.prompt_ids, s.reference) for s in samples] == [([1, 10, 11], "20 21"), ([1], "22")]
    assert evaluation.held_out_samples(part, tok, 1) == samples[:1]  # type: ignore[arg-type]


def test_rouge_scores_are_rouge_score_f1_means() -> None:
    same = evaluation.scores([EvalMetric.ROUGE], ["the cat sat on the mat"], ["the cat sat on the mat"])
    assert same == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    none = evaluation.scores([EvalMetric.ROUGE], ["dogs bark loudly"], ["the cat sat on the mat"])
    assert none == {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    half = evaluation.scores([EvalMetric.ROUGE], ["a b", "x y"], ["a b", "z w"])
    assert half["rouge1"] == pytest.approx(0.5)
    assert evaluation.scores([], ["a"], ["a"]) == {}


def test_sharded_generations_are_the_exported_models_and_are_scored(tiny_model: Path, tmp_path: Path) -> None:
    config = base_config(
        tiny_model, tmp_path / "gen",
        dataset={"packing": False},
        training={"maxSteps": 6, "evalInterval": 3},
        evaluation={"samples": 3, "maxNewTokens": 12, "metrics": ["rouge"]},
        checkpointing={"exportHuggingFace": True},
    )
    proc = launch_trainer(config, tmp_path, "gen", nproc=2)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-5000:]
    reports = read_events(out, "generations")
    assert [r["step"] for r in reports] == [3, 6], "at each eval and at the end"
    for report in reports:
        assert report["samples"] == 3 and len(report["generations"]) == 3
        assert all(0.0 <= report[k] <= 1.0 for k in ("rouge1", "rouge2", "rougeL"))
        again = evaluation.scores([EvalMetric.ROUGE], [g["generated"] for g in report["generations"]],
                                  [g["reference"] for g in report["generations"]])
        assert again == pytest.approx({k: report[k] for k in again}, abs=1e-6)
    # The last eval ran on the exported weights: one process, no FSDP, the same greedy tokens.
    export = tmp_path / "gen" / "export"
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(export)
    store_runs = sorted((tmp_path / "gen" / "data").iterdir())
    assert store_runs, "the token store is beside the checkpoints"
    from llamaft_trainer.data import store as store_mod

    opened = store_mod.open_store(store_runs[0])
    assert opened is not None
    samples = evaluation.held_out_samples(opened.validation, tok, 3)
    assert [s.reference for s in samples] == [g["reference"] for g in reports[-1]["generations"]]
    with torch.no_grad():
        for sample, logged in zip(samples, reports[-1]["generations"], strict=True):
            ids = torch.tensor([sample.prompt_ids])
            out_ids = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                     do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            alone = tok.decode(out_ids[0, ids.shape[1]:], skip_special_tokens=True).strip()
            assert alone == logged["generated"]


class _FakeTokenizer:
    """Token ids as their decimal text; 1 and 2 are special (bos, eos)."""

    all_special_ids = [1, 2]
    pad_token_id = 0
    eos_token_id = 2

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i in self.all_special_ids))


def test_generation_runs_the_compiled_layers_eagerly(tiny_model: Path) -> None:
    """With `fsdp.compile` every decoder layer is a torch.compile wrapper; a greedy decode feeds it
    a new length at every token, which would recompile each layer (up to dynamo's limit) for a few
    prompts. Generation runs them eagerly (as HF's Seq2SeqTrainer generates with the uncompiled
    model) and writes what the uncompiled model writes; training forwards still compile."""
    from llamaft_trainer.parallel.parallelize import decoder_layers
    from llamaft_trainer.process.runtime import Runtime

    compiled: list[int] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiled.append(len(gm.graph.nodes))
        return gm.forward

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()
    rt = Runtime(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
    samples = [evaluation.HeldOutSample(prompt_ids=tok("a b c")["input_ids"], prompt="a b c", reference="d"),
               evaluation.HeldOutSample(prompt_ids=tok("hello there friend")["input_ids"], prompt="", reference="x")]
    eager = evaluation.generate(model, samples, tok, rt, max_new_tokens=6)
    layers = decoder_layers(model)
    for index, layer in enumerate(list(layers)):
        layers[index] = torch.compile(layer, backend=counting_backend)  # type: ignore[assignment]  # as apply_compile
    torch.compiler.reset()
    try:
        assert evaluation.generate(model, samples, tok, rt, max_new_tokens=6) == eager
        assert compiled == [], f"generation compiled {len(compiled)} graph(s)"
        assert model.training, "generate puts the model back in training mode"
        model(input_ids=torch.tensor([samples[0].prompt_ids]))
        assert compiled, "outside generation the layers compile (the test would pass vacuously otherwise)"
    finally:
        torch.compiler.reset()
