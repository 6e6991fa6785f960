"""llamaft_trainer.sources.hub against the Hub server on loopback (tests/hub): snapshots through the HF cache,
one fetch per file for concurrent processes, and Hub errors in the spec's terms."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from llamaft_trainer.process.errors import ConfigError
from llamaft_trainer.process.local_etcd import free_port
from llamaft_trainer.sources import hub

from tests.conftest import REPO
from tests.hub.fixture import HubServer

TOKEN = "hf_secret_granted_token"


@pytest.fixture(scope="module")
def repos(hub_server: HubServer, tiny_model: Path) -> dict[str, str]:
    """A public model, a gated model and a dataset, once per module: name -> commit sha."""
    return {
        "model": hub_server.add_model("trainer/tiny", tiny_model),
        "gated": hub_server.add_model("trainer/gated", tiny_model, gated_token=TOKEN),
        "data": hub_server.add_dataset("trainer/data", {"train.jsonl": b'{"text": "hi"}\n'}),
    }


def test_snapshot_fetches_the_selected_files_into_the_cache(hub_env: HubServer, repos: dict[str, str], tmp_path: Path) -> None:
    folder = hub.snapshot("trainer/tiny", repo_type="model", revision=None, what="spec.model.tokenizer",
                          ignore_patterns=["*.safetensors"], cache_dir=tmp_path / "c")
    assert folder.name == repos["model"] and folder.is_relative_to(tmp_path / "c")
    assert (folder / "tokenizer.json").is_file() and not (folder / "model.safetensors").exists()
    assert not [f for (_, f) in hub_env.downloads() if f.endswith(".safetensors")]
    # cache_dir None: HF_HUB_CACHE (here the test's own, from hub_env), where the operator points shared storage.
    data = hub.snapshot("trainer/data", repo_type="dataset", revision=repos["data"], what="spec.dataset.source")
    assert data.is_relative_to(Path(os.environ["HF_HUB_CACHE"])) and (data / "train.jsonl").read_text() == '{"text": "hi"}\n'


def test_gated_repo_errors_name_the_token_secret_and_never_the_token(hub_env: HubServer, repos: dict[str, str],
                                                                     monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="spec.model.hfTokenSecret") as anonymous:
        hub.snapshot("trainer/gated", repo_type="model", revision=None, what="spec.model.source", cache_dir=tmp_path)
    assert "gated" in str(anonymous.value) and "no token was given" in str(anonymous.value)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_wrong_token")
    with pytest.raises(ConfigError, match="has not been granted access") as denied:
        hub.snapshot("trainer/gated", repo_type="model", revision=None, what="spec.model.source", cache_dir=tmp_path)
    assert "hf_secret" not in str(denied.value)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub_env.reset_counts()
    assert hub.snapshot("trainer/gated", repo_type="model", revision=None, what="spec.model.source",
                        allow_patterns=["config.json"], cache_dir=tmp_path) .joinpath("config.json").is_file()
    assert hub_env.authorizations() and set(hub_env.authorizations()) == {f"Bearer {TOKEN}"}


def test_missing_repo_revision_and_file_name_the_field(hub_env: HubServer, repos: dict[str, str],
                                                       monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from huggingface_hub import hf_hub_download
    from transformers import AutoConfig

    with pytest.raises(ConfigError) as missing:
        hub.snapshot("trainer/nope", repo_type="model", revision=None, what="spec.model.source", cache_dir=tmp_path)
    text = str(missing.value)
    assert text.startswith("spec.model.source:") and "'trainer/nope'" in text and "set spec.model.hfTokenSecret" in text
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # with a token, the hint is about what the token can read
    with pytest.raises(ConfigError, match="check that the token in spec.model.hfTokenSecret can read it"):
        hub.snapshot("trainer/nope", repo_type="model", revision=None, what="spec.model.source", cache_dir=tmp_path)
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(ConfigError, match=r"^spec.dataset.revision: trainer/data \(spec.dataset.source\) has no revision 'v9'"):
        hub.snapshot("trainer/data", repo_type="dataset", revision="v9", what="spec.dataset.source", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"^spec.model.revision: .* has no revision 'v9'"):
        hub.snapshot("trainer/tiny", repo_type="model", revision="v9", what="spec.model.tokenizer", cache_dir=tmp_path)
    with pytest.raises(Exception) as no_file:
        hf_hub_download("trainer/tiny", "tokenizer.model", revision=repos["model"], cache_dir=tmp_path)
    error = hub.hub_error(no_file.value, what="spec.model.tokenizer", source="trainer/tiny", revision=repos["model"])
    assert error is not None and "spec.model.tokenizer" in str(error) and "'tokenizer.model'" in str(error)
    # transformers wraps the Hub's error in an OSError: the cause is found.
    with pytest.raises(OSError) as wrapped:
        AutoConfig.from_pretrained("trainer/nope", cache_dir=tmp_path)
    assert isinstance(hub.hub_error(wrapped.value, what="spec.model.source", source="trainer/nope", revision=None), ConfigError)
    with pytest.raises(ConfigError, match="not a Hugging Face Hub repo id"):
        hub.snapshot("a/b/c", repo_type="model", revision=None, what="spec.model.source", cache_dir=tmp_path)


def test_connection_errors_are_left_for_the_retry_policy(hub_env: HubServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    start = time.monotonic()
    with pytest.raises(Exception) as down:
        hub.snapshot("trainer/tiny", repo_type="model", revision=None, what="spec.model.source", cache_dir=tmp_path)
    assert not isinstance(down.value, ConfigError)
    assert hub.hub_error(down.value, what="spec.model.source", source="trainer/tiny", revision=None) is None
    assert time.monotonic() - start < 20


def test_hub_error_of_non_hub_errors_and_server_errors_is_none() -> None:
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    assert hub.hub_error(ValueError("x"), what="spec.model.source", source="a/b", revision=None) is None
    request = httpx2.Request("GET", "https://huggingface.co/a/b/resolve/main/config.json")
    for status, permanent in ((500, False), (503, False), (429, False), (408, False), (401, True), (403, True), (400, True)):
        err = HfHubHTTPError("boom", response=httpx2.Response(status, request=request))
        got = hub.hub_error(err, what="spec.model.source", source="a/b", revision=None)
        assert (got is not None) == permanent, status
    assert hub.revision_field("spec.dataset.source") == "spec.dataset.revision"
    assert hub.revision_field("spec.model.tokenizer") == "spec.model.revision"


FETCH = """
import json, sys, time
from pathlib import Path
from llamaft_trainer.sources import hub
go = Path(sys.argv[2])
while not go.exists():
    time.sleep(0.01)
print(json.dumps(str(hub.snapshot("trainer/tiny", repo_type="model", revision=None, what="spec.model.source", cache_dir=sys.argv[1]))))
"""


def test_two_processes_fetching_one_repo_at_once_download_each_file_once(hub_env: HubServer, repos: dict[str, str], tmp_path: Path) -> None:
    cache = tmp_path / "shared-cache"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "operator"), str(REPO / "trainer")]),
               HF_HUB_DISABLE_PROGRESS_BARS="1")
    env.pop("HF_TOKEN", None)
    # Each file GET is answered 1 s late, and the second process starts once the first is
    # downloading: it finds those files locked (huggingface_hub's per-blob lock in the cache), waits
    # and reuses them instead of fetching them again.
    hub_env.set_download_delay("trainer/tiny", "model", 1.0)
    gos = [tmp_path / "go-0", tmp_path / "go-1"]
    procs = [subprocess.Popen([sys.executable, "-c", FETCH, str(cache), str(go)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for go in gos]
    try:
        gos[0].touch()
        deadline = time.monotonic() + 60
        while not any(r["kind"] == "resolve" and r["method"] == "GET" for r in hub_env.requests(include_pending=True)):
            assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate()
            time.sleep(0.01)
        gos[1].touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        hub_env.set_download_delay("trainer/tiny", "model", 0)
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    folders = {json.loads(out) for out, _ in outs}
    assert folders == {str(cache / "models--trainer--tiny" / "snapshots" / repos["model"])}
    downloads = hub_env.downloads()
    assert downloads and set(downloads.values()) == {1}, downloads
    assert {f for (_, f) in downloads} == {p.name for p in Path(next(iter(folders))).iterdir()}
    requests = hub_env.requests()
    infos = sorted(r["time"] for r in requests if r["kind"] == "info")
    gets = [r for r in requests if r["kind"] == "resolve" and r["method"] == "GET"]
    assert len(infos) == 2, "both processes asked the Hub"
    assert infos[1] < max(r["end"] for r in gets), "the second process started while the first was downloading"


def test_load_dataset_pins_the_commit_and_names_the_fields(hub_env: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"text": f"row {i}"} for i in range(6)]
    first = hub_env.add_dataset("trainer/rows", {"data/train.jsonl": "".join(json.dumps(r) + "\n" for r in rows[:4])})
    second = hub_env.commit("trainer/rows", "dataset", {"data/train.jsonl": "".join(json.dumps(r) + "\n" for r in rows)})
    assert hub.resolved_commit("trainer/rows", "dataset", None, "spec.dataset.source") == second
    assert hub.resolved_commit("trainer/rows", "dataset", first, "spec.dataset.source") == first
    assert len(hub.load_dataset("trainer/rows", split="train", revision=first, streaming=False, what="spec.dataset.source")) == 4
    streamed = hub.load_dataset("trainer/rows", split="train", revision=None, streaming=True, what="spec.dataset.source")
    assert [r["text"] for r in streamed] == [r["text"] for r in rows]
    with pytest.raises(ConfigError, match=r"^spec.dataset.split: trainer/rows has no split 'validation'"):
        hub.load_dataset("trainer/rows", split="validation", revision=None, streaming=False, what="spec.dataset.source")
    with pytest.raises(ConfigError, match=r"^spec.dataset.revision: .*no revision 'v9'"):
        hub.load_dataset("trainer/rows", split="train", revision="v9", streaming=False, what="spec.dataset.source")
    hub_env.add_dataset("trainer/gated-rows", {"train.jsonl": b'{"text": "x"}\n'}, gated_token=TOKEN)
    with pytest.raises(ConfigError, match="gated repo .* spec.model.hfTokenSecret"):
        hub.load_dataset("trainer/gated-rows", split="train", revision=None, streaming=False, what="spec.dataset.source")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert len(hub.load_dataset("trainer/gated-rows", split="train", revision=None, streaming=False, what="spec.dataset.source")) == 1
    hub_env.add_dataset("trainer/no-data", {"notes.md": "nothing to train on"})
    with pytest.raises(ConfigError, match=r"^spec.dataset.source: trainer/no-data .* holds no data files"):
        hub.load_dataset("trainer/no-data", split="train", revision=None, streaming=False, what="spec.dataset.source")
