"""Each DPO mode's training steps equal TRL 1.16.0's DPOTrainer's on the same batches (TRL run in
.venv-peers: tests/trainer/trl_peer.py's `train` job): full fine-tuning with the precomputed and
the live reference, LoRA (the adapter-disabled base as reference), conversational records (chat
template), IPO, and pairs whose prompt is implicit.

Every case is the issue's protocol: the whole set is every step's batch (so order cannot matter),
beta 0.1, AdamW, constant lr, clip 1.0, fp32, several steps; the per-step loss and TRL's metrics
rewards/chosen|rejected|margins|accuracies and logps/chosen|rejected agree to 1e-4 relative."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.trainer.methods.test_dpo_run import METRICS, PAIRS, dpo_config, of, train
from tests.trainer.trl_compare import run_trl

STEPS = 4
BATCH = 8
LR = 1e-3
LORA = {"r": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}


def records(n: int = BATCH) -> list[dict[str, Any]]:
    """The first `n` pairs of examples/data/preference-tiny.jsonl (prompt, chosen, rejected)."""
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()[:n]]
    return [{k: v for k, v in row.items() if k != "id"} for row in rows]


def conversational(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same pairs as TRL's conversational preference format: a user turn, an assistant turn each."""
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows]


def implicit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same pairs without a prompt field: chosen and rejected each hold the whole text."""
    return [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in rows]


def compare(model: Path, rows: list[dict[str, Any]], tmp: Path, *, loss: str = "sigmoid", reference: str = "precomputed",
            lora: dict[str, Any] | None = None, ours: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Train both sides on `rows` and check every step; ours' step events."""
    source = tmp / "pairs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    training: dict[str, Any] = {"dpo": {"beta": 0.1, "loss": loss, "reference": reference}, "maxSteps": STEPS,
                                "perDeviceBatchSize": len(rows), "learningRate": LR}
    job: dict[str, Any] = {"do": "train", "model": str(model), "records": rows, "max_length": 128, "beta": 0.1,
                           "loss": loss, "lr": LR, "steps": STEPS, "batch_size": len(rows), "reference": reference}
    if lora is not None:
        training["lora"] = {"enabled": True, "r": lora["r"], "alpha": lora["alpha"], "dropout": 0.0,
                            "targetModules": lora["targets"]}
        job["lora"] = {**lora, "adapters": str(initial_adapters(model, training["lora"], tmp / "adapters.safetensors"))}
    cfg = dpo_config(model, tmp / "ck", source, dataset={"validationSplit": 0, **(ours or {})}, training=training)
    rc, events, out = train(cfg, tmp, "ours")
    assert rc == 0, out[-3000:]
    theirs = run_trl(job)
    mine = of(events, "step")
    assert [s["step"] for s in mine] == [s["step"] for s in theirs["steps"]] == list(range(1, STEPS + 1))
    share = 0.0
    for m, t in zip(mine, theirs["steps"], strict=True):
        assert m["loss"] == pytest.approx(t["loss"], rel=1e-4, abs=1e-5), (m, t)
        for name in METRICS:
            assert m[name] == pytest.approx(t[name], rel=1e-4, abs=1e-5), (name, m, t)
        share = max([share] + [abs(m[k] - t[k]) / max(1e-4 * abs(t[k]), 1e-5) for k in ("loss", *METRICS)])
    print(f"largest difference from TRL over {STEPS} steps: {share:.2f} of the tolerance (rel 1e-4, abs 1e-5)")
    if reference == "live" and lora is None:
        assert theirs["reference_model"] is not None  # TRL ran its own ref_model, not a precomputed pass
        assert not of(events, "reference")  # nor did we
    return mine


def initial_adapters(model: Path, lora: dict[str, Any], out: Path) -> Path:
    """The trainer's own initial LoRA adapters (loading.initial_adapters, with the run's seed), saved
    for TRL's side to start from."""
    import torch
    from llamaft.api.spec import LoraSpec, ModelSpec
    from llamaft_trainer.model.loading import initial_adapters as adapters_of
    from safetensors.torch import save_file
    from transformers import AutoConfig

    seed = dpo_config(model, out, PAIRS)["training"]["seed"]
    spec = ModelSpec.model_validate({"source": str(model), "dtype": "float32"})
    adapters = adapters_of(AutoConfig.from_pretrained(model), spec, torch.float32, LoraSpec.model_validate(lora), seed)
    save_file({k: v.contiguous() for k, v in adapters.items()}, str(out))
    return out


@pytest.mark.parametrize("reference", ["precomputed", "live"])
def test_full_fine_tuning_equals_trl(tiny_model: Path, tmp_path: Path, reference: str) -> None:
    steps = compare(tiny_model, records(), tmp_path, reference=reference)
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy is the reference at step 1
    assert steps[-1]["loss"] < 0.6


def test_lora_equals_trl_with_a_peft_lora_config(tiny_model: Path, tmp_path: Path) -> None:
    steps = compare(tiny_model, records(), tmp_path, lora=LORA)
    assert steps[0]["rewards/chosen"] == steps[0]["rewards/rejected"] == 0.0  # B starts at 0
    assert steps[-1]["loss"] < math.log(2)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama of the other DPO tests, with a Llama 3 chat template in its tokenizer."""
    from llamaft_trainer.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("chat") / "tiny-llama3", REPO / "examples" / "data" / "samsum-tiny.jsonl",
                            hidden_size=64, layers=4, vocab_size=512, chat_template="llama3")


def test_conversational_records_equal_trl(chat_model: Path, tmp_path: Path) -> None:
    compare(chat_model, conversational(records()), tmp_path)


def test_ipo_equals_trl(tiny_model: Path, tmp_path: Path) -> None:
    steps = compare(tiny_model, records(), tmp_path, loss="ipo")
    assert steps[0]["loss"] == pytest.approx((1 / (2 * 0.1)) ** 2, rel=1e-6)  # delta 0 at step 1: (0 - 1/(2 beta))^2


@pytest.mark.parametrize("layout", ["plain", "conversational"])
def test_implicit_prompts_equal_trl(tiny_model: Path, chat_model: Path, tmp_path: Path, layout: str) -> None:
    """TRL extracts the prompt (trl.data_utils.extract_prompt) when the records have none."""
    rows = implicit(records()) if layout == "plain" else [
        {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in conversational(records())]
    compare(tiny_model if layout == "plain" else chat_model, rows, tmp_path)
