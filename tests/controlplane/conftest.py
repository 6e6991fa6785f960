"""The real control plane as pytest fixtures: one per pytest worker (session scope), a namespace
per test, the CRDs of crds/ applied once.

Run one test against it: `.venv/bin/pytest tests/controlplane/test_crd.py -k examples` (the first
run on a machine builds the binaries: tests/controlplane/build).
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from tests.controlplane.binaries import binaries
from tests.controlplane.cluster import ControlPlane, running
from tests.controlplane.kubelet import Kubelet, NodeShape
from tests.tiers import starts_processes

CRDS = sorted((REPO / "crds").glob("*.yaml"))
_names = itertools.count()


@pytest.fixture(scope="session")
@starts_processes
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with running(tmp_path_factory.mktemp("controlplane"), binaries()) as plane:
        print(f"control plane up in {plane.started_in_s:.1f} s at {plane.server}")
        yield plane


@pytest.fixture(scope="session")
def crds_applied(control_plane: ControlPlane) -> ControlPlane:
    """crds/ created (server-side apply, as `kubectl apply --server-side` does) and Established."""
    for path in CRDS:
        crd = yaml.safe_load(path.read_text(encoding="utf-8"))
        apply(control_plane, f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}", crd)
    for path in CRDS:
        name = yaml.safe_load(path.read_text(encoding="utf-8"))["metadata"]["name"]
        wait_established(control_plane, name)
    return control_plane


def apply(plane: ControlPlane, path: str, body: dict[str, object], *, manager: str = "llamaft-tests",
          dry_run: bool = False) -> dict[str, object]:
    query = f"?fieldManager={manager}&force=true" + ("&dryRun=All" if dry_run else "")
    status, answer = plane.request("PATCH", path + query, body, content_type="application/apply-patch+yaml")
    if status not in (200, 201):
        raise AssertionError(f"apply {path}: {status} {answer}")
    return dict(answer)


def wait_established(plane: ControlPlane, name: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, crd = plane.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        conditions = {c["type"]: c["status"] for c in (((crd or {}).get("status") or {}).get("conditions") or [])}
        if status == 200 and conditions.get("Established") == "True":
            return
        time.sleep(0.1)
    raise AssertionError(f"CRD {name} not Established within {timeout_s} s: {crd}")


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    """A namespace of this test's own, deleted after it (the namespace controller empties it)."""
    name = f"t{next(_names)}-{uuid.uuid4().hex[:8]}"
    status, body = control_plane.request("POST", "/api/v1/namespaces",
                                         {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    assert status == 201, body
    yield name
    control_plane.request("DELETE", f"/api/v1/namespaces/{name}")


def tail_logs(plane: ControlPlane) -> str:
    return "\n".join(f"--- {c.name}\n{c.tail(2000)}" for c in (plane.apiserver, plane.controller_manager, plane.scheduler))



TAINT = "llamaft.io/test"


@pytest.fixture
@starts_processes
def kubelet(control_plane: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[Kubelet]:
    """A node of this test's own: tainted for its namespace, so only its pods (which tolerate the
    taint) land there, whatever other tests of the worker's cluster do."""
    shape = NodeShape(f"node-{namespace}", labels={"topology.kubernetes.io/zone": "zone-a"},
                      taints=[{"key": TAINT, "value": namespace, "effect": "NoSchedule"}])
    node = Kubelet(control_plane, shape, tmp_path / "kubelet").start()
    yield node
    node.stop()
    control_plane.request("DELETE", f"/api/v1/nodes/{shape.name}")


# The Kubeflow controllers, one of each per control plane, defined here once: a session fixture
# that test modules imported by name would be set up once per module that holds it.
@pytest.fixture(scope="session")
@starts_processes
def training_operator(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The real Kubeflow training operator (tests/controlplane/training_operator.py)."""
    from tests.controlplane.training_operator import TrainingOperator

    operator = TrainingOperator(control_plane, tmp_path_factory.mktemp("training-operator")).start()
    yield operator
    operator.stop()


@pytest.fixture(scope="session")
@starts_processes
def trainer(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """JobSet, then Kubeflow Trainer, which watches JobSets (tests/controlplane/kubeflow_trainer.py)."""
    from tests.controlplane.kubeflow_trainer import JobSetController, TrainerController

    jobset = JobSetController(control_plane, tmp_path_factory.mktemp("jobset")).start()
    controller = TrainerController(control_plane, tmp_path_factory.mktemp("trainer")).start()
    yield controller
    controller.stop()
    jobset.stop()
