"""Generate the LlamaFineTune CustomResourceDefinition from the pydantic models.

pydantic emits JSON Schema (with $refs, anyOf-null for optionals, no defaults for
default_factory fields); Kubernetes needs a *structural* OpenAPI v3 schema: no $ref, every node
typed, `additionalProperties` never beside `properties`, OpenAPI-3.0 exclusive bounds and defaults
that let the API server fill nested objects. This module does that translation, walking the model
classes beside the schema so defaults come from the models themselves, not from a second copy.
"""

from __future__ import annotations

import copy
import typing
from typing import Any

from pydantic import BaseModel

from llamaft.api import resource
from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.status import LlamaFineTuneStatus

Schema = dict[str, Any]

# Only these keywords survive into the CRD; everything else pydantic emits (title, ...) is dropped.
_KEPT_KEYWORDS = {
    "type", "description", "default", "enum", "format", "pattern", "minimum", "maximum",
    "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "required", "properties", "items",
    "additionalProperties", "nullable", "x-kubernetes-validations",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
}

# The root metadata.name feeds child names (PyTorchJob `<name>`, etcd `<name>-etcd`, ...) that
# must be DNS-1035 labels of at most 63 characters. The rule sits at the root (CEL sees metadata
# only there) and names metadata.name by fieldPath, which the API server accepts because the
# schema declares metadata.name (a CRD may declare metadata's name and generateName only); without
# it the server's error names no field.
NAME_RULE = {
    "rule": f"size(self.metadata.name) <= {resource.MAX_NAME_LENGTH} && self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
    "message": "metadata.name must be a DNS-1035 label (lowercase letters, digits, '-', starting with a "
    f"letter) of at most {resource.MAX_NAME_LENGTH} characters, so child objects (e.g. the Service "
    "`<name>-<uid>-<attempt>-worker-<index>`) fit in 63",
    "reason": "FieldValueInvalid",
    "fieldPath": ".metadata.name",
}


def _model_classes(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every model class reachable from `root`, by the name pydantic uses in `$defs`."""
    found: dict[str, type[BaseModel]] = {}

    def visit(tp: Any) -> None:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp.__name__ in found:
                return
            found[tp.__name__] = tp
            for field in tp.model_fields.values():
                visit(field.annotation)
            return
        for arg in typing.get_args(tp):
            visit(arg)

    visit(root)
    return found


def _factory_default(value: Any) -> Any:
    """The JSON default for a default_factory value: the whole default object, every field that
    has a value. The API server checks a default against its node's CEL rules as written, before
    (and without) the nested defaults (apiextensions-apiserver's schema/defaulting/validation.go,
    ValidateDefaults), so a rule on the node reads only what the default itself holds: `{}`
    would fail `self.workers <= ...` with "no such key" and the CRD would be refused. Defaulting
    an object that is absent gives the same object either way."""
    if isinstance(value, BaseModel):
        return value.model_dump(by_alias=True, exclude_none=True, mode="json")
    if isinstance(value, list):
        return [_factory_default(v) for v in value]
    return value


def _is_null(node: Schema) -> bool:
    return node.get("type") == "null"


class _Converter:
    def __init__(self, root: type[BaseModel]) -> None:
        self.classes = _model_classes(root)
        self.defs: dict[str, Schema] = root.model_json_schema(by_alias=True, mode="validation").get(
            "$defs", {}
        )
        self.root = root

    def model(self, cls: type[BaseModel]) -> Schema:
        schema = cls.model_json_schema(by_alias=True, mode="validation")
        schema.pop("$defs", None)
        return self.convert(schema, cls)

    def convert(self, node: Schema, cls: type[BaseModel] | None = None) -> Schema:
        node = copy.deepcopy(node)
        # Optional[X] -> X: absence, not null, is how an unset optional looks in Kubernetes.
        if "anyOf" in node:
            branches = [b for b in node.pop("anyOf") if not _is_null(b)]
            if len(branches) != 1:
                raise ValueError(f"unions other than Optional are not structural: {branches}")
            outer = node
            node = {**branches[0], **{k: v for k, v in outer.items() if k != "default" or v is not None}}
        if "allOf" in node and len(node["allOf"]) == 1:
            node = {**node.pop("allOf")[0], **node}
        if "$ref" in node:
            name = node.pop("$ref").rsplit("/", 1)[-1]
            target = copy.deepcopy(self.defs[name])
            # The field's own description wins over the class docstring.
            node = {**target, **node}
            cls = self.classes.get(name)
            return self.convert(node, cls)
        if node.get("default", 0) is None:
            node.pop("default")

        out: Schema = {}
        if node.get("type") == "object" or "properties" in node:
            out["type"] = "object"
            props = node.get("properties", {})
            if props:
                fields_by_alias = {}
                if cls is not None:
                    fields_by_alias = {(f.alias or n): f for n, f in cls.model_fields.items()}
                out["properties"] = {}
                for alias, prop in props.items():
                    converted = self.convert(prop)
                    field = fields_by_alias.get(alias)
                    if field is not None and field.default_factory is not None:
                        factory = typing.cast(typing.Callable[[], Any], field.default_factory)
                        converted["default"] = _factory_default(factory())
                    out["properties"][alias] = converted
            additional = node.get("additionalProperties")
            if not props and (additional is True or additional is None):
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif not props and isinstance(additional, dict):
                out["additionalProperties"] = self.convert(additional)
        elif node.get("type") == "array":
            out["type"] = "array"
            out["items"] = self.convert(node["items"])
        elif "type" in node:
            out["type"] = node["type"]
        elif "enum" in node:
            out["type"] = "string"
        else:
            raise ValueError(f"schema node without a type is not structural: {node}")

        # OpenAPI 3.0 (what Kubernetes speaks) writes exclusive bounds as booleans.
        if "exclusiveMinimum" in node:
            out["minimum"] = node["exclusiveMinimum"]
            out["exclusiveMinimum"] = True
        if "exclusiveMaximum" in node:
            out["maximum"] = node["exclusiveMaximum"]
            out["exclusiveMaximum"] = True
        for key, value in node.items():
            if key in _KEPT_KEYWORDS and key not in out:
                if key in ("properties", "items", "additionalProperties"):
                    continue
                out[key] = value
        if "description" in out:
            out["description"] = " ".join(str(out["description"]).split())
        if out.get("type") == "object" and "required" in node:
            out["required"] = list(node["required"])
        return out


def spec_schema() -> Schema:
    """The structural OpenAPI schema of `.spec`."""
    return _Converter(LlamaFineTuneSpec).model(LlamaFineTuneSpec)


def status_schema() -> Schema:
    """The structural OpenAPI schema of `.status`."""
    schema = _Converter(LlamaFineTuneStatus).model(LlamaFineTuneStatus)
    # Status is written by the operator, not defaulted by the API server.
    return _strip_defaults(schema)


def _strip_defaults(node: Schema) -> Schema:
    node = {k: v for k, v in node.items() if k != "default"}
    if "properties" in node:
        node["properties"] = {k: _strip_defaults(v) for k, v in node["properties"].items()}
    if "items" in node:
        node["items"] = _strip_defaults(node["items"])
    return node


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Workers", "type": "integer", "jsonPath": ".status.workers.current"},
    {"name": "GPUs", "type": "integer", "jsonPath": ".status.totalGpus"},
    {"name": "Step", "type": "string", "jsonPath": ".status.progress.stepOfTotal"},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss"},
    {"name": "Tokens/s", "type": "number", "jsonPath": ".status.progress.tokensPerSecond"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.retriesUsed"},
    {"name": "Queue", "type": "string", "jsonPath": ".status.queue"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Backend", "type": "string", "jsonPath": ".status.backend", "priority": 1},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.source", "priority": 1},
    {"name": "Strategy", "type": "string", "jsonPath": ".spec.fsdp.shardingStrategy", "priority": 1},
    {"name": "Precision", "type": "string", "jsonPath": ".spec.fsdp.mixedPrecision", "priority": 1},
    {"name": "Eval-Loss", "type": "number", "jsonPath": ".status.progress.evalLoss", "priority": 1},
    {"name": "ROUGE-L", "type": "number", "jsonPath": ".status.evaluation.rougeL", "priority": 1},
    {"name": "RewardAcc", "type": "number", "jsonPath": ".status.progress.rewardAccuracy", "priority": 1},
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.cluster.workers", "priority": 1},
    {"name": "Sized", "type": "string", "jsonPath": ".status.workers.reason", "priority": 1},
]


def crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition (apiextensions.k8s.io/v1)."""
    spec = spec_schema()
    spec["description"] = "Desired state of the fine-tuning run."
    status = status_schema()
    status["description"] = "Observed state, written by the llamaft operator."
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": resource.CRD_NAME,
            "labels": {"app.kubernetes.io/part-of": "llamaft"},
        },
        "spec": {
            "group": resource.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": resource.KIND,
                "listKind": f"{resource.KIND}List",
                "plural": resource.PLURAL,
                "singular": resource.SINGULAR,
                "shortNames": list(resource.SHORT_NAMES),
                "categories": list(resource.CATEGORIES),
            },
            "versions": [
                {
                    "name": resource.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "LlamaFineTune fine-tunes a Llama-shaped model with PyTorch FSDP "
                            "on a Kubeflow PyTorchJob or TrainJob.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object", "properties": {"name": {"type": "string"}}},
                                "spec": spec,
                                "status": status,
                            },
                            "x-kubernetes-validations": [NAME_RULE],
                        }
                    },
                }
            ],
        },
    }


def crd_yaml() -> str:
    """The CRD as the YAML committed in crds/ (stable key order, so drift shows as a diff)."""
    import yaml

    header = "# Generated by `llamaft crd` from llamaft.api; do not edit. A test fails when it drifts.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100, allow_unicode=True)

