"""What the API server cannot check at admission: render every child of a LlamaFineTune and check
it as the cluster will, before anything is created.

`checked_children(owner, spec, ...)` (the operator's check, once per generation) renders the
objects of an attempt once (`objects.children`: ConfigMap, managed etcd, PodMonitor,
PrometheusRule, dashboard; and the attempt's PyTorchJob, with `backend: TrainJob` the TrainJob of
llamaft.render.trainjob instead), checks exactly those and returns the children to apply with the
problems found; `child_errors(spec, name, namespace)` (`llamaft validate` / `render`, the sweep)
checks the same for a spec alone. Both check
- every built-in object against the Kubernetes OpenAPI schemas (kubernetes-validate's strict
  JSON schemas: unknown fields are errors), the worker pod template included;
- the PyTorchJob against the vendored Kubeflow CRD (training-operator v1.9) and its webhook's
  rules; the TrainJob against the vendored Kubeflow Trainer v2.3 CRD (runtimePatches included) and
  the Trainer webhooks' rules, refusing what Trainer cannot express (trainjob.unsupported); the
  PodMonitor and PrometheusRule against the vendored Prometheus Operator CRDs (package data in
  llamaft/assets, copies of tests/fixtures/upstream);
- what the API server checks in a pod beyond its schema (unique container, volume and port names,
  mounts of existing volumes at distinct absolute paths, label syntax, toleration rules, ...);
- every derived name and label value against Kubernetes' limits, for the longest attempt name
  (`<name>-<uid token>-<MAX_ATTEMPTS>-worker-<last index>`);
- what only running would show: the prompt template (a Python format string) and LoRA target
  modules against the Llama module names;
- where the results go (render.storage): checkpoints, export and local tracker files on a volume
  of the rendered worker pod that outlives it, or an fsspec URI, unless
  `checkpointing.discardWithPod` accepts losing them.
The schemas and the pod rules themselves are schemas.py's. Each problem is reported on the spec
field that causes it, with the fix. Pure: no API calls.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import string
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from llamaft.api.resource import MAX_ATTEMPTS
from llamaft.api.sources import SourceKind, parse_source
from llamaft.api.spec import Backend, LlamaFineTuneSpec
from llamaft.api.validation import (
    DNS1123_LABEL,
    DNS1123_SUBDOMAIN,
    FieldError,
    short,
)
from llamaft.render import trainjob
from llamaft.render.naming import Owner
from llamaft.render.schemas import (
    label_rules,
    pod_rules,
    pod_template_errors,
    schema_errors,
)
from llamaft.render.storage import lost_with_pod

PLACEHOLDER_UID = "ffffffff-ffff-ffff-ffff-ffffffffffff"
"""Stands for the CR's uid when there is none yet (names then have their full length)."""
LLAMA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embed_tokens")
"""Module names of a Llama-shaped model (LlamaForCausalLM) that LoRA can adapt."""
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")

POD_MAX_DEPTH = 64
"""No field of a pod template nests deeper (the deepest, in affinity terms, are about 12 levels)."""

Obj = dict[str, Any]
OVERRIDES = "spec.cluster.podTemplateOverrides"
TEMPLATE = ("spec", "pytorchReplicaSpecs", "Worker", "template")


def child_errors(
    spec: LlamaFineTuneSpec, name: str, namespace: str, *, uid: str = PLACEHOLDER_UID, attempt: int = 1,
    backend: Backend | None = None, cache: CheckCache | None = None,
) -> list[FieldError]:
    """Every problem of the objects the operator would create for this (admitted) spec, as
    FieldError (the spec field that causes it, the problem and fix); empty when the cluster will
    accept them all. `backend`: the job kind to check (default spec.backend; `auto` checks what it
    picks when both are served, trainjob.preferred_backend). `cache`: where the verdicts of this
    checker's earlier calls are kept (none: check in full). Deterministic; about 20-60 ms per
    call once the schemas are loaded (~1 s once)."""
    backend = backend or trainjob.preferred_backend(spec)
    train_job = backend is Backend.TRAIN_JOB
    name_errors = _name_errors(spec, name, namespace, uid, train_job=train_job)
    if name_errors or _deeper_than(spec.cluster.pod_template_overrides, POD_MAX_DEPTH) is not None:
        # (too deep overrides are refused at once, and cannot be serialized into a cache key)
        return _unique([*_runtime_errors(spec), *name_errors, *_object_errors(spec, name, namespace, uid, attempt, backend)])
    # With a name that fits every object it names, what the objects' schemas and rules find does
    # not depend on which name (of that length) or uid: LlamaFineTunes made from one template are
    # checked once, for a stand-in name, and the messages name the real objects.
    key = ("child_errors", spec.model_dump_json(), namespace, len(name), attempt, backend)
    stand_in = _stand_in(len(name))
    cached = cache.get(key) if cache is not None else None
    if cached is None:
        cached = _unique([*_runtime_errors(spec), *_object_errors(spec, stand_in, namespace, PLACEHOLDER_UID, attempt, backend)])
        if cache is not None:
            cache.put(key, cached)
    return [FieldError(e.path.replace(stand_in, name).replace(PLACEHOLDER_UID, uid),
                       e.message.replace(stand_in, name).replace(PLACEHOLDER_UID, uid)) for e in cached]


CHECKED_CACHE_SIZE = 256
_K = TypeVar("_K")
_V = TypeVar("_V")


class CheckCache:
    """The verdicts of one checker's earlier checks, by template (spec, namespace, name length,
    attempt, backend; for the operator's check its settings too): the latest CHECKED_CACHE_SIZE,
    shared by the threads that check. Its owner decides how long it lives: the operator keeps one
    in its state (OperatorState.checks), `llamaft validate` one per command; without one (the
    sweep, whose sizes are different specs; `llamaft render`) every call checks in full."""

    def __init__(self, size: int = CHECKED_CACHE_SIZE) -> None:
        self.size = size
        self._verdicts: collections.OrderedDict[tuple[Any, ...], list[FieldError]] = collections.OrderedDict()
        self._texts: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._verdicts)

    def get(self, key: tuple[Any, ...]) -> list[FieldError] | None:
        return self._recall(self._verdicts, key)

    def put(self, key: tuple[Any, ...], verdict: list[FieldError]) -> None:
        self._keep(self._verdicts, key, verdict)

    def config_texts(self, spec: LlamaFineTuneSpec, spec_json: str) -> tuple[str, str]:
        """The config map's texts of the spec whose JSON is `spec_json` (desired.config_texts): the
        render's costliest part (indented JSON takes the pure-Python encoder), the same for every
        object of one template, kept beside that template's verdict (the latest `size`)."""
        found = self._recall(self._texts, spec_json)
        if found is None:
            from llamaft.render import desired

            found = desired.config_texts(spec)
            self._keep(self._texts, spec_json, found)
        return found

    def _recall(self, table: collections.OrderedDict[_K, _V], key: _K) -> _V | None:
        with self._lock:
            found = table.get(key)
            if found is not None:
                table.move_to_end(key)
            return found

    def _keep(self, table: collections.OrderedDict[_K, _V], key: _K, value: _V) -> None:
        with self._lock:
            table[key] = value
            while len(table) > self.size:
                table.popitem(last=False)


def _stand_in(length: int) -> str:
    """A valid object name of `length` characters that no message contains by chance."""
    return ("z" + "q9" * length)[:length]


def _object_errors(spec: LlamaFineTuneSpec, name: str, namespace: str, uid: str, attempt: int,
                   backend: Backend) -> list[FieldError]:
    """What the rendered objects' schemas and the admission rules find (child_errors without the
    runtime and name checks)."""
    errors: list[FieldError] = []
    too_deep = _deeper_than(spec.cluster.pod_template_overrides, POD_MAX_DEPTH)
    if too_deep is not None:
        shown = _format(too_deep[:12], leading_dot=True) + ("…" if len(too_deep) > 12 else "")
        errors.append(FieldError(OVERRIDES + shown, f"nested more than {POD_MAX_DEPTH} levels deep; no field of a pod "
                                 "template nests that deep: remove it"))
        return _unique(errors)
    render = _render(Owner(name, namespace, uid), spec, attempt, backend)
    return _unique([*render.errors, *_storage(spec, render), *_check(spec, render)])


@dataclasses.dataclass
class _Rendered:
    """One render of an attempt: the long-lived children, the attempt's job (None when it cannot
    be rendered), the worker pod template without and with the overrides (what the checker needs
    to name the spec field of a problem) and the render's own problems."""

    children: list[Obj]
    job: Obj | None
    base: Obj | None
    merged: Obj | None
    errors: list[FieldError]


def _render(owner: Owner, spec: LlamaFineTuneSpec, attempt: int, backend: Backend, etcd_image: str | None = None,
            dashboard_labels: dict[str, str] | None = None, config_texts: tuple[str, str] | None = None) -> _Rendered:
    """Every object of one attempt, rendered once (objects.children and the attempt's job)."""
    from llamaft.render import desired, objects
    from llamaft.render.desired import pod_template

    errors: list[FieldError] = []
    try:
        children = objects.children(owner, spec, etcd_image or desired.ETCD_IMAGE, dashboard_labels, config_texts)
        base = pod_template(owner, spec.model_copy(update={"cluster": spec.cluster.model_copy(
            update={"pod_template_overrides": None})}), attempt)
        merged = None
        job: Obj | None
        if backend is Backend.TRAIN_JOB:
            merged = pod_template(owner, spec, attempt)
            try:
                job = trainjob.train_job(owner, spec, attempt)
            except trainjob.TrainJobSpecError as exc:  # what Kubeflow Trainer cannot do, on its spec fields
                job = None
                errors += [FieldError(path, message) for path, message in exc.problems]
        else:
            job = desired.pytorch_job(owner, spec, attempt)
    except Exception as exc:  # a spec the renderer cannot handle: that is the problem to report
        errors.append(FieldError("spec", f"cannot be rendered into Kubernetes objects: {short(str(exc), 300)}"))
        return _Rendered([], None, None, None, errors)
    return _Rendered(children, job, base, merged, errors)


def _storage(spec: LlamaFineTuneSpec, render: _Rendered) -> list[FieldError]:
    """Results the rendered worker pod would keep only in its containers (storage.lost_with_pod),
    judged on the pod template the job carries: the PyTorchJob's Worker template, the TrainJob's
    pod as merged before it becomes runtimePatches."""
    template = render.merged if render.merged is not None else _get(render.job, TEMPLATE) if render.job else None
    return lost_with_pod(spec, template) if isinstance(template, Mapping) else []


def _check(spec: LlamaFineTuneSpec, render: _Rendered) -> list[FieldError]:
    """What the schemas and the admission rules find in the rendered objects."""
    if render.base is None:
        return []
    checker = _Checker(spec, render.base, render.merged)
    return [e for obj in [*render.children, *([render.job] if render.job is not None else [])] for e in checker.check(obj)]


@dataclasses.dataclass(frozen=True)
class Checked:
    """The children of one render and every problem of them (and of the attempt's job)."""

    children: list[Obj]
    """objects.children as rendered: the objects the operator server-side applies."""
    errors: list[FieldError]


def checked_children(owner: Owner, spec: LlamaFineTuneSpec, *, attempt: int = 1, backend: Backend | None = None,
                     etcd_image: str | None = None, dashboard_labels: dict[str, str] | None = None,
                     cache: CheckCache | None = None) -> Checked:
    """The operator's admission check: render the children once (with the operator's etcd image
    and dashboard labels) and the attempt's job, check exactly those objects (child_errors'
    checks, the name and runtime checks included), and return the children to apply with the
    problems found. Objects of a template `cache` holds as clean (same spec, namespace, name length,
    attempt, backend and settings) are not checked again, as in child_errors; a spec with
    problems is checked in full each time (once per generation in the operator)."""
    backend = backend or trainjob.preferred_backend(spec)
    name, namespace, uid = owner.name, owner.namespace, owner.uid or PLACEHOLDER_UID
    errors = [*_runtime_errors(spec), *_name_errors(spec, name, namespace, uid, train_job=backend is Backend.TRAIN_JOB)]
    too_deep = _deeper_than(spec.cluster.pod_template_overrides, POD_MAX_DEPTH) is not None
    if too_deep:  # refused before rendering, as child_errors does
        return Checked([], _unique([*errors, *_object_errors(spec, name, namespace, uid, attempt, backend)]))
    spec_json = spec.model_dump_json()
    texts = cache.config_texts(spec, spec_json) if cache is not None else None
    render = _render(owner, spec, attempt, backend, etcd_image, dashboard_labels, texts)
    errors += [*render.errors, *_storage(spec, render)]
    key = ("checked_children", spec_json, namespace, len(name), attempt, backend, etcd_image or "",
           json.dumps(dashboard_labels, sort_keys=True))
    clean = not errors and cache is not None and cache.get(key) == []
    if not clean:
        errors += _check(spec, render)
        if not errors and cache is not None:
            cache.put(key, [])
    return Checked(render.children, _unique(errors))


def _deeper_than(value: Any, limit: int) -> list[str | int] | None:
    """The path of the first value nested deeper than `limit` (found without recursion), or None."""
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        item, path = stack.pop()
        if len(path) > limit:
            return path
        if isinstance(item, Mapping):
            stack.extend((v, [*path, str(k)]) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, [*path, i]) for i, v in enumerate(item))
    return None


def _unique(errors: Iterable[FieldError]) -> list[FieldError]:
    seen: set[tuple[str, str]] = set()
    out = []
    for error in errors:
        if (error.path, error.message) not in seen:
            seen.add((error.path, error.message))
            out.append(error)
    return out


# ------------------------------------------------------------------ what only running would show
def prompt_template_problem(template: str) -> str | None:
    """Why the trainer's `template.format(**record)` would fail on any record, or None."""
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError as exc:
        return (f"not a valid Python format string ({exc}): write a literal brace as {{{{ or }}}}, a record field as "
                "{field}")
    for _, field_name, format_spec, _ in fields:
        if field_name is None:
            continue
        if field_name == "" or field_name.isdigit():
            return "positional fields ({} or {0}) have no value: name a record field, e.g. {dialogue}"
        if "." in field_name or "[" in field_name:
            return (f"{{{field_name}}} uses attribute access or indexing, which records do not support: use the record "
                    f"field's name only, e.g. {{{re.split(r'[.[]', field_name)[0]}}}")
        if format_spec and "{" in format_spec:
            return f"{{{field_name}:{format_spec}}} has a nested field in its format spec: use a constant format spec"
    return None


def _runtime_errors(spec: LlamaFineTuneSpec) -> list[FieldError]:
    errors: list[FieldError] = []
    if spec.dataset.prompt_template is not None:
        problem = prompt_template_problem(spec.dataset.prompt_template)
        if problem:
            errors.append(FieldError("spec.dataset.promptTemplate", problem))
    for index, field_name in enumerate(spec.dataset.field_mapping.prompt):
        if not re.fullmatch(r"[^{}\[\].:!]+", field_name):
            errors.append(FieldError(f"spec.dataset.fieldMapping.prompt[{index}]", f"{short(field_name)} is not a plain "
                                     "record field name (no braces, '.', '[', ':' or '!'): name the field as it is in "
                                     "the records"))
    lora = spec.training.lora
    if lora is not None and lora.enabled:
        for index, module in enumerate(lora.target_modules):
            if module.rsplit(".", 1)[-1] not in LLAMA_MODULES:
                errors.append(FieldError(
                    f"spec.training.lora.targetModules[{index}]",
                    f"{short(module)} names no module of a Llama model, so LoRA would fail when the model loads: "
                    f"use {', '.join(LLAMA_MODULES[:7])} (attention and MLP projections), lm_head or embed_tokens"))
    return errors


# -------------------------------------------------------------------------------- names
def _name_errors(spec: LlamaFineTuneSpec, name: str, namespace: str, uid: str, *, train_job: bool = False) -> list[FieldError]:
    from llamaft.render.naming import Owner

    errors: list[FieldError] = []
    if len(namespace) > 63 or not DNS1123_LABEL.fullmatch(namespace):
        errors.append(FieldError("metadata.namespace", f"{short(namespace)} is not a namespace name (a DNS-1123 label of "
                                 "at most 63 characters)"))
    owner = Owner(name, namespace, uid)
    workers = spec.cluster.elastic.max_workers if spec.cluster.elastic else spec.cluster.workers
    if train_job:  # JobSet: pod hostname <jobset>-<replicated job>-<job index>-<pod index>
        longest = f"{owner.job_name(MAX_ATTEMPTS)}-{trainjob.NODE}-0-{workers - 1}"
        who = "Kubeflow Trainer (JobSet) names a trainer pod's hostname"
    else:
        longest = f"{owner.job_name(MAX_ATTEMPTS)}-worker-{workers - 1}"
        who = "the training operator names a worker's Service"
    if len(longest) > 63 or not DNS1035_LABEL.fullmatch(longest):
        room = 63 - (len(longest) - len(name))
        what = "a hostname" if train_job else "a Service name"
        errors.append(FieldError("metadata.name", f"{who} {longest!r} ({len(longest)} characters; {what} is a "
                                 f"DNS-1035 label of at most 63): use a name of at most {room} characters"))
    return errors


# ------------------------------------------------------------------- checking each object
class _Checker:
    """Checks rendered objects and says which spec field each problem comes from."""

    def __init__(self, spec: LlamaFineTuneSpec, base_template: Obj, merged_template: Obj | None = None) -> None:
        self.spec = spec
        self.base = base_template
        self.merged = merged_template if merged_template is not None else base_template
        self.overrides = spec.cluster.pod_template_overrides or {}

    def check(self, obj: Obj) -> list[FieldError]:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        kind = str(obj.get("kind"))
        if kind == "PyTorchJob":
            problems += [(p, m) for p, m in schema_errors(obj) if p[:4] != TEMPLATE]
            problems += self._job_rules(obj)
            template = _get(obj, TEMPLATE)
            problems += [((*TEMPLATE, *p), m) for p, m in pod_template_errors(template)]
        elif kind == trainjob.KIND:
            problems += schema_errors(obj)  # the CRD's runtimePatches schema is the pod patch's schema
            problems += self._train_job_rules(obj)
            patch = _get(obj, trainjob.POD_PATCH_PATH)
            if isinstance(patch, Mapping):
                problems += [((*trainjob.POD_PATCH_PATH, *p), m) for p, m in pod_rules(patch)]
        else:
            problems += schema_errors(obj)
            if kind == "Deployment":
                template = _get(obj, ("spec", "template"))
                problems += [(("spec", "template", *p), m) for p, m in pod_rules(template)] \
                    if isinstance(template, Mapping) else []
        problems += self._metadata_rules(obj)
        return [self._locate(obj, path, message) for path, message in problems]

    def _metadata_rules(self, obj: Obj) -> list[tuple[tuple[str | int, ...], str]]:
        out: list[tuple[tuple[str | int, ...], str]] = []
        metadata = obj.get("metadata") or {}
        name = metadata.get("name")
        kind = obj.get("kind")
        if isinstance(name, str):
            if kind in ("Service", "PyTorchJob", trainjob.KIND):
                if len(name) > 63 or not DNS1035_LABEL.fullmatch(name):
                    out.append((("metadata", "name"), f"{name!r} is not a DNS-1035 label of at most 63 characters"))
            elif len(name) > 253 or not DNS1123_SUBDOMAIN.fullmatch(name):
                out.append((("metadata", "name"), f"{name!r} is not a DNS-1123 subdomain of at most 253 characters"))
        out += label_rules(("metadata", "labels"), metadata.get("labels"))
        selector = _get(obj, ("spec", "selector", "matchLabels"))
        out += label_rules(("spec", "selector", "matchLabels"), selector)
        if kind == "Service":
            out += label_rules(("spec", "selector"), _get(obj, ("spec", "selector")))
        if kind == "ConfigMap":
            for key in obj.get("data") or {}:
                if len(key) > 253 or not re.fullmatch(r"[-._a-zA-Z0-9]+", key):
                    out.append((("data", key), f"{short(key)} is not a ConfigMap key"))
        return out

    def _job_rules(self, job: Obj) -> list[tuple[tuple[str | int, ...], str]]:
        """The training operator's webhook rules for a PyTorchJob (v1.9)."""
        out: list[tuple[tuple[str | int, ...], str]] = []
        spec = job.get("spec") or {}
        replicas = spec.get("pytorchReplicaSpecs") or {}
        for role, rs in replicas.items():
            if isinstance(rs, Mapping) and rs.get("restartPolicy") not in (None, "Always", "OnFailure", "Never", "ExitCode"):
                out.append((("spec", "pytorchReplicaSpecs", role, "restartPolicy"), "must be Always, OnFailure, Never or ExitCode"))
        elastic = spec.get("elasticPolicy")
        if isinstance(elastic, Mapping):
            low, high = elastic.get("minReplicas"), elastic.get("maxReplicas")
            if isinstance(low, int) and isinstance(high, int) and low > high:
                out.append((("spec", "elasticPolicy", "minReplicas"), "minReplicas > maxReplicas"))
            if not elastic.get("rdzvId") or elastic.get("rdzvId") == "none":
                out.append((("spec", "elasticPolicy", "rdzvId"), "must be set and unique"))
            port = elastic.get("rdzvPort")
            if isinstance(port, int) and not 0 < port < 65536:
                out.append((("spec", "elasticPolicy", "rdzvPort"), f"{port} is not a port number (1-65535)"))
        return out

    def _train_job_rules(self, job: Obj) -> list[tuple[tuple[str | int, ...], str]]:
        """Kubeflow Trainer v2.3's webhook rules a TrainJob rendered here could break (the torch
        plugin's reserved env names, the JobSet plugin's runtimePatches rules) and the list-map
        keys the API server enforces in runtimePatches."""
        out: list[tuple[tuple[str | int, ...], str]] = []
        env = _get(job, ("spec", "trainer", "env"))
        for index, item in enumerate(env if isinstance(env, list) else []):
            name = item.get("name") if isinstance(item, Mapping) else None
            if isinstance(name, str) and (name in trainjob.TORCHRUN_RESERVED_ENV or name.startswith("PET_")):
                out.append((("spec", "trainer", "env", index, "name"),
                            f"{name} is set by Kubeflow Trainer's torch plugin (its webhook rejects "
                            f"{', '.join(sorted(trainjob.TORCHRUN_RESERVED_ENV))}; torchrun reads every PET_* as a flag)"))
        pod = _get(job, (*trainjob.POD_PATCH_PATH, "spec"))
        if not isinstance(pod, Mapping):
            return out
        ref = self.spec.train_job.runtime_ref
        default_runtime = (ref.kind, ref.name) == ("ClusterTrainingRuntime", "torch-distributed")
        for field in ("containers", "initContainers"):
            items = pod.get(field)
            for index, container in enumerate(items if isinstance(items, list) else []):
                if not isinstance(container, Mapping):
                    continue
                if default_runtime and container.get("name") != trainjob.NODE:
                    out.append(((*trainjob.POD_PATCH_PATH, "spec", field, index, "name"),
                                f"runtimePatches can only patch containers the runtime defines (torch-distributed "
                                f"has one, {trainjob.NODE!r}), not add {short(container.get('name'))}"))
                mounts = container.get("volumeMounts")
                seen: set[str] = set()
                for m_index, mount in enumerate(mounts if isinstance(mounts, list) else []):
                    mname = mount.get("name") if isinstance(mount, Mapping) else None
                    if isinstance(mname, str) and mname in seen:
                        out.append(((*trainjob.POD_PATCH_PATH, "spec", field, index, "volumeMounts", m_index, "name"),
                                    f"mounts volume {mname!r} a second time: runtimePatches key volumeMounts by "
                                    "volume name, so each volume can be mounted once"))
                    if isinstance(mname, str):
                        seen.add(mname)
        return out

    # -------------------------------------------------------------------- where it comes from
    def _locate(self, obj: Obj, path: tuple[str | int, ...], message: str) -> FieldError:
        kind = str(obj.get("kind"))
        name = str((obj.get("metadata") or {}).get("name"))
        where = _format(path)
        field, fix = self._origin(obj, path)
        text = f"{message} (in the {kind} {name}, {where})" if where else f"{message} (in the {kind} {name})"
        return FieldError(field, f"{text}: {fix}" if fix else text)

    def _origin(self, obj: Obj, path: tuple[str | int, ...]) -> tuple[str, str]:
        spec = self.spec
        kind = obj.get("kind")
        if path[:2] in (("metadata", "labels"), ("spec", "selector")) or path[:3] == ("spec", "selector", "matchLabels"):
            key = path[-1] if len(path) > 2 else None
            if key in spec.monitoring.dcgm.scrape_selector and kind in ("PodMonitor", "PrometheusRule"):
                return (f"spec.monitoring.dcgm.scrapeSelector[{_key(key)}]",
                        "use a label your Prometheus selects monitoring objects by, e.g. release: kube-prometheus-stack")
            return "metadata.name", "use a shorter name"
        if path[:2] == ("metadata", "name"):
            return "metadata.name", "use a shorter name"
        if path[:2] == ("metadata", "namespace"):
            return "metadata.namespace", "use a valid namespace"
        if kind == "PyTorchJob" and path[:4] == TEMPLATE:
            return self._template_origin(path[4:])
        if kind == trainjob.KIND:
            return self._train_job_origin(obj, path)
        if kind == "PyTorchJob" and path[:2] == ("spec", "runPolicy") and len(path) > 2:
            return f"spec.runPolicy.{path[2]}", "use a value the training operator accepts"
        if kind == "PyTorchJob" and path[:2] == ("spec", "elasticPolicy"):
            leaf = path[2] if len(path) > 2 else ""
            if leaf in ("rdzvHost", "rdzvPort"):
                return "spec.rendezvous.endpoint", "use host:port with a port from 1 to 65535"
            if leaf == "maxRestarts":
                return "spec.rendezvous.maxRestarts", ""
            return "spec.cluster.workers", ""
        if kind == "Deployment" and path[:2] == ("spec", "template"):
            return "metadata.name", ""
        return "spec", "this is an llamaft bug: please report it"

    def _train_job_origin(self, job: Obj, path: tuple[str | int, ...]) -> tuple[str, str]:
        """The spec field a TrainJob path comes from: the pod patch and spec.trainer's container
        fields are the worker pod template's (desired.pod_template, overrides merged), re-expressed."""
        patch = trainjob.POD_PATCH_PATH
        if path[:len(patch)] == patch:
            return self._template_origin(path[len(patch):])
        containers = _get(self.merged, ("spec", "containers")) or []
        index = next((i for i, c in enumerate(containers) if isinstance(c, Mapping)
                      and c.get("name") == trainjob.TEMPLATE_CONTAINER), 0)
        if path[:2] == ("spec", "trainer") and len(path) > 2:
            field, rest = path[2], path[3:]
            if field == "env" and rest and isinstance(rest[0], int):
                item = _get(job, ("spec", "trainer", "env", rest[0]))
                name = item.get("name") if isinstance(item, Mapping) else None
                env = _get(self.merged, ("spec", "containers", index, "env")) or []
                last = max((i for i, e in enumerate(env) if isinstance(e, Mapping) and e.get("name") == name), default=None)
                if last is not None:
                    return self._template_origin(("spec", "containers", index, "env", last, *rest[1:]))
                return "spec.cluster.env", ""
            container_field = {v: k for k, v in trainjob.TRAINER_FIELDS.items()}.get(str(field))
            if container_field is not None:
                return self._template_origin(("spec", "containers", index, container_field, *rest))
            if field == "numNodes":
                return "spec.cluster.workers", ""
            if field == "numProcPerNode":
                return "spec.cluster.gpusPerWorker", ""
        if path[:2] == ("spec", "runtimeRef"):
            leaf = path[2] if len(path) > 2 else None
            return (f"spec.trainJob.runtimeRef.{leaf}" if leaf in ("name", "kind") else "spec.trainJob.runtimeRef",
                    "name a (Cluster)TrainingRuntime of Kubeflow Trainer, e.g. torch-distributed")
        if path[:2] == ("spec", "suspend"):
            return "spec.runPolicy.suspend", ""
        if path[:2] == ("spec", "activeDeadlineSeconds"):
            return "spec.runPolicy.activeDeadlineSeconds", ""
        return "spec", "this is an llamaft bug: please report it"

    def _template_origin(self, rest: tuple[str | int, ...]) -> tuple[str, str]:
        override = _override_path(self.base, self.overrides, rest)
        if override is not None:
            return (OVERRIDES + _format(override, leading_dot=True),
                    "fix or remove it in podTemplateOverrides (merged into the worker pod template as a strategic "
                    "merge patch: containers, volumes and env by name)")
        spec = self.spec
        if rest[:2] == ("spec", "containers") and len(rest) > 3:
            part = rest[3]
            if part == "image":
                return "spec.cluster.image", "use an image reference such as ghcr.io/llamaft/trainer:0.1.0"
            if part == "resources":
                return "spec.cluster.resources", "use quantities greater than 0, e.g. cpu: 8, memory: 64Gi"
            if part == "ports":
                return "spec.monitoring.metricsPort", "use a port from 1024 to 65535"
            if part == "env" and len(rest) > 4 and isinstance(rest[4], int):
                base_count = len(_get(self.base, ("spec", "containers", 0, "env")) or []) - len(spec.cluster.env)
                if rest[4] >= base_count:
                    return f"spec.cluster.env[{rest[4] - base_count}]", "fix or remove the variable"
                return "spec.cluster.env", ""
            if part == "volumeMounts" and len(rest) > 4 and isinstance(rest[4], int):
                mount = (_get(self.base, ("spec", "containers", 0, "volumeMounts")) or [{}])[rest[4]]
                return self._volume_origin(str(mount.get("name", "")))
        if rest[:2] == ("spec", "volumes") and len(rest) > 2 and isinstance(rest[2], int):
            volume = (_get(self.base, ("spec", "volumes")) or [{}])[rest[2]]
            return self._volume_origin(str(volume.get("name", "")))
        if rest[:2] == ("spec", "nodeSelector"):
            key = rest[2] if len(rest) > 2 else None
            if key == "node.kubernetes.io/instance-type" and spec.cluster.instance_type:
                return "spec.cluster.instanceType", "use the node label's value, e.g. p4de.24xlarge"
            return (f"spec.cluster.nodeSelector[{_key(key)}]" if key is not None else "spec.cluster.nodeSelector",
                    "use a node label, e.g. nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3")
        if rest[:2] == ("spec", "tolerations") and len(rest) > 2:
            return f"spec.cluster.tolerations[{rest[2]}]" + _format(rest[3:], leading_dot=True), ""
        if rest[:2] == ("spec", "priorityClassName"):
            return "spec.cluster.priorityClassName", "name an existing PriorityClass"
        if rest[:2] == ("spec", "terminationGracePeriodSeconds"):
            return "spec.cluster.terminationGracePeriodSeconds", ""
        if rest[:1] == ("metadata",):
            return "metadata.name", "use a shorter name"
        return "spec.cluster", ""

    def _volume_origin(self, volume: str) -> tuple[str, str]:
        spec = self.spec
        if volume == "checkpoints":
            return "spec.checkpointing.directory", "mount the checkpoint claim at its own absolute path, e.g. /checkpoints"
        if volume == "dshm":
            return "spec.cluster.sharedMemorySize", "use a quantity greater than 0, e.g. 64Gi"
        if volume.startswith("input-"):
            claims: list[tuple[str | None, str]] = []
            for field, text in (("spec.model.source", spec.model.source), ("spec.model.tokenizer", spec.model.tokenizer),
                                ("spec.dataset.source", spec.dataset.source)):
                if text and text.startswith("pvc://"):
                    src = parse_source(text)
                    if src.kind is SourceKind.PVC and src.claim not in [c for c, _ in claims]:
                        claims.append((src.claim, field))
            index = int(volume.split("-", 1)[1]) if volume.split("-", 1)[1].isdigit() else -1
            if 0 <= index < len(claims):
                return claims[index][1], "use pvc://<claim>/<path> with the name of a PersistentVolumeClaim"
        return "metadata.name", ""


def _get(obj: Any, path: Sequence[str | int]) -> Any:
    for part in path:
        if isinstance(part, int):
            if not isinstance(obj, list) or part >= len(obj):
                return None
        elif not isinstance(obj, Mapping):
            return None
        obj = obj[part] if isinstance(part, int) else obj.get(part)
    return obj


def _override_path(base: Any, override: Any, path: Sequence[str | int]) -> list[str | int] | None:
    """Where in podTemplateOverrides the rendered template's `path` came from (None: not from it),
    following the strategic merge (llamaft.render.podmerge): mappings merge key by key, lists
    with a merge key (containers by name, ...) patch or add entries, other lists replace."""
    from llamaft.render.podmerge import MERGE_KEYS

    out: list[str | int] = []
    field: str | None = None
    for part in path:
        if isinstance(part, int):
            if not isinstance(override, list):
                return None
            if isinstance(base, list) and field in MERGE_KEYS:
                origins = _merged_origins(base, override, MERGE_KEYS[field])
                if part >= len(origins) or origins[part][0] is None:
                    return None  # an entry of the template the overrides did not touch
                index, base = origins[part]
            else:
                index, base = part, None  # the overrides' list replaced the template's
            if index is None or index >= len(override):
                return None
            out.append(index)
            override = override[index]
        else:
            if not isinstance(override, Mapping) or part not in override:
                return None
            out.append(part)
            override = override[part]
            base = base.get(part) if isinstance(base, Mapping) else None
            field = part
    return out


def _merged_origins(base: list[Any], patch: list[Any], key: str) -> list[tuple[int | None, Any]]:
    """For each entry of the merged list: (index of the override entry that patched or added it,
    or None; the template's entry it patched, or None), as podmerge._merge_list builds it."""
    out: list[tuple[int | None, Any]] = [(None, item) for item in base]
    for index, entry in enumerate(patch):
        if not isinstance(entry, Mapping) or key not in entry:
            out.append((index, None))
            continue
        found = next((i for i, (_, item) in enumerate(out) if isinstance(item, Mapping) and item.get(key) == entry[key]), None)
        if entry.get("$patch") == "delete":
            if found is not None:
                out.pop(found)
            continue
        if found is None:
            out.append((index, None))
        else:
            out[found] = (index, out[found][1])
    return out


def _key(key: Any) -> str:
    """A map key as shown in a path, bounded (keys have no length limit of their own)."""
    text = str(key)
    return text if len(text) <= 64 else text[:63] + "…"


def _format(path: Sequence[str | int], leading_dot: bool = False) -> str:
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part):
            text += f".{part}"
        else:
            text += f"[{_key(part)}]"
    if not leading_dot and text.startswith("."):
        text = text[1:]
    return text
