"""The committed CRD is exactly what the API model generates, and it is a valid structural schema."""

from __future__ import annotations

from typing import Any

import jsonschema
import yaml
from llamaft.api import crd as crdgen

from tests.conftest import REPO

CRD_FILE = REPO / "crds" / "llamafinetunes.llamaft.io.yaml"


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for key, child in node.get("properties", {}).items():
        out.extend(_walk(child, f"{path}.{key}"))
    if isinstance(node.get("items"), dict):
        out.extend(_walk(node["items"], f"{path}[]"))
    if isinstance(node.get("additionalProperties"), dict):
        out.extend(_walk(node["additionalProperties"], f"{path}{{}}"))
    return out


def _schema() -> dict[str, Any]:
    return crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_committed_crd_matches_the_model() -> None:
    assert CRD_FILE.read_text(encoding="utf-8") == crdgen.crd_yaml(), (
        "crds/ drifted from llamaft.api: run `llamaft crd -o crds/llamafinetunes.llamaft.io.yaml`"
    )


def test_crd_names_and_subresources() -> None:
    spec = crdgen.crd()["spec"]
    assert spec["group"] == "llamaft.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "LlamaFineTune" and spec["names"]["plural"] == "llamafinetunes"
    assert spec["names"]["shortNames"] == ["finetune", "finetunes", "lft"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}


def test_schema_is_structural() -> None:
    """Every node typed; no $ref/anyOf/allOf; properties never beside additionalProperties;
    preserve-unknown-fields only where intended (pod overrides, metadata)."""
    preserved = []
    for path, node in _walk(_schema()):
        assert "type" in node, f"{path} has no type"
        for banned in ("$ref", "anyOf", "allOf", "oneOf", "title", "$defs"):
            assert banned not in node, f"{path} carries {banned}"
        assert not ("properties" in node and "additionalProperties" in node), path
        if node.get("x-kubernetes-preserve-unknown-fields"):
            preserved.append(path)
    assert preserved == [".spec.cluster.podTemplateOverrides"]


def _openapi_to_jsonschema(node: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes") and k != "default"}
    if out.pop("exclusiveMinimum", False):
        out["exclusiveMinimum"] = out.pop("minimum")
    if out.pop("exclusiveMaximum", False):
        out["exclusiveMaximum"] = out.pop("maximum")
    if "properties" in out:
        out["properties"] = {k: _openapi_to_jsonschema(v) for k, v in out["properties"].items()}
        out["additionalProperties"] = bool(node.get("x-kubernetes-preserve-unknown-fields"))
    if isinstance(out.get("items"), dict):
        out["items"] = _openapi_to_jsonschema(out["items"])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _openapi_to_jsonschema(out["additionalProperties"])
    return out


def test_every_default_is_valid_for_its_own_schema() -> None:
    checked = 0
    for _path, node in _walk(_schema()):
        if "default" in node:
            jsonschema.validate(node["default"], _openapi_to_jsonschema(node))
            checked += 1
    assert checked > 40


def test_nested_defaults_are_reachable_from_an_empty_parent() -> None:
    """The API server only defaults a child when its parent exists: object fields default to {}."""
    spec = _schema()["properties"]["spec"]["properties"]
    for section in ("fsdp", "checkpointing", "cluster", "rendezvous", "monitoring", "runPolicy"):
        assert spec[section]["default"] == {}, section
    assert spec["training"]["default"] == {"epochs": 1}


def test_every_field_is_described() -> None:
    missing = [
        path
        for path, node in _walk(_schema()["properties"]["spec"])
        if path and not path.endswith(("[]", "{}")) and "description" not in node
    ]
    assert missing == []


def test_enums_bounds_and_required() -> None:
    spec = _schema()["properties"]["spec"]
    fsdp = spec["properties"]["fsdp"]["properties"]
    assert fsdp["shardingStrategy"]["enum"] == ["FULL_SHARD", "HYBRID_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
    assert fsdp["mixedPrecision"]["enum"] == ["bf16", "fp16", "fp32", "pure-bf16"]
    assert spec["properties"]["training"]["properties"]["learningRate"]["exclusiveMinimum"] is True
    assert set(spec["required"]) == {"model", "dataset"}
    assert spec["properties"]["model"]["required"] == ["source"]


def test_lora_use_dora_is_in_the_crd() -> None:
    lora = _schema()["properties"]["spec"]["properties"]["training"]["properties"]["lora"]
    assert lora["properties"]["useDora"] == {"type": "boolean", "default": False, "description": lora["properties"]["useDora"]["description"]}
    assert "DoRA" in lora["properties"]["useDora"]["description"]
    assert any("self.useDora" in r["rule"] and "embed_tokens" in r["message"] for r in lora["x-kubernetes-validations"])


def test_cel_rules_are_in_the_crd() -> None:
    rules = [r["rule"] for _, n in _walk(_schema()) for r in n.get("x-kubernetes-validations", [])]
    assert any("hybridShard.shardGroupSize" in r for r in rules)
    assert any("has(self.epochs) != has(self.maxSteps)" in r for r in rules)
    assert any("targetModules" in r for r in rules)
    assert any("elastic.minWorkers <= self.workers" in r for r in rules)


def test_printer_columns() -> None:
    columns = {c["name"]: c for c in crdgen.crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert [n for n, c in columns.items() if "priority" not in c] == [
        "Phase", "Workers", "GPUs", "Step", "Loss", "Tokens/s", "Restarts", "Queue", "Age"
    ]
    assert [n for n, c in columns.items() if c.get("priority") == 1] == [
        "Backend", "Model", "Strategy", "Precision", "Eval-Loss", "ROUGE-L", "RewardAcc", "Desired", "Sized"]
    status = _schema()["properties"]["status"]["properties"]
    for column in columns.values():
        parts = column["jsonPath"].strip(".").split(".")
        if parts[0] in ("status", "spec"):
            node = _schema()["properties"][parts[0]]
            for part in parts[1:]:
                node = node["properties"][part]
    assert "progress" in status


def test_crd_yaml_round_trips() -> None:
    assert yaml.safe_load(CRD_FILE.read_text(encoding="utf-8")) == crdgen.crd()
