"""Every Kueue object the documentation shows is one the current Kueue accepts.

The YAML blocks of README.md and docs/*.md are read as a user would copy them; each document of a
Kueue kind is checked against Kueue's own CRDs (kubernetes-sigs/kueue v0.19.2, the newest release,
vendored unmodified in tests/fixtures/upstream/kueue-v0.19.2, see SOURCES.md) the way the API
server would: the version must be served and be the storage version (v1beta2; v1beta1 is
deprecated there and due to stop being served), the OpenAPI schema with unknown fields as errors
(kubectl's strict field validation), the schema's defaults, then its CEL rules (create rules only),
and the metadata a cluster- or namespace-scoped object needs.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REFERENCE, REPO
from tests.operator.kubeflow_rules import schema_errors
from tests.validation.apiserver_model import apply_defaults, cel_problems, meta_problems

KUEUE_CRDS = REFERENCE / "kueue-v0.19.2"
KUEUE_GROUP = "kueue.x-k8s.io"
CURRENT = "v1beta2"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
YAML_BLOCK = re.compile(r"^```ya?ml\n(.*?)^```", re.MULTILINE | re.DOTALL)


@functools.lru_cache(maxsize=1)
def kueue_crds() -> dict[str, tuple[Path, dict[str, Any]]]:
    """kind -> (CRD file, CRD)."""
    out = {}
    for path in sorted(KUEUE_CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text(encoding="utf-8"))
        out[crd["spec"]["names"]["kind"]] = (path, crd)
    return out


def documented_kueue_objects() -> list[tuple[str, int, dict[str, Any]]]:
    """(file, block number, object) for every document of the Kueue API group in the docs."""
    found = []
    for doc in DOCS:
        for number, block in enumerate(YAML_BLOCK.findall(doc.read_text(encoding="utf-8")), 1):
            for obj in yaml.safe_load_all(block):
                if isinstance(obj, dict) and str(obj.get("apiVersion", "")).startswith(f"{KUEUE_GROUP}/"):
                    found.append((doc.relative_to(REPO).as_posix(), number, obj))
    return found


def kueue_problems(obj: dict[str, Any]) -> list[str]:
    """Why a current Kueue refuses `obj` on create (empty: accepted)."""
    group, _, version = str(obj.get("apiVersion", "")).partition("/")
    kind = obj.get("kind")
    if group != KUEUE_GROUP or kind not in kueue_crds():
        return [f"{obj.get('apiVersion')} {kind}: not a Kueue kind of the vendored CRDs"]
    path, crd = kueue_crds()[str(kind)]
    served = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served")}
    if version not in served:
        return [f"{kind}: version {version} is not served (served: {', '.join(served)})"]
    problems = []
    if not served[version].get("storage") or served[version].get("deprecated"):
        problems.append(f"{kind}: {version} is deprecated or not the storage version; use {CURRENT}")
    problems += schema_errors(obj, path, version)
    schema = served[version]["schema"]["openAPIV3Schema"]
    defaulted = copy.deepcopy(obj)
    apply_defaults(defaulted, schema)
    for key in ("spec", *(k for k in schema.get("properties", {}) if k not in ("apiVersion", "kind", "metadata", "spec", "status"))):
        if key in defaulted and key in schema["properties"]:
            problems += cel_problems(schema["properties"][key], defaulted[key], key)
    metadata = obj.get("metadata")
    problems += meta_problems(metadata)
    namespaced = crd["spec"]["scope"] == "Namespaced"
    if isinstance(metadata, dict) and namespaced != ("namespace" in metadata):
        problems.append(f"{kind} is {crd['spec']['scope']}-scoped: metadata.namespace "
                        f"{'is required' if namespaced else 'must not be set'}")
    return problems


OBJECTS = documented_kueue_objects()


def test_the_docs_show_the_kueue_objects_a_cluster_needs() -> None:
    kinds = {obj["kind"] for _, _, obj in OBJECTS}
    assert {"ResourceFlavor", "ClusterQueue", "LocalQueue", "WorkloadPriorityClass", "Topology"} <= kinds


def test_the_vendored_crds_serve_and_store_the_current_version() -> None:
    for kind, (_, crd) in kueue_crds().items():
        versions = {v["name"]: v for v in crd["spec"]["versions"]}
        assert versions[CURRENT]["served"] and versions[CURRENT]["storage"], kind
        assert versions["v1beta1"].get("deprecated"), f"{kind}: v1beta1 is deprecated upstream"


@pytest.mark.parametrize(("where", "number", "obj"), OBJECTS,
                         ids=[f"{w}#{n}-{o['kind']}-{o.get('metadata', {}).get('name')}" for w, n, o in OBJECTS])
def test_every_documented_kueue_object_is_accepted(where: str, number: int, obj: dict[str, Any]) -> None:
    assert obj["apiVersion"] == f"{KUEUE_GROUP}/{CURRENT}", f"{where}, YAML block {number}: use {KUEUE_GROUP}/{CURRENT}"
    assert kueue_problems(obj) == [], f"{where}, YAML block {number}"


@pytest.mark.parametrize(("obj", "expected"), [
    # the v1beta1 name of a ClusterQueue's cohort (v1beta2: cohortName) is an unknown field
    ({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "q"},
      "spec": {"cohort": "all"}}, "Additional properties are not allowed ('cohort'"),
    # a TAS flavor without nodeLabels (CEL)
    ({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "f"},
      "spec": {"topologyName": "default", "nodeLabels": {}}}, "at least one nodeLabel is required"),
    # kubernetes.io/hostname must be the lowest level (CEL)
    ({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Topology", "metadata": {"name": "t"},
      "spec": {"levels": [{"nodeLabel": "kubernetes.io/hostname"}, {"nodeLabel": "network.amazonaws.com/efa-block"}]}},
     "hostname label can only be used at the lowest level"),
    # a flavor must name every covered resource (CEL)
    ({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "q"},
      "spec": {"resourceGroups": [{"coveredResources": ["cpu", "memory"],
                                   "flavors": [{"name": "f", "resources": [{"name": "cpu", "nominalQuota": 1}]}]}]}},
     "flavors must have the same number of resources as the coveredResources"),
    ({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "lq"},
      "spec": {"clusterQueue": "q"}}, "metadata.namespace is required"),
    ({"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "LocalQueue", "metadata": {"name": "lq", "namespace": "a"},
      "spec": {"clusterQueue": "q"}}, "use v1beta2"),
    ({"apiVersion": "kueue.x-k8s.io/v1alpha1", "kind": "ResourceFlavor", "metadata": {"name": "f"}}, "is not served"),
])
def test_the_check_refuses_what_kueue_refuses(obj: dict[str, Any], expected: str) -> None:
    problems = kueue_problems(obj)
    assert any(expected in p for p in problems), problems
