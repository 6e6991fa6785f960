"""Kill a torchrun job after a checkpoint; the rerun resumes and reproduces the uninterrupted run's
losses; the final export round-trips through from_pretrained; LoRA exports a peft adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from llamaft_trainer.report.logline import parse_event, read_events

from tests.trainer.conftest import base_config, kill_tree, launch_trainer

STEPS = 24


def _run(config: dict[str, Any], tmp: Path, name: str) -> list[dict[str, Any]]:
    proc = launch_trainer(config, tmp, name)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-5000:]
    return read_events(out)


def _config(model: Path, directory: Path) -> dict[str, Any]:
    return base_config(
        model, directory,
        training={"maxSteps": STEPS, "evalInterval": 0},
        checkpointing={"everyNSteps": 4, "keepLast": 2, "resume": True, "exportHuggingFace": True},
    )


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("resume")
    full = _run(_config(tiny_model, tmp / "full"), tmp, "full")

    killed_dir = tmp / "killed"
    proc = launch_trainer(_config(tiny_model, killed_dir), tmp, "killed")
    assert proc.stdout is not None
    killed_events = []
    for line in proc.stdout:
        event = parse_event(line)
        if event is not None:
            killed_events.append(event)
            if event["event"] == "checkpoint" and event["step"] == 4:
                kill_tree(proc)  # no clean-up of any kind, like a node loss (workers included)
                break
    proc.wait(60)
    complete_after_kill = sorted(p.parent.name for p in killed_dir.glob("step-*/COMPLETE"))
    resumed = _run(_config(tiny_model, killed_dir), tmp, "resumed")
    return {"full": full, "killed": killed_events, "resumed": resumed, "complete_after_kill": complete_after_kill,
            "full_dir": tmp / "full", "killed_dir": killed_dir}


def _losses(events: list[dict[str, Any]]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def test_killed_run_left_a_complete_checkpoint(runs: dict[str, Any]) -> None:
    assert "step-00000004" in runs["complete_after_kill"]
    assert max(_losses(runs["killed"])) < STEPS


def test_resumed_run_continues_with_identical_losses(runs: dict[str, Any]) -> None:
    resume = [e for e in runs["resumed"] if e["event"] == "resume"]
    assert len(resume) == 1
    start = resume[0]["step"]
    assert start >= 4
    full, resumed = _losses(runs["full"]), _losses(runs["resumed"])
    assert sorted(resumed) == list(range(start + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], abs=1e-6), step


def test_keep_last_prunes_old_checkpoints(runs: dict[str, Any]) -> None:
    kept = sorted(p.name for p in runs["full_dir"].glob("step-*"))
    assert kept == [f"step-{STEPS - 4:08d}", f"step-{STEPS:08d}"]
    assert all((runs["full_dir"] / name / "COMPLETE").exists() for name in kept)


def test_resumed_export_equals_uninterrupted_export(runs: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    a = load_file(runs["full_dir"] / "export" / "model.safetensors")
    b = load_file(runs["killed_dir"] / "export" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_export_round_trips_through_from_pretrained_and_generates(runs: dict[str, Any], tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = runs["full_dir"] / "export"
    model = AutoModelForCausalLM.from_pretrained(export)
    tok = AutoTokenizer.from_pretrained(export)
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, dict(base.named_parameters())[n])]
    assert len(changed) == len(list(model.parameters())), "every weight was trained and exported"
    prompt = tok("Summarize this dialog:\nAnna: Have you seen the keys?\n", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    # The exported weights reproduce the trainer's own final eval loss on the same sequences.
    from llamaft.api.spec import TrainingJobConfig
    from llamaft_trainer.data import batching, prepare
    from llamaft_trainer.train import token_loss_sum

    cfg = TrainingJobConfig.model_validate(_config(tiny_model, runs["full_dir"]))
    store = prepare.build_store(cfg.dataset, tok, cfg.training.seed, runs["full_dir"] / "data")  # the run's own store: reused
    val = batching.packed_dataset(store.validation, cfg.dataset, validation=True) if cfg.dataset.packing else batching.PaddedExamples(store.validation)
    used = len(val)  # the eval evaluates every sequence once (data.ValidationShare)
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(used):
            batch = {k: v.unsqueeze(0) for k, v in val[i].items()}
            loss, n = token_loss_sum(model, batch, torch.device("cpu"))
            loss_sum, tokens = loss_sum + float(loss), tokens + n
    logged = [e["eval_loss"] for e in runs["full"] if e["event"] == "eval"][-1]
    assert loss_sum / tokens == pytest.approx(logged, abs=1e-4)


def test_lora_trains_adapters_and_exports_a_peft_adapter(tiny_model: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = base_config(
        tiny_model, tmp_path / "lora",
        training={"maxSteps": 6, "learningRate": 1e-2, "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "targetModules": ["q_proj", "v_proj"]}},
        checkpointing={"exportHuggingFace": True, "everyNSteps": 3},
    )
    events = _run(config, tmp_path, "lora")
    losses = _losses(events)
    assert losses[6] < losses[1]
    export = tmp_path / "lora" / "export"
    adapter = load_file(export / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapter.items()), "lora_B starts at 0 and must have trained"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), export)
    assert model.peft_config["default"].r == 4


def test_lora_merged_export_is_a_plain_model_equal_to_base_plus_adapter(tiny_model: Path, tmp_path: Path) -> None:
    """`lora.export: both` on a sharded run: the root is a plain model (no peft files) whose
    logits equal the base model with the adapter from `adapter/`; every targeted layer merged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    targets = ["q_proj", "v_proj", "down_proj"]
    config = base_config(
        tiny_model, tmp_path / "merged",
        training={"maxSteps": 6, "learningRate": 1e-2,
                  "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "targetModules": targets, "export": "both"}},
        checkpointing={"exportHuggingFace": True, "everyNSteps": 100},
    )
    events = _run(config, tmp_path, "merged")
    assert [e["format"] for e in events if e["event"] == "export"] == ["safetensors (LoRA merged) + peft-adapter in adapter/"]
    export = tmp_path / "merged" / "export"
    assert not (export / "adapter_config.json").exists() and (export / "adapter" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert not any("lora" in k for k in merged.state_dict())
    changed = {k for k, v in merged.state_dict().items() if not torch.equal(v, base.state_dict()[k])}
    assert changed and all(any(t in k for t in targets) for k in changed), "only the targeted layers change"
    assert len(changed) == base.config.num_hidden_layers * len(targets), "every targeted layer got its adapter"
    adapted = PeftModel.from_pretrained(base, export / "adapter").eval()
    ids = torch.randint(3, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (want - got).abs().max() < 1e-4 * want.abs().max()
