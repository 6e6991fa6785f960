"""`llamaft run --local` on a spec whose model and dataset are Hugging Face Hub ids and nothing
else, against the real Hub API server on loopback (tests/hub): a chat fine-tune of a Llama-3-style
model on a Parquet conversation set at pinned revisions, every file fetched once for both ranks;
a gated model gets the token (HF_TOKEN, what the operator fills from spec.model.hfTokenSecret) or
fails at once, permanently, naming hfTokenSecret."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from llamaft.cli import main as cli
from llamaft_trainer.tiny import build_tiny_llama

from tests.conftest import REPO
from tests.hub.fixture import HubServer
from tests.trainer.test_local_run import events

CHAT = REPO / "examples" / "data" / "chat-tiny.jsonl"
TOKEN = "hf_llamaft_test_token_0123456789"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("chat-model"), REPO / "examples" / "data" / "samsum-tiny.jsonl",
                            chat_template="llama3")


def parquet(records: list[dict[str, Any]], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def hub_finetune(tmp: Path, name: str, model: dict[str, Any], dataset: dict[str, Any]) -> Path:
    body = {
        "apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune", "metadata": {"name": name},
        "spec": {
            "model": {"dtype": "float32", **model},
            "dataset": {"maxSeqLength": 128, "packing": True, "validationSplit": 0.05, **dataset},
            "training": {"maxSteps": 6, "perDeviceBatchSize": 2, "learningRate": 3e-3, "evalInterval": 0},
            "fsdp": {"mixedPrecision": "fp32", "activationCheckpointing": {"mode": "none"}},
            "checkpointing": {"directory": str(tmp / name / "checkpoints"), "everyNSteps": 1000},
            "cluster": {"workers": 2, "gpusPerWorker": 0},
            "rendezvous": {"backend": "c10d"},
        },
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_hub_ids_and_nothing_else_fine_tune_on_conversations(hub_env: HubServer, chat_model: Path, tmp_path: Path) -> None:
    model_sha = hub_env.add_model("llamaft-run/tiny-chat", chat_model)
    records = [json.loads(line) for line in CHAT.read_text().splitlines() if line.strip()]
    data = {"data/train-00000.parquet": parquet(records, tmp_path / "train.parquet")}
    hub_env.add_dataset("llamaft-run/chat-parquet", data)
    hub_env.tag("llamaft-run/chat-parquet", "dataset", "v1")
    hub_env.commit("llamaft-run/chat-parquet", "dataset", {"data/train-00000.parquet": parquet(records[:10], tmp_path / "x.parquet")})
    hub_env.reset_counts()
    path = hub_finetune(tmp_path, "hub-chat", {"source": "llamaft-run/tiny-chat", "revision": model_sha},
                        {"format": "chat", "source": "llamaft-run/chat-parquet", "revision": "v1"})
    run_dir = tmp_path / "run"
    assert cli(["run", "--local", str(path), "--run-dir", str(run_dir)]) == 0
    log = events(run_dir)
    losses = [e["loss"] for e in log if e.get("event") == "step"]
    assert len(losses) == 6 and losses[-1] < losses[0]
    stored = [e for e in log if e.get("event") == "data"]
    assert stored and not stored[0]["reused"] and stored[0]["records"] == len(records), "the tag v1, not main's 10 records"
    fetched = hub_env.downloads()
    assert fetched[("llamaft-run/chat-parquet", "data/train-00000.parquet")] == 1
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert fetched[("llamaft-run/tiny-chat", name)] == 1, (name, fetched)
    assert max(fetched.values()) == 1, f"every file once for both ranks: {fetched}"
    assert (tmp_path / "hub-chat" / "checkpoints" / "export" / "model.safetensors").exists()


def test_a_gated_model_gets_the_token_or_fails_naming_the_secret(
    hub_env: HubServer, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    hub_env.add_model("llamaft-run/gated", tiny_model, gated_token=TOKEN)
    hub_env.add_dataset("llamaft-run/samsum", {"train.jsonl": REPO / "examples" / "data" / "samsum-tiny.jsonl"})
    model = {"source": "llamaft-run/gated", "hfTokenSecret": {"name": "hf-token"}}
    path = hub_finetune(tmp_path, "gated", model, {"format": "samsum", "source": "llamaft-run/samsum"})
    assert cli(["run", "--local", str(path), "--run-dir", str(tmp_path / "refused")]) == 2
    out = capsys.readouterr()
    assert "spec.model.hfTokenSecret" in out.out + out.err and "gated" in out.out + out.err
    assert TOKEN not in out.out + out.err
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub_env.reset_counts()
    assert cli(["run", "--local", str(path), "--run-dir", str(tmp_path / "granted")]) == 0
    assert f"Bearer {TOKEN}" in hub_env.authorizations(), "the token reached the Hub"
    logs = "".join(p.read_text() for p in (tmp_path / "granted").glob("*.log"))
    assert TOKEN not in logs
