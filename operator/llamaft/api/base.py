"""Base class and helpers shared by every API model.

Kubernetes objects are camelCase; Python code is snake_case. Every model uses camelCase aliases,
forbids unknown fields (a typo must be an error, never silently dropped) and takes its field
descriptions from attribute docstrings, so the CRD's `kubectl explain` text lives beside the field.

Input is read by the camelCase name only (`model_validate` defaults to `by_name=False`):
`cpu_offload` is an unknown field, as it is for the API server; Python code may still construct
models with snake_case keywords. The verdict on user input (`llamaft.api.validation.validate_spec`,
used by the CLI and the operator) validates with `strict=True`: types exactly as the CRD's
structural schema has them (an integer field takes integers, never `"2"` or `true`; a boolean
takes true/false, never `"true"` or `1`), enumerations their string values (`ApiEnum`). Direct
`model_validate` calls stay lax for what llamaft itself wrote: the trainer reads the operator's
JSON config with a YAML 1.1 parser, which reads `2e-05` as a string.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Self, cast

from pydantic import BaseModel, ConfigDict, GetCoreSchemaHandler
from pydantic.alias_generators import to_camel
from pydantic.config import ExtraValues
from pydantic_core import core_schema


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


def api_config(*rules: dict[str, Any], strict: bool = False) -> ConfigDict:
    """The model config every API model uses, with its CEL rules attached to its schema."""
    extra: dict[str, Any] = {"x-kubernetes-validations": list(rules)} if rules else {}
    return ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,  # Python keywords; input goes through model_validate(by_name=False)
        validate_by_alias=True,
        extra="forbid",
        strict=strict,
        use_attribute_docstrings=True,
        validate_default=True,
        json_schema_extra=extra or None,
    )


class ApiEnum(StrEnum):
    """A string enumeration of the API: input is its value (a string, as in the CRD's `enum`),
    also under strict validation; it serialises as the plain string in every dump mode."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        schema: Any = handler(source)
        schema["serialization"] = core_schema.plain_serializer_function_ser_schema(
            _enum_value, return_schema=core_schema.str_schema()
        )
        members = {str(m.value): m for m in cls}

        def member(value: Any) -> Any:
            # Strict validation takes only members: a string equal to a member's value is that
            # member; anything else (1, b'x', 'other') is left for the enum validator to refuse.
            return members.get(value, value) if type(value) is str else value

        return core_schema.no_info_before_validator_function(member, cast(core_schema.CoreSchema, schema))


def _enum_value(value: Any) -> str:
    return str(value.value) if isinstance(value, StrEnum) else str(value)


class ApiModel(BaseModel):
    """Base of every spec/status model: camelCase, strict about unknown fields and types."""

    model_config = api_config()

    @classmethod
    def model_validate(
        cls,
        obj: Any,
        *,
        strict: bool | None = None,
        extra: ExtraValues | None = None,
        from_attributes: bool | None = None,
        context: Any | None = None,
        by_alias: bool | None = None,
        by_name: bool | None = None,
    ) -> Self:
        """Validate input: camelCase names only, unless `by_name=True` is asked for."""
        return super().model_validate(
            obj, strict=strict, extra=extra, from_attributes=from_attributes, context=context,
            by_alias=by_alias, by_name=False if by_name is None else by_name,
        )

    @classmethod
    def model_validate_json(
        cls,
        json_data: str | bytes | bytearray,
        *,
        strict: bool | None = None,
        extra: ExtraValues | None = None,
        context: Any | None = None,
        by_alias: bool | None = None,
        by_name: bool | None = None,
    ) -> Self:
        """As model_validate: camelCase names only unless asked otherwise."""
        return super().model_validate_json(
            json_data, strict=strict, extra=extra, context=context,
            by_alias=by_alias, by_name=False if by_name is None else by_name,
        )

    def to_k8s(self) -> dict[str, Any]:
        """The object as it appears in Kubernetes: camelCase keys, unset optionals omitted.

        Dumped in Python mode (enumerations are plain strings, see ApiEnum): JSON mode would stop
        at pydantic's serialisation depth limit (254) inside free-form fields such as
        podTemplateOverrides, which the API server stores up to its own nesting limit."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="python")
