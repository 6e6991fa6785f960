"""Which spec edits are changes at all, compared on the defaulted spec (pure)."""

from __future__ import annotations

from llamaft.api.validation import validate_spec
from llamaft.operator.spec_changes import IN_PLACE_FIELDS, changed_fields

from tests.operator.conftest import tiny_spec


def test_explicit_defaults_are_no_change() -> None:
    old = tiny_spec()
    new = validate_spec(tiny_spec(fsdp={"shardingStrategy": "FULL_SHARD", "mixedPrecision": "bf16"}))
    assert changed_fields(old, new) == set()


def test_suspend_added_to_a_spec_without_run_policy_is_one_leaf() -> None:
    assert changed_fields(tiny_spec(), validate_spec(tiny_spec(runPolicy={"suspend": True}))) == {("runPolicy", "suspend")}
    assert {("runPolicy", "suspend")} <= IN_PLACE_FIELDS


def test_other_edits_name_their_fields() -> None:
    new = validate_spec(tiny_spec(training={"epochs": 1, "learningRate": 1e-4}))
    assert changed_fields(tiny_spec(), new) == {("training", "learningRate")}
