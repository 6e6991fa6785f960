"""spec.fsdp.float8: its CEL refusals name the field and the fix; the valid combinations pass."""

from __future__ import annotations

from typing import Any

import pytest
from llamaft.api.spec import Float8Recipe
from llamaft.api.validation import SpecInvalid, validate_resource

from tests.api.test_validation import base


def _fsdp(fsdp: dict[str, Any]) -> dict[str, Any]:
    obj = base()
    obj["spec"]["fsdp"] = fsdp
    return obj


@pytest.mark.parametrize(
    ("fsdp", "path", "words"),
    [
        ({"float8": {"enabled": True, "recipe": "rowwise"}}, "spec.fsdp.float8.allGather", "tensorwise"),
        ({"implementation": "fsdp1", "float8": {"enabled": True}}, "spec.fsdp.float8.enabled", "fsdp2"),
        ({"mixedPrecision": "fp16", "float8": {"enabled": True}}, "spec.fsdp.float8.enabled", "mixedPrecision"),
        ({"float8": {"enabled": True, "recipe": "blockwise"}}, "spec.fsdp.float8.recipe", "tensorwise"),
    ],
    ids=["rowwise-allGather", "fsdp1", "fp16", "unknown-recipe"],
)
def test_float8_refusals_name_the_field(fsdp: dict[str, Any], path: str, words: str) -> None:
    with pytest.raises(SpecInvalid) as info:
        validate_resource(_fsdp(fsdp))
    matching = [e for e in info.value.errors if e.path == path]
    assert matching, f"no error at {path}: {info.value}"
    assert any(words in e.message for e in matching), [e.message for e in matching]


@pytest.mark.parametrize(
    "fsdp",
    [
        {"float8": {"enabled": True}},
        {"float8": {"enabled": True, "recipe": "rowwise", "allGather": False}},
        {"float8": {"enabled": True, "allGather": False}, "mixedPrecision": "fp32"},
        {"float8": {"enabled": True}, "mixedPrecision": "pure-bf16"},
        # Off: the other settings do not matter.
        {"float8": {"recipe": "rowwise"}, "implementation": "fsdp1", "mixedPrecision": "fp16"},
    ],
)
def test_float8_valid_combinations(fsdp: dict[str, Any]) -> None:
    spec = validate_resource(_fsdp(fsdp))
    assert spec.fsdp.float8.enabled is bool(fsdp["float8"].get("enabled"))


def test_float8_defaults() -> None:
    f8 = validate_resource(base()).fsdp.float8
    assert (f8.enabled, f8.recipe, f8.all_gather) == (False, Float8Recipe.TENSORWISE, True)
