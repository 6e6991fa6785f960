"""kmock's KubernetesEmulator plus what kopf and these tests need of a real API server.

Adds, per ../shared/reference/NOTES.md: uid, resourceVersion, generation (bumped on spec changes)
and creationTimestamp; JSON-patch `test` failures as 422 (kopf's finalizer patch relies on it);
kind/apiVersion on lists; status-subresource isolation (the main endpoint ignores .status, /status
changes only .status). Not emulated: ownerReference GC, admission webhooks, schema validation.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import threading
import uuid
from pathlib import Path
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
import yaml
from kmock._internal import dicts, enums, k8s

Obj = dict[str, Any]

RESOURCES: dict[str, dict[str, Any]] = {
    "v1/namespaces": {"kind": "Namespace", "singular": "namespace", "namespaced": False},
    "v1/events": {"kind": "Event", "singular": "event", "namespaced": True},
    "v1/configmaps": {"kind": "ConfigMap", "singular": "configmap", "namespaced": True},
    "v1/services": {"kind": "Service", "singular": "service", "namespaced": True},
    "v1/pods": {"kind": "Pod", "singular": "pod", "namespaced": True, "subresources": ["status"]},
    "apps/v1/deployments": {"kind": "Deployment", "singular": "deployment", "namespaced": True, "subresources": ["status"]},
    "kubeflow.org/v1/pytorchjobs": {"kind": "PyTorchJob", "singular": "pytorchjob", "namespaced": True, "subresources": ["status"]},
    "monitoring.coreos.com/v1/podmonitors": {"kind": "PodMonitor", "singular": "podmonitor", "namespaced": True},
    "monitoring.coreos.com/v1/prometheusrules": {"kind": "PrometheusRule", "singular": "prometheusrule", "namespaced": True},
    "llamaft.io/v1alpha1/llamafinetunes": {
        "kind": "LlamaFineTune", "singular": "llamafinetune", "namespaced": True, "subresources": ["status"],
        "shortnames": ["finetune", "finetunes", "lft"], "categories": ["all", "llamaft"],
    },
}
VERBS = ["get", "list", "watch", "create", "patch", "update", "delete"]


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


class Emulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1)
        self._last_version = 0

    def _next_version(self) -> str:
        self._last_version = next(self._versions)
        return str(self._last_version)

    def _info(self, request: Any) -> Any:
        for res in self._get_resources():
            if res == request.resource:
                return self.resources[res]
        return None

    async def _handle(self, request: Any) -> Any:
        # kmock records every request for assertions and matches reactions by scanning that log,
        # which makes each request cost O(requests so far). Nothing here asserts on the log, so
        # keep a short tail (the current request is the last entry).
        del self._requests[:-16]
        if (request.resource is not None and request.resource.plural
                and request.resource not in k8s.KubernetesScaffold._get_resources(self)):
            # As the API server: an undeclared resource (a CRD not installed) is a 404, not stored.
            return await self._render_error(k8s.KubernetesResourceNotFoundError())
        if request.resource is not None and request.action == enums.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if request.namespace and "namespace" not in meta:
                meta["namespace"] = request.namespace
            if "generateName" in meta and "name" not in meta:
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta["resourceVersion"] = self._next_version()
            meta.setdefault("generation", 1)
            meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        elif request.resource is not None and request.subresource == "status" and request.name is not None:
            try:
                return await self._serve_status(request)
            except k8s.KubernetesError as exc:
                return await self._render_error(exc)
        elif request.resource is not None and request.action == enums.action.UPDATE and request.name is not None:
            request = await self._rewrite_update(request)
        response = await super()._handle(request)
        if request.resource is not None and request.action == enums.action.CREATE and response.status == 200:
            response.set_status(201)  # the kubernetes client only decodes a create's body on 201
        return response

    async def _serve_status(self, request: Any) -> Any:
        """GET/PATCH .../<name>/status: reads the object, changes only its .status."""
        key = (request.resource, request.namespace, request.name)
        if request.action == enums.action.UPDATE:
            request = await self._rewrite_update(request)
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                raise k8s.KubernetesObjectNotFoundError()
            if request.action == enums.action.UPDATE:
                self._objects[key].patch(request.data)
                await self._buses[request.resource].put({"type": "MODIFIED", "object": self._objects[key].raw})
            raw = copy.deepcopy(dict(self._objects[key].raw))
        return aiohttp.web.json_response(raw)

    async def _rewrite_update(self, request: Any) -> Any:
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                raise k8s.KubernetesObjectNotFoundError()
            current = copy.deepcopy(dict(self._objects[key].raw))
        try:
            new = copy.deepcopy(dict(dicts.patch_dict(current, request.data)))
        except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict, jsonpatch.JsonPointerException) as exc:
            raise k8s.KubernetesError(status=422, reason="Invalid", message=f"the patch cannot be applied: {exc}") from None
        info = self._info(request)
        if info is not None and "status" in info.subresources:
            if request.subresource == "status":
                new = {**current, "status": new.get("status")}
                if new["status"] is None:
                    new.pop("status")
            elif "status" in current:
                new["status"] = current["status"]
            else:
                new.pop("status", None)
        meta = new.setdefault("metadata", {})
        meta["resourceVersion"] = self._next_version()
        if new.get("spec") != current.get("spec"):
            meta["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1
        # kmock tracks the request object itself (a copy would match no reaction): rewrite its data.
        object.__setattr__(request, "data", merge_diff(current, new))
        return request

    async def _serve_watch(self, request: Any) -> Any:
        """As the API server: a watch from resourceVersion N does not replay objects at or below N
        (kmock replays everything, which hands kopf stale duplicates of what it just listed)."""
        since = int(request.params.get("resourceVersion") or 0) if str(request.params.get("resourceVersion", "")).isdigit() else 0
        async for event in super()._serve_watch(request):
            if isinstance(event, dict) and event.get("type") == "ADDED" and since:
                version = event.get("object", {}).get("metadata", {}).get("resourceVersion", "0")
                if str(version).isdigit() and int(version) <= since:
                    continue
            yield event

    async def _serve_list(self, request: Any) -> Any:
        result = await super()._serve_list(request)
        result["metadata"] = {"resourceVersion": str(self._last_version)}
        selector = request.params.get("labelSelector")
        if selector:
            result["items"] = [i for i in result["items"] if matches(selector, i.get("metadata", {}).get("labels") or {})]
        info = self._info(request)
        if info is not None and info.kind:
            result["kind"] = f"{info.kind}List"
            group, version = request.resource.group, request.resource.version
            result["apiVersion"] = f"{group}/{version}" if group else version
            for item in result["items"]:
                item.setdefault("kind", info.kind)
                item.setdefault("apiVersion", result["apiVersion"])
        return result


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

    def __init__(self, without: tuple[str, ...] = ()) -> None:
        """`without`: resources this "cluster" does not serve (e.g. no Prometheus Operator)."""
        self.without = without
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
            for key, info in RESOURCES.items():
                if key not in self.without:
                    emulator.resources[key] = {**info, "verbs": VERBS}
            emulator.objects["v1/namespaces", None, "default"] = {
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": "default", "uid": str(uuid.uuid4()), "resourceVersion": "1"},
            }
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def start(self) -> EmulatorThread:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("kmock emulator did not start")
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
