"""The kopf runtime against the emulator, with a real etcd behind the rendezvous: recovery from a
closed rendezvous, deletion, suspend/resume, spec changes, restarts of the operator itself, and
progress read from the real trainer's /progress endpoint."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest
from llamaft.operator import rendezvous
from llamaft_trainer.process.local_etcd import LocalEtcd

from tests.operator.conftest import Cluster, Operator, close_rendezvous, free_port, tiny_spec, wait_for

ETCD_SPEC = {"backend": "etcd-v2", "endpoint": "etcd.infra.svc:2379"}


@pytest.fixture(scope="module")
def operator(etcd_operator: Operator) -> Operator:
    return etcd_operator


def reasons(cluster: Cluster, name: str) -> list[str]:
    return [e["reason"] for e in cluster.events(name)]


def closed_run(etcd: LocalEtcd, rdzv_id: str) -> None:
    close_rendezvous(etcd.endpoint, rdzv_id)


def running(cluster: Cluster, job: str) -> None:
    cluster.set_job_status(job, [("Created", "PyTorchJobCreated", "c"), ("Running", "PyTorchJobRunning", "r")],
                           replicaStatuses={"Worker": {"active": 2}})


def test_closed_rendezvous_is_reset_and_resubmitted(cluster: Cluster, operator: Operator, etcd: LocalEtcd) -> None:
    cluster.create("recover", tiny_spec(rendezvous=ETCD_SPEC, runPolicy={"retryBudget": 2}))
    job = wait_for("recover-1", lambda: cluster.attempt_job("recover", 1))
    rdzv_id = job["spec"]["elasticPolicy"]["rdzvId"]
    closed_run(etcd, rdzv_id)  # the workers ran, then their pods restarted into a closed rendezvous
    assert any(rendezvous.store_key_belongs_to(k, rdzv_id) for k in rendezvous.EtcdV2(etcd.endpoint).children(rendezvous.ETCD_V2_STORE))
    running(cluster, cluster.job_name("recover", 1))
    wait_for("Running", lambda: cluster.status("recover")["phase"] == "Running")
    message = f"torch.distributed.elastic.rendezvous.api.RendezvousClosedError: Rendezvous for run_id={rdzv_id} was observed to be closed"
    cluster.set_job_status(cluster.job_name("recover", 1), [("Created", "PyTorchJobCreated", "c"), ("Failed", "PyTorchJobFailed", message)],
                           replicaStatuses={"Worker": {"failed": 2}})
    wait_for("recover-2", lambda: cluster.attempt_job("recover", 2))
    status = wait_for("attempt 2 recorded", lambda: (s := cluster.status("recover")).get("attempt") == 2 and s)
    assert status["retriesUsed"] == 1 and status["rendezvousId"].endswith("-2")
    assert cluster.attempt_job("recover", 1) is None, "the failed attempt's job is removed"
    store = rendezvous.EtcdV2(etcd.endpoint).children(rendezvous.ETCD_V2_STORE)
    assert not any(rendezvous.store_key_belongs_to(k, rdzv_id) for k in store), "the closed rendezvous was reset"
    assert not rendezvous.EtcdV2(etcd.endpoint).exists(f"{rendezvous.ETCD_V2_STATE}/{rdzv_id}")
    events = wait_for("events", lambda: {"RendezvousClosed", "RendezvousReset", "JobCreated"} <= set(reasons(cluster, "recover")) and reasons(cluster, "recover"))
    assert events
    import urllib.request

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics", timeout=2).read().decode()
    assert 'llamaft_operator_retries_total{reason="RendezvousClosed"} 1.0' in metrics
    assert 'llamaft_operator_rendezvous_resets_total{outcome="deleted"}' in metrics


def test_retry_budget_exhausted_fails_the_run(cluster: Cluster, operator: Operator) -> None:
    cluster.create("nobudget", tiny_spec(rendezvous=ETCD_SPEC, runPolicy={"retryBudget": 0}))
    wait_for("job", lambda: cluster.attempt_job("nobudget", 1))
    cluster.set_job_status(cluster.job_name("nobudget", 1), [("Failed", "PyTorchJobFailed", "RendezvousClosedError: closed")])
    status = wait_for("Failed", lambda: (s := cluster.status("nobudget"))["phase"] == "Failed" and s)
    assert "retry budget (0) is used up" in status["message"]
    wait_for("event", lambda: "RetryBudgetExhausted" in reasons(cluster, "nobudget"))
    time.sleep(1.5)
    assert cluster.attempt_job("nobudget", 2) is None


def test_permanent_failures_are_not_retried(cluster: Cluster, operator: Operator) -> None:
    cluster.create("deadline", tiny_spec(rendezvous=ETCD_SPEC))
    job = wait_for("job", lambda: cluster.attempt_job("deadline", 1))["metadata"]["name"]
    cluster.set_job_status(job, [("Failed", "DeadlineExceeded", f"PyTorchJob {job} has failed because it was active longer than specified deadline")])
    status = wait_for("Failed", lambda: (s := cluster.status("deadline"))["phase"] == "Failed" and s)
    assert "DeadlineExceeded is permanent" in status["message"] and status.get("retriesUsed", 0) == 0
    assert status["failures"][0]["reason"] == "DeadlineExceeded" and status["failures"][0]["retryable"] is False
    wait_for("event", lambda: "DeadlineExceeded" in reasons(cluster, "deadline"))
    time.sleep(1.5)
    assert cluster.attempt_job("deadline", 2) is None
    assert cluster.attempt_job("deadline", 1) is not None, "a job the training operator failed stays for kubectl logs"


@pytest.mark.parametrize("job_failed_first", [False, True], ids=["report-first", "job-failed-first"])
def test_a_permanent_failure_keeps_the_failed_pod_for_kubectl_logs(cluster: Cluster, operator: Operator,
                                                                    job_failed_first: bool) -> None:
    """A trainer that finds no dataset (1 worker) ends its pod with a ConfigError report. Whether the
    operator reads that report before the training operator sets the job's Failed condition or
    with it, the run is Failed and the job is not deleted: its failed pod, which the garbage
    collector would take with the job, stays for `kubectl logs`. The training operator marks the
    job Failed only once it has seen the failed pod, so the pod's report always comes first; to
    have the operator read both at once, it is paused across the two writes."""
    name = "nodata-late" if job_failed_first else "nodata"
    cluster.create(name, tiny_spec(rendezvous=ETCD_SPEC, cluster={"workers": 1}))
    job = wait_for("job", lambda: cluster.attempt_job(name, 1))
    job_name = job["metadata"]["name"]
    cluster.set_job_status(job_name, [("Created", "PyTorchJobCreated", "c"), ("Running", "PyTorchJobRunning", "r")],
                           replicaStatuses={"Worker": {"active": 1}})
    wait_for("Running", lambda: cluster.status(name)["phase"] == "Running")
    failed = [("Created", "PyTorchJobCreated", "c"), ("Failed", "PyTorchJobFailed",
                                                      f"PyTorchJob {job_name} is failed because 1 Worker replica(s) failed.")]
    report = json.dumps({"phase": "Failed", "reason": "ConfigError", "message": "spec.dataset.source: /data/missing.jsonl: no such file"})
    pod = f"{job_name}-worker-0"
    with operator.paused() if job_failed_first else contextlib.nullcontext():
        cluster.create_pod(pod, job_name, phase="Failed", terminated_message=report, owner=job)
        if job_failed_first:
            cluster.set_job_status(job_name, failed, replicaStatuses={"Worker": {"failed": 1}})
    status = wait_for("Failed", lambda: (s := cluster.status(name))["phase"] == "Failed" and s)
    assert "ConfigError is permanent" in status["message"] and status["failures"][0]["reason"] == "ConfigError"
    time.sleep(1.0)  # a delete would have been issued by now, and collected (the emulator's GC acts in 50 ms)
    assert cluster.attempt_job(name, 1) is not None, "a permanently failed run's job is not deleted"
    assert cluster.exists("Pod", pod), "its failed pod stays for kubectl logs"
    if not job_failed_first:
        cluster.set_job_status(job_name, failed, replicaStatuses={"Worker": {"failed": 1}})  # the training operator, late
        time.sleep(0.5)
        assert cluster.exists("Pod", pod) and cluster.status(name)["phase"] == "Failed"
    assert cluster.attempt_job(name, 2) is None


def test_delete_mid_run_removes_children_keeps_checkpoints(cluster: Cluster, operator: Operator) -> None:
    cluster.create("gone", tiny_spec(rendezvous={"backend": "etcd-v2"}, checkpointing={"volumeClaim": "ckpt"}))
    wait_for("etcd deployment", lambda: cluster.exists("Deployment", "gone-etcd"))
    cluster.make_etcd_ready("gone-etcd")
    wait_for("job", lambda: cluster.attempt_job("gone", 1))
    running(cluster, cluster.job_name("gone", 1))
    wait_for("Running", lambda: cluster.status("gone")["phase"] == "Running")
    cluster.delete_finetune("gone")
    wait_for("finetune gone", lambda: not cluster.custom.list_namespaced_custom_object(
        "llamaft.io", "v1alpha1", "default", "llamafinetunes", field_selector="metadata.name=gone")["items"]
        or all(i["metadata"]["name"] != "gone" for i in cluster.custom.list_namespaced_custom_object(
            "llamaft.io", "v1alpha1", "default", "llamafinetunes")["items"]))
    # The children are the garbage collector's (each is owned by the CR): gone once it has run.
    def left() -> list[str]:
        names = [f"{kind}/{name}" for kind, name in (("Deployment", "gone-etcd"), ("Service", "gone-etcd"),
                 ("ConfigMap", "gone-config"), ("ConfigMap", "gone-dashboard")) if cluster.exists(kind, name)]
        names += ["PyTorchJob"] if cluster.attempt_job("gone", 1) is not None else []
        monitors = cluster.custom.list_namespaced_custom_object("monitoring.coreos.com", "v1", "default", "podmonitors")["items"]
        return names + [m["metadata"]["name"] for m in monitors if m["metadata"]["name"] == "gone-trainer"]

    wait_for("children collected", lambda: not left() or None, timeout=10)


def test_suspend_and_resume(cluster: Cluster, operator: Operator) -> None:
    cluster.create("pause", tiny_spec(rendezvous=ETCD_SPEC))
    wait_for("job", lambda: cluster.attempt_job("pause", 1))
    running(cluster, cluster.job_name("pause", 1))
    cluster.patch_finetune("pause", {"spec": {"runPolicy": {"suspend": True}}})
    wait_for("job suspended", lambda: (cluster.attempt_job("pause", 1) or {})["spec"]["runPolicy"]["suspend"] is True)
    cluster.set_job_status(cluster.job_name("pause", 1), [("Suspended", "PyTorchJobSuspended", "suspended")])
    wait_for("Suspended", lambda: cluster.status("pause")["phase"] == "Suspended")
    cluster.patch_finetune("pause", {"spec": {"runPolicy": {"suspend": False}}})
    wait_for("job resumed", lambda: (cluster.attempt_job("pause", 1) or {})["spec"]["runPolicy"]["suspend"] is False)
    assert cluster.attempt_job("pause", 2) is None, "suspend/resume keeps the attempt"
    cluster.wait_reasons("pause", "Suspended", "Resumed")


def test_spec_change_restarts_from_checkpoint_and_immutable_fields_are_refused(cluster: Cluster, operator: Operator) -> None:
    cluster.create("tune", tiny_spec(rendezvous=ETCD_SPEC))
    wait_for("job", lambda: cluster.attempt_job("tune", 1))
    wait_for("observed", lambda: cluster.status("tune").get("observedGeneration") == 1)
    # The default spelled out: the API server's defaulting already stored it, so nothing changes.
    cluster.patch_finetune("tune", {"spec": {"fsdp": {"shardingStrategy": "FULL_SHARD"}}})
    time.sleep(1.5)
    assert cluster.finetune("tune")["metadata"]["generation"] == 1
    assert cluster.attempt_job("tune", 1) is not None and cluster.attempt_job("tune", 2) is None, "an edit that changes nothing restarts nothing"
    cluster.patch_finetune("tune", {"spec": {"training": {"epochs": 1, "learningRate": 1e-4}}})
    wait_for("tune-2", lambda: cluster.attempt_job("tune", 2))
    assert cluster.attempt_job("tune", 1) is None
    config = cluster.core.read_namespaced_config_map("tune-config", "default").data["config.json"]
    assert '"learningRate": 0.0001' in config
    wait_for("SpecChanged event", lambda: any("restarting from the latest checkpoint" in e["message"]
                                              for e in cluster.events("tune") if e["reason"] == "SpecChanged"))
    cluster.patch_finetune("tune", {"spec": {"model": {"source": "meta-llama/Llama-2-13b-hf"}}})
    wait_for("immutable event", lambda: any("model.source is immutable" in e["message"] for e in cluster.events("tune")))
    assert cluster.attempt_job("tune", 3) is None and cluster.attempt_job("tune", 2) is not None


def test_elastic_worker_change_is_applied_in_place(cluster: Cluster, operator: Operator) -> None:
    cluster.create("elastic", tiny_spec(rendezvous=ETCD_SPEC, cluster={"workers": 2, "elastic": {"minWorkers": 1, "maxWorkers": 4}}))
    wait_for("job", lambda: cluster.attempt_job("elastic", 1))
    cluster.patch_finetune("elastic", {"spec": {"cluster": {"workers": 3}}})
    wait_for("scaled", lambda: (cluster.attempt_job("elastic", 1) or {})["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3)
    cluster.wait_reasons("elastic", "Scaled")  # the event can trail the job's new replica count
    assert cluster.attempt_job("elastic", 2) is None
    cluster.patch_finetune("elastic", {"spec": {"cluster": {"workers": 9}}})  # outside the elastic range
    wait_for("refused", lambda: any("must lie within elastic.minWorkers..maxWorkers" in e["message"] for e in cluster.events("elastic")))
    assert cluster.attempt_job("elastic", 1)["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3  # type: ignore[index]


def test_operator_killed_mid_reconcile_creates_no_duplicates(cluster: Cluster, kubeconfig: Path, etcd: LocalEtcd,
                                                            operator: Operator, tmp_path: Path) -> None:
    operator.stop()
    first = Operator(kubeconfig, tmp_path / "first.log", LLAMAFT_RENDEZVOUS_ADDRESS_OVERRIDE=etcd.endpoint).start()
    try:
        cluster.create("crash", tiny_spec(rendezvous={"backend": "etcd-v2"}))
        wait_for("etcd deployment", lambda: cluster.exists("Deployment", "crash-etcd"))
        waiting = wait_for("waiting for etcd", lambda: any(
            c["type"] == "RendezvousReady" and c["status"] == "False" for c in cluster.status("crash").get("conditions", [])))
        assert waiting and cluster.attempt_job("crash", 1) is None, "no job before the managed etcd is ready"
        first.kill()  # while it waits for etcd: ConfigMap and etcd exist, no job yet
        cluster.make_etcd_ready("crash-etcd")
        second = Operator(kubeconfig, tmp_path / "second.log", LLAMAFT_RENDEZVOUS_ADDRESS_OVERRIDE=etcd.endpoint).start()
        wait_for("job", lambda: cluster.attempt_job("crash", 1), timeout=40)
        second.kill()  # right after creating the job
        third = Operator(kubeconfig, tmp_path / "third.log", LLAMAFT_RENDEZVOUS_ADDRESS_OVERRIDE=etcd.endpoint).start()
        running(cluster, cluster.job_name("crash", 1))
        wait_for("Running", lambda: cluster.status("crash")["phase"] == "Running", timeout=40)
        assert [j["metadata"]["name"] for j in cluster.jobs("llamaft.io/finetune=crash")] == [cluster.job_name("crash", 1)]
        deployments = cluster.apps.list_namespaced_deployment("default", label_selector="llamaft.io/finetune=crash").items
        assert len(deployments) == 1
        # No duplicate decision: at most one JobCreated. kopf posts events from a background queue, so
        # the operator killed right after creating the job may die before its event is posted; the
        # third one finds the job and creates (and announces) nothing.
        assert len([e for e in cluster.events("crash") if e["reason"] == "JobCreated"]) <= 1
        third.stop()
    finally:
        first.kill()
        operator.start()


def test_progress_from_the_trainer_endpoint(cluster: Cluster, operator: Operator) -> None:
    from llamaft_trainer.report.metrics import ProgressPublisher

    port = free_port()
    progress = ProgressPublisher()
    progress.update(rank=0, pod="prog-leader")
    server = progress.serve(port)
    try:
        cluster.create("prog", tiny_spec(rendezvous=ETCD_SPEC, monitoring={"metricsPort": port}))
        wait_for("job", lambda: cluster.attempt_job("prog", 1))
        job = cluster.job_name("prog", 1)
        cluster.create_pod(f"{job}-worker-0", job)
        running(cluster, cluster.job_name("prog", 1))
        progress.total_steps.set(100)
        progress.update(totalSteps=100)
        progress.record_step({"step": 42, "epoch": 1, "loss": 1.25, "lr": 1e-5, "grad_norm": 0.5, "tokens_per_second": 5000.0,
                              "tokens_per_second_per_device": 2500.0, "mfu": 0.4, "peak_memory_bytes": 1, "tokens": 10, "eta_seconds": 60})
        status = wait_for("progress", lambda: (s := cluster.status("prog")).get("progress", {}).get("step") == 42 and s)
        assert status["progress"]["stepOfTotal"] == "42/100" and status["progress"]["loss"] == 1.25
        assert status["progress"]["tokensPerSecond"] == 5000.0 and status["leaderPod"] == "prog-leader"
    finally:
        server.shutdown()


def test_operator_metrics_endpoint(cluster: Cluster, operator: Operator) -> None:
    import urllib.request

    cluster.create("metered", tiny_spec(rendezvous=ETCD_SPEC))
    url = f"http://127.0.0.1:{operator.metrics_port}/metrics"
    text = wait_for("lifecycle metrics", lambda: (t := urllib.request.urlopen(url, timeout=2).read().decode())
                    and 'llamaft_operator_reconciles_total{handler="lifecycle",result="ok"}' in t and t)
    for name in ("llamaft_operator_reconciles_total", "llamaft_operator_reconcile_seconds_bucket", "llamaft_operator_finetunes",
                 "llamaft_operator_rendezvous_resets_total", "llamaft_operator_retries_total"):
        assert name in text, name
    assert 'llamaft_operator_finetunes{phase="Creating"}' in text
