"""Validate a LlamaFineTune the way the API server does, with messages that name the field.

Two layers, both derived from the one API model:
1. pydantic (types, enums, bounds, required and unknown fields), errors rewritten to say which
   field and what to do;
2. the CEL rules (`x-kubernetes-validations`) of the generated CRD schema, evaluated with
   cel-python on the defaulted object, exactly as the API server evaluates them after defaulting.
`llamaft validate`, `llamaft render`, `llamaft run --local` and the operator all call this.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import celpy
from celpy.adapter import json_to_cel
from pydantic import ValidationError

from llamaft.api import resource
from llamaft.api.crd import NAME_RULE, spec_schema
from llamaft.api.spec import LlamaFineTuneSpec

Schema = dict[str, Any]


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


# ---------------------------------------------------------------------------- CEL evaluation
@functools.lru_cache(maxsize=1)
def _environment() -> celpy.Environment:
    return celpy.Environment()


@functools.lru_cache(maxsize=256)
def _program(expression: str) -> Any:
    env = _environment()
    return env.program(env.compile(expression))


def _evaluate(expression: str, value: Any, old: Any = None) -> Any:
    activation = {"self": json_to_cel(value)}
    if old is not None:
        activation["oldSelf"] = json_to_cel(old)
    return _program(expression).evaluate(activation)


def is_transition_rule(rule: Mapping[str, Any]) -> bool:
    """Rules that compare with the previous object run only on updates, as in the API server."""
    return "oldSelf" in str(rule["rule"])


def _rule_errors(
    rules: Sequence[Mapping[str, Any]], value: Any, path: str, old: Any = None
) -> Iterator[FieldError]:
    for rule in rules:
        if is_transition_rule(rule) and old is None:
            continue
        try:
            ok = bool(_evaluate(rule["rule"], value, old if is_transition_rule(rule) else None))
        except Exception as exc:  # a rule that cannot evaluate is a failed rule, as in the API server
            yield FieldError(path, f"rule {rule['rule']!r} could not be evaluated: {exc}")
            continue
        if ok:
            continue
        if "messageExpression" in rule:
            message = str(_evaluate(rule["messageExpression"], value))
        else:
            message = str(rule.get("message") or f"failed rule: {rule['rule']}")
        yield FieldError(path + str(rule.get("fieldPath", "")), message)


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
        else:
            node = node.get("properties", {}).get(part)
    return node


def _format_loc(base: str, loc: Sequence[str | int]) -> str:
    text = base
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def _describe_error(err: Mapping[str, Any]) -> str:
    loc = [p for p in err["loc"]]
    kind = err["type"]
    given = err.get("input")
    if kind == "extra_forbidden":
        parent = _schema_at(loc[:-1]) or {}
        known = sorted(parent.get("properties", {}))
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return f"unknown field; {hint}known fields: {', '.join(known)}"
    if kind == "missing":
        field = _schema_at(loc) or {}
        what = field.get("description", "")
        return "required field is missing" + (f" ({what})" if what else "")
    if kind == "enum":
        allowed = (_schema_at(loc) or {}).get("enum", [])
        return f"{given!r} is not one of: {', '.join(map(str, allowed))}"
    return f"{err['msg']} (got {given!r})"


def _pydantic_errors(exc: ValidationError, base: str) -> list[FieldError]:
    return [
        FieldError(_format_loc(base, list(e["loc"])), _describe_error(e))
        for e in exc.errors(include_url=False)
    ]


# ------------------------------------------------------------------------------ entry points
def validate_spec(spec: Any, path: str = "spec", old: Any = None) -> LlamaFineTuneSpec:
    """Parse and validate a `.spec` mapping; raise SpecInvalid naming every bad field.
    `old`: the previous spec on an update, so immutable fields are enforced as the API server does."""
    if not isinstance(spec, Mapping):
        raise SpecInvalid([FieldError(path, f"must be a mapping, got {type(spec).__name__}")])
    try:
        parsed = LlamaFineTuneSpec.model_validate(spec)
    except ValidationError as exc:
        raise SpecInvalid(_pydantic_errors(exc, path)) from None
    old_defaulted = None
    if old is not None:
        try:
            old_defaulted = LlamaFineTuneSpec.model_validate(old).to_k8s()
        except ValidationError:
            old_defaulted = None  # an invalid previous spec cannot constrain the new one
    errors = cel_errors(_spec_schema(), parsed.to_k8s(), path, old_defaulted)
    if errors:
        raise SpecInvalid(errors)
    return parsed


def validate_resource(obj: Any) -> LlamaFineTuneSpec:
    """Validate a whole LlamaFineTune object (apiVersion, kind, metadata.name, spec)."""
    if not isinstance(obj, Mapping):
        raise SpecInvalid([FieldError("<document>", "must be a LlamaFineTune mapping")])
    errors: list[FieldError] = []
    if obj.get("apiVersion") != resource.API_VERSION:
        errors.append(FieldError("apiVersion", f"must be {resource.API_VERSION!r}, got {obj.get('apiVersion')!r}"))
    if obj.get("kind") != resource.KIND:
        errors.append(FieldError("kind", f"must be {resource.KIND!r}, got {obj.get('kind')!r}"))
    metadata = obj.get("metadata")
    if not isinstance(metadata, Mapping) or not isinstance(metadata.get("name"), str):
        errors.append(FieldError("metadata.name", "required: name the fine-tune, e.g. llama2-7b-samsum"))
    else:
        errors.extend(_rule_errors([NAME_RULE], {"metadata": {"name": metadata["name"]}}, "metadata.name"))
    unknown = sorted(set(obj) - {"apiVersion", "kind", "metadata", "spec", "status"})
    for key in unknown:
        errors.append(FieldError(key, "unknown top-level field; known: apiVersion, kind, metadata, spec"))
    if "spec" not in obj:
        errors.append(FieldError("spec", "required: a LlamaFineTune needs at least spec.model and spec.dataset"))
        raise SpecInvalid(errors)
    try:
        parsed = validate_spec(obj["spec"])
    except SpecInvalid as exc:
        errors.extend(exc.errors)
    if errors:
        raise SpecInvalid(errors)
    return parsed
