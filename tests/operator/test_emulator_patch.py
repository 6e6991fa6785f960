"""The emulator's merge patch is RFC 7386's: the RFC's own examples (Appendix A), row by row, and
a JSON patch (RFC 6902) for the list form."""

from __future__ import annotations

from typing import Any

import kmock
import pytest

from tests.operator.emulator import merge_patch, patched

RFC_7386_APPENDIX_A = [
    ({"a": "b"}, {"a": "c"}, {"a": "c"}),
    ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
    ({"a": "b"}, {"a": None}, {}),
    ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
    ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
    ({"a": "c"}, {"a": ["b"]}, {"a": ["b"]}),
    ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
    ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
    (["a", "b"], ["c", "d"], ["c", "d"]),
    ({"a": "b"}, ["c"], ["c"]),
    ({"a": "foo"}, None, None),
    ({"a": "foo"}, "bar", "bar"),
    ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
    ([1, 2], {"a": "b", "c": None}, {"a": "b"}),
    ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
]


@pytest.mark.parametrize(("target", "patch", "result"), RFC_7386_APPENDIX_A)
def test_merge_patch_is_rfc_7386(target: Any, patch: Any, result: Any) -> None:
    before = repr(target)
    assert merge_patch(target, patch) == result
    assert repr(target) == before, "the stored object is not changed in place"


def test_a_merge_patch_keeps_the_key_order_and_a_json_patch_applies() -> None:
    stored = {"metadata": {"name": "x", "labels": {"a": "1"}}, "spec": {"replicas": 1}}
    assert list(patched(stored, {"status": {"phase": "Running"}, "metadata": {"labels": {"b": "2"}}})) == ["metadata", "spec", "status"]
    assert patched(stored, [{"op": "replace", "path": "/spec/replicas", "value": 3}])["spec"] == {"replicas": 3}
    assert stored["spec"] == {"replicas": 1}
    with pytest.raises(kmock.KubernetesError):
        patched(stored, "not a patch")
