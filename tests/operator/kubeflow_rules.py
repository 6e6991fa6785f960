"""Checks a PyTorchJob the way the cluster would: the real Kubeflow CRD schema (training-operator
v1.9, tests/fixtures/upstream/SOURCES.md) plus the training operator's validating-webhook rules
(kubeflow/training-operator v1.9 pkg/webhooks/pytorch/pytorchjob_webhook.go)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from tests.conftest import REFERENCE

PYTORCHJOB_CRD = REFERENCE / "kubeflow" / "kubeflow.org_pytorchjobs.yaml"
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _to_jsonschema(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
        if node.get("x-kubernetes-int-or-string"):
            out.pop("type", None)
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            if not node.get("x-kubernetes-preserve-unknown-fields"):
                out["additionalProperties"] = False  # the API server prunes unknown fields: treat them as errors
        return out
    if isinstance(node, list):
        return [_to_jsonschema(v) for v in node]
    return node


@functools.lru_cache(maxsize=8)
def crd_schema(path: str, version_name: str) -> dict[str, Any]:
    """The JSON schema of one version of an upstream CRD file (unknown fields are errors)."""
    crd = yaml.safe_load(Path(path).read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == version_name)
    schema: dict[str, Any] = _to_jsonschema(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def pytorchjob_schema() -> dict[str, Any]:
    return crd_schema(str(PYTORCHJOB_CRD), "v1")


@functools.lru_cache(maxsize=8)
def crd_validator(path: str, version_name: str) -> jsonschema.Draft7Validator:
    """One validator per CRD version (it only reads its schema: the emulator checks every PyTorchJob
    created with the same one)."""
    return jsonschema.Draft7Validator(crd_schema(path, version_name))


def schema_errors(obj: dict[str, Any], path: Path, version: str) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in crd_validator(str(path), version).iter_errors(obj)]


def validate_pytorchjob(job: dict[str, Any], *, llamaft_rules: bool = True) -> list[str]:
    """Every problem the cluster would report, as strings (empty: accepted). With llamaft_rules,
    also what llamaft itself guarantees beyond admission (min <= max workers, a unique rdzvId);
    the emulator's admission passes False."""
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in crd_validator(str(PYTORCHJOB_CRD), "v1").iter_errors(job)
    ]
    name = job.get("metadata", {}).get("name", "")
    if not DNS1035.match(name) or len(name) > 63:
        errors.append(f"metadata.name {name!r} is not a DNS-1035 label")
    spec = job.get("spec", {})
    replicas = spec.get("pytorchReplicaSpecs", {})
    for role, rs in replicas.items():
        if rs.get("restartPolicy") not in (None, "Always", "OnFailure", "Never", "ExitCode"):
            errors.append(f"{role}: restartPolicy {rs.get('restartPolicy')!r} is not one of Always, OnFailure, Never, ExitCode")
        containers = rs.get("template", {}).get("spec", {}).get("containers", [])
        if not any(c.get("name") == "pytorch" for c in containers):
            errors.append(f"{role}: no container named 'pytorch'")
    if "Master" in replicas and replicas["Master"].get("replicas", 1) != 1:
        errors.append("Master.replicas must be 1")
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if "Worker" not in replicas:
            errors.append("an elastic job needs a Worker replica spec")
        if elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            errors.append("set only one of spec.nprocPerNode and elasticPolicy.nProcPerNode")
        low, high = elastic.get("minReplicas"), elastic.get("maxReplicas")
        if llamaft_rules and low is not None and high is not None and low > high:
            errors.append("elasticPolicy.minReplicas > maxReplicas")
        if llamaft_rules and (not elastic.get("rdzvId") or elastic.get("rdzvId") == "none"):
            errors.append("rdzvId must be set and unique (torch's default 'none' is shared by every job)")
    return errors
