"""kmock's KubernetesEmulator plus what kopf and these tests need of a real API server.

Adds, as the Kubernetes API server has them: uid, resourceVersion, generation (bumped on spec changes)
and creationTimestamp; JSON-patch `test` failures as 422 (kopf's finalizer patch relies on it);
kind/apiVersion on lists; status-subresource isolation (the main endpoint ignores .status, /status
changes only .status); label and field selectors on list and watch; PUT; metadata.resourceVersion
and metadata.uid in a write's body as preconditions (409 Conflict, as client-go's optimistic
concurrency and the kubelet's status writes rely on); 409 AlreadyExists on creating a live name.

Deletion as the API server and kube-controller-manager do it, because the operator's correctness
lives in these details (a job that is still there while its pods shut down, dependents that outlive
their owner for a moment):
- an object with finalizers gets deletionTimestamp and stays until the last finalizer is removed;
- propagationPolicy (query parameter or DeleteOptions body; default Background): Foreground adds
  the `foregroundDeletion` finalizer and the garbage collector removes it once no dependent with
  blockOwnerDeletion is left; Orphan adds `orphan` and the collector strips the dependents'
  ownerReferences before it lets the owner go; Background removes the owner at once;
- the garbage collector (a task in the emulator's loop, woken by every change, acting after
  `gc_delay` seconds so that a test can see the in-between state) deletes dependents whose owners
  (by uid) are all gone or waiting for their dependents (Foreground for a dependent that has
  dependents of its own, else Background), and drops the other references of a dependent that
  still has a live owner;
- pods bound to a node are deleted gracefully: deletionTimestamp = now + grace and
  deletionGracePeriodSeconds (DeleteOptions.gracePeriodSeconds, else
  spec.terminationGracePeriodSeconds, default 30); the kubelet (tests/operator/sim.py) stops the
  container and then deletes the pod with gracePeriodSeconds=0, which removes it. Unbound or
  finished pods, and gracePeriodSeconds=0, are removed at once;
- pods bound to a Node that no longer exists are force-deleted after `podgc_delay` seconds (the
  PodGC controller);
- pods/eviction (policy/v1 Eviction) adds the DisruptionTarget condition and deletes the pod
  (no PodDisruptionBudgets); pods/binding sets spec.nodeName and PodScheduled.
Server-side apply (PATCH application/apply-patch+yaml) follows tests/operator/apply.py.
Not emulated: admission webhooks, schema validation, namespace deletion, PodDisruptionBudgets.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import functools
import itertools
import json
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import orjson
import yaml
from kmock._internal import parsing as kmock_parsing

from tests.operator.apply import ApplyConflict
from tests.operator.apply import apply as server_side_apply

Obj = dict[str, Any]
GENERATE_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
"""k8s.io/apimachinery pkg/util/rand's alphanums, which SimpleNameGenerator draws from."""
GENERATE_NAME_RANDOM, GENERATED_NAME_BASE = 5, 58
"""randomLength and maxGeneratedNameLength (63 - 5) of k8s.io/apiserver pkg/storage/names/generate.go."""
# kmock's public API (everything else used here) has no hook for one thing: the path parser that
# _parse_path corrects (kmock._internal.parsing, the only private name used).
_kmock_parse_path = kmock_parsing.parse_path


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as the API server applies application/merge-patch+json: a null
    removes the key, an object merges into an object (anything else is replaced)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def patched(current: Obj, patch: Any) -> Obj:
    """A stored object after a merge patch (a JSON object) or a JSON patch (RFC 6902, a list)."""
    if isinstance(patch, dict):
        return dict(merge_patch(current, patch))
    if isinstance(patch, list):
        return dict(jsonpatch.apply_patch(current, patch, in_place=False))
    raise kmock.KubernetesError(status=400, reason="BadRequest", message="a patch is a JSON object or a JSON patch list")


def _parse_path(path: str) -> Any:
    """kmock reads `/api/v1/namespaces[/<name>]` as the start of a namespaced path and fails (a
    500): the API server serves it as the cluster-scoped Namespace list / object, which kopf lists
    and watches when it serves given namespaces."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) in (3, 4):
        return kmock_parsing.ParsedPath("", "v1", "namespaces", None, parts[3] if len(parts) == 4 else None, None)
    return _kmock_parse_path(path)


kmock_parsing.parse_path = _parse_path

RESOURCES: dict[str, dict[str, Any]] = {
    "v1/namespaces": {"kind": "Namespace", "singular": "namespace", "namespaced": False},
    # Served as on every cluster: kopf watches CRDs to follow resources as they come and go.
    "apiextensions.k8s.io/v1/customresourcedefinitions": {
        "kind": "CustomResourceDefinition", "singular": "customresourcedefinition", "namespaced": False},
    "v1/nodes": {"kind": "Node", "singular": "node", "namespaced": False, "subresources": ["status"]},
    "v1/events": {"kind": "Event", "singular": "event", "namespaced": True},
    "v1/configmaps": {"kind": "ConfigMap", "singular": "configmap", "namespaced": True},
    "v1/services": {"kind": "Service", "singular": "service", "namespaced": True},
    "v1/pods": {"kind": "Pod", "singular": "pod", "namespaced": True, "subresources": ["status", "eviction", "binding"]},
    "apps/v1/deployments": {"kind": "Deployment", "singular": "deployment", "namespaced": True, "subresources": ["status"]},
    "kubeflow.org/v1/pytorchjobs": {"kind": "PyTorchJob", "singular": "pytorchjob", "namespaced": True, "subresources": ["status"]},
    # Kubeflow Trainer v2.3 (tests/fixtures/upstream/kubeflow-trainer-v2.3; tests/operator/sim_trainjob.py plays its controller).
    "trainer.kubeflow.org/v1alpha1/trainjobs": {"kind": "TrainJob", "singular": "trainjob", "namespaced": True, "subresources": ["status"]},
    "trainer.kubeflow.org/v1alpha1/trainingruntimes": {"kind": "TrainingRuntime", "singular": "trainingruntime", "namespaced": True},
    "trainer.kubeflow.org/v1alpha1/clustertrainingruntimes": {
        "kind": "ClusterTrainingRuntime", "singular": "clustertrainingruntime", "namespaced": False},
    "monitoring.coreos.com/v1/podmonitors": {"kind": "PodMonitor", "singular": "podmonitor", "namespaced": True},
    "monitoring.coreos.com/v1/prometheusrules": {"kind": "PrometheusRule", "singular": "prometheusrule", "namespaced": True},
    # Kueue's Workloads (v1beta2 since Kueue v0.15): a test plays Kueue's job reconciler and scheduler.
    "kueue.x-k8s.io/v1beta2/workloads": {"kind": "Workload", "singular": "workload", "namespaced": True, "subresources": ["status"]},
    "llamaft.io/v1alpha1/llamafinetunes": {
        "kind": "LlamaFineTune", "singular": "llamafinetune", "namespaced": True, "subresources": ["status"],
        "shortnames": ["finetune", "finetunes", "lft"], "categories": ["all", "llamaft"],
    },
    # kopf's peering CRDs (crds/kopfpeerings.kopf.dev.yaml and crds/clusterkopfpeerings.kopf.dev.yaml):
    # no status subresource, so kopf's keep-alives merge-patch .status through the main endpoint.
    "kopf.dev/v1/kopfpeerings": {"kind": "KopfPeering", "singular": "kopfpeering", "namespaced": True},
    "kopf.dev/v1/clusterkopfpeerings": {"kind": "ClusterKopfPeering", "singular": "clusterkopfpeering", "namespaced": False},
}
VERBS = ["get", "list", "watch", "create", "patch", "update", "delete"]
FOREGROUND = "foregroundDeletion"
ORPHAN = "orphan"
TERMINAL_PHASES = ("Succeeded", "Failed")
STATS_PATH = "/_emulator/stats"
"""The emulator's own timings and recorded requests (EmulatorThread(timed=True)); not a Kubernetes path."""


def _rkey(resource: Any) -> tuple[str, str, str]:
    """A kmock resource as a plain tuple: hashing and comparing kmock's resource objects (attrs
    with a Protocol match in __eq__) was the emulator's largest cost per request."""
    return (resource.group or "", resource.version or "", resource.plural or "")


def _copy(obj: Obj) -> Obj:
    """A deep copy of a JSON document (what every stored object is): an orjson round trip, several
    times faster than copy.deepcopy and than the standard library's json (non-string keys become
    strings, as json.dumps makes them)."""
    return orjson.loads(orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS))  # type: ignore[no-any-return]


def _json_response(obj: Any, status: int = 200) -> aiohttp.web.Response:
    """aiohttp's json_response, encoded by orjson: the API server's replies are most of what the
    emulator spends its CPU on in a burst, and that CPU is not the operator's."""
    return aiohttp.web.Response(body=orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS), status=status,
                                content_type="application/json")


def _event_line(event: Obj) -> bytes:
    """One watch event as the stream's line (kmock would encode each with the standard library)."""
    return orjson.dumps(event, option=orjson.OPT_NON_STR_KEYS) + b"\n"


def now_rfc3339(offset_s: float = 0.0) -> str:
    """Kubernetes' timestamp format (second precision, UTC, `Z`)."""
    moment = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=offset_s)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


UPSTREAM_CRDS = (Path(__file__).resolve().parents[1] / "fixtures" / "upstream" / "kubeflow-trainer-v2.3"
                 / "trainer.kubeflow.org_trainjobs.yaml",)
"""Vendored upstream CRDs whose schema defaults the emulator applies too, as the API server would."""


@functools.lru_cache(maxsize=1)
def upstream_crd_schemas() -> dict[str, Obj]:
    """openAPIV3Schema per resource key of UPSTREAM_CRDS (parsed once: the TrainJob CRD is 550 kB)."""
    out: dict[str, Obj] = {}
    for path in UPSTREAM_CRDS:
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 (a safe loader)
        group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
        for version in crd["spec"]["versions"]:
            out[f"{group}/{version['name']}/{plural}"] = version["schema"]["openAPIV3Schema"]
    return out


def _crd_schemas() -> dict[str, Obj]:
    """openAPIV3Schema per resource key of the CRDs this repo defines (generated into crds/)."""
    out: dict[str, Obj] = {}
    for path in sorted((Path(__file__).resolve().parents[2] / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
        for version in crd["spec"]["versions"]:
            out[f"{group}/{version['name']}/{plural}"] = version["schema"]["openAPIV3Schema"]
    return out


def apply_defaults(value: Any, schema: Obj) -> Any:
    """Structural-schema defaulting as the API server does it: a missing property with a default
    gets it (then its own nested defaults), recursively through objects and arrays; a null for a
    non-nullable property is pruned first, so the default applies."""
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties") or {}
        for key in [k for k, v in value.items() if v is None and k in props and not props[k].get("nullable")]:
            del value[key]
        for key, sub in props.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(value[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in [k for k in value if k not in props]:
                value[key] = apply_defaults(value[key], extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


def merge_diff(old: Any, new: Any) -> Any:
    """A JSON merge patch that turns `old` into exactly `new` (removed keys become None)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return copy.deepcopy(new)
    patch: Obj = {key: None for key in old if key not in new}
    for key, value in new.items():
        if key not in old:
            patch[key] = copy.deepcopy(value)
        elif old[key] != value:
            patch[key] = merge_diff(old[key], value)
    return patch


def matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selectors: `a=b`, `a==b`, `a!=b`, `a`, `!a`, comma-separated."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def field_matches(selector: str, obj: Obj) -> bool:
    """Field selectors as the API server supports them for every kind (metadata.name,
    metadata.namespace) and for pods (spec.nodeName, status.phase): `a=b`, `a==b`, `a!=b`."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negate = "!=" in term
        path, value = term.split("!=" if negate else "=", 1)
        value = value.lstrip("=")
        current: Any = obj
        for part in path.split("."):
            current = current.get(part) if isinstance(current, dict) else None
        actual = "" if current is None else str(current)
        if (actual == value) == negate:
            return False
    return True


def _selected(request: Any, obj: Obj) -> bool:
    labels = request.params.get("labelSelector")
    fields = request.params.get("fieldSelector")
    if labels and not matches(labels, obj.get("metadata", {}).get("labels") or {}):
        return False
    return not (fields and not field_matches(fields, obj))


@attrs.frozen
class Recorded:
    """One request as an audit log would show it (what RBAC is checked against)."""

    method: str
    path: str
    params: dict[str, str]
    user_agent: str
    content_type: str = ""
    blocking_owners: tuple[str, ...] = ()
    """Kinds of the body's ownerReferences with blockOwnerDeletion (OwnerReferencesPermissionEnforcement
    requires `update` on those owners' finalizers subresource)."""


class Emulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    """The API server: kmock stores objects and serves reads; this class owns every write."""

    recorded: list[Recorded] | None = None
    """Every request, when a test asks for it (EmulatorThread(record=True))."""
    timings: list[tuple[str, float]] | None = None
    """(method, seconds) of every request but watches, from arrival to response, when asked for
    (EmulatorThread(timed=True)): the emulator's own latency. GET STATS_PATH reads (and with
    ?reset=1 clears) them together with the recorded requests and `lags`."""
    lags: list[float]
    """With timed: the loop's worst lateness per second (Emulator.measure_lag)."""

    gc_delay = 0.05
    """Seconds between a change and the garbage collector acting on it (a real GC takes ~10-100 ms)."""
    gc_period = 0.5
    """The collector also looks at everything this often (deadlines, missed wake-ups)."""
    podgc_delay = 2.0
    """Seconds a pod bound to a vanished Node stays before PodGC force-deletes it (real: 40 s)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(2)  # 1 is the default namespace's
        self._last_version = 0
        self._gc_wake = asyncio.Event()
        self._orphaned_since: dict[str, float] = {}
        self._schemas = {**upstream_crd_schemas(), **_crd_schemas()}
        self.lags = []
        self._infos: dict[tuple[str, str, str], Any] = {}
        self._infos_for = -1
        self._mirror: dict[tuple[str, str, str], dict[tuple[str | None, str], Obj]] = {}
        self._mirror_count = -1
        self.webhooks: list[Callable[[str, Obj], None]] = []
        """Mutating/validating admission a test plays (e.g. Kueue's job webhook): each is called on
        create with the resource key (group/version/plural) and the object, after the schema's
        defaults; it may change the object or raise KubernetesError to refuse it."""

    def _defaulted(self, resource: Any, obj: Obj) -> Obj:
        """Objects of this repo's CRDs (and of UPSTREAM_CRDS) get their schema's defaults, on create and on every write."""
        key = f"{resource.group}/{resource.version}/{resource.plural}" if resource.group else f"{resource.version}/{resource.plural}"
        schema = self._schemas.get(key)
        return apply_defaults(obj, schema) if schema is not None else obj

    @staticmethod
    def _admit(resource: Any, obj: Obj) -> None:
        """Admission as the cluster does it for PyTorchJobs (the Kubeflow CRD's schema and the
        training operator's webhook rules) and TrainJobs (the Trainer v2.3 CRD's schema and its
        webhook's rules, tests/operator/sim_trainjob.py); a rejected object is a 422 naming the fields."""
        if (resource.group, resource.plural) == ("trainer.kubeflow.org", "trainjobs"):
            from tests.operator.sim_trainjob import admission_errors

            problems = admission_errors(obj)
            if problems:
                name = obj.get("metadata", {}).get("name")
                raise kmock.KubernetesError(status=422, reason="Invalid",
                                          message=f'TrainJob.trainer.kubeflow.org "{name}" is invalid: {"; ".join(problems)[:1500]}')
            return
        if (resource.group, resource.plural) != ("kubeflow.org", "pytorchjobs"):
            return
        from tests.operator.kubeflow_rules import validate_pytorchjob

        errors = validate_pytorchjob(obj, llamaft_rules=False)
        if errors:
            name = obj.get("metadata", {}).get("name")
            raise kmock.KubernetesError(status=422, reason="Invalid",
                                      message=f'PyTorchJob.kubeflow.org "{name}" is invalid: {"; ".join(errors)[:1500]}')

    def _next_version(self) -> str:
        self._last_version = next(self._versions)
        return str(self._last_version)

    def _info(self, request: Any) -> Any:
        return self._info_for(request.resource)

    def _info_for(self, resource: Any) -> Any:
        """The declared ResourceInfo of a resource (None: not declared). Cached: kmock finds it by
        comparing against every resource of every stored object, per request."""
        if len(self.resources) != self._infos_for:
            self._infos = {_rkey(res): self.resources[res] for res in self.resources}
            self._infos_for = len(self.resources)
        return self._infos.get(_rkey(resource)) if resource is not None else None

    # ------------------------------------------------------------------------------ the store
    # kmock's store (`objects`, with its history views) stays the record that watches, dumps and
    # tests read; the mirror beside it holds each live object's current dict by plain keys, so
    # that reads are dict lookups instead of kmock's scans over every object of every kind.
    def _mirrored(self) -> dict[tuple[str, str, str], dict[tuple[str | None, str], Obj]]:
        """resource key -> (namespace, name) -> the live object (never mutated in place: every
        write stores a new dict). Rebuilt when objects were put into kmock's store directly."""
        if len(self._objects) != self._mirror_count:
            mirror: dict[tuple[str, str, str], dict[tuple[str | None, str], Obj]] = {}
            for (resource, namespace, name), obj in self._objects.items():
                bucket = mirror.setdefault(_rkey(resource), {})
                if not obj.deleted:
                    bucket[(namespace, name)] = obj.raw
            self._mirror, self._mirror_count = mirror, len(self._objects)
        return self._mirror

    def _current(self, key: tuple[Any, str | None, str]) -> Obj | None:
        """The stored object itself (read-only: for responses and checks), None if not live."""
        return self._mirrored().get(_rkey(key[0]), {}).get((key[1], key[2]))

    def _live(self, key: tuple[Any, str | None, str]) -> Obj | None:
        """A copy of the stored object to change, or None if it does not exist (never or any more)."""
        current = self._current(key)
        return None if current is None else _copy(current)

    async def _store(self, key: tuple[Any, str | None, str], new: Obj, event: str) -> Obj:
        """Write `new` as the object's next version and tell the watchers. Keeps one version of
        history: kmock would otherwise keep every version of every object forever. The stored
        dict is shared with the watchers and the response: nothing mutates it afterwards."""
        new = _copy(new)
        new.setdefault("metadata", {})["resourceVersion"] = self._next_version()
        mirror = self._mirrored()
        if key in self._objects:
            self._objects[key].history[:] = [new]
        else:
            self._objects[key] = new
            self._mirror_count += 1
        mirror.setdefault(_rkey(key[0]), {})[(key[1], key[2])] = new
        await self._buses[key[0]].put({"type": event, "object": new})
        self._gc_wake.set()
        return new

    async def _remove(self, key: tuple[Any, str | None, str]) -> Obj:
        last = _copy(self._objects[key].raw)
        last["metadata"]["resourceVersion"] = self._next_version()
        self._mirrored().get(_rkey(key[0]), {}).pop((key[1], key[2]), None)
        self._objects[key].history[:] = [last, None]
        await self._buses[key[0]].put({"type": "DELETED", "object": last})
        self._gc_wake.set()
        return last

    async def _store_or_release(self, key: tuple[Any, str | None, str], new: Obj) -> Obj:
        """After an update: an object being deleted whose last finalizer is gone (and, for a pod,
        whose grace period was cut to 0 by the kubelet) disappears, as on the API server."""
        stored = await self._store(key, new, "MODIFIED")
        meta = stored["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and not int(meta.get("deletionGracePeriodSeconds") or 0):
            return await self._remove(key)
        return stored

    # ---------------------------------------------------------------------------- dispatching
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if self.timings is None or raw_request.query.get("watch") in ("true", "1"):
            return await super().__call__(raw_request)  # a watch lasts as long as its client wants
        if raw_request.path == STATS_PATH:
            return self._serve_stats(raw_request)
        started = time.perf_counter()
        try:
            return await super().__call__(raw_request)
        finally:
            self.timings.append((raw_request.method, time.perf_counter() - started))

    def _serve_stats(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """The timings and recorded requests so far; ?reset=1 starts both afresh."""
        timings, recorded, lags = list(self.timings or []), list(self.recorded or []), list(self.lags)
        if raw_request.query.get("reset") in ("true", "1"):
            for kept in (self.timings, self.recorded, self.lags):
                if kept is not None:
                    kept.clear()
        return aiohttp.web.json_response({"timings": timings, "requests": [attrs.asdict(r) for r in recorded], "lags": lags})

    async def measure_lag(self) -> None:
        """Every second, the event loop's worst lateness in it (time a request can wait before it is
        even read: not part of `timings`), until cancelled."""
        while True:
            worst, until = 0.0, time.perf_counter() + 1.0
            while time.perf_counter() < until:
                before = time.perf_counter()
                await asyncio.sleep(0.01)
                worst = max(worst, time.perf_counter() - before - 0.01)
            self.lags.append(worst)

    async def _handle(self, request: Any) -> Any:
        # kmock records every request for assertions and matches reactions by scanning that log,
        # which makes each request cost O(requests so far). Nothing here asserts on the log, so
        # keep a short tail (the current request is the last entry).
        del self._requests[:-16]
        if self.recorded is not None:
            self.recorded.append(Recorded(
                method=str(request.method.value if hasattr(request.method, "value") else request.method).upper(),
                path=request.url.path, params=dict(request.params),
                user_agent=next((v for k, v in request.headers.items() if k.lower() == "user-agent"), ""),
                content_type=next((v for k, v in request.headers.items() if k.lower() == "content-type"), ""),
                blocking_owners=tuple(sorted({str(ref.get("kind")) for ref in (
                    ((request.data or {}).get("metadata") or {}).get("ownerReferences") or [] if isinstance(request.data, dict) else [])
                    if ref.get("blockOwnerDeletion")}))))
        if request.resource is not None and request.resource.plural and self._info_for(request.resource) is None:
            # As the API server: an undeclared resource (a CRD not installed) is a 404, not stored.
            return await self._render_error(kmock.KubernetesResourceNotFoundError())
        if request.resource is None:
            return await super()._handle(request)
        method = str(request.method.value if hasattr(request.method, "value") else request.method).upper()
        try:
            if (method == "GET" and request.resource.plural and request.subresource is None
                    and request.params.get("watch") not in ("true", "1")):
                # Reads from the mirror: kmock would match the request against its reactions and
                # scan every stored object.
                return await (self._serve_get(request) if request.name is not None else self._serve_list_request(request))
            if request.name is not None and request.subresource == "eviction" and method == "POST":
                return await self._serve_eviction(request)
            if request.name is not None and request.subresource == "binding" and method == "POST":
                return await self._serve_binding(request)
            if request.name is not None and request.subresource == "status" and method in ("GET", "PATCH", "PUT"):
                return await self._serve_write(request, status_only=True, replace=method == "PUT") if method != "GET" \
                    else await self._serve_get(request)
            if request.subresource is None:
                content_type = next((v for k, v in request.headers.items() if k.lower() == "content-type"), "")
                if request.name is not None and method == "PATCH" and content_type.startswith("application/apply-patch"):
                    return await self._serve_apply(request)
                if request.action == kmock.action.CREATE:
                    return await self._serve_create_request(request)
                if request.name is not None and method in ("PATCH", "PUT"):
                    return await self._serve_write(request, status_only=False, replace=method == "PUT")
                if request.name is not None and method == "DELETE":
                    return await self._serve_delete_request(request)
        except kmock.KubernetesError as exc:
            return await self._render_error(exc)
        return await super()._handle(request)

    async def _serve_get(self, request: Any) -> Any:
        obj = self._current((request.resource, request.namespace, request.name))
        if obj is None:
            raise kmock.KubernetesObjectNotFoundError()
        return _json_response(obj)

    async def _serve_list_request(self, request: Any) -> Any:
        """A list of one kind (in one namespace, or in all), with label and field selectors, as
        `<Kind>List` at the current resourceVersion."""
        info = self._info(request)
        group, version = request.resource.group, request.resource.version
        api_version = f"{group}/{version}" if group else version
        bucket = self._mirrored().get(_rkey(request.resource), {})
        items = [obj for (namespace, _), obj in bucket.items()
                 if (request.namespace is None or namespace == request.namespace) and _selected(request, obj)]
        if info is not None and info.kind:
            items = [obj if "kind" in obj and "apiVersion" in obj else {"kind": info.kind, "apiVersion": api_version, **obj}
                     for obj in items]
        return _json_response({
            "kind": f"{info.kind}List" if info is not None and info.kind else "List", "apiVersion": api_version,
            "metadata": {"resourceVersion": str(self._last_version)}, "items": items})

    # ---------------------------------------------------------------------------------- create
    async def _serve_create_request(self, request: Any) -> Any:
        if not isinstance(request.data, dict):
            raise kmock.KubernetesError(status=400, reason="BadRequest", message="the body must be a JSON object")
        key, obj = self._prepared_create(request, _copy(request.data))
        async with self._lock:
            if self._current(key) is not None:
                raise kmock.KubernetesError(status=409, reason="AlreadyExists",
                                          message=f'{request.resource.plural} "{obj["metadata"]["name"]}" already exists')
            stored = await self._store(key, obj, "ADDED")
        # The kubernetes client only decodes a create's body on 201.
        return _json_response(stored, status=201)

    def _generated_name(self, resource: Any, namespace: str | None, base: str) -> str:
        """metadata.generateName as the API server completes it: the base cut to 58 characters plus
        5 random characters from "bcdfghjklmnpqrstvwxz2456789" (k8s.io/apiserver pkg/storage/names
        SimpleNameGenerator.GenerateName, utilrand.String: no vowels, no look-alikes), drawn again
        on a clash (the RetryGenerateName behaviour, on by default since Kubernetes 1.31), so the
        create answers 409 only when every draw clashed."""
        if len(base) > GENERATED_NAME_BASE:
            base = base[:GENERATED_NAME_BASE]
        name = base + "".join(secrets.choice(GENERATE_NAME_ALPHABET) for _ in range(GENERATE_NAME_RANDOM))
        for _ in range(7):
            if self._current((resource, namespace, name)) is None:
                break
            name = base + "".join(secrets.choice(GENERATE_NAME_ALPHABET) for _ in range(GENERATE_NAME_RANDOM))
        return name

    def _prepared_create(self, request: Any, obj: Obj) -> tuple[tuple[Any, str | None, str], Obj]:
        """A new object as the API server stores it: server fields, defaults, admission."""
        meta = obj.setdefault("metadata", {})
        if request.namespace and "namespace" not in meta:
            meta["namespace"] = request.namespace
        if "generateName" in meta and "name" not in meta:
            meta["name"] = self._generated_name(request.resource, request.namespace or meta.get("namespace"), str(meta["generateName"]))
        if not meta.get("name"):
            raise kmock.KubernetesError(status=422, reason="Invalid", message="metadata.name: Required value")
        meta["uid"] = str(uuid.uuid4())
        meta["generation"] = 1
        meta["creationTimestamp"] = now_rfc3339()
        for field in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(field, None)
        info = self._info(request)
        if info is not None and "status" in info.subresources:
            obj.pop("status", None)  # a create cannot set the status of a resource with /status
        if info is not None and info.kind:
            group, version = request.resource.group, request.resource.version
            obj.setdefault("apiVersion", f"{group}/{version}" if group else version)
            obj.setdefault("kind", info.kind)
        if info is not None and info.kind == "Pod":
            self._default_pod(obj)
        obj = self._defaulted(request.resource, obj)
        resource = request.resource
        for webhook in self.webhooks:
            webhook(f"{resource.group}/{resource.version}/{resource.plural}" if resource.group
                    else f"{resource.version}/{resource.plural}", obj)
        self._admit(request.resource, obj)
        return (request.resource, request.namespace or meta.get("namespace"), meta["name"]), obj

    # --------------------------------------------------------------------- server-side apply
    async def _serve_apply(self, request: Any) -> Any:
        """PATCH with application/apply-patch+yaml (tests/operator/apply.py has the rules)."""
        manager = request.params.get("fieldManager")
        if not manager:
            raise kmock.KubernetesError(status=422, reason="Invalid", message="PatchOptions.meta.k8s.io \"\" is invalid: "
                                      "fieldManager: Required value: is required for apply patch")
        if not isinstance(request.data, dict):
            raise kmock.KubernetesError(status=400, reason="BadRequest", message="the body must be a JSON or YAML object")
        force = str(request.params.get("force", "")).lower() == "true"
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            current = self._live(key)
            try:
                new = server_side_apply(current, request.data, manager, force)
            except ApplyConflict as exc:
                raise kmock.KubernetesError(status=409, reason="Conflict", message=str(exc)) from None
            if current is None:
                new["metadata"]["name"] = request.name
                key, new = self._prepared_create(request, new)
                return _json_response(await self._store(key, new, "ADDED"), status=201)
            if new is current:
                return _json_response(current)
            for field in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
                if field in current["metadata"]:
                    new["metadata"][field] = current["metadata"][field]
            if "status" in current:
                new["status"] = current["status"]
            new = self._defaulted(request.resource, new)
            new["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + (new.get("spec") != current.get("spec"))
            if new == current:
                return _json_response(current)
            self._admit(request.resource, new)
            stored = await self._store_or_release(key, new)
        return _json_response(stored)

    @staticmethod
    def _default_pod(pod: Obj) -> None:
        """The API server's defaulting for the fields the kubelet and the deletion logic read."""
        spec = pod.setdefault("spec", {})
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("schedulerName", "default-scheduler")
        for container in spec.get("containers") or []:
            container.setdefault("terminationMessagePath", "/dev/termination-log")
            container.setdefault("terminationMessagePolicy", "File")
        pod["status"] = {"phase": "Pending", "qosClass": "BestEffort"}

    # ----------------------------------------------------------------------- patch, put, status
    async def _serve_write(self, request: Any, *, status_only: bool, replace: bool) -> Any:
        key = (request.resource, request.namespace, request.name)
        info = self._info(request)
        async with self._lock:
            current = self._live(key)
            if current is None:
                raise kmock.KubernetesObjectNotFoundError()
            if replace:
                if not isinstance(request.data, dict):
                    raise kmock.KubernetesError(status=400, reason="BadRequest", message="the body must be a JSON object")
                wanted = str(request.data.get("metadata", {}).get("resourceVersion") or "")
                new = _copy(request.data)
            else:
                wanted = str(request.data.get("metadata", {}).get("resourceVersion") or "") if isinstance(request.data, dict) else ""
                try:
                    new = _copy(patched(current, request.data))
                except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict, jsonpatch.JsonPointerException) as exc:
                    raise kmock.KubernetesError(status=422, reason="Invalid", message=f"the patch cannot be applied: {exc}") from None
            uid = str(request.data.get("metadata", {}).get("uid") or "") if isinstance(request.data, dict) else ""
            if uid and uid != current["metadata"].get("uid"):
                raise kmock.KubernetesError(status=409, reason="Conflict", message=f"Precondition failed: UID in precondition: {uid}, "
                                          f"UID in object meta: {current['metadata'].get('uid')}")
            if wanted and wanted != current["metadata"].get("resourceVersion"):
                raise kmock.KubernetesError(
                    status=409, reason="Conflict",
                    message=f"Operation cannot be fulfilled on {request.resource.plural} \"{request.name}\": "
                            "the object has been modified; please apply your changes to the latest version and try again")
            if info is not None and "status" in info.subresources:
                if status_only:
                    new = {**current, "status": new.get("status")}
                    if new["status"] is None:
                        new.pop("status")
                elif "status" in current:
                    new["status"] = current["status"]
                else:
                    new.pop("status", None)
            meta = new.setdefault("metadata", {})
            # Fields only the server sets.
            for field in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "name", "namespace"):
                if field in current["metadata"]:
                    meta[field] = current["metadata"][field]
                else:
                    meta.pop(field, None)
            new = self._defaulted(request.resource, new)
            meta["generation"] = int(current["metadata"].get("generation", 1))
            if new.get("spec") != current.get("spec"):
                meta["generation"] += 1
            stored = await self._store_or_release(key, new)
        return _json_response(stored)

    # ---------------------------------------------------------------------------------- delete
    async def _serve_delete_request(self, request: Any) -> Any:
        body = request.data if isinstance(request.data, dict) else {}
        params = request.params
        policy = params.get("propagationPolicy") or body.get("propagationPolicy")
        if policy is None and ("orphanDependents" in params or "orphanDependents" in body):
            orphan = str(params.get("orphanDependents", body.get("orphanDependents"))).lower() == "true"
            policy = "Orphan" if orphan else "Background"
        grace_text = params.get("gracePeriodSeconds", body.get("gracePeriodSeconds"))
        grace = int(grace_text) if grace_text is not None else None
        preconditions = body.get("preconditions") or {}
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            result, pending = await self._delete(key, policy=policy, grace=grace, preconditions=preconditions)
        # As the API server: 202 only for a pending deletion asked for with orphanDependents=false
        # (kept for old clients), 200 otherwise.
        explicit = str(params.get("orphanDependents", body.get("orphanDependents", ""))).lower() == "false"
        return _json_response(result, status=202 if pending and explicit else 200)

    async def _delete(self, key: tuple[Any, str | None, str], *, policy: str | None = None, grace: int | None = None,
                      preconditions: dict[str, Any] | None = None) -> tuple[Obj, bool]:
        """The API server's deletion, for requests and for the collectors. Call with the lock held.
        Returns (the object as it now is, whether it still exists)."""
        current = self._live(key)
        if current is None:
            raise kmock.KubernetesObjectNotFoundError()
        meta = current["metadata"]
        for field in ("uid", "resourceVersion"):
            if (preconditions or {}).get(field) and preconditions[field] != meta.get(field):  # type: ignore[index]
                raise kmock.KubernetesError(status=409, reason="Conflict", message=f"Precondition failed: {field} mismatch")
        if policy not in (None, "Foreground", "Background", "Orphan"):
            raise kmock.KubernetesError(status=400, reason="BadRequest", message=f"unknown propagationPolicy {policy!r}")
        info = self._info_for(key[0])
        is_pod = info is not None and info.kind == "Pod"
        if is_pod:
            spec, status = current.get("spec", {}), current.get("status", {})
            if grace is None:
                grace = int(spec.get("terminationGracePeriodSeconds", 30))
            if not spec.get("nodeName") or status.get("phase") in TERMINAL_PHASES:
                grace = 0  # nothing runs it, or it has finished: no kubelet needs to stop anything
        else:
            grace = 0
        grace = max(grace, 0)
        finalizers = list(meta.get("finalizers") or [])
        if policy == "Foreground" and FOREGROUND not in finalizers:
            finalizers.append(FOREGROUND)
        elif policy == "Orphan" and ORPHAN not in finalizers:
            finalizers.append(ORPHAN)
        if meta.get("deletionTimestamp"):
            # Already being deleted: a later DELETE can only shorten a pod's grace period and add
            # the collector's finalizers.
            old_grace = int(meta.get("deletionGracePeriodSeconds") or 0)
            if grace < old_grace:
                meta["deletionGracePeriodSeconds"] = grace
                meta["deletionTimestamp"] = now_rfc3339(grace)
            elif finalizers == list(meta.get("finalizers") or []):
                return current, True
            meta["finalizers"] = finalizers
            stored = await self._store_or_release(key, current)
            return stored, key in self._objects and not self._objects[key].deleted
        if not finalizers and grace == 0:
            return await self._remove(key), False
        meta["deletionTimestamp"] = now_rfc3339(grace)
        meta["deletionGracePeriodSeconds"] = grace
        if finalizers:
            meta["finalizers"] = finalizers
        if meta.get("generation"):
            meta["generation"] = int(meta["generation"]) + 1
        return await self._store(key, current, "MODIFIED"), True

    # ------------------------------------------------------------------- eviction and binding
    async def _serve_eviction(self, request: Any) -> Any:
        """policy/v1 Eviction: DisruptionTarget condition, then a graceful delete (no PDBs here)."""
        key = (request.resource, request.namespace, request.name)
        options = (request.data or {}).get("deleteOptions") or {} if isinstance(request.data, dict) else {}
        async with self._lock:
            pod = self._live(key)
            if pod is None:
                raise kmock.KubernetesObjectNotFoundError()
            if not pod["metadata"].get("deletionTimestamp") and pod.get("status", {}).get("phase") not in TERMINAL_PHASES:
                status = pod.setdefault("status", {})
                status["conditions"] = [c for c in status.get("conditions") or [] if c.get("type") != "DisruptionTarget"] + [{
                    "type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                    "message": "Eviction API: evicting", "lastTransitionTime": now_rfc3339(),
                }]
                await self._store(key, pod, "MODIFIED")
            grace = options.get("gracePeriodSeconds")
            await self._delete(key, policy=options.get("propagationPolicy"), grace=None if grace is None else int(grace),
                               preconditions=options.get("preconditions"))
        return _json_response(
            {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}, status=201)

    async def _serve_binding(self, request: Any) -> Any:
        """The scheduler's bind: spec.nodeName (once) and PodScheduled=True."""
        key = (request.resource, request.namespace, request.name)
        target = ((request.data or {}).get("target") or {}).get("name") if isinstance(request.data, dict) else None
        if not target:
            raise kmock.KubernetesError(status=422, reason="Invalid", message="target.name: Required value")
        async with self._lock:
            pod = self._live(key)
            if pod is None:
                raise kmock.KubernetesObjectNotFoundError()
            if pod.get("spec", {}).get("nodeName"):
                raise kmock.KubernetesError(status=409, reason="Conflict",
                                          message=f"pod {request.name} is already assigned to node {pod['spec']['nodeName']!r}")
            pod.setdefault("spec", {})["nodeName"] = target
            status = pod.setdefault("status", {})
            status["conditions"] = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"] + [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now_rfc3339()}]
            await self._store(key, pod, "MODIFIED")
        return _json_response(
            {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}, status=201)

    # ------------------------------------------------------------------------- the collectors
    async def run_collectors(self) -> None:
        """The garbage collector and PodGC, until cancelled. Woken by every change; each pass
        waits `gc_delay` first, so that dependents visibly outlive their owner for a moment."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gc_wake.wait(), self.gc_period)
            self._gc_wake.clear()
            await asyncio.sleep(self.gc_delay)
            try:
                async with self._lock:
                    await self._collect()
            except Exception:  # noqa: BLE001 (a collector bug must not stop the collector)
                import traceback

                traceback.print_exc()

    async def _collect(self) -> None:
        live: dict[tuple[Any, str | None, str], Obj] = {}
        for key in list(self._objects.keys()):
            current = self._current(key)
            if current is not None:
                live[key] = current
        by_uid = {raw.get("metadata", {}).get("uid"): key for key, raw in live.items()}
        dependents: dict[str, list[tuple[Any, Obj]]] = {}
        for key, raw in live.items():
            for ref in raw.get("metadata", {}).get("ownerReferences") or []:
                dependents.setdefault(ref.get("uid"), []).append((key, ref))

        def waiting(uid: str) -> bool:
            owner = live.get(by_uid.get(uid))  # type: ignore[arg-type]
            meta = (owner or {}).get("metadata", {})
            return bool(meta.get("deletionTimestamp")) and FOREGROUND in (meta.get("finalizers") or [])

        # Dependents: delete those without a solid owner; drop dangling references of the others.
        for key, raw in live.items():
            meta = raw.get("metadata", {})
            refs = meta.get("ownerReferences") or []
            if not refs or meta.get("deletionTimestamp") or self._current(key) is None:
                continue
            dangling = [r for r in refs if r.get("uid") not in by_uid]
            waiting_for = [r for r in refs if r.get("uid") in by_uid and waiting(r["uid"])]
            solid = [r for r in refs if r not in dangling and r not in waiting_for]
            if solid:
                if dangling or waiting_for:  # as the real collector: keep only the solid owners
                    current = self._live(key)
                    assert current is not None
                    current["metadata"]["ownerReferences"] = solid
                    await self._store(key, current, "MODIFIED")
                continue
            policy = "Foreground" if waiting_for and dependents.get(meta.get("uid")) else "Background"
            with contextlib.suppress(kmock.KubernetesError):
                await self._delete(key, policy=policy)

        # Owners: release foreground deletions without blocking dependents, orphan on request.
        for key, raw in live.items():
            meta = raw.get("metadata", {})
            finalizers = meta.get("finalizers") or []
            if not meta.get("deletionTimestamp") or not (FOREGROUND in finalizers or ORPHAN in finalizers):
                continue
            uid = meta.get("uid")
            deps = [(k, r) for k, r in dependents.get(uid, []) if self._current(k) is not None]
            if ORPHAN in finalizers:
                for dep_key, _ in deps:
                    dep = self._live(dep_key)
                    assert dep is not None
                    dep["metadata"]["ownerReferences"] = [r for r in dep["metadata"].get("ownerReferences") or [] if r.get("uid") != uid]
                    if not dep["metadata"]["ownerReferences"]:
                        dep["metadata"].pop("ownerReferences")
                    await self._store(dep_key, dep, "MODIFIED")
                removed = ORPHAN
            elif not any(r.get("blockOwnerDeletion") for _, r in deps):
                removed = FOREGROUND
            else:
                continue
            current = self._live(key)
            if current is not None:
                current["metadata"]["finalizers"] = [f for f in current["metadata"].get("finalizers") or [] if f != removed]
                if not current["metadata"]["finalizers"]:
                    current["metadata"].pop("finalizers")
                await self._store_or_release(key, current)

        # PodGC: pods bound to a Node that no longer exists.
        kinds = {(r.group, r.version, r.plural): self.resources[r].kind for r in self.resources}

        def kind(key: tuple[Any, str | None, str]) -> str | None:
            return kinds.get((key[0].group, key[0].version, key[0].plural))

        nodes = {key[2] for key in live if kind(key) == "Node"}
        now = time.monotonic()
        seen: set[str] = set()
        for key, raw in live.items():
            node = raw.get("spec", {}).get("nodeName")
            if kind(key) != "Pod" or not node or node in nodes:
                continue
            uid = raw["metadata"]["uid"]
            seen.add(uid)
            first = self._orphaned_since.setdefault(uid, now)
            if now - first >= self.podgc_delay and self._current(key) is not None:
                with contextlib.suppress(kmock.KubernetesError):
                    await self._delete(key, grace=0)
        self._orphaned_since = {uid: t for uid, t in self._orphaned_since.items() if uid in seen}

    # ------------------------------------------------------------------------------- reading
    async def _serve_watch(self, request: Any) -> Any:
        """As the API server: the objects that exist (for a watch from resourceVersion N, those
        written after N; kmock replays everything, which hands kopf stale duplicates of what it
        just listed), then every change, with nothing lost in between: the stream's place on the
        event bus is taken before the objects are listed, under the store's lock (kmock listed
        first and joined the bus after sending the list: a watch restarted during a burst of
        creates missed the objects created meanwhile, and kopf never saw them). Label and field
        selectors apply; with allowWatchBookmarks, a BOOKMARK every `bookmark_period` seconds of
        quiet, as the API server sends them (kopf reconnects a stream silent for 70 s)."""
        yield b""  # the headers: the stream has started
        resource = request.resource
        since = int(request.params.get("resourceVersion") or 0) if str(request.params.get("resourceVersion", "")).isdigit() else 0
        bus = self._buses[resource]

        def wanted(obj: Obj) -> bool:
            meta = obj.get("metadata", {})
            return ((request.namespace is None or meta.get("namespace") == request.namespace)
                    and (request.name is None or meta.get("name") == request.name) and _selected(request, obj))

        async with self._lock:
            marker = await bus.mark()
            existing = [obj for obj in self._mirrored().get(_rkey(resource), {}).values()
                        if wanted(obj) and not (since and int(obj["metadata"].get("resourceVersion", 0)) <= since)]
        events: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            async for event in bus.stream(since=marker):
                await events.put(event)

        pumping = asyncio.create_task(pump())
        info = self._info_for(resource)
        group, version = resource.group, resource.version
        bookmark = {"kind": info.kind if info is not None else "", "apiVersion": f"{group}/{version}" if group else version}
        bookmarks = request.params.get("allowWatchBookmarks") in ("true", "1")
        try:
            for obj in existing:
                yield _event_line({"type": "ADDED", "object": obj})
            while True:
                try:
                    event = await (asyncio.wait_for(events.get(), self.bookmark_period) if bookmarks else events.get())
                except TimeoutError:
                    yield _event_line({"type": "BOOKMARK", "object": {**bookmark, "metadata": {"resourceVersion": str(self._last_version)}}})
                    continue
                if wanted(event.get("object", {})):
                    yield _event_line(event)
        finally:
            pumping.cancel()  # the bus forgets the position once nothing holds its marker (weak keys)

    bookmark_period = 30.0
    """Seconds of quiet on a watch with allowWatchBookmarks before a BOOKMARK (the API server: ~60)."""


def write_kubeconfig(url: str, path: Path) -> Path:
    """A kubeconfig whose current context points at the emulator (kubectl, kopf and clients use it)."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "kmock", "user": {"token": "kmock"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": "default"}}],
    }))
    return path


class EmulatorThread:
    """The emulator on 127.0.0.1:<port>, in its own thread and event loop, for subprocess clients."""

    def __init__(self, without: tuple[str, ...] = (), *, gc_delay: float | None = None,
                 podgc_delay: float | None = None, record: bool = False, timed: bool = False) -> None:
        """`without`: resources this "cluster" does not serve (e.g. no Prometheus Operator).
        `gc_delay`/`podgc_delay`: see Emulator (how long deletions visibly take).
        `record`: keep every request; `timed`: time every request (Emulator.timings, STATS_PATH)."""
        self.without = without
        self.gc_delay, self.podgc_delay = gc_delay, podgc_delay
        self.record, self.timed = record, timed
        self.url = ""
        self.emulator: Emulator | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="kmock")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with Emulator() as emulator, kmock.Server(emulator) as server:
            if self.gc_delay is not None:
                emulator.gc_delay = self.gc_delay
            if self.podgc_delay is not None:
                emulator.podgc_delay = self.podgc_delay
            if self.record:
                emulator.recorded = []
            if self.timed:
                emulator.timings = []
                lag = asyncio.create_task(emulator.measure_lag())
            for key, info in RESOURCES.items():
                if key not in self.without:
                    emulator.resources[key] = {**info, "verbs": VERBS}
            emulator.objects["v1/namespaces", None, "default"] = {
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": "default", "uid": str(uuid.uuid4()), "resourceVersion": "1"},
            }
            collectors = asyncio.create_task(emulator.run_collectors())
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                if self.timed:
                    lag.cancel()
                collectors.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collectors

    def start(self) -> EmulatorThread:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("kmock emulator did not start")
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def dump(self) -> str:
        """Every live object, for a failing test's message."""
        emulator = self.emulator
        if emulator is None:
            return "{}"
        out = {f"{key[0].plural}/{key[1]}/{key[2]}": obj.raw for key, obj in list(emulator.objects.items()) if not obj.deleted}
        return json.dumps(out, indent=1, default=str)

    def requests(self) -> list[Recorded]:
        """What the emulator recorded so far (EmulatorThread(record=True))."""
        emulator = self.emulator
        return list(emulator.recorded or []) if emulator is not None else []
