"""The schemas and rules the API server holds rendered objects to: the Kubernetes OpenAPI schemas
(kubernetes-validate's strict JSON schemas: unknown fields are errors), the vendored Kubeflow and
Prometheus Operator CRDs (package data in llamaft/assets), and what the API server checks in a pod
beyond its schema (unique container, volume and port names, mounts of existing volumes at distinct
absolute paths, label syntax, toleration rules, ...). admission.py renders a LlamaFineTune's
objects and checks each with these, reporting every problem on the spec field that causes it.
Pure: no API calls.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from importlib import resources
from typing import Any

from llamaft.api.validation import (
    DNS1123_LABEL,
    DNS1123_SUBDOMAIN,
    label_key_problem,
    label_value_problem,
    short,
)
from llamaft.render import trainjob

K8S_SCHEMA_VERSION = "1.30"
"""Oldest Kubernetes the operator supports: its schemas are the ones rendered objects must pass."""
IANA_SVC_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
QUANTITY = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(([KMGTPE]i)|[numkMGTPE]|[eE][+-]?[0-9]+)?")

Obj = dict[str, Any]


# ------------------------------------------------------------------------------ schemas
@functools.lru_cache(maxsize=1)
def _k8s_registry() -> Any:
    from referencing import Registry, Resource

    defs = json.loads(_k8s_file("_definitions.json"))
    return Resource.from_contents(defs) @ Registry()


def _k8s_file(name: str) -> str:
    return (resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{K8S_SCHEMA_VERSION}.0-local-strict"
            / name).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=16)
def _k8s_validator(filename: str) -> Any:
    """A strict validator for one built-in kind (kubernetes-validate's schema files)."""
    import jsonschema

    schema = json.loads(_k8s_file(filename))
    return jsonschema.Draft202012Validator(schema, registry=_k8s_registry(), format_checker=_format_checker())


def _format_checker() -> Any:
    import jsonschema

    checker = jsonschema.FormatChecker(formats=())

    def _int32(value: object) -> bool:
        return not isinstance(value, int) or isinstance(value, bool) or -(2**31) <= value < 2**31

    def _int64(value: object) -> bool:
        return not isinstance(value, int) or isinstance(value, bool) or -(2**63) <= value < 2**63

    checker.checks("int32")(_int32)
    checker.checks("int64")(_int64)
    return checker


def _crd_to_jsonschema(node: Any) -> Any:
    """An upstream CRD's OpenAPI schema as JSON Schema: int-or-string as anyOf, unknown fields as
    errors (kubectl's strict field validation) except where the CRD preserves them."""
    if isinstance(node, dict):
        out = {k: _crd_to_jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
        if node.get("x-kubernetes-int-or-string"):
            out.pop("type", None)
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            if not node.get("x-kubernetes-preserve-unknown-fields"):
                out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_crd_to_jsonschema(v) for v in node]
    return node


CRD_ASSETS = {
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.yaml",
    (trainjob.API_VERSION, trainjob.KIND): "trainer.kubeflow.org_trainjobs.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
}
K8S_FILES = {
    ("v1", "ConfigMap"): "configmap-v1.json",
    ("v1", "Service"): "service-v1.json",
    ("apps/v1", "Deployment"): "deployment-apps-v1.json",
}


@functools.lru_cache(maxsize=8)
def _crd_validator(filename: str, version: str) -> Any:
    import jsonschema
    import yaml

    text = (resources.files("llamaft") / "assets" / filename).read_text(encoding="utf-8")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader, package data
    found = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    schema: Obj = _crd_to_jsonschema(found["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema, format_checker=_format_checker())


def schema_errors(obj: Obj) -> list[tuple[tuple[str | int, ...], str]]:
    """(path in the object, problem) for everything the object's schema rejects (nothing when
    kubernetes-validate and jsonschema are not installed: see schemas_available)."""
    if not schemas_available():
        return []
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in K8S_FILES:
        validator = _k8s_validator(K8S_FILES[key])  # type: ignore[index]
    elif key in CRD_ASSETS:
        validator = _crd_validator(CRD_ASSETS[key], str(key[0]).rsplit("/", 1)[-1])  # type: ignore[index]
    else:
        return [((), f"no schema for {key[1]} {key[0]}")]
    out = []
    for error in validator.iter_errors(obj):
        path = tuple(error.absolute_path)
        message = error.message
        if error.validator == "additionalProperties" and "(" in message:
            unexpected = re.findall(r"'([^']+)'", message.split("(", 1)[1])
            for field in unexpected or ["?"]:
                out.append(((*path, field), "unknown field"))
            continue
        out.append((path, _schema_message(error)))
    return out


def _schema_message(error: Any) -> str:
    if error.validator == "type":
        expected = error.validator_value
        expected = [t for t in expected if t != "null"] if isinstance(expected, list) else [expected]
        return f"must be of type {' or '.join(expected)}, got {short(error.instance)}"
    if error.validator == "format":
        return f"must be a {error.validator_value} integer, got {short(error.instance)}"
    if error.validator in ("oneOf", "anyOf"):
        return f"must be a string or a number, got {short(error.instance)}"
    if error.validator == "required":
        return f"{error.message}"
    text = str(error.message)
    return text if len(text) <= 300 else text[:299] + "…"


def pod_template_errors(template: Any) -> list[tuple[tuple[str | int, ...], str]]:
    """A pod template as the API server checks it: the schema (strict) and the pod rules."""
    if not isinstance(template, Mapping):
        return [((), "must be a mapping")]
    out: list[tuple[tuple[str | int, ...], str]] = []
    validator = _k8s_validator("podtemplatespec-v1.json") if schemas_available() else None
    for error in validator.iter_errors(template) if validator is not None else ():
        path = tuple(error.absolute_path)
        if error.validator == "additionalProperties" and "(" in error.message:
            for field in re.findall(r"'([^']+)'", error.message.split("(", 1)[1]) or ["?"]:
                out.append(((*path, field), "unknown field"))
            continue
        out.append((path, _schema_message(error)))
    out += pod_rules(template, trainer=True)
    return out


def pod_rules(template: Mapping[str, Any], trainer: bool = False) -> list[tuple[tuple[str | int, ...], str]]:
    """What pod validation checks beyond the schema (only on well-typed parts); `trainer`: the
    training operator's rule that one container is named `pytorch` too."""
    out: list[tuple[tuple[str | int, ...], str]] = []
    metadata = template.get("metadata")
    if isinstance(metadata, Mapping):
        out += label_rules(("metadata", "labels"), metadata.get("labels"))
        annotations = metadata.get("annotations")
        if isinstance(annotations, Mapping):
            for key in annotations:
                problem = label_key_problem(str(key))
                if problem:
                    out.append((("metadata", "annotations", str(key)), f"not an annotation key: {problem}"))
    pod = template.get("spec")
    if not isinstance(pod, Mapping):
        return out
    volumes: list[Any] = pod["volumes"] if isinstance(pod.get("volumes"), list) else []
    volume_names: set[str] = set()
    for index, volume in enumerate(volumes):
        if not isinstance(volume, Mapping) or not isinstance(volume.get("name"), str):
            continue
        vname = volume["name"]
        if vname in volume_names:
            out.append((("spec", "volumes", index, "name"), f"a second volume named {vname!r}: volume names must be unique"))
        volume_names.add(vname)
        if len(vname) > 63 or not DNS1123_LABEL.fullmatch(vname):
            out.append((("spec", "volumes", index, "name"), f"{short(vname)} is not a DNS-1123 label"))
        empty = volume.get("emptyDir")
        if isinstance(empty, Mapping) and isinstance(empty.get("sizeLimit"), str):
            if not QUANTITY.fullmatch(empty["sizeLimit"]):
                out.append((("spec", "volumes", index, "emptyDir", "sizeLimit"), f"{short(empty['sizeLimit'])} is not a quantity"))
        claim = volume.get("persistentVolumeClaim")
        if isinstance(claim, Mapping) and isinstance(claim.get("claimName"), str):
            if len(claim["claimName"]) > 253 or not DNS1123_SUBDOMAIN.fullmatch(claim["claimName"]):
                out.append((("spec", "volumes", index, "persistentVolumeClaim", "claimName"),
                            f"{short(claim['claimName'])} is not a PersistentVolumeClaim name (a DNS-1123 subdomain)"))
    containers = pod.get("containers")
    if isinstance(containers, list):
        names: dict[str, int] = {}
        for index, container in enumerate(containers):
            if isinstance(container, Mapping):
                out += _container_rules(("spec", "containers", index), container, volume_names, names)
        if trainer and "pytorch" not in names:
            out.append((("spec", "containers"), "no container named 'pytorch': the training operator requires it"))
    for key in ("nodeSelector",):
        selector = pod.get(key)
        if isinstance(selector, Mapping):
            out += label_rules(("spec", key), selector)
    tolerations = pod.get("tolerations")
    if isinstance(tolerations, list):
        for index, toleration in enumerate(tolerations):
            if isinstance(toleration, Mapping):
                out += [(("spec", "tolerations", index, *p), m) for p, m in _toleration_rules(toleration)]
    priority = pod.get("priorityClassName")
    if isinstance(priority, str) and priority and (len(priority) > 253 or not DNS1123_SUBDOMAIN.fullmatch(priority)):
        out.append((("spec", "priorityClassName"), f"{short(priority)} is not a PriorityClass name (a DNS-1123 subdomain)"))
    return out


def _container_rules(
    at: tuple[str | int, ...], container: Mapping[str, Any], volumes: set[str], names: dict[str, int]
) -> list[tuple[tuple[str | int, ...], str]]:
    out: list[tuple[tuple[str | int, ...], str]] = []
    cname = container.get("name")
    if isinstance(cname, str):
        if cname in names:
            out.append(((*at, "name"), f"a second container named {cname!r}: container names must be unique in a pod"))
        names[cname] = int(at[-1])
        if len(cname) > 63 or not DNS1123_LABEL.fullmatch(cname):
            out.append(((*at, "name"), f"{short(cname)} is not a container name (a DNS-1123 label)"))
    image = container.get("image")
    if isinstance(image, str) and (not image or image != image.strip() or any(c.isspace() for c in image)):
        out.append(((*at, "image"), f"{short(image)} is not an image reference (no spaces)"))
    mounts = container.get("volumeMounts")
    if isinstance(mounts, list):
        paths: set[str] = set()
        for index, mount in enumerate(mounts):
            if not isinstance(mount, Mapping):
                continue
            path = mount.get("mountPath")
            if isinstance(path, str):
                if path in paths:
                    out.append(((*at, "volumeMounts", index, "mountPath"), f"{path!r} is mounted twice: mount paths must be unique"))
                paths.add(path)
                if not path.startswith("/"):
                    out.append(((*at, "volumeMounts", index, "mountPath"), f"{short(path)} is not an absolute path"))
            vname = mount.get("name")
            if isinstance(vname, str) and vname not in volumes:
                out.append(((*at, "volumeMounts", index, "name"), f"mounts volume {vname!r}, which the pod does not have"))
    ports = container.get("ports")
    if isinstance(ports, list):
        seen: set[str] = set()
        for index, port in enumerate(ports):
            if not isinstance(port, Mapping):
                continue
            number = port.get("containerPort")
            if isinstance(number, int) and not 0 < number < 65536:
                out.append(((*at, "ports", index, "containerPort"), f"{number} is not a port number (1-65535)"))
            pname = port.get("name")
            if isinstance(pname, str):
                if pname in seen:
                    out.append(((*at, "ports", index, "name"), f"a second port named {pname!r}"))
                seen.add(pname)
                if len(pname) > 15 or not IANA_SVC_NAME.fullmatch(pname) or not re.search("[a-z]", pname):
                    out.append(((*at, "ports", index, "name"), f"{short(pname)} is not a port name (at most 15 lowercase "
                                "letters, digits and '-')"))
    resources_ = container.get("resources")
    if isinstance(resources_, Mapping):
        for part in ("requests", "limits"):
            values = resources_.get(part)
            if isinstance(values, Mapping):
                for rname, quantity in values.items():
                    if isinstance(quantity, str) and not QUANTITY.fullmatch(quantity):
                        out.append(((*at, "resources", part, rname), f"{short(quantity)} is not a quantity"))
    env = container.get("env")
    if isinstance(env, list):
        for index, item in enumerate(env):
            if isinstance(item, Mapping) and isinstance(item.get("name"), str):
                if not re.fullmatch(r"[-._a-zA-Z][-._a-zA-Z0-9]*", item["name"]):
                    out.append(((*at, "env", index, "name"), f"{short(item['name'])} is not an environment variable name"))
    return out


def _toleration_rules(toleration: Mapping[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    out: list[tuple[tuple[str | int, ...], str]] = []
    operator, key, value = toleration.get("operator", "Equal"), toleration.get("key") or "", toleration.get("value") or ""
    if operator == "Exists" and value:
        out.append((("value",), "must be empty when operator is Exists"))
    if not key and operator != "Exists":
        out.append((("operator",), "must be Exists when key is empty"))
    if toleration.get("tolerationSeconds") is not None and toleration.get("effect") != "NoExecute":
        out.append((("effect",), "must be NoExecute when tolerationSeconds is set"))
    if isinstance(key, str) and key and label_key_problem(key):
        out.append((("key",), f"not a label key: {label_key_problem(key)}"))
    if isinstance(value, str) and value and label_value_problem(value):
        out.append((("value",), str(label_value_problem(value))))
    return out


def label_rules(at: tuple[str | int, ...], labels: Any) -> list[tuple[tuple[str | int, ...], str]]:
    out: list[tuple[tuple[str | int, ...], str]] = []
    if not isinstance(labels, Mapping):
        return out
    for key, value in labels.items():
        problem = label_key_problem(str(key))
        if problem:
            out.append(((*at, str(key)), f"not a label key: {problem}"))
        if isinstance(value, str):
            bad = label_value_problem(value)
            if bad:
                out.append(((*at, str(key)), f"label value {bad}"))
    return out


@functools.lru_cache(maxsize=1)
def schemas_available() -> bool:
    """Whether the Kubernetes schemas (kubernetes-validate, in the `operator` extra) and jsonschema
    are installed; without them only the pod rules, names and runtime checks run."""
    try:
        import jsonschema  # noqa: F401
        import kubernetes_validate  # noqa: F401
    except ImportError:
        return False
    return True
