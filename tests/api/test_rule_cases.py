"""Every CEL rule of the CRD is broken by at least one case of the tables (BROKEN, the error
table's ADMISSION and RULE_CASES; transition rules by TRANSITIONS), and llamaft refuses each case naming the field:
the real API server's verdicts on the same cases are compared in tests/controlplane/test_verdicts.py."""

from __future__ import annotations

from typing import Any

import pytest
from llamaft.api import crd as crdgen
from llamaft.api.validation import SpecInvalid, validate_resource, validate_spec

from tests.api.rule_cases import RULE_CASES, TRANSITIONS
from tests.api.test_validation import BROKEN
from tests.validation.test_error_messages import ADMISSION


def crd_rules() -> list[dict[str, Any]]:
    """Every x-kubernetes-validations entry of the CRD's schema."""
    found: list[dict[str, Any]] = []

    def walk(node: dict[str, Any]) -> None:
        found.extend(node.get("x-kubernetes-validations", []))
        for child in (node.get("properties") or {}).values():
            walk(child)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key])

    walk(crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    return found


def _messages(obj: dict[str, Any]) -> list[str]:
    try:
        validate_resource(obj)
    except SpecInvalid as exc:
        return [str(e) for e in exc.errors]
    return []


@pytest.mark.parametrize(("obj", "path", "words"), [c[1:] for c in RULE_CASES], ids=[c[0] for c in RULE_CASES])
def test_each_rule_case_is_refused_naming_the_field(obj: dict[str, Any], path: str, words: str) -> None:
    messages = _messages(obj)
    assert any(m.startswith(f"{path}: ") and words in m for m in messages), messages


@pytest.mark.parametrize(("old", "new", "path", "words"), [c[1:] for c in TRANSITIONS], ids=[c[0] for c in TRANSITIONS])
def test_each_transition_is_refused_on_update_only(old: dict[str, Any], new: dict[str, Any], path: str, words: str) -> None:
    validate_resource(new)  # as a new object it is fine
    with pytest.raises(SpecInvalid) as info:
        validate_spec(new["spec"], old=old["spec"])
    assert any(e.path == path and words in e.message for e in info.value.errors), info.value.errors


def test_every_rule_is_broken_by_a_case() -> None:
    messages = [m for case in [*BROKEN, *ADMISSION, *RULE_CASES] for m in _messages(case[1])]
    transitions = [str(e) for _, old, new, *_ in TRANSITIONS for e in _update_errors(old, new)]
    unbroken = []
    for rule in crd_rules():
        text = rule.get("message") or max(rule["messageExpression"].split("'")[1::2], key=len)
        pool = transitions if "oldSelf" in rule["rule"] else messages
        if not any(text in m for m in pool):
            unbroken.append(rule["rule"])
    assert not unbroken, "no case breaks these rules: add one to tests/api/rule_cases.py\n" + "\n".join(unbroken)


def _update_errors(old: dict[str, Any], new: dict[str, Any]) -> list[Any]:
    try:
        validate_spec(new["spec"], old=old["spec"])
    except SpecInvalid as exc:
        return list(exc.errors)
    return []
