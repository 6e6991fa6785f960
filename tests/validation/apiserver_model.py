"""An independent model of what the API server does with a LlamaFineTune on create, built only from
the committed CRD (crds/llamafinetunes.llamaft.io.yaml) and never from llamaft's pydantic model or
its validation code:

1. kubectl: YAML values to JSON (sigs.k8s.io/yaml + Go's encoding/json): a whole float is written
   without a fraction and read back as an integer, integers beyond int64 become floats, map keys
   become strings, NaN/Inf cannot be sent;
2. the structural schema: nulls pruned from non-nullable fields, then defaults applied (recursively,
   where the parent exists), as apiextensions-apiserver does;
3. OpenAPI v3 validation of the schema (jsonschema with Go's semantics: integers are integers,
   patterns are RE2, unknown fields are errors as with kubectl's strict field validation);
4. the CEL rules (x-kubernetes-validations) evaluated with the Rust `cel` engine (not cel-python);
5. ObjectMeta checks (name rule, namespace, labels, annotations, unknown fields).
`verdict(obj)` returns the list of problems (empty: the API server accepts the object).
"""

from __future__ import annotations

import copy
import functools
import math
import re
from pathlib import Path
from typing import Any

import jsonschema
import re2  # RE2, the regex engine of the API server's OpenAPI patterns
import yaml

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "llamafinetunes.llamaft.io.yaml"
API_VERSION = "llamaft.io/v1alpha1"
KIND = "LlamaFineTune"


class _Unsendable(Exception):
    pass


# ---------------------------------------------------------------------------- 1. kubectl
def kubectl_json(value: Any) -> Any:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if isinstance(key, bool):
                key = "true" if key else "false"
            elif isinstance(key, int | float):
                key = str(int(key)) if isinstance(key, float) and key.is_integer() else str(key)
            elif not isinstance(key, str):
                raise _Unsendable(f"map key {key!r}")
            if key in out:
                raise _Unsendable(f"duplicate key {key!r}")
            out[key] = kubectl_json(item)
        return out
    if isinstance(value, list | tuple):
        return [kubectl_json(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**63 else float(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _Unsendable(f"{value} is not JSON")
        if value.is_integer() and abs(value) < 1e21 and -(2**63) <= value < 2**63:
            return int(value)
        return value
    raise _Unsendable(f"{type(value).__name__}")


# ------------------------------------------------------------------ 2. pruning and defaulting
def prune_nulls(value: Any, schema: dict[str, Any]) -> None:
    if isinstance(value, dict):
        props = schema.get("properties")
        if props:
            for key in list(value):
                if key in props:
                    if value[key] is None and not props[key].get("nullable") and "default" not in props[key]:
                        del value[key]
                    else:
                        prune_nulls(value[key], props[key])
        elif isinstance(schema.get("additionalProperties"), dict):
            sub = schema["additionalProperties"]
            for key in list(value):
                if value[key] is None and not sub.get("nullable") and "default" not in sub:
                    del value[key]
                else:
                    prune_nulls(value[key], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            prune_nulls(item, schema["items"])


def apply_defaults(value: Any, schema: dict[str, Any]) -> None:
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if "default" in sub and (key not in value or (value[key] is None and not sub.get("nullable"))):
                value[key] = copy.deepcopy(sub["default"])
        for key, sub in props.items():
            if key in value:
                apply_defaults(value[key], sub)
        if isinstance(schema.get("additionalProperties"), dict):
            for item in value.values():
                apply_defaults(item, schema["additionalProperties"])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(item, schema["items"])


# ------------------------------------------------------------------------ 3. OpenAPI schema
def _to_jsonschema(node: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes") and k not in ("default", "description", "nullable")}
    # OpenAPI 3.0's boolean exclusiveMinimum/exclusiveMaximum are Draft 4's: kept as they are.
    if "properties" in out:
        out["properties"] = {k: _to_jsonschema(v) for k, v in out["properties"].items()}
        out["additionalProperties"] = bool(node.get("x-kubernetes-preserve-unknown-fields"))
    if isinstance(out.get("items"), dict):
        out["items"] = _to_jsonschema(out["items"])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _to_jsonschema(out["additionalProperties"])
    if node.get("nullable"):
        out["type"] = [out["type"], "null"]
    return out


def _is_integer(_: Any, value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(_: Any, value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _re2_pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
    if isinstance(instance, str) and not re2.search(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


_TYPES = jsonschema.Draft4Validator.TYPE_CHECKER.redefine_many({"integer": _is_integer, "number": _is_number})
_Validator = jsonschema.validators.extend(jsonschema.Draft4Validator, {"pattern": _re2_pattern}, type_checker=_TYPES)


@functools.lru_cache(maxsize=1)
def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_FILE.read_text(encoding="utf-8"))
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1"
    return dict(version["schema"]["openAPIV3Schema"])


@functools.lru_cache(maxsize=1)
def _validator() -> Any:
    schema = _to_jsonschema(crd_schema())
    # metadata is checked as ObjectMeta below; apiVersion/kind by the API server's routing.
    schema["properties"]["metadata"] = {"type": "object"}
    return _Validator(schema)


# ---------------------------------------------------------------------------- 4. CEL rules
def cel_problems(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    import cel

    out: list[str] = []
    if value is None:
        return out
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue  # transition rules do not run on create
        try:
            ok = cel.evaluate(rule["rule"], {"self": value})
        except Exception as exc:  # the API server rejects a rule that cannot evaluate
            out.append(f"{path}: rule error {exc}")
            continue
        if ok is not True:
            out.append(f"{path}{rule.get('fieldPath', '')}: {rule.get('message') or rule['rule']}")
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                out += cel_problems(sub, value[key], f"{path}.{key}")
        if isinstance(schema.get("additionalProperties"), dict):
            for key, item in value.items():
                out += cel_problems(schema["additionalProperties"], item, f"{path}[{key}]")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            out += cel_problems(schema["items"], item, f"{path}[{index}]")
    return out


# ---------------------------------------------------------------------------- 5. ObjectMeta
_META = {"name": str, "generateName": str, "namespace": str, "selfLink": str, "uid": str, "resourceVersion": str,
         "generation": int, "creationTimestamp": str, "deletionTimestamp": str, "deletionGracePeriodSeconds": int,
         "labels": dict, "annotations": dict, "ownerReferences": list, "finalizers": list, "managedFields": list}
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = rf"{_DNS_LABEL}(\.{_DNS_LABEL})*"
_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"


def _qualified(key: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if slash and not (0 < len(prefix) <= 253 and re.fullmatch(_SUBDOMAIN, prefix)):
        return False
    return 0 < len(name) <= 63 and re.fullmatch(_NAME, name) is not None


def meta_problems(meta: Any) -> list[str]:
    if not isinstance(meta, dict):
        return ["metadata: not an object"]
    out = []
    for key, value in meta.items():
        kind = _META.get(key)
        if kind is None:
            out.append(f"metadata.{key}: unknown field")
        elif value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            out.append(f"metadata.{key}: wrong type")
    if not isinstance(meta.get("name"), str):
        out.append("metadata.name: required")
    ns = meta.get("namespace")
    if isinstance(ns, str) and not (len(ns) <= 63 and re.fullmatch(_DNS_LABEL, ns)):
        out.append("metadata.namespace: invalid")
    for field in ("labels", "annotations"):
        values = meta.get(field)
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            if value is not None and not isinstance(value, str):
                out.append(f"metadata.{field}[{key}]: not a string")
                continue
            if not _qualified(key):
                out.append(f"metadata.{field}: invalid key {key!r}")
            if field == "labels" and value and not (len(value) <= 63 and re.fullmatch(_NAME, value)):
                out.append(f"metadata.labels[{key}]: invalid value")
    for index, item in enumerate(meta.get("finalizers") or []):
        if not isinstance(item, str) or not _qualified(item):
            out.append(f"metadata.finalizers[{index}]: invalid")
    return out


# ------------------------------------------------------------------------------ the verdict
def verdict(document: Any) -> list[str]:
    """Every reason the API server refuses `document` on create (empty: it is accepted)."""
    try:
        obj = kubectl_json(document)
    except _Unsendable as exc:
        return [f"kubectl cannot send it: {exc}"]
    if not isinstance(obj, dict):
        return ["not an object"]
    if obj.get("apiVersion") != API_VERSION or obj.get("kind") != KIND:
        return ["apiVersion/kind is not llamaft.io/v1alpha1 LlamaFineTune"]
    obj.pop("status", None)  # with the status subresource, a create ignores .status
    schema = crd_schema()
    prune_nulls(obj, schema)
    apply_defaults(obj, schema)
    problems = meta_problems(obj.get("metadata"))
    problems += [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator().iter_errors(obj)]
    if problems:
        return problems
    root_rules = {"x-kubernetes-validations": schema.get("x-kubernetes-validations", [])}
    problems += cel_problems(root_rules, {"metadata": {"name": obj["metadata"]["name"]}}, "<root>")
    problems += cel_problems(schema["properties"]["spec"], obj["spec"], "spec")
    return problems
