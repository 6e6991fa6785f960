"""Topology-aware placement (issue 25): `spec.scheduling.topology` through Kueue's topology-aware
scheduling (TAS).

- Rendering: the worker pod template of either backend carries Kueue's PodSet annotation
  `kueue.x-k8s.io/podset-{required,preferred}-topology: <level>` (Kueue docs, concepts/
  topology_aware_scheduling, "User-facing APIs"); for a TrainJob it goes in our runtimePatch's pod
  metadata, which Trainer merges into the JobSet Kueue makes its PodSets from. Checked against the
  vendored Kubeflow CRDs (child_errors) and against Kueue's webhook rule for those annotations
  (a port of kueue v0.19.2 pkg/controller/jobframework/tas_validation.go, ValidateTASPodSetRequest).
- Refusals: topology without a Kueue queue, with a Volcano gang (which cannot carry it: see
  docs/operations.md), an invalid label key (tests/api/test_validation.py has the table).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kmock
import pytest
from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.validation import SpecInvalid, label_key_problem, validate_spec
from llamaft.render import desired, trainjob
from llamaft.render.admission import child_errors
from llamaft.render.naming import Owner

from tests.operator.conftest import Cluster, Operator, tiny_spec, wait_for
from tests.operator.emulator import write_kubeconfig
from tests.operator.sim import pod_port
from tests.operator.sim_fixtures import (  # noqa: F401 (the *_fixture imports register pytest fixtures)
    make_sim_fixture,
    sim_emulator_fixture,
    sim_etcd_fixture,
    torch_distributed_runtime,
)
from tests.operator.sim_trainjob import jobset_spec

OWNER = Owner("ft", "team-a", "abcd1234-0000-0000-0000-000000000000")
REQUIRED = "kueue.x-k8s.io/podset-required-topology"
PREFERRED = "kueue.x-k8s.io/podset-preferred-topology"
UNCONSTRAINED = "kueue.x-k8s.io/podset-unconstrained-topology"
EFA_BLOCK = "network.amazonaws.com/efa-block"


def parsed(**sections: Any) -> LlamaFineTuneSpec:
    return validate_spec(tiny_spec(**sections))


def kueue_tas_problems(template_meta: dict[str, Any]) -> list[str]:
    """What Kueue's job webhooks refuse in a PodSet template's topology annotations (v0.19.2
    ValidateTASPodSetRequest: at most one of the three, a required/preferred value is a label name)."""
    annotations = template_meta.get("annotations") or {}
    found = [key for key in (REQUIRED, PREFERRED, UNCONSTRAINED) if key in annotations]
    problems = [f"more than one topology annotation: {found}"] if len(found) > 1 else []
    for key in (REQUIRED, PREFERRED):
        if key in annotations and label_key_problem(annotations[key]):
            problems.append(f"{key}: {label_key_problem(annotations[key])}")
    return problems


def podset_templates(spec: LlamaFineTuneSpec) -> dict[str, dict[str, Any]]:
    """The pod template Kueue makes the workers' PodSet from, per backend: the PyTorchJob's Worker
    replica template; the TrainJob's `node` replicated job of the JobSet Trainer builds from the
    torch-distributed runtime and our runtimePatch."""
    pytorch = desired.pytorch_job(OWNER, spec, 1)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    jobset = jobset_spec(trainjob.train_job(OWNER, spec, 1), torch_distributed_runtime())
    node = next(r for r in jobset["replicatedJobs"] if r["name"] == trainjob.NODE)
    return {"PyTorchJob": pytorch, "TrainJob": node["template"]["spec"]["template"]}


@pytest.mark.parametrize(("topology", "annotation"), [
    ({"level": EFA_BLOCK}, REQUIRED),
    ({"mode": "required", "level": "kubernetes.io/hostname"}, REQUIRED),
    ({"mode": "preferred", "level": EFA_BLOCK}, PREFERRED),
    ({"mode": "preferred", "level": "topology.kubernetes.io/zone"}, PREFERRED),
])
@pytest.mark.parametrize("backend", ["PyTorchJob", "TrainJob"])
def test_the_workers_podset_asks_kueue_for_the_topology(backend: str, topology: dict[str, str], annotation: str) -> None:
    spec = parsed(scheduling={"queueName": "team-a-gpus", "topology": topology}, backend=backend)
    template = podset_templates(spec)[backend]
    annotations = template["metadata"]["annotations"]
    assert annotations[annotation] == topology["level"]
    assert {REQUIRED, PREFERRED, UNCONSTRAINED} & set(annotations) == {annotation}
    assert kueue_tas_problems(template["metadata"]) == []
    assert child_errors(spec, "ft", "team-a") == [], "valid against the vendored PyTorchJob / TrainJob CRDs"
    job = desired.pytorch_job(OWNER, spec, 1) if backend == "PyTorchJob" else trainjob.train_job(OWNER, spec, 1)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a-gpus"
    assert "annotations" not in job["metadata"], "the request is the PodSet's (pod template), not the job's"


def test_no_topology_no_annotation() -> None:
    spec = parsed(scheduling={"queueName": "team-a-gpus"})
    for template in podset_templates(spec).values():
        assert not {REQUIRED, PREFERRED, UNCONSTRAINED} & set(template["metadata"].get("annotations") or {})


def test_overrides_keep_their_annotations_beside_the_topology() -> None:
    spec = parsed(scheduling={"queueName": "q", "topology": {"level": EFA_BLOCK}},
                  cluster={"workers": 2, "gpusPerWorker": 0,
                           "podTemplateOverrides": {"metadata": {"annotations": {"example.com/team": "nlp"}}}})
    for backend, template in podset_templates(spec).items():
        assert template["metadata"]["annotations"] == {REQUIRED: EFA_BLOCK, "example.com/team": "nlp"}, backend


def test_the_webhook_port_refuses_what_kueue_refuses() -> None:
    assert kueue_tas_problems({"annotations": {REQUIRED: "a", PREFERRED: "b"}})
    assert kueue_tas_problems({"annotations": {REQUIRED: "efa block"}})


@pytest.mark.parametrize(("scheduling", "words"), [
    ({"topology": {"level": EFA_BLOCK}}, "set queueName to a LocalQueue"),
    ({"gang": {}, "topology": {"level": EFA_BLOCK}}, "podGroupPolicy.volcano.networkTopology"),
    ({"queueName": "q", "topology": {"level": "-efa"}}, "must be a label key"),
])
@pytest.mark.parametrize("backend", ["PyTorchJob", "TrainJob"])
def test_topology_that_cannot_work_is_refused_by_field(backend: str, scheduling: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecInvalid) as info:
        parsed(scheduling=scheduling, backend=backend)
    assert any(e.path.startswith("spec.scheduling.topology") and words in e.message for e in info.value.errors), info.value


# ------------------------------------------------------------------ Kueue admits, the run proceeds
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
TOPOLOGY_GATE = "kueue.x-k8s.io/topology"
POOL = "llamaft.test/pool"
BLOCKS = {"node-0": "block-a", "node-1": "block-b", "node-2": "block-b"}
"""block-a has one node, block-b two: only block-b holds both workers. Without the topology the
scheduler spreads the two pods over node-0 and node-1, across blocks."""
KUEUE_OBJECTS = [
    {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Topology", "metadata": {"name": "efa"},
     "spec": {"levels": [{"nodeLabel": EFA_BLOCK}, {"nodeLabel": "kubernetes.io/hostname"}]}},
    {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "cpu-efa"},
     "spec": {"nodeLabels": {POOL: "cpu"}, "topologyName": "efa"}},
    {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": "cpus"},
     "spec": {"namespaceSelector": {}, "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [
         {"name": "cpu-efa", "resources": [{"name": "cpu", "nominalQuota": 64}, {"name": "memory", "nominalQuota": "256Gi"}]}]}]}},
    {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue", "metadata": {"name": "team-a-cpus", "namespace": "default"},
     "spec": {"clusterQueue": "cpus"}},
]
"""The Kueue objects this "cluster" has; Kueue itself is played by the test."""


def kueue_job_webhook(key: str, obj: dict[str, Any]) -> None:
    """Kueue's PyTorchJob webhook: a job with a queue label is validated (the TAS annotations of its
    replica templates) and suspended at creation."""

    if key != "kubeflow.org/v1/pytorchjobs" or QUEUE_LABEL not in (obj.get("metadata") or {}).get("labels", {}):
        return
    for replica in (obj.get("spec") or {}).get("pytorchReplicaSpecs", {}).values():
        problems = kueue_tas_problems((replica.get("template") or {}).get("metadata") or {})
        if problems:
            raise kmock.KubernetesError(status=422, reason="Invalid", message="; ".join(problems))
    obj["spec"].setdefault("runPolicy", {})["suspend"] = True


def topology_assignment(nodes: list[dict[str, Any]], level: str, count: int) -> tuple[str, list[str]]:
    """Kueue's TAS for a `required` PodSet on a Topology [level, hostname]: the first domain of
    `level` whose schedulable nodes hold `count` pods (one per node here: each pod asks for a node's
    worth), and its nodes in order."""
    domains: dict[str, list[str]] = {}
    for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        labels = node["metadata"].get("labels") or {}
        if level in labels and not (node.get("spec") or {}).get("unschedulable"):
            domains.setdefault(labels[level], []).append(node["metadata"]["name"])
    domain = next(d for d, members in sorted(domains.items()) if len(members) >= count)
    return domain, domains[domain][:count]


def test_kueue_admits_with_a_topology_assignment_and_the_run_proceeds(
    sim_emulator: Any, sim_etcd: Any, make_sim: Any, tiny_model: Path, tmp_path: Path,
) -> None:
    """The real operator, trainer and etcd on the simulated cluster; the test plays Kueue: its webhook
    suspends the queued PyTorchJob at creation; on admission into block-b it unsuspends the job and
    adds the flavor's nodeSelector and the `kueue.x-k8s.io/topology` scheduling gate to the worker
    template (podset.Merge of PodSetInfo.FromAssignment); its TopologyUngater then gives each pod, by
    replica index, the nodeSelector of its domain and host and removes the gate (kueue
    pkg/controller/tas/topology_ungater.go). The run ends Succeeded, with both workers in block-b."""
    from kubernetes import client

    from tests.operator.sim import Api, pod_path
    from tests.operator.sim_fixtures import tiny_finetune
    from tests.operator.test_runs import phase
    from tests.test_docs_kueue import kueue_problems

    for obj in KUEUE_OBJECTS:
        assert kueue_problems(obj) == [], obj
    assert sim_emulator.emulator is not None
    sim_emulator.emulator.webhooks.append(kueue_job_webhook)
    sim = make_sim(nodes=3, node_labels={name: {EFA_BLOCK: block, POOL: "cpu"} for name, block in BLOCKS.items()})
    config = client.Configuration()
    config.host = sim_emulator.url
    cluster = Cluster(client.ApiClient(config))
    operator = Operator(write_kubeconfig(sim_emulator.url, tmp_path / "kubeconfig"), tmp_path / "operator.log", cli=True,
                        LLAMAFT_RENDEZVOUS_ADDRESS_OVERRIDE=sim_etcd.endpoint, LLAMAFT_SYNC_INTERVAL="1").start()
    api = Api(sim_emulator.url)
    try:
        spec = tiny_finetune("tas", tiny_model, monitoring={"metricsPort": pod_port()},
                             scheduling={"queueName": "team-a-cpus", "topology": {"mode": "required", "level": EFA_BLOCK}})["spec"]
        cluster.create("tas", spec)
        job = wait_for("the queued job", lambda: cluster.attempt_job("tas", 1), timeout=60)
        name = job["metadata"]["name"]
        worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
        assert job["spec"]["runPolicy"]["suspend"] is True, "Kueue's webhook suspended it"
        assert worker["template"]["metadata"]["annotations"][REQUIRED] == EFA_BLOCK
        cluster.set_job_status(name, [("Created", "PyTorchJobCreated", "created"), ("Suspended", "PyTorchJobSuspended", "suspended")])
        assert phase(cluster, "tas", "Queued", timeout=60)["queue"] == "team-a-cpus"
        assert sim.pods(name) == [], "no pod while Kueue holds the job"

        # Kueue admits the workload into block-b.
        domain, hosts = topology_assignment(api.list("/api/v1/nodes"), EFA_BLOCK, worker["replicas"])
        assert (domain, hosts) == ("block-b", ["node-1", "node-2"])
        flavor = next(o for o in KUEUE_OBJECTS if o["kind"] == "ResourceFlavor")
        api.patch(f"/apis/kubeflow.org/v1/namespaces/default/pytorchjobs/{name}", {"spec": {
            "runPolicy": {"suspend": False},
            "pytorchReplicaSpecs": {"Worker": {"template": {"spec": {
                "nodeSelector": {**(worker["template"]["spec"].get("nodeSelector") or {}), **flavor["spec"]["nodeLabels"]},
                "schedulingGates": [{"name": TOPOLOGY_GATE}]}}}}}})
        pods = wait_for("the gated pods", lambda: len(p := sim.pods(name)) == worker["replicas"] and p, timeout=60)
        assert all(p["spec"].get("schedulingGates") == [{"name": TOPOLOGY_GATE}] and not p["spec"].get("nodeName") for p in pods)
        # The TopologyUngater: rank (replica index) i goes to the i-th host of the assignment.
        for pod, host in zip(pods, hosts, strict=True):
            selector = {**(pod["spec"].get("nodeSelector") or {}), EFA_BLOCK: domain, "kubernetes.io/hostname": host}
            api.patch(pod_path("default", pod["metadata"]["name"]), {"spec": {"schedulingGates": None, "nodeSelector": selector}})

        status = phase(cluster, "tas", "Succeeded", "Failed", timeout=240)
        assert status["phase"] == "Succeeded" and status["attempt"] == 1, status
        assert next(c for c in status["conditions"] if c["type"] == "Queued")["reason"] == "Admitted"
        placed = {p["metadata"]["name"]: sim.node_of(p["metadata"]["name"]) for p in pods}
        assert sorted(placed.values()) == hosts and {BLOCKS[n] for n in placed.values() if n} == {"block-b"}, placed
    finally:
        operator.stop()
