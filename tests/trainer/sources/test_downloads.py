"""fsspec sources are fetched only where read: the small files (config, tokenizer, index) by every
node that needs them, the weight files only by the ranks that read them (broadcast: global rank 0;
sliced: once per node, by a rank of that node; the previous path: rank 0), and a changed source
(another URI, another revision, a remote file with a new size or mtime) is fetched again.

The source is `countfile://...`: a local folder behind an fsspec filesystem that logs each fetch
with the fetching rank (countingfs.py). Four ranks play two nodes of two (one cache folder each).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from llamaft_trainer.model import loading
from llamaft_trainer.process.errors import ConfigError
from llamaft_trainer.process.runtime import Runtime
from llamaft_trainer.sources import downloads

from tests.trainer import countingfs
from tests.trainer.conftest import base_config
from tests.trainer.load_worker import digest, launch

SOLO = Runtime(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
WHAT = "spec.model.source"


@pytest.fixture
def source(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path, Path]:
    """(URI, the folder behind it, the fetch log), with a fresh cache."""
    countingfs.register()
    folder = tmp_path / "remote"
    shutil.copytree(tiny_model, folder)
    log = tmp_path / "fetches.log"
    monkeypatch.setenv(countingfs.LOG_ENV, str(log))
    monkeypatch.setattr(downloads, "CACHE_ROOT", tmp_path / "cache")
    return f"{countingfs.PROTOCOL}://{folder}", folder, log


def _names(log: Path) -> list[str]:
    return sorted(name for (_, name), n in countingfs.fetches(log).items() for _ in range(n))


def test_config_and_tokenizer_fetch_no_weights(source: tuple[str, Path, Path]) -> None:
    uri, folder, log = source
    where = Path(downloads.resolve(uri, SOLO, WHAT, weights=False))
    fetched = _names(log)
    assert "config.json" in fetched and "tokenizer.json" in fetched
    assert not [n for n in fetched if downloads.is_weight_file(n)]
    assert not (where / "model.safetensors").exists()
    downloads.resolve(uri, SOLO, WHAT, weights=False)
    assert _names(log) == fetched, "unchanged files are not fetched again"


def test_a_weight_file_is_fetched_once_then_again_when_it_changes(source: tuple[str, Path, Path]) -> None:
    uri, folder, log = source
    first = downloads.fetch_file(uri, "model.safetensors", SOLO, WHAT)
    assert downloads.fetch_file(uri, "model.safetensors", SOLO, WHAT) == first
    assert _names(log) == ["model.safetensors"]
    stat = os.stat(folder / "model.safetensors")
    os.utime(folder / "model.safetensors", (stat.st_atime, stat.st_mtime + 60))  # a new mtime, same size
    downloads.fetch_file(uri, "model.safetensors", SOLO, WHAT)
    assert _names(log) == ["model.safetensors"] * 2
    downloads.resolve(uri, SOLO, WHAT, weights=False)
    config = folder / "config.json"
    config.write_text(config.read_text().replace("{", '{"note": "edited",', 1))  # a new size
    downloads.resolve(uri, SOLO, WHAT, weights=False)
    downloads.resolve(uri, SOLO, WHAT, weights=False)
    assert _names(log).count("config.json") == 2
    assert "edited" in (Path(downloads.cache_dir(uri, None)) / "config.json").read_text()


def test_another_revision_or_uri_is_another_cache_entry(source: tuple[str, Path, Path], tmp_path: Path) -> None:
    uri, folder, log = source
    a = downloads.fetch_file(uri, "model.safetensors", SOLO, WHAT)
    b = downloads.fetch_file(uri, "model.safetensors", SOLO, WHAT, revision="v2")
    shutil.copytree(folder, tmp_path / "elsewhere")
    c = downloads.fetch_file(f"{countingfs.PROTOCOL}://{tmp_path / 'elsewhere'}", "model.safetensors", SOLO, WHAT)
    assert len({a.parent, b.parent, c.parent}) == 3
    assert _names(log) == ["model.safetensors"] * 3


def test_full_resolve_fetches_everything_and_bad_uris_are_config_errors(source: tuple[str, Path, Path]) -> None:
    uri, folder, log = source
    where = Path(downloads.resolve(uri, SOLO, WHAT))
    assert (where / "model.safetensors").exists() and (where / ".complete").exists()
    with pytest.raises(ConfigError, match=f"{WHAT}: cannot read {countingfs.PROTOCOL}:///nowhere"):
        downloads.resolve(f"{countingfs.PROTOCOL}:///nowhere", SOLO, WHAT, weights=False)
    with pytest.raises(ConfigError, match=f"{WHAT}: cannot read .*absent.safetensors"):
        downloads.fetch_file(uri, "absent.safetensors", SOLO, WHAT)


def test_a_rank_reads_only_files_holding_rows_it_owns() -> None:
    """A rank whose part of a tensor is empty (fewer rows than ranks) needs not fetch its file."""
    items = {"a": loading.Item("a", "one.safetensors"), "b": loading.Item("b", "two.safetensors")}
    groups: list[loading.Group] = [(contextlib.nullcontext, [
        loading.Target("a", torch.empty(0, 4)), loading.Target("b", torch.empty(2, 4))])]
    assert loading._needed_files(groups, items) == {"two.safetensors"}


# --- four ranks, two simulated nodes ------------------------------------------------------------------

NODE = 2  # ranks per simulated node


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bf16 multi-file checkpoint (index + several safetensors files) with tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("remote") / "multi"
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder, max_shard_size="20KB")
    assert len(list(folder.glob("*.safetensors"))) >= 3
    return folder


@pytest.fixture(scope="module")
def runs(remote: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("downloads")
    uri = f"{countingfs.PROTOCOL}://{remote}"
    first_shard = sorted(p.name for p in remote.glob("*.safetensors"))[0]

    config = base_config(remote, tmp / "ck")
    config["model"]["source"] = uri

    def case(name: str, method: str, cache: str, **extra: Any) -> dict[str, Any]:
        return {"name": name, "method": method, "cache": str(tmp / cache), "ranks_per_node": NODE,
                "count_log": str(tmp / f"{name}.log"), "config": config, **extra}

    cases = [
        case("broadcast", "broadcast", "cache-broadcast"),
        case("full", "full", "cache-full"),
        case("sliced", "sliced", "cache-sliced"),
        case("sliced-again", "sliced", "cache-sliced"),
        case("sliced-changed", "sliced", "cache-sliced", touch=[str(remote / first_shard)]),
    ]
    out, _ = launch(tmp, 2 * NODE, cases)
    return {"out": out, "logs": {c["name"]: countingfs.fetches(Path(c["count_log"])) for c in cases},
            "weights": sorted(p.name for p in remote.glob("*.safetensors")), "first_shard": first_shard, "remote": remote}


def _weights(counts: Any) -> dict[tuple[int, str], int]:
    return {k: n for k, n in counts.items() if k[1].endswith(".safetensors")}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["broadcast", "full"])
def test_only_rank_0_fetches_weights_when_it_alone_reads(runs: dict[str, Any], name: str) -> None:
    counts = runs["logs"][name]
    assert _weights(counts) == {(0, w): 1 for w in runs["weights"]}
    config_fetchers = sorted(rank // NODE for (rank, file) in counts.elements() if file == "config.json")
    assert config_fetchers == [0, 1], "each node fetches the (small) config once"


@pytest.mark.slow
def test_sliced_fetches_each_weight_file_once_per_node(runs: dict[str, Any]) -> None:
    per_node: dict[tuple[int, str], int] = {}
    for (rank, file), n in _weights(runs["logs"]["sliced"]).items():
        per_node[(rank // NODE, file)] = per_node.get((rank // NODE, file), 0) + n
    assert per_node == {(node, w): 1 for node in (0, 1) for w in runs["weights"]}


@pytest.mark.slow
def test_a_changed_remote_file_alone_is_fetched_again(runs: dict[str, Any]) -> None:
    assert _weights(runs["logs"]["sliced-again"]) == {}
    changed = _weights(runs["logs"]["sliced-changed"])
    assert sorted(file for (_, file) in changed) == [runs["first_shard"]] * 2  # once per node
    assert sorted(rank // NODE for (rank, _) in changed) == [0, 1]


@pytest.mark.slow
def test_loaded_weights_equal_from_pretrained(runs: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    want = {k: digest(v) for k, v in AutoModelForCausalLM.from_pretrained(runs["remote"], dtype=torch.float32).state_dict().items()}
    for name, got in runs["out"].items():
        assert got.get("digests") == want, name
