"""The Kubernetes calls the operator makes, in one place (the chart's RBAC is derived from them).

Every call is idempotent by name: create treats 409 as "already there", delete treats 404 as
"already gone", get returns None for 404. Objects are plain dicts (as the pure functions build them).
"""

from __future__ import annotations

from typing import Any, cast

from kubernetes import client
from kubernetes.client.exceptions import ApiException

Obj = dict[str, Any]
PYTORCHJOBS = ("kubeflow.org", "v1", "pytorchjobs")
LLAMAFINETUNES = ("llamaft.io", "v1alpha1", "llamafinetunes")

# (api group, resource, verbs): what this module calls. tests/operator/test_rbac.py checks the
# chart's Role against it.
API_CALLS: list[tuple[str, str, tuple[str, ...]]] = [
    ("llamaft.io", "llamafinetunes", ("get",)),
    ("llamaft.io", "llamafinetunes/status", ("patch",)),
    ("kubeflow.org", "pytorchjobs", ("get", "list", "create", "patch", "delete")),
    ("", "configmaps", ("get", "create", "patch", "delete")),
    ("apps", "deployments", ("get", "create", "delete")),
    ("", "services", ("get", "create", "delete")),
    ("", "pods", ("list",)),
    ("monitoring.coreos.com", "podmonitors", ("create", "delete")),
    ("monitoring.coreos.com", "prometheusrules", ("create", "delete")),
]
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


class Kube:
    def __init__(self, api: client.ApiClient | None = None) -> None:
        self.api = api or client.ApiClient()
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

    # ------------------------------------------------------------------------- PyTorchJobs
    def get_job(self, namespace: str, name: str) -> Obj | None:
        try:
            job = self.custom.get_namespaced_custom_object(*PYTORCHJOBS[:2], namespace, PYTORCHJOBS[2], name)
            return cast(Obj, job)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list_jobs(self, namespace: str, selector: str) -> list[Obj]:
        body = cast(Obj, self.custom.list_namespaced_custom_object(*PYTORCHJOBS[:2], namespace, PYTORCHJOBS[2], label_selector=selector))
        return list(body.get("items", []))

    def create_job(self, namespace: str, job: Obj) -> bool:
        """True when created, False when it already existed."""
        try:
            self.custom.create_namespaced_custom_object(*PYTORCHJOBS[:2], namespace, PYTORCHJOBS[2], job)
            return True
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise

    def patch_job(self, namespace: str, name: str, patch: Obj) -> None:
        self.custom.patch_namespaced_custom_object(*PYTORCHJOBS[:2], namespace, PYTORCHJOBS[2], name, patch)

    def delete_job(self, namespace: str, name: str) -> bool:
        try:
            self.custom.delete_namespaced_custom_object(
                *PYTORCHJOBS[:2], namespace, PYTORCHJOBS[2], name, propagation_policy="Foreground"
            )
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    # ------------------------------------------------------------------- built-in objects
    def apply_config_map(self, namespace: str, cm: Obj) -> str:
        """created | updated | unchanged; ForeignObject when another owner's ConfigMap has the name."""
        name = cm["metadata"]["name"]
        try:
            current = _plain(self.api, self.core.read_namespaced_config_map(name, namespace))
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.core.create_namespaced_config_map(namespace, cast(Any, cm))  # the client takes plain dicts
            return "created"
        self._check_owner(current, cm)
        if current.get("data") == cm["data"]:
            return "unchanged"
        self.core.patch_namespaced_config_map(name, namespace, {"data": cm["data"]})
        return "updated"

    @staticmethod
    def _check_owner(current: Obj, wanted: Obj) -> None:
        uid = _owner_uid(wanted)
        if uid and not owned_by(current, uid) and current.get("metadata", {}).get("ownerReferences"):
            raise ForeignObject(f"{wanted['kind']} {wanted['metadata']['name']} still belongs to "
                                f"{current['metadata']['ownerReferences'][0].get('uid')} (being deleted)")
        if uid and current.get("metadata", {}).get("deletionTimestamp"):
            raise ForeignObject(f"{wanted['kind']} {wanted['metadata']['name']} is being deleted")

    def _read(self, namespace: str, obj: Obj) -> Obj | None:
        name = obj["metadata"]["name"]
        try:
            if obj["kind"] == "Deployment":
                return _plain(self.api, self.apps.read_namespaced_deployment(name, namespace))
            if obj["kind"] == "Service":
                return _plain(self.api, self.core.read_namespaced_service(name, namespace))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return None

    def ensure(self, namespace: str, obj: Obj) -> bool:
        """Create a Deployment, Service or monitoring object unless it exists; True when created.
        ForeignObject when a Deployment or Service of that name belongs to another owner."""
        try:
            if obj["kind"] == "Deployment":
                self.apps.create_namespaced_deployment(namespace, cast(Any, obj))
            elif obj["kind"] == "Service":
                self.core.create_namespaced_service(namespace, cast(Any, obj))
            elif obj["kind"] in MONITORING:
                self.custom.create_namespaced_custom_object("monitoring.coreos.com", "v1", namespace, MONITORING[obj["kind"]], obj)
            else:
                raise ValueError(f"unsupported kind {obj['kind']}")
            return True
        except ApiException as exc:
            if exc.status == 409:
                current = self._read(namespace, obj)
                if current is not None:
                    self._check_owner(current, obj)
                return False
            if exc.status == 404 and obj["kind"] in MONITORING:
                raise MonitoringUnavailable(f"{obj['kind']} (monitoring.coreos.com/v1) is not served by this cluster") from exc
            raise

    def deployment_ready(self, namespace: str, name: str) -> bool:
        try:
            dep = _plain(self.api, self.apps.read_namespaced_deployment(name, namespace))
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

    def list_pods(self, namespace: str, selector: str) -> list[Obj]:
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector)
        return [_plain(self.api, p) for p in pods.items]
