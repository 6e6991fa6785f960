"""The committed CRD is exactly what the API model generates, and it is a valid structural schema."""

from __future__ import annotations

import copy
import re
import typing
from typing import Any

import jsonschema
import yaml
from llamaft.api import crd as crdgen
from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.validation import cel_errors
from pydantic import BaseModel

from tests.conftest import REPO
from tests.validation import apiserver_model

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


def _model_defaults(node: dict[str, Any], cls: type[BaseModel], path: str) -> list[tuple[str, Any, Any]]:
    """(path, the CRD's default, the model's default object) for every field of `cls` and below
    whose default is a model object (a default_factory), walking the CRD node beside the class."""
    out = []
    fields = {(f.alias or n): f for n, f in cls.model_fields.items()}
    for key, child in node.get("properties", {}).items():
        field = fields[key]
        if field.default_factory is not None:
            value = typing.cast(typing.Callable[[], Any], field.default_factory)()
            if isinstance(value, BaseModel):
                out.append((f"{path}.{key}", child.get("default"), value.to_k8s()))
        inner = [a for a in (field.annotation, *typing.get_args(field.annotation))
                 if isinstance(a, type) and issubclass(a, BaseModel)]
        if inner and "properties" in child:
            out.extend(_model_defaults(child, inner[0], f"{path}.{key}"))
    return out


def test_object_defaults_are_the_whole_default_object_of_their_model() -> None:
    """An object field's default is its model's default object with every field that has a value,
    not `{}`: what the operator reads for an absent section is what the API server stores."""
    found = _model_defaults(_schema()["properties"]["spec"], LlamaFineTuneSpec, ".spec")
    assert {p for p, _, _ in found} >= {f".spec.{s}" for s in (
        "training", "fsdp", "checkpointing", "cluster", "rendezvous", "monitoring", "runPolicy")}
    for path, default, whole in found:
        assert default == whole, path
    training = _schema()["properties"]["spec"]["properties"]["training"]["default"]
    assert training["epochs"] == 1 and "maxSteps" not in training
    assert training["learningRate"] == 2e-05 and training["method"] == "sft"


def test_object_defaults_are_valid_and_complete_as_written() -> None:
    """The API server validates a default as written, against its own node's schema and CEL rules,
    without applying the nested defaults first (apiextensions-apiserver
    pkg/apiserver/schema/defaulting/validation.go), and refuses the CRD if one fails: `{}` for
    spec.cluster fails `self.workers * ...` with "no such key". So every object (and list) default
    must pass its node's OpenAPI schema and CEL rules as it stands, and must already be complete:
    applying the nested defaults to it changes nothing."""
    checked = 0
    for path, node in _walk(_schema()):
        default = node.get("default")
        if not isinstance(default, dict | list):
            continue
        jsonschema.validate(default, _openapi_to_jsonschema(node))
        assert apiserver_model.cel_problems(node, copy.deepcopy(default), path) == [], path
        assert [str(e) for e in cel_errors(node, default, path)] == [], path
        completed = copy.deepcopy(default)
        apiserver_model.apply_defaults(completed, node)
        assert completed == default, f"{path}: the nested defaults add to the default"
        checked += 1
    assert checked >= 20


def test_no_message_expression_prints_a_value_with_string() -> None:
    """The API server refuses a CRD whose rules' estimated CEL cost exceeds its static limit
    (apiextensions-apiserver pkg/apis/apiextensions/validation/validation.go,
    StaticEstimatedCostLimit), and cel-go's estimate gives `string(...)` of a number no size bound,
    so every `+` after it is estimated at an enormous cost: each such messageExpression was over
    the limit more than 100 times. Messages that would print a value are static `message` texts
    instead. Concatenating a bounded string field (`self.name + '...'` on an env var, whose name
    has a maxLength) is fine. The real API server's verdict is tested in tests/controlplane."""
    expressions = {
        f"{path or '.'}: {rule['messageExpression']}"
        for path, node in _walk(crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
        for rule in node.get("x-kubernetes-validations", [])
        if "messageExpression" in rule
    }
    assert [e for e in expressions if re.search(r"\bstring\s*\(", e.split(": ", 1)[1])] == []
    names = [e for e in expressions if e.split(": ", 1)[1].startswith("self.name + '")]
    assert len(names) == 2 and all(e.startswith(".spec.cluster.env[]") for e in names), expressions


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
