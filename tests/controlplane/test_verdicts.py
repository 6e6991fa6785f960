"""`llamaft validate` says what the API server says: the same verdict and the same fields, from
the real kube-apiserver with the CRD of crds/ installed, for every example, every case of the
error table (tests/validation/test_error_messages.ADMISSION), every field's bounds on both sides,
and a generated corpus (tests/validation/test_differential's mutations of the examples).

Disagreements are collected, not raised one at a time, so one run shows them all; every CEL rule
of the CRD must be broken by at least one document of the corpus (a rule no document breaks is
a rule whose verdict nobody compared).
"""

from __future__ import annotations

import copy
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from llamaft.api.validation import SpecInvalid, validate_spec
from llamaft.cli import main

from tests.api.rule_cases import RULE_CASES, TRANSITIONS
from tests.api.test_validation import BROKEN
from tests.conftest import EXAMPLES
from tests.controlplane.cluster import ControlPlane
from tests.controlplane.verdicts import Verdict, cli_verdict, sendable, server_verdict
from tests.validation.apiserver_model import crd_schema
from tests.validation.test_differential import PATHS, _set, documents
from tests.validation.test_error_messages import ADMISSION, base, with_
from tests.validation.test_parsing import CLAIM, GOOD

pytestmark = pytest.mark.filterwarnings("ignore:The recursion limit will not be reset")

CORPUS_SIZE = int(os.environ.get("LLAMAFT_SERVER_CORPUS", "500"))


def _marker(rule: dict[str, Any]) -> str:
    """Text every refusal by `rule` contains: its message, or the longest literal of its messageExpression."""
    if "messageExpression" in rule:
        return max(re.findall(r"'([^']*)'", rule["messageExpression"]), key=len)
    return str(rule.get("message") or rule["rule"])


def _rules(node: dict[str, Any], path: str = "spec") -> list[tuple[str, str]]:
    """(path, marker) of every CEL rule in the schema below `node`."""
    out = [(path, _marker(rule)) for rule in node.get("x-kubernetes-validations", [])]
    for key, child in (node.get("properties") or {}).items():
        out += _rules(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        out += _rules(node["items"], f"{path}[*]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _rules(node["additionalProperties"], f"{path}[*]")
    return out


RULES = _rules(crd_schema()["properties"]["spec"])
TRANSITION_RULES = {(p, m) for p, m in RULES if any(m in case[-1] or case[-1] in m for case in TRANSITIONS)}
"""Rules on what may change (oldSelf): broken by updates, test_each_transition_is_refused_by_the_server."""


def _bounds_cases() -> list[tuple[str, dict[str, Any]]]:
    """For every field with a bound (minimum, maximum, minLength, maxLength, minItems, maxItems):
    the base object with the field at the bound and one past it, on each side that has one."""
    cases: list[tuple[str, dict[str, Any]]] = []
    for path, node in PATHS:
        dotted = ".".join(str(p) for p in path)
        edges: list[Any] = []
        if node.get("type") in ("integer", "number"):
            step = 1 if node.get("type") == "integer" else 0.5
            if "minimum" in node:
                edges += [node["minimum"], node["minimum"] - step]
            if "maximum" in node:
                edges += [node["maximum"], node["maximum"] + step]
        if node.get("type") == "string":
            if "minLength" in node:
                edges += ["a" * node["minLength"], "a" * max(node["minLength"] - 1, 0)]
            if "maxLength" in node:
                edges += ["a" * node["maxLength"], "a" * (node["maxLength"] + 1)]
        if node.get("type") == "array" and isinstance(node.get("items"), dict) and node["items"].get("type") == "string":
            if "minItems" in node:
                edges += [["a"] * node["minItems"], ["a"] * max(node["minItems"] - 1, 0)]
            if "maxItems" in node:
                edges += [["a"] * node["maxItems"], ["a"] * (node["maxItems"] + 1)]
        for value in edges:
            doc = base()
            _set(doc, ("spec", *path), value)
            cases.append((f"{dotted}={value!r:.40}", doc))
    return cases


def same_fields(server: Verdict, cli: Verdict) -> bool:
    """Whether two refusals name the same fields, as far as the server looked:
    - a document of another apiVersion or kind is one kubectl sends elsewhere: no fields to compare;
    - refused while decoding, the server names only the fields it could not decode (unknown,
      duplicate, mistyped metadata) and checks nothing else: llamaft names each of them too;
    - otherwise llamaft names fields, and only fields the server names. The server may name more:
      it evaluates a parent's rules beside a child's schema error where llamaft stops at the child."""
    if cli.fields & {"apiVersion", "kind"}:
        return True
    if server.decoding:
        return bool(server.fields) and server.fields <= cli.fields
    return bool(cli.fields) and cli.fields <= server.fields


class Comparison:
    """Both verdicts for many documents: the disagreements and what the server's refusals named."""

    def __init__(self, plane: ControlPlane, namespace: str) -> None:
        self.plane, self.namespace = plane, namespace
        self.disagreements: list[str] = []
        self.counts: Counter[str] = Counter()
        self.server_messages: list[str] = []

    def compare(self, label: str, doc: Any) -> tuple[Verdict, Verdict] | None:
        try:
            sendable(doc)
        except Exception:  # noqa: BLE001 - kubectl cannot send it (NaN, a non-string key): no verdict to compare
            self.counts["unsendable"] += 1
            return None
        server = server_verdict(self.plane, self.namespace, doc)
        cli = cli_verdict(doc)
        self.counts["accepted" if server.accepted else "rejected"] += 1
        self.server_messages += server.messages
        if server.accepted != cli.accepted:
            self.disagreements.append(f"{label}: the API server {server}\n  llamaft {cli}\n  "
                                      f"document: {yaml.safe_dump(doc, sort_keys=False, width=200)}")
        elif not server.accepted and not same_fields(server, cli):
            self.disagreements.append(f"{label}: the API server names {sorted(server.fields)}, llamaft "
                                      f"{sorted(cli.fields)}\n  server: {server}\n  llamaft: {cli}")
        return server, cli

    def broken_rules(self) -> set[tuple[str, str]]:
        return {rule for rule in RULES if any(rule[1] in m for m in self.server_messages)}

    def report(self) -> str:
        dump = os.environ.get("LLAMAFT_VERDICTS_DUMP")
        if dump:
            with open(dump, "a", encoding="utf-8") as out:
                out.write("\n\n".join(self.disagreements) + "\n\n")
        return "\n\n".join(self.disagreements[:30]) + (
            f"\n... and {len(self.disagreements) - 30} more" if len(self.disagreements) > 30 else "")


def test_every_example_is_admitted_by_the_api_server(crds_applied: ControlPlane, namespace: str) -> None:
    comparison = Comparison(crds_applied, namespace)
    for path in EXAMPLES:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        verdicts = comparison.compare(path.name, doc)
        assert verdicts is not None and verdicts[0].accepted, f"{path.name}: {verdicts}"
    assert not comparison.disagreements, comparison.report()


def test_the_error_tables_refusals_are_the_servers(crds_applied: ControlPlane, namespace: str) -> None:
    """Each case of the error table is refused by the API server, naming the fields llamaft names."""
    comparison = Comparison(crds_applied, namespace)
    for case, obj, _expected in ADMISSION:
        comparison.compare(case, obj)
    assert not comparison.disagreements, comparison.report()


def test_every_bound_on_both_sides(crds_applied: ControlPlane, namespace: str) -> None:
    comparison = Comparison(crds_applied, namespace)
    cases = _bounds_cases()
    assert len(cases) >= 40, "the schema's bounds were not found"
    for label, doc in cases:
        comparison.compare(label, doc)
    assert not comparison.disagreements, comparison.report()
    assert comparison.counts["accepted"] and comparison.counts["rejected"], comparison.counts


def test_a_generated_corpus_gets_the_servers_verdicts(crds_applied: ControlPlane, namespace: str) -> None:
    comparison = Comparison(crds_applied, namespace)
    for case, obj, _expected in ADMISSION:
        comparison.compare(case, copy.deepcopy(obj))
    for case, obj, *_ in [*BROKEN, *RULE_CASES]:
        comparison.compare(case, copy.deepcopy(obj))

    @settings(max_examples=CORPUS_SIZE, deadline=None, database=None,
              derandomize=not os.environ.get("LLAMAFT_DIFFERENTIAL_RANDOM"),
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(doc=documents())
    def generated(doc: dict[str, Any]) -> None:
        comparison.compare("generated", doc)

    generated()
    counts = comparison.counts
    print(f"corpus: {sum(counts.values())} documents, {dict(counts)}, {len(comparison.disagreements)} disagreements")
    assert not comparison.disagreements, comparison.report()
    total = counts["accepted"] + counts["rejected"]
    assert total >= CORPUS_SIZE and counts["accepted"] >= total // 10 and counts["rejected"] >= total // 3, counts
    unbroken = sorted(set(RULES) - comparison.broken_rules() - TRANSITION_RULES)
    assert not unbroken, "no document of the corpus breaks these CEL rules:\n" + "\n".join(f"{p}: {m}" for p, m in unbroken)


def test_each_transition_is_refused_by_the_server(crds_applied: ControlPlane, namespace: str) -> None:
    """What may not change once created (the transition rules, oldSelf) is refused on update by
    the server and by llamaft (the operator's spec-change check), naming the same field."""
    assert len(TRANSITION_RULES) == len(TRANSITIONS), (TRANSITION_RULES, [c[0] for c in TRANSITIONS])
    base_path = f"/apis/llamaft.io/v1alpha1/namespaces/{namespace}/llamafinetunes"
    for index, (case, old, new, path, words) in enumerate(TRANSITIONS):
        name = f"transition-{index}"
        created = {**copy.deepcopy(old), "metadata": {"name": name}}
        status, body = crds_applied.request("POST", base_path, created)
        assert status == 201, (case, body)
        updated = {**copy.deepcopy(new), "metadata": {"name": name, "resourceVersion": body["metadata"]["resourceVersion"]}}
        status, answer = crds_applied.request("PUT", f"{base_path}/{name}?dryRun=All&fieldValidation=Strict", updated)
        assert status == 422, (case, status, answer)
        causes = {(c.get("field"), c.get("message", "")) for c in answer["details"]["causes"]}
        assert any(field == path and words in message for field, message in causes), (case, causes)
        with pytest.raises(SpecInvalid) as info:
            validate_spec(new["spec"], old=old["spec"])
        assert {e.path for e in info.value.errors} == {path}, (case, info.value.errors)


@pytest.mark.parametrize("broken", [False, True], ids=["valid", "broken"])
def test_a_file_with_a_claim_beside_the_fine_tune_is_checked_as_kubectl_applies_it(
        crds_applied: ControlPlane, namespace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], broken: bool) -> None:
    """A PersistentVolumeClaim for the results and the LlamaFineTune in one file (found from
    outside: validate refused the file that `kubectl apply -f` takes): the server admits the claim
    and gives the fine-tune the verdict llamaft validate gives it, naming the same field; validate
    says which document it did not check."""
    fine_tune = yaml.safe_load(GOOD) if not broken else with_(("spec.cluster.workers", 0))
    path = tmp_path / "run.yaml"
    path.write_text(CLAIM + "---\n" + yaml.safe_dump(fine_tune, sort_keys=False), encoding="utf-8")
    code = main(["validate", "--schema-only", str(path)])
    out = capsys.readouterr().out.replace(str(path), "F")
    assert "F: not checked: a PersistentVolumeClaim v1 (line 1); llamaft validate checks LlamaFineTune documents only" in out

    claim = yaml.safe_load(CLAIM)
    status, answer = crds_applied.request(
        "POST", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims?dryRun=All&fieldValidation=Strict", claim)
    assert status == 201, answer
    server = server_verdict(crds_applied, namespace, fine_tune)
    assert server.accepted is (not broken) and (code == 0) is (not broken), (out, server)
    assert server.fields == cli_verdict(fine_tune).fields, (out, server)
    if broken:
        assert server.fields == {"spec.cluster.workers"} and "F#1: spec.cluster.workers:" in out, (out, server)
