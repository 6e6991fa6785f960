"""The TrainJob backend through the operator, with the real kopf runtime against the emulator, where
the real Kubeflow Trainer cannot produce the case: backend selection (`auto` picks what the
cluster serves: the emulator serves a chosen subset of the CRDs), and a TrainJob whose Failed
condition (which the real Trainer sets only after the Job's backoffLimit, 6 restarts) is recorded
as the attempt's failure and retried within the budget. The test plays Kubeflow Trainer's status
writes. A run to success, a gang replaced after a restart in place, and suspend/resume run on the
real Trainer and JobSet: tests/controlplane/test_trainjob.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.operator.conftest import Cluster, Operator, own_cluster, tiny_spec, wait_for

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"


def trainjob(cluster: Cluster, name: str) -> dict[str, Any] | None:
    try:
        obj: dict[str, Any] = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, name)
        return obj
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def set_status(cluster: Cluster, name: str, conditions: list[tuple[str, str, str]] = (), active: int = 0,  # type: ignore[assignment]
               failed: int = 0) -> None:
    """What Kubeflow Trainer writes: conditions (Complete/Failed/Suspended) and the node Job's counts."""
    status = {"conditions": [{"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": "2026-11-30T12:00:00Z"}
                             for t, r, m in conditions],
              "jobsStatus": [{"name": "node", "active": active, "ready": active, "succeeded": 0, "failed": failed, "suspended": 0}]}
    cluster.custom.patch_namespaced_custom_object_status(GROUP, VERSION, cluster.ns, PLURAL, name, {"status": status})


@pytest.fixture(scope="module")
def operator(kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    op = Operator(kubeconfig, tmp_path_factory.mktemp("op") / "operator.log").start()
    yield op
    op.stop()


def test_a_failed_trainjob_is_retried_as_a_new_attempt_within_the_budget(cluster: Cluster, operator: Operator) -> None:
    cluster.create("tjr", tiny_spec(backend="TrainJob", runPolicy={"retryBudget": 1}))
    first = cluster.job_name("tjr", 1)
    wait_for("attempt 1", lambda: trainjob(cluster, first))
    set_status(cluster, first, [("Failed", "JobSetFailed", "jobset failed: node-0 exited 1")], failed=1)
    second = cluster.job_name("tjr", 2)
    wait_for("attempt 2", lambda: trainjob(cluster, second))
    status = wait_for("recorded", lambda: (s := cluster.status("tjr")).get("retriesUsed") == 1 and s)
    assert status["failures"][-1]["reason"] == "JobFailed" and "TrainJob" in status["failures"][-1]["message"]
    wait_for("old attempt deleted", lambda: trainjob(cluster, first) is None)
    set_status(cluster, second, [("Failed", "JobSetFailed", "jobset failed again")], failed=1)
    status = wait_for("Failed", lambda: (s := cluster.status("tjr"))["phase"] == "Failed" and s)
    assert "retry budget (1) is used up" in status["message"]


@pytest.mark.parametrize(("without", "extra", "expected"), [
    ((), {}, "TrainJob"),  # both served: Trainer v2, the maintained line
    ((), {"cluster": {"workers": 2, "gpusPerWorker": 8, "priorityClassName": "high"}}, "PyTorchJob"),  # not a TrainJob's
    (("kubeflow.org/v1/pytorchjobs",), {}, "TrainJob"),
    (("trainer.kubeflow.org/v1alpha1/trainjobs",), {}, "PyTorchJob"),
])
def test_auto_picks_the_backend_the_cluster_serves(without: tuple[str, ...], extra: dict[str, Any], expected: str,
                                                   tmp_path: Path) -> None:
    with own_cluster(tmp_path, without) as own:
        own.create("auto", tiny_spec(backend="auto", **extra))
        status = wait_for("backend", lambda: (s := own.status("auto")).get("backend") and s)
        assert status["backend"] == expected
        name = own.job_name("auto", 1)
        if expected == "TrainJob":
            wait_for("TrainJob", lambda: trainjob(own, name))
        else:
            wait_for("PyTorchJob", lambda: own.attempt_job("auto", 1))
        assert any(e["reason"] == "BackendSelected" and expected in e["message"] for e in own.events("auto"))


def test_auto_on_a_cluster_with_neither_says_what_to_install(tmp_path: Path) -> None:
    with own_cluster(tmp_path, ("kubeflow.org/v1/pytorchjobs", "trainer.kubeflow.org/v1alpha1/trainjobs")) as own:
        own.create("none", tiny_spec(backend="auto"))
        status = wait_for("message", lambda: "serves neither" in (s := own.status("none")).get("message", "") and s)
        assert "Kubeflow training operator v1.9" in status["message"] and "Kubeflow Trainer v2.3" in status["message"]
        assert "backend" not in status
