"""Least privilege, exactly (issue 13): the chart grants what the operator calls, and nothing else.

The operator (`llamaft operator`, the chart's entry point, with peering as the chart runs it) runs
against an emulator that records every request, through a scenario that exercises every call
path: both backends, managed etcd, monitoring applied, edited in place and pruned, a restart as a
new attempt, suspend, deletion. Each request becomes the (API group, resource, verb) RBAC would
check (a server-side apply that creates the object needs `create` besides `patch`: kubernetes
apiserver endpoints/handlers/patch.go). That set, kopf's own calls included (its CRD scan,
namespace watch, peering, events), must equal the chart's Role/ClusterRole rules.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from kubernetes import client
from llamaft_trainer.process.local_etcd import LocalEtcd

from tests.operator.conftest import Cluster, Operator, tiny_spec, wait_for
from tests.operator.emulator import EmulatorThread, Recorded, write_kubeconfig
from tests.operator.test_trainjob_lifecycle import trainjob

Rule = tuple[str, str, str]
TEST_AGENT = "llamaft-rbac-test"
PATH = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
                  r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$")


OWNERS = {"LlamaFineTune": ("llamaft.io", "llamafinetunes")}


def rule_of(request: Recorded) -> set[Rule]:
    """The RBAC attributes of one request (none for discovery and other non-resource URLs), plus
    what admission checks for it: OwnerReferencesPermissionEnforcement lets a request set
    blockOwnerDeletion on an ownerReference only with `update` on the owner's finalizers."""
    match = PATH.match(request.path)
    if match is None:
        return set()  # /api, /apis, /apis/<group>/<version>, /version: discovery, granted to every user
    group = match["group"] or ""
    resource = match["resource"]
    name, sub = match["name"], match["sub"]
    owners = {(OWNERS[kind][0], f"{OWNERS[kind][1]}/finalizers", "update") for kind in request.blocking_owners}
    return owners | _verb_rules(request, group, resource, name, sub)


def _verb_rules(request: Recorded, group: str, resource: str, name: str | None, sub: str | None) -> set[Rule]:
    if sub:
        resource = f"{resource}/{sub}"
    method = request.method
    if method == "GET":
        verb = "get" if name else ("watch" if request.params.get("watch") in ("true", "1") else "list")
    elif method == "POST":
        verb = "create"
    elif method == "PUT":
        verb = "update"
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    elif method == "PATCH":
        if request.content_type.startswith("application/apply-patch"):
            return {(group, resource, "patch"), (group, resource, "create")}
        verb = "patch"
    else:
        verb = method.lower()
    return {(group, resource, verb)}


def operator_rules(requests: Iterable[Recorded]) -> set[Rule]:
    return set().union(*(rule_of(r) for r in requests if r.user_agent != TEST_AGENT))


def scenario(emu: EmulatorThread, etcd: LocalEtcd, tmp_path: Path, *args: str) -> set[Rule]:
    """Every call path of the operator, as the chart runs it; returns what it asked for."""
    config = client.Configuration()
    config.host = emu.url
    api = client.ApiClient(config)
    api.user_agent = TEST_AGENT
    cluster = Cluster(api)
    # The peering object the chart creates (ClusterKopfPeering cluster-wide, KopfPeering per watched namespace).
    peering = {"apiVersion": "kopf.dev/v1", "metadata": {"name": "llamaft-operator"}}
    if "--namespace" in args:
        cluster.custom.create_namespaced_custom_object("kopf.dev", "v1", cluster.ns, "kopfpeerings",
                                                       {**peering, "kind": "KopfPeering"})
    else:
        cluster.custom.create_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", {**peering, "kind": "ClusterKopfPeering"})
    op = Operator(write_kubeconfig(emu.url, tmp_path / "config"), tmp_path / "operator.log", cli=True,
                  peering="llamaft-operator", args=args, LLAMAFT_RENDEZVOUS_ADDRESS_OVERRIDE=etcd.endpoint).start()
    try:
        # PyTorchJob backend, c10d: config, monitoring, the job; then in-place monitoring edits and pruning.
        cluster.create("rbac", tiny_spec(monitoring={"dcgm": {"scrapeSelector": {"release": "a"}}}))
        wait_for("job", lambda: cluster.attempt_job("rbac", 1))
        cluster.set_job_status(cluster.job_name("rbac", 1), [("Created", "c", "c"), ("Running", "r", "r")],
                               replicaStatuses={"Worker": {"active": 2}})
        cluster.create_pod(f"{cluster.job_name('rbac', 1)}-worker-0", cluster.job_name("rbac", 1))
        wait_for("Running", lambda: cluster.status("rbac").get("phase") == "Running")
        cluster.patch_finetune("rbac", {"spec": {"monitoring": {"dcgm": {"enabled": False}}}})
        wait_for("pruned", lambda: not cluster.exists("ConfigMap", "rbac-dashboard"))
        cluster.patch_finetune("rbac", {"spec": {"runPolicy": {"suspend": True}}})
        wait_for("suspended", lambda: (cluster.attempt_job("rbac", 1) or {}).get("spec", {}).get("runPolicy", {}).get("suspend"))
        cluster.patch_finetune("rbac", {"spec": {"training": {"learningRate": 0.001}}})
        wait_for("attempt 2", lambda: cluster.attempt_job("rbac", 2))
        # Managed etcd (Deployment, Service; readiness read; pruned after a switch to c10d).
        cluster.create("rbac-etcd", tiny_spec(rendezvous={"backend": "etcd-v2"}))
        wait_for("etcd", lambda: cluster.exists("Deployment", "rbac-etcd-etcd"))
        cluster.make_etcd_ready("rbac-etcd-etcd")
        wait_for("etcd job", lambda: cluster.attempt_job("rbac-etcd", 1))
        cluster.patch_finetune("rbac-etcd", {"spec": {"rendezvous": {"backend": "c10d"}}})
        wait_for("etcd pruned", lambda: not cluster.exists("Deployment", "rbac-etcd-etcd") and not cluster.exists("Service", "rbac-etcd-etcd"))
        # The TrainJob backend: created, suspended in place, replaced on a restart.
        cluster.create("rbac-tj", tiny_spec(backend="TrainJob"))
        tj = cluster.job_name("rbac-tj", 1)
        wait_for("TrainJob", lambda: trainjob(cluster, tj))
        cluster.patch_finetune("rbac-tj", {"spec": {"runPolicy": {"suspend": True}}})
        wait_for("TrainJob suspended", lambda: (trainjob(cluster, tj) or {}).get("spec", {}).get("suspend"))
        cluster.patch_finetune("rbac-tj", {"spec": {"training": {"learningRate": 0.001}}})
        wait_for("TrainJob 2", lambda: trainjob(cluster, cluster.job_name("rbac-tj", 2)))
        for name in ("rbac", "rbac-etcd", "rbac-tj"):
            cluster.delete_finetune(name)
        wait_for("deleted", lambda: not any(cluster.exists("ConfigMap", f"{n}-config") for n in ("rbac", "rbac-etcd", "rbac-tj")))
    finally:
        op.stop()
    return operator_rules(emu.requests())


def test_the_request_mapping() -> None:
    def req(method: str, path: str, content_type: str = "", **params: str) -> Recorded:
        return Recorded(method=method, path=path, params=params, user_agent="x", content_type=content_type)

    assert rule_of(req("GET", "/apis/kubeflow.org/v1/namespaces/ns/pytorchjobs", watch="true")) == {("kubeflow.org", "pytorchjobs", "watch")}
    assert rule_of(req("GET", "/api/v1/pods")) == {("", "pods", "list")}
    assert rule_of(req("PATCH", "/apis/llamaft.io/v1alpha1/namespaces/ns/llamafinetunes/x/status")) == \
        {("llamaft.io", "llamafinetunes/status", "patch")}
    assert rule_of(req("PATCH", "/api/v1/namespaces/ns/configmaps/x", "application/apply-patch+yaml")) == \
        {("", "configmaps", "patch"), ("", "configmaps", "create")}
    assert rule_of(req("GET", "/apis/trainer.kubeflow.org/v1alpha1")) == set()


def record(etcd: LocalEtcd, tmp_path: Path, *args: str) -> set[Rule]:
    emu = EmulatorThread(record=True).start()
    try:
        return scenario(emu, etcd, tmp_path, *args)
    finally:
        emu.stop()


def chart_rules(values: dict[str, object]) -> tuple[set[Rule], set[Rule]]:
    """(grants of the Roles, grants of the ClusterRoles) the chart renders for these values."""
    from tests.helm.test_chart import granted, render

    docs = render(values)
    roles = [d for d in docs if d["kind"] == "Role"]
    cluster_roles = [d for d in docs if d["kind"] == "ClusterRole"]
    return (set().union(*(granted(r["rules"]) for r in roles)) if roles else set(),
            set().union(*(granted(r["rules"]) for r in cluster_roles)) if cluster_roles else set())


def expected(called: set[Rule]) -> set[Rule]:
    """What the operator may call: every call in kube.py (read from the code, so paths the scenario
    does not reach count too) and everything recorded (kopf's watches, patches, events, peering,
    CRD and namespace scans; the admission-implied finalizers update)."""
    from tests.helm.test_chart import calls_in_code

    return calls_in_code() | called


CLUSTER_SCOPED = {"namespaces", "customresourcedefinitions", "clusterkopfpeerings"}
PEERING = {"kopfpeerings", "clusterkopfpeerings"}


def gap(granted: set[Rule], wanted: set[Rule]) -> str:
    return f"granted, never called: {sorted(granted - wanted)}; called, not granted: {sorted(wanted - granted)}"


def test_cluster_wide_grants_are_exactly_what_the_operator_and_kopf_call(etcd: LocalEtcd, tmp_path: Path) -> None:
    called = record(etcd, tmp_path, "--all-namespaces")
    assert ("apiextensions.k8s.io", "customresourcedefinitions", "watch") in called, "kopf's CRD watch is recorded"
    assert ("llamaft.io", "llamafinetunes/finalizers", "update") in called
    wanted = expected(called)
    roles, cluster_roles = chart_rules({})
    assert roles == set()
    assert cluster_roles == wanted, gap(cluster_roles, wanted)
    _, standalone = chart_rules({"replicas": 1})
    assert standalone == {r for r in wanted if r[1] not in PEERING}, "one replica runs standalone: no peering grants"


def test_namespaced_grants_are_exactly_what_the_operator_and_kopf_call(etcd: LocalEtcd, tmp_path: Path) -> None:
    called = record(etcd, tmp_path, "--namespace", "default")
    assert ("", "namespaces", "watch") in called, "kopf watches the namespaces it serves"
    wanted = expected(called)
    in_namespace = {r for r in wanted if r[1].split("/")[0] not in CLUSTER_SCOPED}
    roles, cluster_roles = chart_rules({"watchNamespaces": ["default"]})
    assert roles == in_namespace, gap(roles, in_namespace)
    assert cluster_roles == wanted - in_namespace, gap(cluster_roles, wanted - in_namespace)
    roles, _ = chart_rules({"watchNamespaces": ["default"], "replicas": 1})
    assert roles == {r for r in in_namespace if r[1] not in PEERING}
