"""Validate a LlamaFineTune the way the API server does, with messages that name the field.

The steps are the API server's, in its order, all derived from the one API model:
1. the object as kubectl sends it: JSON values only (a whole number such as `2.0` is the integer 2,
   `.nan` cannot be sent, map keys are strings);
2. `null` removed from every field that is not nullable (none of ours is), so the default applies,
   as the API server prunes nulls before defaulting;
3. pydantic in strict mode (types exactly as the structural schema types them, enums, bounds,
   patterns, required and unknown fields: kubectl's strict field validation), errors rewritten to
   say which field and what to do;
4. the CEL rules (`x-kubernetes-validations`) of the generated CRD schema, evaluated with
   cel-python on the defaulted object, exactly as the API server evaluates them after defaulting;
5. metadata as the API server checks ObjectMeta (name, namespace, labels, annotations).
`llamaft validate`, `llamaft render`, `llamaft run --local` and the operator all call this.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

import celpy
from celpy import celtypes
from pydantic import ValidationError
from pydantic.alias_generators import to_camel

from llamaft.api import cel_parser, resource
from llamaft.api import spec as api
from llamaft.api.crd import NAME_RULE, spec_schema
from llamaft.api.spec import LlamaFineTuneSpec

Schema = dict[str, Any]

MAX_DEPTH = 10_000
"""Deepest nesting of an object (kubectl's YAML decoder and the API server's JSON decoder stop here)."""
MAX_ANNOTATIONS_BYTES = 256 * 1024
"""Total size of metadata.annotations the API server accepts."""


@dataclass(frozen=True)
class FieldError:
    """One problem, located by its path in the object (`spec.fsdp.shardingStrategy`)."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecInvalid(ValueError):
    """A LlamaFineTune that the API server (and so the operator) would reject."""

    def __init__(self, errors: Sequence[FieldError]) -> None:
        self.errors = list(errors)
        super().__init__("; ".join(str(e) for e in self.errors))


def short(value: Any, limit: int = 60) -> str:
    """A bounded repr for messages (a rejected value may be a whole nested document)."""
    if isinstance(value, Mapping):
        return "a mapping" if value else "{}"
    if isinstance(value, list):
        return "a list" if value else "[]"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…'"


def _describe_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {short(value)}"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


# -------------------------------------------------------------------- the object kubectl sends
def _format_path(parts: Sequence[str | int]) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _json_key(key: Any) -> str | None:
    """Map keys as sigs.k8s.io/yaml turns them into JSON (None: not representable)."""
    if isinstance(key, str):
        return key
    if isinstance(key, bool):
        return "true" if key else "false"
    if isinstance(key, int):
        return str(key)
    if isinstance(key, float) and math.isfinite(key):
        return repr(int(key)) if key.is_integer() and abs(key) < 1e21 else repr(key)
    return None


def _json_scalar(value: Any) -> tuple[Any, str | None]:
    """(JSON value, problem) for one scalar, as kubectl's YAML -> JSON -> API server round trip has it."""
    if value is None or isinstance(value, bool | str):
        return value, None
    if isinstance(value, int):
        if -(2**63) <= value < 2**63:
            return value, None
        as_float = float(value) if abs(value) < 10**308 else math.inf
        if math.isinf(as_float):
            return None, f"the number {short(value)} is too large for JSON"
        return as_float, None  # beyond int64 the API server decodes a float
    if isinstance(value, float):
        if not math.isfinite(value):
            return None, f"{value} is not a JSON number: write a finite number"
        if value.is_integer() and -(2**63) <= value < 2**63 and abs(value) < 1e21:
            return int(value), None  # Go writes 2.0 as 2: the API server reads an integer
        return value, None
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace"), None
    if isinstance(value, datetime | date):
        return value.isoformat(), None
    return None, f"a {type(value).__name__} cannot be written as JSON"


def to_json(value: Any, path: str) -> tuple[Any, list[FieldError]]:
    """`value` as the API server receives it from kubectl, without recursion (any depth up to
    MAX_DEPTH), plus what cannot be sent. The input is not modified."""
    errors: list[FieldError] = []

    def where(trail: tuple[Any, ...] | None) -> str:
        parts: list[str | int] = []
        while trail is not None:
            trail, part = trail
            parts.append(part)
        return _format_path([path, *reversed(parts)]) if parts else path

    def convert(item: Any, trail: tuple[Any, ...] | None, depth: int) -> Any:
        if isinstance(item, Mapping | list | tuple):
            if depth > MAX_DEPTH:
                errors.append(FieldError(where(trail), f"nested deeper than {MAX_DEPTH} levels"))
                return None
            out: Any = {} if isinstance(item, Mapping) else []
            pending.append((item, out, trail, depth))
            return out
        converted, problem = _json_scalar(item)
        if problem is not None:
            errors.append(FieldError(where(trail), problem))
        return converted

    pending: list[tuple[Any, Any, tuple[Any, ...] | None, int]] = []
    root = convert(value, None, 0)
    while pending and len(errors) < 100:
        item, out, trail, depth = pending.pop()
        if isinstance(item, Mapping):
            for key, child in item.items():
                name = _json_key(key)
                if name is None:
                    errors.append(FieldError(where(trail), f"the key {short(key)} cannot be a JSON object key"))
                    continue
                if name in out:
                    errors.append(FieldError(where((trail, name)), "duplicate key"))
                    continue
                out[name] = convert(child, (trail, name), depth + 1)
        else:
            for index, child in enumerate(item):
                out.append(convert(child, (trail, index), depth + 1))
    return root, errors


def prune_nulls(value: Any, schema: Schema) -> Any:
    """A copy of `value` without `null` in fields that are not nullable, as the API server prunes
    them before defaulting (so `workers: null` gets the default). Free-form fields
    (x-kubernetes-preserve-unknown-fields) keep their nulls, as they do in the API server."""
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is not None:
            out: dict[str, Any] = {}
            for key, child in value.items():
                sub = props.get(key)
                if sub is None:
                    out[key] = child  # unknown: reported by validation
                elif child is None and not sub.get("nullable"):
                    continue
                else:
                    out[key] = prune_nulls(child, sub)
            return out
        if isinstance(extra, dict):
            return {k: prune_nulls(v, extra) for k, v in value.items() if v is not None or extra.get("nullable")}
        return value
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune_nulls(item, schema["items"]) for item in value]
    return value


# ---------------------------------------------------------------------------- CEL evaluation
@functools.lru_cache(maxsize=1)
def _environment() -> celpy.Environment:
    cel_parser.install()  # the analysed grammar from this machine's cache (cel_parser.py)
    return celpy.Environment()


@functools.lru_cache(maxsize=256)
def _program(expression: str) -> Any:
    env = _environment()
    return env.program(env.compile(expression))


def to_cel(document: Any) -> Any:
    """celpy.adapter.json_to_cel without recursion (free-form fields may be thousands deep)."""
    def leaf(item: Any) -> Any:
        if isinstance(item, bool):
            return celtypes.BoolType(item)
        if isinstance(item, float):
            return celtypes.DoubleType(item)
        if isinstance(item, int):
            return celtypes.IntType(item)
        if isinstance(item, str):
            return celtypes.StringType(item)
        if item is None:
            return None
        raise ValueError(f"unexpected type {type(item).__name__} in a JSON document")

    if not isinstance(document, dict | list):
        return leaf(document)
    # Post-order: a container is built once its children are.
    results: dict[int, Any] = {}
    stack: list[tuple[Any, bool]] = [(document, False)]
    while stack:
        item, ready = stack.pop()
        children = list(item.values()) if isinstance(item, dict) else item
        if not ready:
            stack.append((item, True))
            stack.extend((c, False) for c in children if isinstance(c, dict | list))
            continue
        converted = [results.pop(id(c)) if isinstance(c, dict | list) else leaf(c) for c in children]
        if isinstance(item, dict):
            results[id(item)] = celtypes.MapType(
                {celtypes.StringType(k): v for k, v in zip(item.keys(), converted, strict=True)}
            )
        else:
            results[id(item)] = celtypes.ListType(converted)
    return results[id(document)]


def _evaluate(expression: str, value: Any, old: Any = None) -> Any:
    activation = {"self": to_cel(value)}
    if old is not None:
        activation["oldSelf"] = to_cel(old)
    return _program(expression).evaluate(activation)


def is_transition_rule(rule: Mapping[str, Any]) -> bool:
    """Rules that compare with the previous object run only on updates, as in the API server."""
    return "oldSelf" in str(rule["rule"])


def _rule_errors(
    rules: Sequence[Mapping[str, Any]], value: Any, path: str, old: Any = None
) -> Iterator[FieldError]:
    if not rules:
        return
    activation = {"self": to_cel(value)}
    with_old = {**activation, "oldSelf": to_cel(old)} if old is not None else None
    for rule in rules:
        transition = is_transition_rule(rule)
        if transition and with_old is None:
            continue
        try:
            ok = bool(_program(rule["rule"]).evaluate(with_old if transition else activation))
        except Exception as exc:  # a rule that cannot evaluate is a failed rule, as in the API server
            yield FieldError(path, f"rule {rule['rule']!r} could not be evaluated: {exc}")
            continue
        if ok:
            continue
        if "messageExpression" in rule:
            message = str(_program(rule["messageExpression"]).evaluate(activation))
        else:
            message = str(rule.get("message") or f"failed rule: {rule['rule']}")
        # fieldPath is relative to the rule's node; a rule at the object's root has path "".
        yield FieldError((path + str(rule.get("fieldPath", ""))).lstrip("."), message)


def cel_errors(schema: Schema, value: Any, path: str, old: Any = None) -> list[FieldError]:
    """Evaluate every `x-kubernetes-validations` rule of `schema` against `value`, recursively.
    With `old` (the previous object), transition rules (`oldSelf`) are evaluated too."""
    errors: list[FieldError] = []
    if value is None:
        return errors
    errors.extend(_rule_errors(schema.get("x-kubernetes-validations", []), value, path, old))
    if isinstance(value, Mapping):
        for key, child in schema.get("properties", {}).items():
            if key in value:
                child_old = old.get(key) if isinstance(old, Mapping) else None
                errors.extend(cel_errors(child, value[key], f"{path}.{key}", child_old))
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in value.items():
                errors.extend(cel_errors(extra, item, f"{path}[{key}]"))
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            errors.extend(cel_errors(schema["items"], item, f"{path}[{index}]"))
    return errors


# ----------------------------------------------------------------------- pydantic error text
@functools.lru_cache(maxsize=1)
def _spec_schema() -> Schema:
    return spec_schema()


def _schema_at(loc: Sequence[str | int]) -> Schema | None:
    node: Schema | None = _spec_schema()
    for part in loc:
        if node is None:
            return None
        if isinstance(part, int):
            node = node.get("items")
        elif part in node.get("properties", {}):
            node = node["properties"][part]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return None
    return node


def _format_loc(base: str, loc: Sequence[str | int]) -> str:
    """`spec.cluster.nodeSelector.gpu`, `spec.cluster.env[0].name`: the path the API server's
    OpenAPI validation names (k8s.io/kube-openapi pkg/validation/validate: a map entry is a child
    of the map, joined with a dot; a list index in brackets)."""
    text = base
    node: Schema | None = _spec_schema() if base == "spec" else None
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
            node = node.get("items") if node else None
        elif node is not None and part not in node.get("properties", {}) and isinstance(node.get("additionalProperties"), dict):
            text += f".{part}"
            node = node["additionalProperties"]
        else:
            text += f".{part}"
            node = node.get("properties", {}).get(part) if node else None
    return text


_LABEL_VALUE_TEXT = "a label value: at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
PATTERN_TEXT: dict[str, str] = {
    api.POSITIVE_QUANTITY_PATTERN: "must be a Kubernetes quantity greater than 0, e.g. 64Gi, 500Mi, 8 or 500m",
    api.QUANTITY_PATTERN: "must be a Kubernetes quantity, e.g. 64Gi, 500Mi or 8",
    api.NAME_PATTERN: "must be a DNS-1123 label: lowercase letters, digits and '-', starting and ending with a letter or digit",
    api.DNS_SUBDOMAIN_PATTERN: "must be a DNS-1123 subdomain: lowercase letters, digits, '-' and '.', starting and ending "
    "with a letter or digit",
    api.LABEL_VALUE_PATTERN: f"must be {_LABEL_VALUE_TEXT}",
    api.LABEL_KEY_PATTERN.replace("^(", "^$|^(", 1): "must be a label key: an optional DNS-subdomain prefix and '/', then "
    "at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit",
    api.LABEL_KEY_PATTERN: "must be a label key: an optional DNS-subdomain prefix and '/', then at most 63 letters, "
    "digits, '-', '_' or '.', starting and ending with a letter or digit, e.g. network.amazonaws.com/efa-block",
    api.NO_WHITESPACE_PATTERN: "must not contain spaces or other whitespace (an image reference such as "
    "ghcr.io/llamaft/trainer:0.1.0)",
    r"^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?:" + api.PORT_PATTERN + "$": "must be host:port with a port from 1 to "
    "65535, e.g. etcd.infra.svc:2379",
    r"^[-._a-zA-Z][-._a-zA-Z0-9]*$": "must be an environment variable name: letters, digits, '_', '-' or '.', not "
    "starting with a digit",
    r"^(NoSchedule|PreferNoSchedule|NoExecute)$": "must be one of NoSchedule, PreferNoSchedule, NoExecute",
    r"^(Equal|Exists)$": "must be Equal or Exists",
    r"^[-._a-zA-Z0-9]+$": "must be a Secret key: letters, digits, '-', '_' or '.'",
}


def _describe_error(err: Mapping[str, Any]) -> str:
    loc = list(err["loc"])
    kind = err["type"]
    given = err.get("input")
    if kind == "extra_forbidden":
        parent = _schema_at(loc[:-1]) or {}
        known = sorted(parent.get("properties", {}))
        name = str(loc[-1])
        camel = to_camel(name)
        if camel != name and camel in known:
            hint = f"did you mean {camel!r}? (field names are camelCase) "
        else:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
        return f"unknown field; {hint}known fields: {', '.join(known)}"
    if kind == "missing":
        field = _schema_at(loc) or {}
        what = field.get("description", "")
        return "required field is missing" + (f" ({what})" if what else "")
    if kind == "enum" or (kind == "is_instance_of" and "enum" in (_schema_at(loc) or {})):
        allowed = (_schema_at(loc) or {}).get("enum", [])
        return f"{short(given)} is not one of: {', '.join(map(str, allowed))}"
    if kind == "int_type":
        fix = ""
        if isinstance(given, str) and re.fullmatch(r"[-+]?[0-9]+", given.strip()):
            fix = f" (write {given.strip()} without quotes)"
        elif isinstance(given, float):
            fix = " (too large for an integer)" if given.is_integer() else " (a whole number)"
        return f"must be an integer, got {_describe_value(given)}{fix}"
    if kind == "bool_type":
        fix = ""
        if isinstance(given, str) and given.strip().lower() in ("true", "false"):
            fix = f" (write {given.strip().lower()} without quotes)"
        return f"must be true or false, got {_describe_value(given)}{fix}"
    if kind == "float_type":
        fix = ""
        if isinstance(given, str):
            try:
                float(given)
                fix = f" (write {given.strip()} without quotes)"
                if "e" in given.lower() and "." not in given:
                    fix = (f" (write {given.strip()} without quotes; YAML 1.1 readers such as PyYAML take an exponent "
                           "without a '.' for a string, e.g. write 2.0e-5 rather than 2e-5)")
            except ValueError:
                pass
        return f"must be a number, got {_describe_value(given)}{fix}"
    if kind == "string_type":
        fix = f" (quote it: '{str(given).lower()}')" if isinstance(given, bool | int | float) else ""
        return f"must be a string, got {_describe_value(given)}{fix}"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return f"must be a mapping (key: value), got {_describe_value(given)}"
    if kind == "list_type":
        return f"must be a list, got {_describe_value(given)}"
    if kind == "string_pattern_mismatch":
        pattern = str((err.get("ctx") or {}).get("pattern", ""))
        text = PATTERN_TEXT.get(pattern, f"must match the pattern {pattern}")
        return f"{text} (got {short(given)})"
    return f"{err['msg']} (got {short(given)})"


def _pydantic_errors(exc: ValidationError, base: str) -> list[FieldError]:
    return [
        FieldError(_format_loc(base, list(e["loc"])), _describe_error(e))
        for e in exc.errors(include_url=False)
    ]


# ------------------------------------------------------------------------------ metadata
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
OBJECT_META_FIELDS: dict[str, str] = {
    "name": "string", "generateName": "string", "namespace": "string", "selfLink": "string", "uid": "string",
    "resourceVersion": "string", "generation": "integer", "creationTimestamp": "string",
    "deletionTimestamp": "string", "deletionGracePeriodSeconds": "integer", "labels": "map",
    "annotations": "map", "ownerReferences": "list", "finalizers": "list", "managedFields": "list",
}


def label_key_problem(key: str) -> str | None:
    """Why `key` is not a label key (qualified name), or None."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not DNS1123_SUBDOMAIN.fullmatch(prefix)):
        return "its prefix (before '/') must be a DNS-1123 subdomain of at most 253 characters, e.g. example.com"
    if not name or len(name) > 63 or not _QUALIFIED_NAME.fullmatch(name):
        return ("its name must be at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter "
                "or digit")
    return None


def label_value_problem(value: str) -> str | None:
    if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
        return f"must be {_LABEL_VALUE_TEXT} (got {short(value)})"
    return None


def metadata_errors(metadata: Any) -> list[FieldError]:
    """What the API server rejects in ObjectMeta (a CR's metadata is checked as ObjectMeta)."""
    if not isinstance(metadata, Mapping):
        return [FieldError("metadata", f"must be a mapping with at least name, got {_describe_value(metadata)}")]
    errors: list[FieldError] = []
    for key, value in metadata.items():
        kind = OBJECT_META_FIELDS.get(key)
        where = f"metadata.{key}"
        if kind is None:
            close = difflib.get_close_matches(str(key), list(OBJECT_META_FIELDS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            errors.append(FieldError(where, f"unknown field; {hint}known fields: name, namespace, labels, annotations"))
        elif value is None:
            continue
        elif kind == "string" and not isinstance(value, str):
            errors.append(FieldError(where, f"must be a string, got {_describe_value(value)}"))
        elif kind == "integer" and (not isinstance(value, int) or isinstance(value, bool)):
            errors.append(FieldError(where, f"must be an integer, got {_describe_value(value)}"))
        elif kind == "list" and not isinstance(value, list):
            errors.append(FieldError(where, f"must be a list, got {_describe_value(value)}"))
        elif kind == "map" and not isinstance(value, Mapping):
            errors.append(FieldError(where, f"must be a mapping of strings, got {_describe_value(value)}"))
        elif kind == "map":
            errors.extend(_string_map_errors(where, value, labels=key == "labels"))
    namespace = metadata.get("namespace")
    # "" is no namespace: the API server takes the request's (kubectl's current namespace), as for an absent one.
    if isinstance(namespace, str) and namespace and (len(namespace) > 63 or not DNS1123_LABEL.fullmatch(namespace)):
        errors.append(FieldError("metadata.namespace", "must be a DNS-1123 label of at most 63 characters (lowercase "
                                 f"letters, digits and '-', starting and ending with a letter or digit), got {short(namespace)}"))
    finalizers = metadata.get("finalizers")
    if isinstance(finalizers, list):
        for index, item in enumerate(finalizers):
            if not isinstance(item, str) or label_key_problem(item):
                errors.append(FieldError(f"metadata.finalizers[{index}]", "must be a qualified name such as example.com/cleanup"))
    return errors


def _string_map_errors(where: str, value: Mapping[str, Any], labels: bool) -> list[FieldError]:
    errors: list[FieldError] = []
    total = 0
    for key, item in value.items():
        if item is not None and not isinstance(item, str):
            fix = f" (quote it: '{str(item).lower()}')" if isinstance(item, bool | int | float) else ""
            # The API server cannot decode it into ObjectMeta's map[string]string and names the map.
            errors.append(FieldError(where, f"{short(key)}: must be a string, got {_describe_value(item)}{fix}"))
            continue
        text = item or ""
        total += len(str(key)) + len(text)
        problem = label_key_problem(str(key))
        if problem:
            errors.append(FieldError(where, f"invalid key {short(key)}: {problem}"))
        if labels:
            bad = label_value_problem(text)
            if bad:
                # The API server names the map (apimachinery's ValidateLabels: metadata.labels), with the value.
                errors.append(FieldError(where, f"{short(key)}: {bad}"))
    if not labels and total > MAX_ANNOTATIONS_BYTES:
        errors.append(FieldError(where, f"annotations total {total} bytes; the API server accepts at most {MAX_ANNOTATIONS_BYTES}"))
    return errors


# ------------------------------------------------------------------------------ entry points
def _prepared(spec: Any, path: str) -> tuple[Any, list[FieldError]]:
    """The spec as the API server validates it: JSON values, nulls pruned."""
    value, errors = to_json(spec, path)
    if errors:
        return None, errors
    if not isinstance(value, dict):
        return None, [FieldError(path, f"must be a mapping, got {_describe_value(value)}")]
    return prune_nulls(value, _spec_schema()), []


def validate_spec(spec: Any, path: str = "spec", old: Any = None) -> LlamaFineTuneSpec:
    """Parse and validate a `.spec` mapping; raise SpecInvalid naming every bad field.
    `old`: the previous spec on an update, so immutable fields are enforced as the API server does."""
    value, errors = _prepared(spec, path)
    if errors:
        raise SpecInvalid(errors)
    try:
        parsed = LlamaFineTuneSpec.model_validate(value, strict=True)
    except ValidationError as exc:
        raise SpecInvalid(_pydantic_errors(exc, path)) from None
    old_defaulted = None
    if old is not None:
        old_value, old_errors = _prepared(old, path)
        try:
            old_defaulted = None if old_errors else LlamaFineTuneSpec.model_validate(old_value, strict=True).to_k8s()
        except ValidationError:
            old_defaulted = None  # an invalid previous spec cannot constrain the new one
    errors = cel_errors(_spec_schema(), parsed.to_k8s(), path, old_defaulted)
    if errors:
        raise SpecInvalid(errors)
    return parsed


def validate_resource(obj: Any) -> LlamaFineTuneSpec:
    """Validate a whole LlamaFineTune object (apiVersion, kind, metadata, spec)."""
    if not isinstance(obj, Mapping):
        raise SpecInvalid([FieldError("<document>", f"must be a LlamaFineTune mapping (apiVersion, kind, metadata, "
                                                    f"spec), got {_describe_value(obj)}")])
    errors: list[FieldError] = []
    if obj.get("apiVersion") != resource.API_VERSION:
        errors.append(FieldError("apiVersion", f"must be {resource.API_VERSION!r}, got {short(obj.get('apiVersion'))}"))
    if obj.get("kind") != resource.KIND:
        errors.append(FieldError("kind", f"must be {resource.KIND!r}, got {short(obj.get('kind'))}"))
    metadata = obj.get("metadata")
    if not isinstance(metadata, Mapping) or not isinstance(metadata.get("name"), str):
        errors.append(FieldError("metadata.name", "required: name the fine-tune, e.g. llama2-7b-samsum"))
    else:
        errors.extend(_rule_errors([NAME_RULE], {"metadata": {"name": metadata["name"]}}, ""))
    if metadata is not None:
        errors.extend(e for e in metadata_errors(metadata) if e.path != "metadata.name")
    unknown = sorted(str(k) for k in set(obj) - {"apiVersion", "kind", "metadata", "spec", "status"})
    for key in unknown:
        errors.append(FieldError(key, "unknown top-level field; known: apiVersion, kind, metadata, spec"))
    if obj.get("spec") is None:
        errors.append(FieldError("spec", "required: a LlamaFineTune needs at least spec.model and spec.dataset"))
        raise SpecInvalid(errors)
    try:
        parsed = validate_spec(obj["spec"])
    except SpecInvalid as exc:
        errors.extend(exc.errors)
    if errors:
        raise SpecInvalid(errors)
    return parsed
