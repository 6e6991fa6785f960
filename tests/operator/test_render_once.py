"""Children rendered once per generation (issue 24): the validation of a generation renders the
children with the operator's settings and checks those objects, and the generation's first apply
applies exactly them (adopted by the LlamaFineTune). Pure: a Step with a recording client."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from llamaft.api.validation import SpecInvalid
from llamaft.operator import specs
from llamaft.operator.children import adopted
from llamaft.operator.settings import OperatorSettings
from llamaft.operator.state import new_memo, object_state
from llamaft.operator.step import Step
from llamaft.render import admission, objects
from llamaft.render.naming import Owner

from tests.operator.conftest import tiny_spec
from tests.operator.test_operator_scale import RecordingKube

UID = "1234abcd-0000-0000-0000-000000000000"


def finetune(generation: int = 1, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune",
            "metadata": {"name": "x", "namespace": "default", "uid": UID, "generation": generation},
            "spec": tiny_spec(**spec), "status": {}}


def step_with(settings: OperatorSettings | None = None) -> tuple[Step, RecordingKube]:
    kube = RecordingKube()
    memo: Any = new_memo(settings or OperatorSettings(), kube=kube)
    step = Step(memo, "default", "x", logger=None)
    step.event = lambda *_: None  # type: ignore[method-assign]
    step.children_index = {}
    return step, kube


@pytest.fixture
def renders(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every call of objects.children (the operator's and the checker's render of the children)."""
    calls: list[Any] = []
    real = objects.children
    monkeypatch.setattr(objects, "children", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def test_one_render_per_generation_and_the_checked_objects_are_applied(renders: list[Any],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[list[Any]] = []
    real_check = admission._check
    monkeypatch.setattr(admission, "_check", lambda spec, render: checked.append(copy.deepcopy(render.children))
                        or real_check(spec, render))
    step, kube = step_with()
    obj = finetune()
    spec = specs.validated(step.memo, obj)
    assert not isinstance(spec, SpecInvalid)
    step._reconcile_children(obj, Owner("x", "default", UID), spec, {}, force=True)
    assert len(renders) == 1, "validated rendered the children; the apply used them"
    applied = [args[0] for name, args in kube.calls if name == "apply"]
    assert checked and applied == [adopted(child, obj) for child in checked[0]], \
        "the objects applied are the ones checked, owned by the LlamaFineTune"
    assert {o["kind"] for o in applied} >= {"ConfigMap", "PodMonitor", "PrometheusRule"}
    assert object_state(step.memo).rendered is None, "handed over once: the memo does not keep the objects"

    # The next step of the same generation renders nothing; a new generation renders once more.
    specs.validated(step.memo, obj)
    step._reconcile_children(obj, Owner("x", "default", UID), spec, {})
    assert len(renders) == 1
    newer = finetune(2, cluster={"workers": 4})
    spec = specs.validated(step.memo, newer)
    assert not isinstance(spec, SpecInvalid)
    step._reconcile_children(newer, Owner("x", "default", UID), spec, {})
    assert len(renders) == 2


def test_the_operators_settings_are_in_the_checked_objects(renders: list[Any]) -> None:
    """The dashboard labels of the operator's settings are checked, because the checked objects are
    the applied ones (before, the check rendered without them)."""
    step, _ = step_with(OperatorSettings(dashboard_labels=(("grafana_dashboard", "not a label value!"),)))
    result = specs.validated(step.memo, finetune())
    assert isinstance(result, SpecInvalid) and "not a label value!" in str(result), result
    assert object_state(step.memo).rendered is None, "nothing to apply from a generation that failed its check"


def test_objects_of_one_template_are_checked_once(renders: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-template sharing of child_errors, for the operator's check: a second LlamaFineTune of
    the same spec (and name length) reuses the first one's clean verdict; its own name is still
    checked, and its own objects are the ones handed to the apply."""
    checks: list[str] = []
    real_check = admission._check
    monkeypatch.setattr(admission, "_check", lambda spec, render: checks.append(render.children[0]["metadata"]["name"])
                        or real_check(spec, render))
    spec = specs.cached_spec(new_memo(OperatorSettings()), tiny_spec())
    assert not isinstance(spec, SpecInvalid)
    cache = admission.CheckCache()
    first = admission.checked_children(Owner("run-a", "team", UID), spec, cache=cache)
    second = admission.checked_children(Owner("run-b", "team", "5678abcd-0000-0000-0000-000000000000"), spec, cache=cache)
    assert first.errors == second.errors == [] and checks == ["run-a-config"]
    assert second.children[0]["metadata"]["name"] == "run-b-config"
    admission.checked_children(Owner("run-c", "team", UID), spec)
    assert checks == ["run-a-config", "run-c-config"], "without a cache every call checks in full"
    too_long = admission.checked_children(Owner("r" * 60, "team", UID), spec, cache=cache)
    assert too_long.errors and too_long.errors[0].path == "metadata.name"


def test_the_config_texts_are_made_once_per_spec_content(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config map's indented JSON texts (the render's costliest part) are kept per spec
    content by the operator's check cache: fine-tunes of one template share them, and each gets
    the same config map an uncached render makes."""
    from llamaft.api.validation import validate_spec
    from llamaft.render import desired

    made: list[Any] = []
    real = desired.config_texts
    monkeypatch.setattr(desired, "config_texts", lambda spec: made.append(spec) or real(spec))
    cache = admission.CheckCache()
    spec = validate_spec(tiny_spec())
    for name in ("a", "b", "c"):
        owner = Owner(name, "default", UID)
        checked = admission.checked_children(owner, spec, cache=cache)
        assert not checked.errors
        config = next(c for c in checked.children if c["metadata"]["name"] == owner.config_map)
        assert config == desired.config_map(owner, spec)
    assert len(made) == 1 + 3, "once through the cache, then once per uncached render in the comparison"
    other = validate_spec(tiny_spec(cluster={"workers": 4}))
    admission.checked_children(Owner("d", "default", UID), other, cache=cache)
    assert len(made) == 5 and made[-1] is other, "another spec content: its own texts"
    uncached = admission.checked_children(Owner("e", "default", UID), spec)
    assert len(made) == 6, "without a cache every render makes them"
    assert not uncached.errors
