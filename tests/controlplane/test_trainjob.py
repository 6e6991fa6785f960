"""The TrainJob backend on the real control plane, with the real Kubeflow Trainer v2 and JobSet
controllers and webhooks (tests/controlplane/kubeflow_trainer.py) and the torch-distributed
ClusterTrainingRuntime: the TrainJob llamaft renders becomes a JobSet (Trainer), the JobSet a Job
(JobSet), the Job indexed pods (kube-controller-manager), which our kubelet runs with the real
trainer. The llamaft operator runs as the chart runs it.

- Every TrainJob llamaft renders from examples/ is admitted by Trainer's webhooks (a server-side
  dry-run create), and one they refuse (a reserved PET_* variable in the trainer's env) is refused.
- A run whose worker container is killed: the Job's pods restart in place (restartPolicy
  OnFailure, the JobSet default), the operator reads the restarted container's last state as the
  attempt's failure, replaces the whole gang with attempt 2, which resumes from the newest
  checkpoint and succeeds; its pods carry the Job's completion index as PET_NODE_RANK.
- spec.runPolicy.suspend suspends the TrainJob in place (Trainer suspends the JobSet, JobSet the
  Job, the Job controller deletes the pods; the trainer saves on SIGTERM), and resuming it lets the
  same attempt finish from where it stopped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from llamaft.render import backends
from llamaft_trainer.process.local_etcd import LocalEtcd
from llamaft_trainer.report.logline import read_events

from tests.conftest import REPO
from tests.controlplane import runs
from tests.controlplane.cluster import ControlPlane
from tests.controlplane.kubeflow_trainer import TrainerController
from tests.controlplane.kubelet import Kubelet
from tests.operator.conftest import Cluster, Operator, wait_for

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
rendezvous, admin = runs.rendezvous, runs.admin
checkpoint_claim, nodes = runs.checkpoint_claim, runs.nodes
"""Trainer and JobSet, and the same external etcd, admin client, claim and two tainted nodes as the
PyTorchJob runs (tests/controlplane/runs.py)."""


@pytest.fixture
def operator(control_plane: ControlPlane, namespace: str, trainer: TrainerController, tmp_path: Path) -> Iterator[Operator]:
    with runs.chart_operator(control_plane, namespace, tmp_path / "operator.log") as op:
        yield op


def _trainjob(cluster: Cluster, name: str) -> dict[str, Any] | None:
    try:
        job: dict[str, Any] = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, name)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return job


def _pods(cluster: Cluster, job: str) -> list[client.V1Pod]:
    return list(cluster.core.list_namespaced_pod(cluster.ns, label_selector=backends.backend_for("TrainJob").pod_selector(job)).items)


def test_every_rendered_trainjob_is_admitted_by_trainers_webhooks(
        control_plane: ControlPlane, namespace: str, trainer: TrainerController, admin: client.ApiClient) -> None:
    custom = client.CustomObjectsApi(admin)
    rendered = 0
    for path in runs.EXAMPLES:
        for job in runs.rendered_jobs(path, namespace, "TrainJob"):
            custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job, dry_run="All")
            rendered += 1
    assert rendered >= 3, f"only {rendered} TrainJob(s) rendered from {len(runs.EXAMPLES)} examples"
    # The webhook is in the path: a job it refuses (a variable the torch plugin reserves) is refused.
    (job,) = runs.rendered_jobs(REPO / "examples" / "tiny.yaml", namespace, "TrainJob")[:1]
    job["spec"]["trainer"].setdefault("env", []).append({"name": "PET_NNODES", "value": "3"})
    with pytest.raises(client.ApiException) as refused:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job, dry_run="All")
    message = json.loads(refused.value.body)["message"]
    assert message.startswith('admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request: '
                              "spec.trainer.env: Invalid value:"), message
    assert "must not have reserved envs, invalid envs configured: [PET_NNODES]" in message, message


def test_a_killed_container_restarts_in_place_and_the_operator_replaces_the_whole_gang(
        control_plane: ControlPlane, namespace: str, nodes: list[Kubelet], operator: Operator, rendezvous: LocalEtcd,
        tiny_model: Path, admin: client.ApiClient, checkpoint_claim: Path) -> None:
    cluster = Cluster(admin, namespace)
    cluster.create("tj", runs.run_spec(tiny_model, namespace, rendezvous, backend="TrainJob", training={"maxSteps": 20},
                                  checkpointing={"everyNSteps": 10}))
    first = cluster.job_name("tj", 1)
    wait_for("attempt 1's TrainJob", lambda: _trainjob(cluster, first), timeout=60)
    _, victim = wait_for("attempt 1 past checkpoint 10", lambda: runs.past_checkpoint(nodes, namespace, first, 10),
                         timeout=180, interval=0.1)
    runs.assert_monitored(cluster, "tj", first, runs.running_pods(cluster, "TrainJob", first))
    pods = _pods(cluster, first)
    indices = [p.metadata.annotations["batch.kubernetes.io/job-completion-index"] for p in pods]
    assert sorted(indices) == ["0", "1"], "the operator's selector finds the node Job's two pods, one per index"
    for pod, index in zip(pods, indices, strict=True):
        node = next(k for k in nodes if pod.metadata.name in runs.pod_names(k, namespace))
        environ = node.environ(namespace, pod.metadata.name)
        assert (environ["PET_NODE_RANK"], environ["PET_NNODES"]) == (index, "2"), "the torch plugin's env, the index by the downward API"
    node = next(k for k in nodes if victim in runs.pod_names(k, namespace))
    node.kill(namespace, victim)
    # The kubelet restarts the container in place (the Job's pod template: restartPolicy OnFailure).
    wait_for("the container restarted", lambda: next(
        (p for p in _pods(cluster, first) if p.metadata.name == victim and p.status.container_statuses
         and p.status.container_statuses[0].restart_count >= 1), None), timeout=60)
    status = runs.end(cluster, "tj", nodes, operator, timeout=300)
    assert status["phase"] == "Succeeded" and status["backend"] == "TrainJob", json.dumps(status, indent=1)[:3000]
    assert status["attempt"] == 2 and status["failures"][0]["reason"] in ("Killed", "PeerLost", "TrainerError"), status
    assert status["progress"]["step"] == 20, status
    second = cluster.job_name("tj", 2)
    resumed = [e for lines in runs.events(nodes, namespace, second).values() for e in lines if e.get("event") == "resume"]
    assert resumed and resumed[0]["step"] >= 10, "attempt 2 resumes from the newest checkpoint"
    done = [e for k in nodes for pod in runs.pod_names(k, namespace) if pod.startswith(f"{second}-")
            for e in read_events(k.logs(namespace, pod)) if e.get("event") == "done"]
    assert done and status["progress"]["loss"] == pytest.approx(done[-1]["loss"], abs=1e-9)
    job = wait_for("attempt 2's TrainJob Complete", lambda: (j := _trainjob(cluster, second)) and any(
        c["type"] == "Complete" and c["status"] == "True" for c in (j.get("status") or {}).get("conditions") or []) and j)
    assert job["spec"]["runtimeRef"]["name"] == TrainerController.RUNTIME
    assert job["metadata"]["labels"]["llamaft.io/finetune"] == "tj" and job["metadata"]["ownerReferences"][0]["name"] == "tj"
    assert f"TrainJob {second} succeeded" in status["message"], status
    assert cluster.attempt_job("tj", 2) is None, "no PyTorchJob on this backend"
    wait_for("attempt 1's TrainJob gone", lambda: _trainjob(cluster, first) is None, timeout=60)


def test_suspend_and_resume_through_spec_suspend_finish_the_same_attempt(
        control_plane: ControlPlane, namespace: str, nodes: list[Kubelet], operator: Operator, rendezvous: LocalEtcd,
        tiny_model: Path, admin: client.ApiClient, checkpoint_claim: Path) -> None:
    cluster = Cluster(admin, namespace)
    cluster.create("tjs", runs.run_spec(tiny_model, namespace, rendezvous, backend="TrainJob", training={"maxSteps": 20},
                                   checkpointing={"everyNSteps": 10}))
    name = cluster.job_name("tjs", 1)
    wait_for("past checkpoint 10", lambda: runs.past_checkpoint(nodes, namespace, name, 10), timeout=180, interval=0.1)
    cluster.patch_finetune("tjs", {"spec": {"runPolicy": {"suspend": True}}})
    wait_for("Suspended", lambda: cluster.status("tjs")["phase"] == "Suspended", timeout=60)
    wait_for("the gang's pods gone", lambda: not _pods(cluster, name), timeout=60)
    job = _trainjob(cluster, name)
    assert job is not None and job["spec"]["suspend"] is True
    cluster.patch_finetune("tjs", {"spec": {"runPolicy": {"suspend": False}}})
    status = runs.end(cluster, "tjs", nodes, operator, timeout=240)
    assert status["phase"] == "Succeeded" and status["attempt"] == 1 and not status.get("failures"), status
    assert status["progress"]["step"] == 20, status
    resumed = [e for lines in runs.events(nodes, namespace, name).values() for e in lines if e.get("event") == "resume"]
    assert resumed and resumed[0]["step"] >= 10, "the resumed gang starts from its newest checkpoint"
