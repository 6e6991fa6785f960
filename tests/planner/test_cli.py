"""`llamaft plan` and the verdict `llamaft validate` prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from llamaft.cli import main

from tests.conftest import REPO

EXAMPLES = REPO / "examples"


def _write(tmp_path: Path, name: str, **spec_updates: object) -> Path:
    body = yaml.safe_load((EXAMPLES / "llama2-7b.yaml").read_text())
    for path, value in spec_updates.items():
        node = body["spec"]
        keys = path.split(".")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    out = tmp_path / name
    out.write_text(yaml.safe_dump(body))
    return out


def test_plan_prints_components_verdict_host_checkpoints_and_time(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(EXAMPLES / "llama2-7b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "llama2-7b-samsum: meta-llama/Llama-2-7b-hf: 6,738,415,616 parameters" in out
    assert "on p4de.24xlarge (8 x A100-80GB, 1,152 GiB host memory, 4 EFA)" in out
    for line in ("sharded parameters (master copy)", "optimizer state (AdamW exp_avg, exp_avg_sq)",
                 "activations saved for backward", "tensor peak (torch.cuda.max_memory_allocated)",
                 "+ CUDA context and NCCL buffers (assumed)", "= needed per GPU"):
        assert line in out
    assert "Verdict: Fits: fits: needs about" in out
    assert "every node: 8 process(es) x 4.0 GiB (assumed) + 3.9 GiB read buffers (the largest tensor, fp32, per process)" in out
    assert "per save: 75.3 GiB (model 25.1 GiB, optimizer 50.2 GiB)" in out
    assert "Time (an assumption, not a measurement: the GPUs run at 40% of their bf16 peak)" in out
    assert "16 GPU(s) x 312 TFLOP/s bf16 peak" in out


def test_plan_of_a_run_that_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "big.yaml", **{"cluster.instanceType": "g5.48xlarge", "cluster.workers": 1,
                                           "fsdp.activationCheckpointing": {"mode": "none"}})
    assert main(["plan", str(path)]) == 3
    out = capsys.readouterr().out
    assert "Verdict: WillNotFit: will not fit" in out
    assert "Changes that lower the peak, cheapest kind first:" in out
    assert "full activation checkpointing: saves" in out and "[fits]" in out
    assert "set fsdp.activationCheckpointing.mode: full" in out
    # --gpu-memory overrides the catalog (a 141 GB part instead of the A10G)
    assert main(["plan", str(path), "--gpu-model", "H200", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["reason"] == "Fits" and body["plan"]["gpu"]["model"] == "H200" and body["plan"]["fixes"] == []


def test_plan_reads_a_local_config_and_says_when_the_shape_is_unknown(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 172,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}))
    body = yaml.safe_load((EXAMPLES / "tiny.yaml").read_text())
    body["spec"]["model"]["source"] = str(model)
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text(yaml.safe_dump(body))
    assert main(["plan", str(spec_file), "--dataset-records", "1000"]) == 0
    out = capsys.readouterr().out
    assert f"shape from {model / 'config.json'}" in out and "247,360 parameters" in out
    assert "Verdict: CpuOnly: CPU-only run (gpusPerWorker 0)" in out
    assert "Tensor memory per process at the peak" in out
    # a private hub model, not cached here: the shape is unknown offline
    body["spec"]["model"]["source"] = "acme/private-llama"
    spec_file.write_text(yaml.safe_dump(body))
    assert main(["plan", str(spec_file)]) == 2
    assert "unknown offline" in capsys.readouterr().err
    assert main(["plan", str(spec_file), "--model-config", str(model)]) == 0
    assert "CpuOnly" in capsys.readouterr().out


def test_plan_exact_count_on_the_meta_device(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    assert main(["plan", str(EXAMPLES / "llama2-7b.yaml"), "--exact"]) == 0
    assert "6,738,415,616 on the meta device = analytic" in capsys.readouterr().out


def test_validate_prints_the_capacity_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(EXAMPLES / "llama2-7b.yaml"), str(EXAMPLES / "minimal.yaml")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("ok (llama2-7b-samsum: 2 worker(s) x 8 GPU(s), FULL_SHARD, bf16)")
    assert out[1].startswith("  capacity: Fits: fits: needs about") and out[1].endswith("(details: llamaft plan)")
    assert out[3].startswith("  capacity: UnknownGpu: cannot tell whether it fits")
    big = {"cluster.instanceType": "g5.48xlarge", "cluster.workers": 1, "fsdp.activationCheckpointing": {"mode": "none"}}
    # the schema accepts it, the operator refuses it: exit 1 (--schema-only: 0, as the API server would)
    assert main(["validate", str(_write(tmp_path, "enforce.yaml", **big))]) == 1
    assert "capacity: WillNotFit [the operator will refuse it]: will not fit" in capsys.readouterr().out
    assert main(["validate", "--schema-only", str(_write(tmp_path, "enforce.yaml", **big))]) == 0
    capsys.readouterr()
    assert main(["validate", str(_write(tmp_path, "warn.yaml", preflight="Warn", **big))]) == 0
    assert "WillNotFit [spec.preflight Warn: the operator only warns]" in capsys.readouterr().out
    assert main(["validate", str(_write(tmp_path, "off.yaml", preflight="Off", **big))]) == 0
    assert "capacity: not checked (spec.preflight: Off)" in capsys.readouterr().out
