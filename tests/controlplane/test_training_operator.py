"""Runs on the real control plane with the real Kubeflow training operator (PyTorchJob controller
and webhook, tests/controlplane/training_operator.py): the llamaft operator as the chart runs it,
our kubelet running the real trainer in the pods the training operator creates, a real etcd for
torchrun's rendezvous (spec.rendezvous.endpoint: an external etcd, as users may give one).

- Every PyTorchJob llamaft renders from examples/ is admitted by the training operator's webhook
  (a server-side dry-run create, which calls admission webhooks), and a job the webhook refuses is
  refused there, so the webhook is in the path.
- A fine-tune trains to Succeeded: 2 workers, the training operator's Succeeded condition, the
  trainer's last report in the status, the job's pods Succeeded.
- A run that fails permanently (a dataset that does not exist, 1 worker) keeps its PyTorchJob and
  its failed pod for `kubectl logs`, whatever order the pod's termination report and the job's
  Failed condition reach the operator in (found from outside: the operator used to delete the job,
  and garbage collection took the failed pod).
- Faults (a container killed, OOM-killed or hung, an XID, a node-pressure eviction, the Eviction
  API, the scheduler's preemption) each cost at most one checkpoint interval; a used-up retry
  budget fails the run with its history; a run deleted and applied again (mid-run, after success)
  trains in a job of its own; the operator killed mid-run is picked up by its next process.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from llamaft_trainer.process.local_etcd import LocalEtcd
from llamaft_trainer.report.logline import read_events

from tests.conftest import REPO
from tests.controlplane import runs
from tests.controlplane.cluster import ControlPlane
from tests.controlplane.conftest import TAINT
from tests.controlplane.kubelet import Kubelet
from tests.controlplane.training_operator import TrainingOperator
from tests.operator import dcgm_exporter
from tests.operator.conftest import Cluster, Operator, tiny_spec, wait_for
from tests.operator.dcgm_exporter import xid_on

rendezvous, admin = runs.rendezvous, runs.admin
checkpoint_claim, nodes = runs.checkpoint_claim, runs.nodes
"""The shared fixtures (tests/controlplane/runs.py)."""
dcgm = dcgm_exporter.dcgm
"""A real Prometheus scraping a replayed dcgm-exporter: the GPU-health evidence the operator reads."""


@pytest.fixture
def operator(control_plane: ControlPlane, namespace: str, training_operator: TrainingOperator,
             dcgm: tuple[str, dict[str, str]], tmp_path: Path) -> Iterator[Operator]:
    """The llamaft operator as the chart runs it (its ServiceAccount, its RBAC), watching
    `namespace`, reading GPU health from the module's Prometheus."""
    with runs.chart_operator(control_plane, namespace, tmp_path / "operator.log", LLAMAFT_PROMETHEUS_URL=dcgm[0]) as op:
        yield op


def test_every_rendered_pytorchjob_is_admitted_by_the_training_operators_webhook(
        control_plane: ControlPlane, namespace: str, training_operator: TrainingOperator, admin: client.ApiClient) -> None:
    custom = client.CustomObjectsApi(admin)
    rendered = 0
    for path in runs.EXAMPLES:
        for job in runs.rendered_jobs(path, namespace, "PyTorchJob"):
            custom.create_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", job, dry_run="All")
            rendered += 1
    assert rendered >= 3, f"only {rendered} PyTorchJob(s) rendered from {len(runs.EXAMPLES)} examples"
    # The webhook is in the path: a job it refuses (its container is not named `pytorch`) is refused.
    (job,) = runs.rendered_jobs(REPO / "examples" / "tiny.yaml", namespace, "PyTorchJob")[:1]
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    with pytest.raises(client.ApiException) as refused:
        custom.create_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", job, dry_run="All")
    message = json.loads(refused.value.body)["message"]
    assert message == ('admission webhook "validator.pytorchjob.training-operator.kubeflow.org" denied the request: '
                       "spec.pytorchReplicaSpecs[Worker].template.spec.containers: Required value: must have at "
                       "least one container with name pytorch"), message


def test_a_fine_tune_trains_to_success_through_the_real_training_operator(
        control_plane: ControlPlane, namespace: str, nodes: list[Kubelet], operator: Operator, rendezvous: LocalEtcd,
        tiny_model: Path, admin: client.ApiClient, checkpoint_claim: Path) -> None:
    cluster = Cluster(admin, namespace)
    cluster.create("ft", runs.run_spec(tiny_model, namespace, rendezvous))
    job_name = cluster.job_name("ft", 1)
    runs.assert_monitored(cluster, "ft", job_name, runs.running_pods(cluster, "PyTorchJob", job_name))
    status = runs.end(cluster, "ft", nodes, operator, timeout=240)
    logs = {p: k.logs(namespace, p) for k in nodes for p in runs.pod_names(k, namespace)}
    assert status["phase"] == "Succeeded", (status, {p: text[-2000:] for p, text in logs.items()})
    assert status["attempt"] == 1 and not status.get("failures"), status
    progress = status["progress"]
    assert progress["step"] == 12 and progress["stepOfTotal"] == "12/12", status
    # The claim is mounted at the checkpoint directory itself (/checkpoints/run).
    exported = checkpoint_claim / Path(status["exportPath"]).relative_to("/checkpoints/run")
    assert (exported / "config.json").exists(), f"exported onto the claim: {status['exportPath']}"
    job = cluster.attempt_job("ft", 1)
    assert job is not None
    conditions = {c["type"]: c["status"] for c in job["status"]["conditions"]}
    assert conditions.get("Succeeded") == "True", job["status"]
    # training-operator v1.9 calls an elastic job Succeeded when a worker has succeeded and, by its
    # cleanPodPolicy (Running), deletes the workers still running: what stays has succeeded.
    selector = f"training.kubeflow.org/job-name={job['metadata']['name']}"
    pods = wait_for("no worker running", lambda: (items := client.CoreV1Api(admin).list_namespaced_pod(
        namespace, label_selector=selector).items) and all(p.status.phase != "Running" for p in items) and items, timeout=60)
    assert {p.status.phase for p in pods} == {"Succeeded"}, [(p.metadata.name, p.status.phase) for p in pods]
    assert {p.spec.node_name for p in pods} <= {k.name for k in nodes}
    done = [line for k in nodes for pod in runs.pod_names(k, namespace) for line in read_events(k.logs(namespace, pod))
            if line.get("event") == "done"]
    assert done and progress["step"] == done[-1]["step"] and progress["loss"] == pytest.approx(done[-1]["loss"], abs=1e-9)


def test_applied_again_after_success_a_run_trains_in_its_own_job(
        control_plane: ControlPlane, namespace: str, nodes: list[Kubelet], operator: Operator, rendezvous: LocalEtcd,
        tiny_model: Path, admin: client.ApiClient, checkpoint_claim: Path) -> None:
    """A run that succeeded, deleted and applied again (`kubectl delete -f` then `apply -f`): the
    new incarnation never takes its predecessor's finished job (garbage collection may still be
    taking it) for its result; it runs a job of its own, resumes from the checkpoints on the claim
    and ends Succeeded with its own report."""
    cluster = Cluster(admin, namespace)
    spec = runs.run_spec(tiny_model, namespace, rendezvous)
    cluster.create("again", spec)
    first = runs.end(cluster, "again", nodes, operator, timeout=240)
    assert first["phase"] == "Succeeded" and first["attempt"] == 1 and not first.get("failures"), first
    cluster.wait_reasons("again", "JobCreated", "Running", "Succeeded")
    cluster.delete_finetune("again")
    wait_for("the first incarnation gone", lambda: all(i["metadata"]["name"] != "again" for i in cluster.custom.list_namespaced_custom_object(
        "llamaft.io", "v1alpha1", namespace, "llamafinetunes")["items"]), timeout=60)
    cluster.create("again", spec)  # at once: its predecessor's job may still be there, being collected
    second = runs.end(cluster, "again", nodes, operator, timeout=240)
    assert second["phase"] == "Succeeded" and second["jobName"] != first["jobName"], (first, second)
    assert second["progress"]["step"] == 12, second
    ran = runs.events(nodes, namespace, second["jobName"])
    assert any(lines for lines in ran.values()), "the new incarnation ran its own pods"
    resumed = [e for lines in ran.values() for e in lines if e.get("event") == "resume"]
    assert resumed and resumed[0]["step"] == 12, "it found the finished run's last checkpoint on the claim"


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_deleted_and_applied_again_mid_run_the_new_incarnation_finishes(
        control_plane: ControlPlane, namespace: str, nodes: list[Kubelet], operator: Operator, rendezvous: LocalEtcd,
        tiny_model: Path, admin: client.ApiClient, checkpoint_claim: Path, backend: str) -> None:
    """`kubectl delete -f ft.yaml && kubectl apply -f ft.yaml` mid-run, with either etcd rendezvous
    backend of torchrun: the new incarnation runs to the end in its first attempt, resuming the
    checkpoints on the claim, never meeting its predecessor's job (being collected) or rendezvous
    (its run id is the new job's)."""
    cluster = Cluster(admin, namespace)
    spec = runs.run_spec(tiny_model, namespace, rendezvous, training={"maxSteps": 30}, checkpointing={"everyNSteps": 10},
                    rendezvous={"backend": backend})
    cluster.create("rerun", spec)
    old_job = wait_for("attempt 1's job", lambda: cluster.attempt_job("rerun", 1), timeout=60)["metadata"]["name"]
    wait_for("past checkpoint 10", lambda: runs.past_checkpoint(nodes, namespace, old_job, 10), timeout=180, interval=0.1)
    old_rendezvous = cluster.status("rerun")["rendezvousId"]
    cluster.delete_finetune("rerun")
    wait_for("the old incarnation gone", lambda: all(i["metadata"]["name"] != "rerun" for i in cluster.custom.list_namespaced_custom_object(
        "llamaft.io", "v1alpha1", namespace, "llamafinetunes")["items"]), timeout=60)
    cluster.create("rerun", spec)  # at once: the old job and its pods may still be terminating
    status = runs.end(cluster, "rerun", nodes, operator, timeout=240)
    assert status["phase"] == "Succeeded" and status["jobName"] != old_job, status
    assert status["attempt"] == 1 and not status.get("failures"), status
    assert status["rendezvousId"] != old_rendezvous and status["progress"]["step"] == 30, status
    ran = runs.events(nodes, namespace, status["jobName"])
    resumed = [e for lines in ran.values() for e in lines if e.get("event") == "resume"]
    assert resumed and resumed[0]["step"] >= 10, "the rerun resumed from the checkpoints on the claim"
    live = wait_for("one live job", lambda: (names := [j["metadata"]["name"] for j in cluster.jobs("llamaft.io/finetune=rerun")
                                                     if not j["metadata"].get("deletionTimestamp")]) == [status["jobName"]] and names)
    assert live == [status["jobName"]]


def test_a_permanently_failed_run_keeps_its_job_and_failed_pod(
        control_plane: ControlPlane, namespace: str, nodes: list[Kubelet], operator: Operator, rendezvous: LocalEtcd,
        tiny_model: Path, admin: client.ApiClient, tmp_path: Path) -> None:
    cluster = Cluster(admin, namespace)
    missing = tmp_path / "missing.jsonl"
    cluster.create("typo", runs.run_spec(tiny_model, namespace, rendezvous, dataset={"source": str(missing)},
                                    cluster={"workers": 1}))
    status = runs.end(cluster, "typo", nodes, operator, timeout=180)
    assert status["phase"] == "Failed" and status["attempt"] == 1, status
    record = status["failures"][0]
    assert record["reason"] == "ConfigError" and not record["retryable"] and "missing.jsonl" in record["message"], record
    job_name = cluster.job_name("typo", 1)
    # The training operator has failed the job by now or will: either way the job and its pod stay.
    job = wait_for("the training operator's Failed condition", lambda: (
        j := cluster.job(job_name)) and any(c["type"] == "Failed" and c["status"] == "True"
                                            for c in (j.get("status") or {}).get("conditions") or []) and j, timeout=60)
    assert job["metadata"]["name"] == job_name
    time.sleep(3)  # past the operator's next sync: nothing deletes them later either
    assert cluster.job(job_name) is not None, "a permanently failed run's job is not deleted"
    pods = client.CoreV1Api(admin).list_namespaced_pod(
        namespace, label_selector=f"training.kubeflow.org/job-name={job_name}").items
    assert [p.status.phase for p in pods] == ["Failed"], [(p.metadata.name, p.status.phase) for p in pods]
    logs = next(k.logs(namespace, pods[0].metadata.name) for k in nodes if pods[0].spec.node_name == k.name)
    assert "missing.jsonl" in logs, logs[-2000:]


FAULT_RUNS = [["kill_container", "oom_kill", "hang", "gpu_xid"], ["kubelet_eviction", "api_eviction", "preemption"]]
"""Faults on the real control plane, each ending one attempt of a run that takes several in turn:
fault k lands on a worker of attempt k once it has passed checkpoint k x 10. Each run has at most
one fault that keeps later attempts off its node: its last attempt needs a node of the two."""
EXPECTED = {"kill_container": "Killed", "oom_kill": "OOMKilled", "hang": "Stalled", "kubelet_eviction": "Evicted",
            "api_eviction": "Evicted", "preemption": "Preempted", "gpu_xid": "GPUXid"}
EXCLUDES_THE_NODE = {"kubelet_eviction", "gpu_xid"}
WORKER_CPU = "1"
"""The fault runs' workers request a CPU each (requests = limits): a pod that requests nothing
takes no room on a node, and the scheduler preempts pods only to make room."""
PREEMPTOR_PRIORITY = "llamaft-test-preemptor"


def _inject(plane: ControlPlane, node: Kubelet, namespace: str, pod: str, fault: str) -> None:
    """One fault on one pod: by our kubelet (the node's own faults), or through the API server
    (the Eviction API; the real kube-scheduler preempting for a pod of higher priority)."""
    if fault == "api_eviction":  # the Eviction API: the API server adds DisruptionTarget and deletes the pod
        status, answer = plane.request("POST", f"/api/v1/namespaces/{namespace}/pods/{pod}/eviction", {
            "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": namespace}})
        assert status == 201, answer
        return
    if fault == "preemption":
        _preempt(plane, node, namespace)
        return
    {"kill_container": node.kill, "oom_kill": node.oom_kill, "hang": node.hang, "kubelet_eviction": node.evict}[fault](
        namespace, pod)


def _preempt(plane: ControlPlane, node: Kubelet, namespace: str) -> None:
    """A pod of higher priority that needs all of `node`'s CPU: kube-scheduler's preemption
    (DefaultPreemption) marks the trainer pods there DisruptionTarget PreemptionByScheduler and
    deletes them (our kubelet SIGTERMs their containers), then binds it there."""
    status, answer = plane.request("POST", "/apis/scheduling.k8s.io/v1/priorityclasses", {
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": PREEMPTOR_PRIORITY},
        "value": 1_000_000, "description": "a test's pod that preempts trainer pods"})
    assert status in (201, 409), answer
    status, answer = plane.request("POST", f"/api/v1/namespaces/{namespace}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"preemptor-{node.name}"},
        "spec": {"priorityClassName": PREEMPTOR_PRIORITY, "nodeSelector": {"kubernetes.io/hostname": node.name},
                 "tolerations": [{"key": TAINT, "operator": "Equal", "value": namespace, "effect": "NoSchedule"}],
                 "terminationGracePeriodSeconds": 0,
                 "containers": [{"name": "hold", "image": "busybox", "command": ["sleep", "600"],
                                 "resources": {"requests": {"cpu": node.shape.cpu}, "limits": {"cpu": node.shape.cpu}}}]}})
    assert status == 201, answer


@pytest.mark.parametrize("faults", FAULT_RUNS, ids=["+".join(f.replace("_", "") for f in run) for run in FAULT_RUNS])
def test_each_fault_costs_at_most_one_checkpoint_interval(
        control_plane: ControlPlane, namespace: str, nodes: list[Kubelet], operator: Operator, rendezvous: LocalEtcd,
        tiny_model: Path, admin: client.ApiClient, dcgm: tuple[str, dict[str, str]], faults: list[str]) -> None:
    """Each fault lands after its attempt's newest checkpoint; the llamaft operator classifies it
    from the pod's evidence (a hang by the progress deadline, an XID by dcgm-exporter's series in
    Prometheus, which ends the attempt: its job is deleted), keeps later attempts off a node the
    evidence named, and the next attempt resumes from that checkpoint or a later one (an eviction's
    SIGTERM lets the trainer save where it stopped); the run finishes with one live job, after
    len(faults) retries."""
    cluster = Cluster(admin, namespace)
    steps = 10 * (len(faults) + 1)
    policy: dict[str, Any] = {"retryBudget": len(faults), **({"progressDeadlineSeconds": 10} if "hang" in faults else {})}
    cluster.create("faults", runs.run_spec(tiny_model, namespace, rendezvous, training={"maxSteps": steps},
                                      checkpointing={"everyNSteps": 10}, runPolicy=policy,
                                      cluster={"resources": {"cpu": WORKER_CPU}}))
    excluded: list[str] = []
    for attempt, fault in enumerate(faults, start=1):
        job = wait_for(f"attempt {attempt}'s job", lambda a=attempt: cluster.attempt_job("faults", a), timeout=60)
        name = job["metadata"]["name"]
        _, victim = wait_for(f"attempt {attempt} past checkpoint {attempt * 10}",
                             lambda n=name, a=attempt: runs.past_checkpoint(nodes, namespace, n, a * 10), timeout=180, interval=0.1)
        node = next(k for k in nodes if victim in runs.pod_names(k, namespace))

        def next_attempt(a: int = attempt) -> dict[str, Any]:
            return wait_for(f"attempt {a + 1}", lambda: (s := cluster.status("faults")).get("attempt") == a + 1 and s, timeout=90)
        if fault == "gpu_xid":
            status = xid_on(dcgm[1], victim, node.name, next_attempt, namespace)
        else:
            _inject(control_plane, node, namespace, victim, fault)
            status = next_attempt()
        record = status["failures"][attempt - 1]
        seen = f"{fault} on {victim} ({node.name}): {record}"
        assert record["reason"] == EXPECTED[fault] and record["attempt"] == attempt and record["retryable"], seen
        if fault in EXCLUDES_THE_NODE:
            excluded.append(node.name)
        assert status.get("excludedNodes", []) == excluded, seen
        if fault == "hang":
            assert "no step advance" in record["message"], seen
        if fault == "gpu_xid":
            assert "XID 79" in record["message"], seen
        if fault == "preemption":  # its work done, the preemptor leaves: the next attempt may need that node
            status, answer = control_plane.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/preemptor-{node.name}")
            assert status == 200, answer
        second = cluster.job_name("faults", attempt + 1)
        resumed = wait_for(f"attempt {attempt + 1} resumed", lambda j=second: [
            e for lines in runs.events(nodes, namespace, j).values() for e in lines if e.get("event") == "resume"], timeout=120)
        # At most the interval since checkpoint attempt x 10 is lost; a fault that SIGTERMs the
        # container (an eviction) lets the trainer save the step it stopped at, and it resumes there.
        assert resumed[0]["step"] >= attempt * 10, (seen, resumed)
    status = runs.end(cluster, "faults", nodes, operator, timeout=240)
    assert status["phase"] == "Succeeded" and status["attempt"] == len(faults) + 1, status
    cluster.wait_reasons("faults", *{EXPECTED[f] for f in faults}, *(["XidError", "NodeExcluded"] if "gpu_xid" in faults else []))
    assert status["retriesUsed"] == len(faults) and status["progress"]["step"] == steps, status
    last = cluster.job_name("faults", len(faults) + 1)
    live = wait_for("one live job", lambda: (names := [j["metadata"]["name"] for j in cluster.jobs("llamaft.io/finetune=faults")
                                                     if not j["metadata"].get("deletionTimestamp")]) == [last] and names)
    assert live == [last], "a failed attempt's job is gone: its pods never sit beside the next attempt's"


def test_a_used_up_retry_budget_fails_the_run_with_its_history(
        control_plane: ControlPlane, namespace: str, nodes: list[Kubelet], operator: Operator, rendezvous: LocalEtcd,
        tiny_model: Path, admin: client.ApiClient) -> None:
    """retryBudget 1 and a worker killed in each of two attempts: the second failure fails the run
    (RetryBudgetExhausted), with both failures in its history and no third job; deleting it leaves
    nothing behind (kube-controller-manager's garbage collector takes the jobs' pods and children)."""
    cluster = Cluster(admin, namespace)
    cluster.create("broke", runs.run_spec(tiny_model, namespace, rendezvous, training={"maxSteps": 40},
                                     checkpointing={"everyNSteps": 10}, runPolicy={"retryBudget": 1}))
    for attempt in (1, 2):
        job = wait_for(f"attempt {attempt}'s job", lambda a=attempt: cluster.attempt_job("broke", a), timeout=60)
        _, victim = wait_for(f"attempt {attempt} past checkpoint 10", lambda n=job["metadata"]["name"]: runs.past_checkpoint(
            nodes, namespace, n, 10), timeout=180, interval=0.1)
        next(k for k in nodes if victim in runs.pod_names(k, namespace)).kill(namespace, victim)
    status = runs.end(cluster, "broke", nodes, operator, timeout=120)
    assert status["phase"] == "Failed" and "retry budget (1) is used up" in status["message"], status
    assert [(f["attempt"], f["reason"]) for f in status["failures"]] == [(1, "Killed"), (2, "Killed")], status
    assert status["retriesUsed"] == 1, status
    cluster.wait_reasons("broke", "RetryBudgetExhausted")
    time.sleep(3)  # several sync intervals: no third attempt starts later either
    assert cluster.status("broke")["phase"] == "Failed" and cluster.attempt_job("broke", 3) is None
    cluster.delete_finetune("broke")

    def leftovers() -> list[str]:
        selector = "llamaft.io/finetune=broke"
        left = [f"PyTorchJob/{j['metadata']['name']}" for j in cluster.jobs(selector)]
        left += [f"Pod/{p.metadata.name}" for p in cluster.core.list_namespaced_pod(namespace, label_selector=selector).items]
        left += [f"{kind}/{o.metadata.name}" for kind, items in (
            ("ConfigMap", cluster.core.list_namespaced_config_map(namespace, label_selector=selector).items),
            ("Service", cluster.core.list_namespaced_service(namespace, label_selector=selector).items)) for o in items]
        left += [f"LlamaFineTune/{i['metadata']['name']}" for i in cluster.custom.list_namespaced_custom_object(
            "llamaft.io", "v1alpha1", namespace, "llamafinetunes")["items"]]
        left += [f"process of {r.pod['metadata']['name']}" for k in nodes for r in k.runs.values()
                 if r.pod["metadata"]["namespace"] == namespace and r.process is not None and r.process.poll() is None]
        return left
    wait_for("nothing left of the run", lambda: not leftovers(), timeout=60)
    assert leftovers() == []


def test_a_lost_node_costs_at_most_one_checkpoint_interval(
        control_plane: ControlPlane, namespace: str, nodes: list[Kubelet], operator: Operator, rendezvous: LocalEtcd,
        tiny_model: Path, admin: client.ApiClient) -> None:
    """The node of a 1-worker run dies (its kubelet stops: no status, no heartbeat, the container's
    processes SIGKILLed) and its Node object is deleted, as a cloud provider's node controller does
    when the machine is gone. kube-controller-manager's pod GC marks the orphaned pod Failed with
    DisruptionTarget DeletionByPodGC and deletes it (after its quarantine of the missing node); the
    operator reads that as NodeLost, keeps the next attempt off the node, and the next attempt
    resumes from the claim on the other node; its finished job goes by ttlSecondsAfterFinished,
    the final status stays. (With 2 workers the survivor's PeerLost would come
    first, long before pod GC; which cause wins when both are seen is tests/operator/test_lifecycle.py.)"""
    cluster = Cluster(admin, namespace)
    cluster.create("lost", runs.run_spec(tiny_model, namespace, rendezvous, training={"maxSteps": 20},
                                         checkpointing={"everyNSteps": 10}, cluster={"workers": 1},
                                         runPolicy={"ttlSecondsAfterFinished": 1}))
    job = wait_for("attempt 1's job", lambda: cluster.attempt_job("lost", 1), timeout=60)["metadata"]["name"]
    leader, _ = wait_for("attempt 1 past checkpoint 10", lambda: runs.past_checkpoint(nodes, namespace, job, 10, workers=1),
                         timeout=180, interval=0.1)
    node = next(k for k in nodes if leader in runs.pod_names(k, namespace))
    node.stop()
    status, answer = control_plane.request("DELETE", f"/api/v1/nodes/{node.name}")
    assert status == 200, answer
    status_ = wait_for("attempt 2", lambda: (s := cluster.status("lost")).get("attempt") == 2 and s, timeout=150)
    record = status_["failures"][0]
    assert record["reason"] == "NodeLost" and record["retryable"] and node.name in record["message"], record
    assert status_.get("excludedNodes") == [node.name], status_
    wait_for("the lost pod collected", lambda: not cluster.core.list_namespaced_pod(
        namespace, field_selector=f"metadata.name={leader}").items, timeout=60)
    done = runs.end(cluster, "lost", nodes, operator, timeout=240)
    assert done["phase"] == "Succeeded" and done["attempt"] == 2 and done["progress"]["step"] == 20, done
    resumed = [e for lines in runs.events(nodes, namespace, cluster.job_name("lost", 2)).values() for e in lines
               if e.get("event") == "resume"]
    assert resumed and resumed[0]["step"] >= 10, resumed
    # runPolicy.ttlSecondsAfterFinished: the training operator removes the finished job; the final
    # status outlives it.
    wait_for("the job removed by its TTL", lambda: cluster.attempt_job("lost", 2) is None, timeout=60)
    time.sleep(3)  # several sync intervals and deletion events later
    after = cluster.status("lost")
    assert after["phase"] == "Succeeded" and after["progress"] == done["progress"], after
    assert after["conditions"] == done["conditions"], "the final status outlives the job"


def test_two_quick_spec_edits_restart_the_run_once(
        control_plane: ControlPlane, namespace: str, operator: Operator, admin: client.ApiClient) -> None:
    """Two edits within a second, suspend and then a learning rate, come to the operator as two
    watch events: the first is applied in place, the second restarts the run once, as attempt 2,
    suspended as the spec says. (Found on the real control plane: the first event was judged
    against the second's spec, read meanwhile, and the second event restarted the run again.)"""
    cluster = Cluster(admin, namespace)
    cluster.create("edits", tiny_spec())  # its workers ask for GPUs: Pending, nothing runs
    wait_for("attempt 1's job", lambda: cluster.attempt_job("edits", 1), timeout=60)
    cluster.patch_finetune("edits", {"spec": {"runPolicy": {"suspend": True}}})
    cluster.patch_finetune("edits", {"spec": {"training": {"learningRate": 0.001}}})
    second = wait_for("attempt 2's job", lambda: cluster.attempt_job("edits", 2), timeout=60)
    time.sleep(3)  # several sync intervals and the second edit's event later
    status = cluster.status("edits")
    assert status["attempt"] == 2 and cluster.attempt_job("edits", 3) is None, status
    assert second["spec"]["runPolicy"]["suspend"] is True, second["spec"]["runPolicy"]
    restarts = [e["message"] for e in cluster.events("edits") if e["reason"] == "SpecChanged"]
    assert restarts == ["training.learningRate changed: restarting from the latest checkpoint as attempt 2"], restarts


def test_the_operator_killed_mid_run_picks_the_run_up(
        control_plane: ControlPlane, namespace: str, nodes: list[Kubelet], operator: Operator, rendezvous: LocalEtcd,
        tiny_model: Path, admin: client.ApiClient) -> None:
    """SIGKILL to the llamaft operator while its run trains, a new operator process later: the run
    ends in its first attempt with its one job (the new process adopts what the old one made)."""
    cluster = Cluster(admin, namespace)
    cluster.create("adopt", runs.run_spec(tiny_model, namespace, rendezvous, training={"maxSteps": 40}))
    job = wait_for("attempt 1's job", lambda: cluster.attempt_job("adopt", 1), timeout=60)["metadata"]["name"]
    wait_for("training", lambda: runs.past_checkpoint(nodes, namespace, job, 6), timeout=180, interval=0.1)
    operator.kill()
    time.sleep(2)
    operator.start()
    status = runs.end(cluster, "adopt", nodes, operator, timeout=240)
    assert status["phase"] == "Succeeded" and status["attempt"] == 1 and not status.get("failures"), status
    assert status["progress"]["step"] == 40, status
    assert [j["metadata"]["name"] for j in cluster.jobs("llamaft.io/finetune=adopt")] == [job]
