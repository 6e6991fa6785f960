"""render.admission.child_errors (through test_error_messages.check_children): every rendered child of every example passes the Kubernetes
schemas, the Kubeflow and Prometheus Operator CRDs and the pod rules; derived names fit; what the
operator and the trainer read still parses under strict types; the rules are portable CEL."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import pytest
import yaml
from llamaft.api.resource import MAX_ATTEMPTS, MAX_NAME_LENGTH
from llamaft.api.spec import LlamaFineTuneSpec, TrainingJobConfig
from llamaft.api.validation import validate_resource, validate_spec
from llamaft.render import admission, desired, objects
from llamaft.render.admission import PLACEHOLDER_UID, child_errors
from llamaft.render.naming import Owner
from llamaft.render.schemas import schema_errors

from tests.conftest import EXAMPLES, REFERENCE, REPO
from tests.validation import apiserver_model
from tests.validation.test_error_messages import ADMISSION, RENDERED, base, check_children, with_

EXAMPLE_DOCS = {p.name: yaml.safe_load(p.read_text(encoding="utf-8")) for p in EXAMPLES}


@pytest.mark.parametrize("name", sorted(EXAMPLE_DOCS))
def test_every_example_renders_children_the_cluster_accepts(name: str) -> None:
    body = EXAMPLE_DOCS[name]
    spec = validate_resource(body)
    assert check_children(spec, body["metadata"]["name"], "team-a") == []
    for attempt in (1, MAX_ATTEMPTS):
        assert child_errors(spec, body["metadata"]["name"], "team-a", uid="0f5e1c2a-1111", attempt=attempt) == []


def test_the_longest_name_fits_everywhere() -> None:
    """A 42-character name, 4096 elastic workers, the last attempt: every derived name and label fits."""
    name = "a" * MAX_NAME_LENGTH
    obj = with_(("metadata.name", name), ("spec.cluster", {"workers": 8, "gpusPerWorker": 8,
                                                           "elastic": {"minWorkers": 1, "maxWorkers": 4096}}))
    spec = validate_resource(obj)
    namespace = "n" * 63
    assert child_errors(spec, name, namespace, attempt=MAX_ATTEMPTS) == []
    owner = Owner(name, namespace, PLACEHOLDER_UID)
    for child in objects.desired_objects(owner, spec, MAX_ATTEMPTS):
        assert len(child["metadata"]["name"]) <= 63
        assert all(len(v) <= 63 for v in child["metadata"]["labels"].values())
    assert len(f"{owner.job_name(MAX_ATTEMPTS)}-worker-4095") == 63


def test_a_name_that_cannot_fit_is_refused_with_the_longest_allowed() -> None:
    spec = validate_resource(with_(("spec.cluster", {"workers": 4096, "gpusPerWorker": 8})))
    errors = check_children(spec, "a" * 43, "default")
    assert errors[0] == (
        "metadata.name: the training operator names a worker's Service "
        f"'{'a' * 43}-ffff-999-worker-4095' (64 characters; a Service name is a DNS-1035 label of at most 63): use a "
        "name of at most 42 characters"
    )


def test_check_children_is_cheap() -> None:
    spec = validate_resource(EXAMPLE_DOCS["llama2-70b.yaml"])
    check_children(spec, "llama2-70b-samsum", "default")  # loads the schemas once
    start = time.perf_counter()
    for _ in range(10):
        check_children(spec, "llama2-70b-samsum", "default")  # no cache: the full check each time
    assert (time.perf_counter() - start) / 10 < 0.2


def test_one_template_is_checked_once_and_names_are_checked_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """LlamaFineTunes made from one template share the objects' check (the operator validates every
    new object's children); each one's name is still checked, and a name that does not fit gets
    the full check (nothing cached for it)."""
    bad = validate_resource(with_(("spec.cluster.podTemplateOverrides", {"spec": {"hostNetwrok": True}})))
    calls: list[str] = []
    real = admission._object_errors
    monkeypatch.setattr(admission, "_object_errors", lambda spec, name, *a: calls.append(name) or real(spec, name, *a))
    cache = admission.CheckCache()
    first = [str(e) for e in child_errors(bad, "run-a", "team-a", uid="uid-a", cache=cache)]
    assert any("hostNetwrok: unknown field (in the PyTorchJob run-a-" in e for e in first), first
    assert [str(e) for e in child_errors(bad, "run-a", "team-a", uid="uid-a")] == first, "the same, cached or not"
    calls.clear()
    second = [str(e) for e in child_errors(bad, "run-b", "team-a", uid="uid-b", cache=cache)]
    assert second == [e.replace("run-a", "run-b") for e in first], "the messages name this object's children"
    assert calls == [], "the second object of the template reuses the first one's check"
    assert [str(e) for e in child_errors(bad, "run-b", "team-b", cache=cache)] != [] and len(calls) == 1, \
        "another namespace: another check"
    assert child_errors(bad, "run-bb", "team-a", cache=cache) and len(calls) == 2, "another name length: another check"
    too_long = "a" * 60
    errors = [str(e) for e in child_errors(bad, too_long, "team-a", cache=cache)]
    assert errors[0].startswith("metadata.name:") and any("hostNetwrok" in e for e in errors)
    assert calls[-1] == too_long and len(cache) == 3, "a name that does not fit is checked in full, uncached"
    assert admission._stand_in(5) == "zq9q9" and len(admission._stand_in(42)) == 42
    good = validate_resource(with_())
    assert child_errors(good, "run-a", "team-a") == [] and child_errors(good, "run-c", "team-a") == []


# ------------------------------------------------------------------ the schemas catch broken children
def _objects() -> dict[str, dict[str, Any]]:
    spec = validate_resource(EXAMPLE_DOCS["llama2-7b.yaml"])
    return {o["kind"] + ("-dash" if o["metadata"]["name"].endswith("dashboard") else ""): o
            for o in objects.desired_objects(Owner("x", "ns", PLACEHOLDER_UID), spec, 1)}


@pytest.mark.parametrize(("kind", "path", "value", "expected"), [
    ("ConfigMap", ("data",), {"k": 1}, (("data", "k"), "must be of type string, got 1")),
    ("Service", ("spec", "ports", 0, "port"), "2379", (("spec", "ports", 0, "port"), "must be of type integer, got '2379'")),
    ("Deployment", ("spec", "replicas"), "1", (("spec", "replicas"), "must be of type integer, got '1'")),
    ("Deployment", ("spec", "strategy", "kind"), "x", (("spec", "strategy", "kind"), "unknown field")),
    ("PodMonitor", ("spec", "podMetricsEndpoints", 0, "portz"), "x", (("spec", "podMetricsEndpoints", 0, "portz"), "unknown field")),
    ("PrometheusRule", ("spec", "groups", 0, "rules", 0, "for"), 5, (("spec", "groups", 0, "rules", 0, "for"), "must be of type string, got 5")),
    ("PyTorchJob", ("spec", "runPolicy", "ttlSecondsAfterFinished"), 2**31,
     (("spec", "runPolicy", "ttlSecondsAfterFinished"), "must be a int32 integer, got 2147483648")),
])
def test_schema_errors_catch_what_the_cluster_rejects(kind: str, path: tuple[Any, ...], value: Any,
                                                      expected: tuple[tuple[Any, ...], str]) -> None:
    obj = copy.deepcopy(_objects()[kind])
    node: Any = obj
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    assert expected in schema_errors(obj)
    assert schema_errors(_objects()[kind]) == []


def test_assets_are_the_vendored_upstream_crds() -> None:
    """The operator image carries copies of the fixtures as package data: they must not drift."""
    assets = REPO / "operator" / "llamaft" / "assets"
    pairs = {
        "kubeflow.org_pytorchjobs.yaml": REFERENCE / "kubeflow" / "kubeflow.org_pytorchjobs.yaml",
        "monitoring.coreos.com_podmonitors.yaml": REFERENCE / "prometheus-operator" / "monitoring.coreos.com_podmonitors.yaml",
        "monitoring.coreos.com_prometheusrules.yaml": REFERENCE / "prometheus-operator" / "monitoring.coreos.com_prometheusrules.yaml",
    }
    for asset, fixture in pairs.items():
        assert (assets / asset).read_bytes() == fixture.read_bytes(), asset


# ------------------------------------------------------ what the operator and the trainer read
@pytest.mark.parametrize("name", sorted(EXAMPLE_DOCS))
def test_the_operator_parses_what_the_api_server_stored(name: str) -> None:
    """The operator reads the CR after the API server pruned and defaulted it (JSON from the watch)."""
    body = EXAMPLE_DOCS[name]
    stored = json.loads(json.dumps(apiserver_model.kubectl_json(body)))
    schema = apiserver_model.crd_schema()
    apiserver_model.prune_nulls(stored, schema)
    apiserver_model.apply_defaults(stored, schema)
    expected = validate_resource(body)
    assert validate_spec(stored["spec"]) == expected
    assert LlamaFineTuneSpec.model_validate(stored["spec"]) == expected
    assert validate_spec(stored["spec"], old=stored["spec"]) == expected


@pytest.mark.parametrize("name", sorted(EXAMPLE_DOCS))
def test_the_trainer_parses_the_config_map(name: str) -> None:
    """The trainer reads the ConfigMap's JSON (written with to_k8s) with yaml.safe_load, strictly."""
    spec = validate_resource(EXAMPLE_DOCS[name])
    text = desired.config_map(Owner("x", "ns"), spec)["data"]["config.json"]
    assert TrainingJobConfig.model_validate(yaml.safe_load(text)) == spec.training_config()
    assert TrainingJobConfig.model_validate(json.loads(text)) == spec.training_config()
    assert TrainingJobConfig.model_validate_json(text) == spec.training_config()


def test_python_code_still_builds_models_by_name() -> None:
    from llamaft.api.spec import ClusterSpec, LoraSpec

    assert ClusterSpec(gpus_per_worker=0).gpus_per_worker == 0
    assert LoraSpec(target_modules=["q_proj"]).target_modules == ["q_proj"]
    with pytest.raises(ValueError):
        ClusterSpec.model_validate({"gpus_per_worker": 0})


def test_to_k8s_is_plain_json_even_for_deep_overrides() -> None:
    deep: dict[str, Any] = {"a": 1}
    for _ in range(3000):
        deep = {"a": deep}
    spec = validate_resource(with_(("spec.cluster.podTemplateOverrides", {"x": deep})))
    out = spec.to_k8s()
    assert type(out["fsdp"]["shardingStrategy"]) is str
    assert yaml.safe_dump(base()["spec"])  # plain types


# ------------------------------------------------------------------------- portable CEL
def _rules_walk(node: dict[str, Any], value: Any, seen: list[int]) -> None:
    import cel
    from llamaft.api.validation import _evaluate

    if value is None:
        return
    for rule in node.get("x-kubernetes-validations", []):
        ours = bool(_evaluate(rule["rule"], value, value))
        assert ours == cel.evaluate(rule["rule"], {"self": value, "oldSelf": value}), rule["rule"]
        seen[0] += 1
        if not ours and "messageExpression" in rule:  # evaluated only when the rule fails, as in the API server
            expression = rule["messageExpression"]
            assert str(_evaluate(expression, value)) == str(cel.evaluate(expression, {"self": value})), expression
    if isinstance(value, dict):
        for key, child in (node.get("properties") or {}).items():
            _rules_walk(child, value.get(key), seen)
        if isinstance(node.get("additionalProperties"), dict):
            for item in value.values():
                _rules_walk(node["additionalProperties"], item, seen)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            _rules_walk(node["items"], item, seen)


def test_new_rules_evaluate_alike_in_both_cel_engines() -> None:
    """Every rule and messageExpression, on every table case that parses, gives the same result in
    cel-python (llamaft) and the Rust engine: only portable CEL, RE2 regexes included."""
    pytest.importorskip("cel")
    schema = apiserver_model.crd_schema()["properties"]["spec"]
    seen = [0]
    cases = [obj for _, obj, _ in ADMISSION + RENDERED] + list(EXAMPLE_DOCS.values())
    for obj in cases:
        try:
            spec = LlamaFineTuneSpec.model_validate(obj["spec"])
        except ValueError:
            continue
        _rules_walk(schema, spec.to_k8s(), seen)
    assert seen[0] > 500
