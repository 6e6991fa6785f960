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

from typing import Any

import pytest
from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.validation import SpecInvalid, label_key_problem, validate_spec
from llamaft.operator import desired, trainjob
from llamaft.operator.naming import Owner
from llamaft.rendered import child_errors

from tests.operator.conftest import tiny_spec
from tests.operator.sim_fixtures import torch_distributed_runtime
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
