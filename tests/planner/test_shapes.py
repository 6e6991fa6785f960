"""Model shapes from config only: the built-in table, config.json discovery, parameter counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llamaft.planner.shapes import (
    KNOWN_CONFIGS,
    UnknownShape,
    known_shape,
    meta_parameter_count,
    read_model_config,
    resolve_shape,
    shape_from_config,
)

# Parameter counts of Meta's checkpoints (the analytic Llama formula must give exactly these).
PUBLISHED = {
    "meta-llama/Llama-2-7b-hf": 6_738_415_616,
    "meta-llama/Llama-2-13b-hf": 13_015_864_320,
    "meta-llama/Llama-2-70b-hf": 68_976_648_192,
    "meta-llama/Meta-Llama-3-8B": 8_030_261_248,
    "meta-llama/Meta-Llama-3-70B": 70_553_706_496,
    "meta-llama/Llama-3.1-8B-Instruct": 8_030_261_248,
    "meta-llama/Llama-3.1-70B": 70_553_706_496,
    "meta-llama/Llama-3.1-405B": 405_853_388_800,
}


@pytest.mark.parametrize("repo_id", sorted(PUBLISHED))
def test_builtin_table_matches_published_parameter_counts(repo_id: str) -> None:
    shape = known_shape(repo_id)
    assert shape is not None and shape.parameters == PUBLISHED[repo_id]


def test_hand_computed_parameter_count() -> None:
    # Llama 2 7B by hand: 2 x 32000 x 4096 (embedding + head) + 4096 (final norm)
    # + 32 x (4 x 4096^2 attention + 3 x 4096 x 11008 MLP + 2 x 4096 norms)
    layer = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    shape = known_shape("meta-llama/Llama-2-7b-hf")
    assert shape is not None
    assert shape.layer_parameters == layer == 202_383_360
    assert shape.parameters == 2 * 32000 * 4096 + 4096 + 32 * layer
    # grouped-query attention: Llama 3 8B's k/v projections are 1024 wide
    l3 = known_shape("meta-llama/Meta-Llama-3-8B")
    assert l3 is not None and (l3.q_dim, l3.kv_dim) == (4096, 1024)
    assert l3.lora_parameters(8, ["q_proj", "v_proj"]) == 32 * 8 * ((4096 + 4096) + (1024 + 4096))


def test_name_match_for_paths_and_case() -> None:
    s3 = known_shape("s3://bucket/models/Llama-2-13b-hf/")
    assert s3 is not None and s3.hidden_size == 5120 and "as meta-llama/llama-2-13b-hf" in s3.name
    assert known_shape("META-LLAMA/LLAMA-2-70B-HF") is not None
    assert known_shape("pvc://models/Meta-Llama-3.1-8B") is not None
    assert known_shape("someone/my-llama") is None


def test_unknown_shape_says_what_to_do() -> None:
    with pytest.raises(UnknownShape, match="--model-config"):
        resolve_shape("someone/private-llama")
    with pytest.raises(UnknownShape, match="not a Llama-shaped config"):
        shape_from_config({"hidden_size": 8}, "broken")


def test_config_defaults_tied_embeddings_and_biases() -> None:
    shape = shape_from_config({"vocab_size": 100, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "tie_word_embeddings": True, "attention_bias": True})
    assert shape.num_kv_heads == 4 and shape.head_dim == 4
    layer = 4 * 16 * 16 + 4 * 16 + 3 * 16 * 32 + 2 * 16
    assert shape.parameters == 100 * 16 + 16 + 2 * layer  # one embedding matrix: tied


def test_read_model_config_from_a_local_dir_and_the_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = dict(KNOWN_CONFIGS["meta-llama/llama-2-7b-hf"], model_type="llama")
    local = tmp_path / "my-model"
    local.mkdir()
    (local / "config.json").write_text(json.dumps(config))
    found = read_model_config(str(local))
    assert found is not None and found[0]["hidden_size"] == 4096 and found[1].endswith("config.json")
    assert read_model_config(str(tmp_path / "absent")) is None
    # a hub id already in the local Hugging Face cache: read, never downloaded
    snapshot = tmp_path / "hub" / "models--acme--llama-x" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cached = read_model_config("acme/llama-x")
    assert cached is not None and cached[0]["num_hidden_layers"] == 32
    assert read_model_config("acme/not-cached") is None
    assert read_model_config("s3://bucket/model") is None


@pytest.mark.parametrize(
    "config",
    [
        KNOWN_CONFIGS["meta-llama/llama-2-7b-hf"],
        KNOWN_CONFIGS["meta-llama/meta-llama-3-8b"],
        {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
        {"vocab_size": 300, "hidden_size": 96, "intermediate_size": 200, "num_hidden_layers": 3,
         "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 32, "attention_bias": True, "mlp_bias": True},
    ],
    ids=["llama2-7b", "llama3-8b", "tiny-tied", "odd-head-dim-biases"],
)
def test_analytic_count_equals_the_meta_device_model(config: dict[str, object]) -> None:
    pytest.importorskip("transformers")
    assert meta_parameter_count(dict(config)) == shape_from_config(dict(config)).parameters
