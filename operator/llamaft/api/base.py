"""Base class and helpers shared by every API model.

Kubernetes objects are camelCase; Python code is snake_case. Every model uses camelCase aliases,
forbids unknown fields (a typo must be an error, never silently dropped) and takes its field
descriptions from attribute docstrings, so the CRD's `kubectl explain` text lives beside the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


def cel_rule(
    rule: str,
    *,
    message: str | None = None,
    message_expression: str | None = None,
    field_path: str | None = None,
    reason: str = "FieldValueInvalid",
) -> dict[str, Any]:
    """One `x-kubernetes-validations` entry.

    The same entry is put in the CRD (evaluated by the API server) and evaluated by
    `llamaft validate` and the operator, so the cluster and the CLI always agree.
    """
    entry: dict[str, Any] = {"rule": rule, "reason": reason}
    if message is not None:
        entry["message"] = message
    if message_expression is not None:
        entry["messageExpression"] = message_expression
    if field_path is not None:
        entry["fieldPath"] = field_path
    return entry


def api_config(*rules: dict[str, Any]) -> ConfigDict:
    """The model config every API model uses, with its CEL rules attached to its schema."""
    extra: dict[str, Any] = {"x-kubernetes-validations": list(rules)} if rules else {}
    return ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        json_schema_extra=extra or None,
    )


class ApiModel(BaseModel):
    """Base of every spec/status model: camelCase, strict about unknown fields."""

    model_config = api_config()

    def to_k8s(self) -> dict[str, Any]:
        """The object as it appears in Kubernetes: camelCase keys, unset optionals omitted."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
