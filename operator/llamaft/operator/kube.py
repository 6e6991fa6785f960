"""The Kubernetes calls the operator makes, in one place (the chart's RBAC is derived from them).

Every call is idempotent by name: create treats 409 as "already there", delete treats 404 as
"already gone", get returns None for 404; children the spec describes are server-side applied.
Objects are plain dicts (as the pure functions build them).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, cast

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from llamaft.render.backends import BACKENDS

Obj = dict[str, Any]
JOBS = {kind: (b.resource.group, b.resource.version, b.resource.plural) for kind, b in BACKENDS.items()}
"""An attempt's job resource, by backend (spec.backend / status.backend): render.backends says."""
FIELD_MANAGER = "llamaft"
USER_AGENT = "llamaft-operator"
APPLY_PATCH = "application/apply-patch+yaml"
LLAMAFINETUNES = ("llamaft.io", "v1alpha1", "llamafinetunes")

# (api group, resource, verbs): what this module calls (tests/helm/test_chart.py reads the calls
# from this file and compares). tests/operator/test_rbac.py compares the chart's grants with these
# calls plus kopf's own, recorded from a running operator.
API_CALLS: list[tuple[str, str, tuple[str, ...]]] = [
    ("llamaft.io", "llamafinetunes", ("get",)),
    ("llamaft.io", "llamafinetunes/status", ("patch",)),
    ("kubeflow.org", "pytorchjobs", ("get", "list", "create", "patch", "delete")),
    ("trainer.kubeflow.org", "trainjobs", ("get", "list", "create", "patch", "delete")),
    # children: server-side apply is `patch`, plus `create` when the apply creates the object
    # (kubernetes apiserver, endpoints/handlers/patch.go: createAuthorizerAttributes); get checks
    # the owner before the first apply; list and delete prune.
    ("", "configmaps", ("get", "create", "patch", "list", "delete")),
    ("apps", "deployments", ("get", "create", "patch", "list", "delete")),
    ("", "services", ("get", "create", "patch", "list", "delete")),
    ("", "pods", ("list",)),
    ("monitoring.coreos.com", "podmonitors", ("get", "create", "patch", "list", "delete")),
    ("monitoring.coreos.com", "prometheusrules", ("get", "create", "patch", "list", "delete")),
    # an elastic run's job that Kueue holds: its Workload says whether it waits for quota (operator/elastic.py)
    ("kueue.x-k8s.io", "workloads", ("list",)),
]
WORKLOADS = ("kueue.x-k8s.io", "workloads")
WORKLOAD_VERSIONS = ("v1beta2", "v1beta1")
"""Kueue serves v1beta2 since v0.15 and v1beta1 before it (apis/kueue/): the newest one served."""
MONITORING = {"PodMonitor": "podmonitors", "PrometheusRule": "prometheusrules"}


class MonitoringUnavailable(RuntimeError):
    """The Prometheus Operator's CRDs are not installed in the cluster."""


class ForeignObject(RuntimeError):
    """An object of the wanted name exists but belongs to another owner, typically the previous
    incarnation of a LlamaFineTune deleted and re-applied at once: wait until it is gone."""


def owned_by(obj: Obj, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences", []) or [])


def _owner_uid(obj: Obj) -> str | None:
    refs = obj.get("metadata", {}).get("ownerReferences", []) or []
    return str(refs[0].get("uid")) if refs else None


def _plain(api: client.ApiClient, obj: Any) -> Obj:
    out: Obj = api.sanitize_for_serialization(obj)  # type: ignore[no-untyped-call]
    return out


RAW: dict[str, Any] = {"_preload_content": False}
"""Read built-in kinds as JSON: the generated client's models would cost a deserialization and
then a serialization back to the plain dict the operator works on (most of a read's CPU time)."""


def _json(response: Any) -> Obj:
    return cast(Obj, json.loads(response.data))


def refresh_at_most_every(seconds: float, hook: Callable[[Any], None] | None,
                          clock: Callable[[], float] = time.monotonic) -> Callable[[Any], None] | None:
    """The kubernetes client's credential refresh, run at most once per `seconds`. Its loaders'
    hook (incluster_config.py and kube_config.py `_set_config`) runs before every request and
    sets the configuration's host, CA and token again each time; setting `host` looks the proxies
    up in the whole environment (urllib's getproxies_environment), and a pod's environment holds
    a variable per Service of its namespace. The loaders refresh a token well before it is due
    (in-cluster: the token file every minute; a kubeconfig token 5 minutes before its expiry), so
    looking every `seconds` (well under both) changes nothing but the cost.

    Each run of a loader's hook installs a new hook on the configuration it was given (both
    loaders' `_set_config` end with `refresh_api_key_hook = _refresh_api_key`): the wrapper takes
    that one as the hook to run next time and puts itself back, or the first request would
    unwrap it for good."""
    if hook is None:
        return None
    due = [clock()]
    current = [hook]

    def refresh(configuration: Any) -> None:
        now = clock()
        if now < due[0]:
            return
        current[0](configuration)
        due[0] = now + seconds
        installed = getattr(configuration, "refresh_api_key_hook", None)
        if installed is not None and installed is not refresh:
            current[0] = installed
            configuration.refresh_api_key_hook = refresh

    return refresh


def throttle_credential_refresh(seconds: float = 30.0) -> None:
    """Wrap the default configuration's refresh hook (see refresh_at_most_every); call once the
    credentials are loaded, before any client is made from the default configuration."""
    configuration = client.Configuration.get_default_copy()
    configuration.refresh_api_key_hook = refresh_at_most_every(  # type: ignore[assignment]  # typed as None only
        seconds, configuration.refresh_api_key_hook)
    client.Configuration.set_default(configuration)


class Kube:
    def __init__(self, api: client.ApiClient | None = None) -> None:
        self.api = api or client.ApiClient()
        if api is None:
            self.api.user_agent = USER_AGENT  # audit logs tell the operator's calls from kopf's and users'
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    # --------------------------------------------------------------------- LlamaFineTunes
    def get_finetune(self, namespace: str, name: str) -> Obj | None:
        """A fresh read (the lifecycle must never decide on a status older than its last write)."""
        try:
            return cast(Obj, self.custom.get_namespaced_custom_object(*LLAMAFINETUNES[:2], namespace, LLAMAFINETUNES[2], name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def patch_finetune_status(self, namespace: str, name: str, status: Obj) -> None:
        """A JSON merge patch of .status (None values remove fields)."""
        self.custom.patch_namespaced_custom_object_status(
            *LLAMAFINETUNES[:2], namespace, LLAMAFINETUNES[2], name, {"status": status}
        )

    # ------------------------------------------------------ the attempts' jobs (either backend)
    def get_job(self, namespace: str, name: str, kind: str = "PyTorchJob") -> Obj | None:
        try:
            job = self.custom.get_namespaced_custom_object(*JOBS[kind][:2], namespace, JOBS[kind][2], name)
            return cast(Obj, job)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list_jobs(self, namespace: str, selector: str, kind: str = "PyTorchJob") -> list[Obj]:
        """ApiException 404 when the cluster does not serve the kind (its operator is not installed)."""
        body = cast(Obj, self.custom.list_namespaced_custom_object(*JOBS[kind][:2], namespace, JOBS[kind][2],
                                                                     label_selector=selector))
        return list(body.get("items", []))

    def serves(self, namespace: str, kind: str) -> bool:
        """Whether the cluster serves the job kind (a list of at most one item; 404 when not)."""
        try:
            self.custom.list_namespaced_custom_object(*JOBS[kind][:2], namespace, JOBS[kind][2], limit=1)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    def create_job(self, namespace: str, job: Obj) -> Obj | None:
        """The job as created, or None when it already existed."""
        kind = job["kind"]
        try:
            return cast(Obj, self.custom.create_namespaced_custom_object(*JOBS[kind][:2], namespace, JOBS[kind][2], job))
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise

    def patch_job(self, namespace: str, name: str, patch: Obj, kind: str = "PyTorchJob") -> None:
        self.custom.patch_namespaced_custom_object(*JOBS[kind][:2], namespace, JOBS[kind][2], name, patch)

    def delete_job(self, namespace: str, name: str, kind: str = "PyTorchJob") -> bool:
        try:
            self.custom.delete_namespaced_custom_object(
                *JOBS[kind][:2], namespace, JOBS[kind][2], name, propagation_policy="Foreground"
            )
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    # ------------------------------------------------------------- children: apply, list, prune
    def apply(self, namespace: str, obj: Obj) -> Obj:
        """Server-side apply as the `llamaft` field manager (force: the operator owns what it
        renders, so a hand edit of those fields is drift to repair, not a conflict to report).
        Creates the object when it is missing; fields llamaft set before and no longer renders are
        removed; an unchanged object is not written. Returns the live object."""
        name, kind = obj["metadata"]["name"], obj["kind"]
        # The raw response: an apply that creates answers 201, which the generated client does not
        # decode for patch calls.
        options: dict[str, Any] = {"field_manager": FIELD_MANAGER, "force": True, "_content_type": APPLY_PATCH,
                                   "_preload_content": False}
        try:
            if kind == "ConfigMap":
                live: Any = self.core.patch_namespaced_config_map(name, namespace, obj, **options)
            elif kind == "Service":
                live = self.core.patch_namespaced_service(name, namespace, obj, **options)
            elif kind == "Deployment":
                live = self.apps.patch_namespaced_deployment(name, namespace, obj, **options)
            elif kind in MONITORING:
                live = self.custom.patch_namespaced_custom_object(
                    "monitoring.coreos.com", "v1", namespace, MONITORING[kind], name, obj, **options)
            else:
                raise ValueError(f"unsupported kind {kind}")
        except ApiException as exc:
            if exc.status == 404 and kind in MONITORING:
                raise MonitoringUnavailable(f"{kind} (monitoring.coreos.com/v1) is not served by this cluster") from exc
            raise
        return cast(Obj, json.loads(live.data))

    def list_children(self, namespace: str, kind: str, selector: str) -> list[Obj]:
        """Objects of one child kind with the label selector; [] when the kind is not served."""
        try:
            if kind == "ConfigMap":
                body = _json(self.core.list_namespaced_config_map(namespace, label_selector=selector, **RAW))
            elif kind == "Service":
                body = _json(self.core.list_namespaced_service(namespace, label_selector=selector, **RAW))
            elif kind == "Deployment":
                body = _json(self.apps.list_namespaced_deployment(namespace, label_selector=selector, **RAW))
            elif kind in MONITORING:
                body = cast(Obj, self.custom.list_namespaced_custom_object(
                    "monitoring.coreos.com", "v1", namespace, MONITORING[kind], label_selector=selector))
            else:
                raise ValueError(f"unsupported kind {kind}")
        except ApiException as exc:
            if exc.status == 404 and kind in MONITORING:
                return []
            raise
        return [dict(item, kind=kind) for item in body.get("items") or []]

    def check_owner(self, namespace: str, obj: Obj) -> None:
        """ForeignObject when an object of the child's name exists and belongs to another owner or
        is being deleted (the previous incarnation's, after a delete and re-apply): applying to it
        would adopt an object the garbage collector is about to remove."""
        name, kind = obj["metadata"]["name"], obj["kind"]
        try:
            if kind == "ConfigMap":
                current: Any = _json(self.core.read_namespaced_config_map(name, namespace, **RAW))
            elif kind == "Service":
                current = _json(self.core.read_namespaced_service(name, namespace, **RAW))
            elif kind == "Deployment":
                current = _json(self.apps.read_namespaced_deployment(name, namespace, **RAW))
            elif kind in MONITORING:
                current = self.custom.get_namespaced_custom_object("monitoring.coreos.com", "v1", namespace, MONITORING[kind], name)
            else:
                raise ValueError(f"unsupported kind {kind}")
        except ApiException as exc:
            if exc.status == 404:
                return
            raise
        live = current if isinstance(current, dict) else _plain(self.api, current)
        uid = _owner_uid(obj)
        if uid and not owned_by(live, uid) and live.get("metadata", {}).get("ownerReferences"):
            raise ForeignObject(f"{kind} {name} still belongs to {live['metadata']['ownerReferences'][0].get('uid')} "
                                "(being deleted)")
        if uid and live.get("metadata", {}).get("deletionTimestamp"):
            raise ForeignObject(f"{kind} {name} is being deleted")

    def deployment_ready(self, namespace: str, name: str) -> bool:
        try:
            dep = _json(self.apps.read_namespaced_deployment(name, namespace, **RAW))
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return int(dep.get("status", {}).get("readyReplicas") or 0) >= 1

    def delete(self, namespace: str, kind: str, name: str) -> bool:
        if kind in MONITORING:
            try:
                self.custom.delete_namespaced_custom_object("monitoring.coreos.com", "v1", namespace, MONITORING[kind], name)
                return True
            except ApiException as exc:
                if exc.status == 404:
                    return False
                raise
        calls = {
            "Deployment": self.apps.delete_namespaced_deployment,
            "Service": self.core.delete_namespaced_service,
            "ConfigMap": self.core.delete_namespaced_config_map,
        }
        try:
            calls[kind](name, namespace)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    def list_workloads(self, namespace: str, selector: str) -> list[Obj]:
        """Kueue Workloads with the label selector; [] when Kueue is not installed (no version served)."""
        for version in WORKLOAD_VERSIONS:
            try:
                body = cast(Obj, self.custom.list_namespaced_custom_object(WORKLOADS[0], version, namespace, WORKLOADS[1],
                                                                           label_selector=selector))
            except ApiException as exc:
                if exc.status == 404:
                    continue
                raise
            return list(body.get("items") or [])
        return []

    def list_pods(self, namespace: str, selector: str) -> list[Obj]:
        return list(_json(self.core.list_namespaced_pod(namespace, label_selector=selector, **RAW)).get("items") or [])
