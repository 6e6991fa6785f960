"""The Hub server on loopback answers as huggingface.co does, for the real clients: huggingface_hub
(hf_hub_download, snapshot_download, HfApi), transformers (from_pretrained with a revision pin) and
datasets (load_dataset of JSON Lines and Parquet repos, pinned and streaming)."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.hub.fixture import HubServer

ROWS = [{"dialogue": f"A: hello {i}\nB: hi", "summary": f"greeting {i}"} for i in range(12)]


def jsonl(rows: list[dict[str, str]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def parquet(rows: list[dict[str, str]]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def model_repo(hub_server: HubServer, tiny_model: Path) -> tuple[str, str, str]:
    """(repo id, first commit, second commit): the second changes config.json only."""
    first = hub_server.add_model("acme/tiny-llama", tiny_model, tags=("llama", "text-generation"))
    hub_server.tag("acme/tiny-llama", "model", "v1", first)
    config = json.loads((tiny_model / "config.json").read_text())
    second = hub_server.commit("acme/tiny-llama", "model", {"config.json": json.dumps({**config, "rms_norm_eps": 1e-3})})
    return "acme/tiny-llama", first, second


def test_hf_hub_download_and_snapshot_download_fetch_each_file_once(hub_env: HubServer, model_repo: tuple[str, str, str], tiny_model: Path) -> None:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    repo, first, second = model_repo
    path = Path(hf_hub_download(repo, "tokenizer.json"))
    assert path.read_bytes() == (tiny_model / "tokenizer.json").read_bytes()
    assert path.parent.name == second, "main resolves to the newest commit (X-Repo-Commit)"
    folder = Path(snapshot_download(repo, revision=first))
    assert folder.name == first
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in tiny_model.iterdir())
    assert (folder / "model.safetensors").read_bytes() == (tiny_model / "model.safetensors").read_bytes()
    snapshot_download(repo, revision=first)
    downloads = hub_env.downloads()
    assert downloads[(repo, "model.safetensors")] == 1 and downloads[(repo, "config.json")] == 1
    # tokenizer.json is the same blob at both commits: the cache had it (same ETag), no second GET.
    assert downloads[(repo, "tokenizer.json")] == 1
    assert not [r for r in hub_env.requests() if r["kind"] is None and r["path"] != "/api/agent-harnesses"], \
        "only Hub routes were asked for"

    info = HfApi().model_info(repo)
    assert info.sha == second and {"llama", "text-generation"} <= set(info.tags or [])
    assert HfApi().model_info(repo, revision="v1").sha == first
    assert {s.rfilename for s in HfApi().model_info(repo).siblings or []} >= {"config.json", "model.safetensors"}


def test_transformers_from_pretrained_with_a_revision_pin(hub_env: HubServer, model_repo: tuple[str, str, str]) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    repo, first, second = model_repo
    assert AutoConfig.from_pretrained(repo).rms_norm_eps == pytest.approx(1e-3)
    for pin in (first, "v1"):
        assert AutoConfig.from_pretrained(repo, revision=pin).rms_norm_eps != pytest.approx(1e-3)
    # AutoTokenizer probes optional files (tokenizer.model, special_tokens_map.json, ...): each is a
    # 404 EntryNotFound, which transformers skips; anything else there would be fatal.
    tok = AutoTokenizer.from_pretrained(repo, revision=first)
    assert tok("hello world")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(repo, revision=first)
    assert model.config.rms_norm_eps != pytest.approx(1e-3)
    assert hub_env.downloads()[(repo, "model.safetensors")] == 1


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_load_dataset_by_id_pinned_and_streaming(hub_env: HubServer, tmp_path: Path, kind: str) -> None:
    import datasets

    repo = f"acme/chat-{kind}"
    name, encode = ("data/train.jsonl", jsonl) if kind == "jsonl" else ("data/train-00000-of-00001.parquet", parquet)
    first = hub_env.add_dataset(repo, {name: encode(ROWS[:10])})
    hub_env.commit(repo, "dataset", {name: encode(ROWS)})
    cache = str(tmp_path / "datasets")
    train = datasets.load_dataset(repo, split="train", cache_dir=cache)
    assert len(train) == 12 and train[0] == ROWS[0]
    pinned = datasets.load_dataset(repo, split="train", revision=first, cache_dir=cache)
    assert len(pinned) == 10
    streamed = datasets.load_dataset(repo, split="train", revision=first, streaming=True)
    assert [r["summary"] for r in streamed] == [r["summary"] for r in ROWS[:10]]
    assert hub_env.downloads()[(repo, name)] >= 2  # one per commit (+ ranged GETs when streaming)


def test_missing_file_repo_and_revision_raise_what_the_hub_raises(hub_env: HubServer, model_repo: tuple[str, str, str]) -> None:
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import (
        GatedRepoError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, _, _ = model_repo
    with pytest.raises(RemoteEntryNotFoundError) as missing_file:
        hf_hub_download(repo, "nope.json")
    assert missing_file.value.response.status_code == 404
    with pytest.raises(RepositoryNotFoundError) as anonymous:
        hf_hub_download("acme/no-such-repo", "config.json")
    assert anonymous.value.response.status_code == 401 and not isinstance(anonymous.value, GatedRepoError)
    with pytest.raises(RepositoryNotFoundError) as authenticated:
        hf_hub_download("acme/no-such-repo", "config.json", token="hf_some_token")
    assert authenticated.value.response.status_code == 404
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(repo, "config.json", revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        HfApi().model_info(repo, revision="0" * 40)
    with pytest.raises(RepositoryNotFoundError):
        HfApi().dataset_info(repo)  # a model id is no dataset
    # Routes the Hub server does not serve are never forwarded anywhere.
    with pytest.raises(urllib.error.HTTPError) as page:
        urllib.request.urlopen(hub_env.endpoint + "/api/whoami-v2", timeout=5)
    assert page.value.code == 404


def test_gated_repo_needs_the_token_and_the_token_arrives(hub_env: HubServer, tiny_model: Path) -> None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import GatedRepoError

    repo = "acme/gated-llama"
    hub_env.add_model(repo, tiny_model, gated_token="hf_granted")
    hub_env.add_dataset("acme/gated-data", {"train.jsonl": jsonl(ROWS)}, gated_token="hf_granted")
    with pytest.raises(GatedRepoError) as anonymous:
        hf_hub_download(repo, "config.json")
    assert anonymous.value.response.status_code == 401
    with pytest.raises(GatedRepoError) as denied:
        hf_hub_download(repo, "config.json", token="hf_not_granted")
    assert denied.value.response.status_code == 403
    with pytest.raises(GatedRepoError):
        hf_hub_download("acme/gated-data", "train.jsonl", repo_type="dataset")
    assert hub_env.downloads() == {}
    hub_env.reset_counts()
    assert json.loads(Path(hf_hub_download(repo, "config.json", token="hf_granted")).read_text())["model_type"] == "llama"
    assert hf_hub_download("acme/gated-data", "train.jsonl", repo_type="dataset", token="hf_granted")
    assert set(hub_env.authorizations()) == {"Bearer hf_granted"}
    assert hub_env.downloads() == {(repo, "config.json"): 1, ("acme/gated-data", "train.jsonl"): 1}
