"""render.backends: one JobBackend per job kind, each answering the operator's questions about its
own objects (rendered here, checked against the vendored upstream CRDs)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from llamaft.api.spec import Backend
from llamaft.api.status import Phase
from llamaft.operator import kube
from llamaft.render import backends
from llamaft.render.naming import Owner

from tests.conftest import REPO
from tests.operator.kubeflow_rules import crd_schema
from tests.render.test_trainjob import example, with_spec

UPSTREAM = REPO / "tests" / "fixtures" / "upstream"
CRDS = {"PyTorchJob": (UPSTREAM / "kubeflow" / "kubeflow.org_pytorchjobs.yaml", "v1"),
        "TrainJob": (UPSTREAM / "kubeflow-trainer-v2.3" / "trainer.kubeflow.org_trainjobs.yaml", "v1alpha1")}
OWNER = Owner("llama", "team-a", "0b4c8a4e-3d2a-4f51-9a0e-7d4f2f7f0c11")


def merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386), as the API server applies the operator's patches."""
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def test_every_backend_kind_of_the_api_has_one_backend() -> None:
    assert set(backends.BACKENDS) == {b.value for b in Backend} - {Backend.AUTO.value}
    assert backends.backend_for(None).kind == "PyTorchJob"  # a status written before status.backend
    assert backends.backend_for(Backend.TRAIN_JOB) is backends.BACKENDS["TrainJob"]
    with pytest.raises(ValueError, match="no job backend 'MPIJob'"):
        backends.backend_for("MPIJob")


@pytest.mark.parametrize("kind", sorted(backends.BACKENDS))
def test_the_resource_is_the_upstream_crds(kind: str) -> None:
    backend = backends.backend_for(kind)
    path, version = CRDS[kind]
    crd = yaml.safe_load(Path(path).read_text())
    assert (crd["spec"]["group"], crd["spec"]["names"]["plural"], crd["spec"]["names"]["kind"]) == (
        backend.resource.group, backend.resource.plural, kind)
    assert version == backend.resource.version and any(v["name"] == version and v["served"] for v in crd["spec"]["versions"])
    assert kube.JOBS[kind] == (backend.resource.group, backend.resource.version, backend.resource.plural)


@pytest.mark.parametrize("kind", sorted(backends.BACKENDS))
@pytest.mark.parametrize("suspend", [False, True])
def test_suspend_patch_is_what_suspended_reads_and_the_crd_accepts(kind: str, suspend: bool) -> None:
    backend = backends.backend_for(kind)
    spec = with_spec(example("llama2-7b.yaml"), backend=kind)
    job = backend.render(OWNER, spec, 1)
    assert job["kind"] == kind
    patched = merge(job, backend.suspend_patch(suspend))
    assert backend.suspended(patched) is suspend
    assert backend.suspended(merge(patched, backend.suspend_patch(not suspend))) is (not suspend)
    jsonschema.validate(patched, crd_schema(str(CRDS[kind][0]), CRDS[kind][1]))


def test_only_an_elastic_pytorchjob_scales_in_place() -> None:
    elastic = with_spec(example("llama2-7b.yaml"), cluster={"elastic": {"minWorkers": 1, "maxWorkers": 4}})
    fixed = example("llama2-7b.yaml")
    pytorch, train = backends.BACKENDS["PyTorchJob"], backends.BACKENDS["TrainJob"]
    assert pytorch.scalable(elastic) and not pytorch.scalable(fixed)
    assert not train.scalable(elastic) and not train.scalable(fixed)
    job = merge(pytorch.render(OWNER, elastic, 1), pytorch.scale_patch(3))
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    with pytest.raises(ValueError, match="new attempt"):
        train.scale_patch(3)


def test_pod_selectors_name_the_jobs_own_pods() -> None:
    assert backends.BACKENDS["PyTorchJob"].pod_selector("llama-a1") == "training.kubeflow.org/job-name=llama-a1"
    assert backends.BACKENDS["TrainJob"].pod_selector("llama-a1") == (
        "jobset.sigs.k8s.io/jobset-name=llama-a1,jobset.sigs.k8s.io/replicatedjob-name=node")


@pytest.mark.parametrize(("job", "phase"), [
    (None, Phase.CREATING),
    ({"kind": "PyTorchJob", "status": {"conditions": [{"type": "Running", "status": "True"},
                                                     {"type": "Restarting", "status": "True"}]}}, Phase.RESTARTING),
    ({"kind": "PyTorchJob", "status": {"conditions": [{"type": "Succeeded", "status": "True"}]}}, Phase.SUCCEEDED),
    ({"kind": "TrainJob", "status": {"conditions": [{"type": "Complete", "status": "True"}]}}, Phase.SUCCEEDED),
    ({"kind": "TrainJob", "status": {"jobsStatus": [{"name": "node", "active": 2}]}}, Phase.RUNNING),
    ({"kind": "TrainJob", "metadata": {"name": "x"}, "status": {}}, Phase.CREATING),
])
def test_the_phase_is_read_by_the_jobs_own_backend(job: dict[str, Any] | None, phase: Phase) -> None:
    assert backends.phase_of_job(job)[0] is phase


def test_a_trainjob_reads_as_the_lifecycles_view_and_a_pytorchjob_as_itself() -> None:
    train = {"kind": "TrainJob", "metadata": {"name": "x"},
             "status": {"conditions": [{"type": "Complete", "status": "True", "lastTransitionTime": "t"}]}}
    pods = [{"status": {"phase": "Succeeded"}}, {"status": {"phase": "Running"}}]
    view = backends.BACKENDS["TrainJob"].view(train, pods)
    assert {"type": "Succeeded", "status": "True", "lastTransitionTime": "t"} in view["status"]["conditions"]
    assert view["status"]["replicaStatuses"]["Worker"] == {"active": 1, "succeeded": 1, "failed": 0}
    pytorch = {"kind": "PyTorchJob", "status": {"replicaStatuses": {"Worker": {"active": 2}}}}
    assert backends.BACKENDS["PyTorchJob"].view(pytorch, pods) is pytorch
