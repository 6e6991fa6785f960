"""spec -> desired objects, without any server: shape, wiring and validity against Kubeflow."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.validation import SpecInvalid, validate_resource, validate_spec
from llamaft.render import desired, objects
from llamaft.render.naming import Owner

from tests.conftest import EXAMPLES
from tests.operator.kubeflow_rules import validate_pytorchjob

OWNER = Owner("llama2-7b-samsum", "team-a", "0f5e1c2a-1111-2222-3333-444455556666")


def example(name: str) -> LlamaFineTuneSpec:
    return validate_resource(yaml.safe_load((EXAMPLES[0].parent / name).read_text()))


def env_of(job: dict[str, Any]) -> dict[str, Any]:
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_renders_a_valid_pytorchjob(path: Any) -> None:
    spec = validate_resource(yaml.safe_load(path.read_text()))
    job = desired.pytorch_job(OWNER, spec, attempt=1)
    assert validate_pytorchjob(job) == []


def test_llama2_7b_job_wiring() -> None:
    spec = example("llama2-7b.yaml")
    job = desired.pytorch_job(OWNER, spec, attempt=3)
    assert job["metadata"]["name"] == "llama2-7b-samsum-0f5e-3", "the uid token keeps incarnations apart"
    elastic = job["spec"]["elasticPolicy"]
    assert elastic["rdzvBackend"] == "etcd-v2" and elastic["rdzvPort"] == 2379
    assert elastic["rdzvHost"] == "llama2-7b-samsum-etcd.team-a.svc"
    assert elastic["rdzvId"] == "team-a-llama2-7b-samsum-0f5e1c2a-3"
    assert (elastic["minReplicas"], elastic["maxReplicas"], elastic["maxRestarts"]) == (2, 2, 3)
    assert job["spec"]["nprocPerNode"] == "8" and "nProcPerNode" not in elastic
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2 and worker["restartPolicy"] == "Never"
    pod = worker["template"]["spec"]
    container = pod["containers"][0]
    assert container["name"] == "pytorch"
    assert container["command"][:3] == ["torchrun", "-m", "llamaft_trainer"]
    limits = container["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "4", "cpu": "90", "memory": "1000Gi"}
    assert container["resources"]["requests"] == limits
    env = env_of(job)
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "fsx-checkpoints"
    assert volumes["config"]["configMap"]["name"] == "llama2-7b-samsum-config"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"dshm": "/dev/shm", "config": "/etc/llamaft", "checkpoints": "/checkpoints/llama2-7b-samsum",
                      "llamaft-cache": "/var/cache/llamaft"}
    assert volumes["llamaft-cache"] == {"name": "llamaft-cache", "emptyDir": {}}, "no spec.cache: a node-local download cache"
    assert (env["LLAMAFT_CACHE"], env["HF_HOME"], env["LLAMAFT_CACHE_SHARED"]) == (
        "/var/cache/llamaft", "/var/cache/llamaft/huggingface", "0")
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p4de.24xlarge"}
    labels = job["metadata"]["labels"]
    assert labels["llamaft.io/finetune"] == "llama2-7b-samsum" and labels["llamaft.io/attempt"] == "3"


def test_a_cache_claim_is_the_shared_download_cache_and_the_condition_says_which() -> None:
    spec = example("llama3-8b-chat.yaml")
    job = desired.pytorch_job(OWNER, spec, 1)
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["llamaft-cache"]["persistentVolumeClaim"] == {"claimName": "fsx-hf-cache"}
    assert env_of(job)["LLAMAFT_CACHE_SHARED"] == "1"
    assert desired.cache_condition(spec)[:2] == ("True", "VolumeClaim")
    status, reason, message = desired.cache_condition(example("llama2-7b.yaml"))
    assert (status, reason) == ("False", "NoVolumeClaim") and "spec.cache.volumeClaim" in message


def test_trackers_get_the_run_identity_and_their_credentials_by_secret_reference_only() -> None:
    spec = example("minimal.yaml").model_copy(deep=True)
    plain = env_of(desired.pytorch_job(OWNER, spec, 1))
    assert (plain["LLAMAFT_RUN_NAME"], plain["LLAMAFT_RUN_NAMESPACE"], plain["LLAMAFT_RUN_UID"]) == (
        OWNER.name, OWNER.namespace, OWNER.uid)
    assert plain["LLAMAFT_IMAGE"] == spec.cluster.image
    assert not {"MLFLOW_TRACKING_TOKEN", "WANDB_API_KEY"} & set(plain), "no tracker, no credentials"
    body = spec.to_k8s()
    body["tracking"] = {"mlflow": {"trackingUri": "http://mlflow:5000", "credentialsSecret": "mlflow-auth"},
                        "wandb": {"project": "p", "apiKeySecret": {"name": "wandb", "key": "apiKey"}}}
    env = env_of(desired.pytorch_job(OWNER, LlamaFineTuneSpec.model_validate(body), 1))
    for name, key in (("MLFLOW_TRACKING_TOKEN", "token"), ("MLFLOW_TRACKING_USERNAME", "username"),
                      ("MLFLOW_TRACKING_PASSWORD", "password")):
        assert env[name] == {"secretKeyRef": {"name": "mlflow-auth", "key": key, "optional": True}}
    assert env["WANDB_API_KEY"] == {"secretKeyRef": {"name": "wandb", "key": "apiKey"}}


def test_efa_env_only_when_requested() -> None:
    env = env_of(desired.pytorch_job(OWNER, example("minimal.yaml"), 1))
    assert "FI_PROVIDER" not in env and "FI_EFA_USE_DEVICE_RDMA" not in env and "HF_TOKEN" not in env


def test_rendezvous_id_is_unique_per_attempt_and_never_none() -> None:
    ids = {OWNER.rendezvous_id(a) for a in range(1, 20)}
    assert len(ids) == 19 and "none" not in ids
    assert Owner("x", "ns", "aaaa").rendezvous_id(1) != Owner("x", "ns2", "aaaa").rendezvous_id(1)


def test_managed_etcd_objects() -> None:
    spec = example("llama2-7b.yaml")
    objs = objects.desired_objects(OWNER, spec, 1)
    assert [o["kind"] for o in objs] == ["ConfigMap", "Deployment", "Service", "PodMonitor", "PrometheusRule", "ConfigMap", "PyTorchJob"]
    deployment = objs[1]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"].startswith("quay.io/coreos/etcd:v3.5.")
    assert "--enable-v2" in container["command"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert objs[2]["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_external_etcd_and_c10d_need_no_managed_etcd() -> None:
    spec = validate_spec({**example("minimal.yaml").to_k8s(), "rendezvous": {"endpoint": "etcd.shared:2379"}})
    assert [o["kind"] for o in objects.desired_objects(OWNER, spec, 1)] == ["ConfigMap", "PodMonitor", "PrometheusRule", "ConfigMap", "PyTorchJob"]
    assert desired.pytorch_job(OWNER, spec, 1)["spec"]["elasticPolicy"]["rdzvHost"] == "etcd.shared"
    c10d = validate_spec({**example("minimal.yaml").to_k8s(), "rendezvous": {"backend": "c10d"}})
    policy = desired.pytorch_job(OWNER, c10d, 2)["spec"]["elasticPolicy"]
    assert (policy["rdzvHost"], policy["rdzvPort"]) == ("llama2-7b-samsum-0f5e-2-worker-0", 29400)


def test_config_map_carries_the_trainer_part_of_the_spec() -> None:
    spec = example("llama2-70b.yaml")
    data = json.loads(desired.config_map(OWNER, spec)["data"]["config.json"])
    assert set(data) == {"model", "dataset", "training", "fsdp", "checkpointing", "tracking", "evaluation"}
    assert data["fsdp"]["shardingStrategy"] == "FULL_SHARD" and data["training"]["gradientAccumulationSteps"] == 2
    whole = json.loads(desired.config_map(OWNER, spec)["data"]["spec.json"])
    assert whole == spec.to_k8s() and whole["cluster"]["workers"] == spec.cluster.workers, "the trackers' params"
    env = {e["name"]: e.get("value") for e in desired.pytorch_job(OWNER, spec, 1)["spec"]["pytorchReplicaSpecs"]["Worker"]
           ["template"]["spec"]["containers"][0]["env"]}
    assert env["LLAMAFT_SPEC"] == "/etc/llamaft/spec.json"


def test_pvc_sources_are_mounted_read_only() -> None:
    spec = example("llama2-7b-lora.yaml")
    job = desired.pytorch_job(OWNER, spec, 1)
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    inputs = [v for v in pod["volumes"] if v["name"].startswith("input-")]
    assert inputs == [{"name": "input-0", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}}]
    mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "input-0"]
    assert mounts == [{"name": "input-0", "mountPath": "/mnt/pvc/datasets", "readOnly": True}]


def test_elastic_range_and_run_policy() -> None:
    spec = validate_spec({**example("minimal.yaml").to_k8s(), "cluster": {"workers": 3, "elastic": {"minWorkers": 2, "maxWorkers": 4}},
                          "runPolicy": {"suspend": True, "ttlSecondsAfterFinished": 600, "activeDeadlineSeconds": 86400, "backoffLimit": 2}})
    job = desired.pytorch_job(OWNER, spec, 1)
    assert (job["spec"]["elasticPolicy"]["minReplicas"], job["spec"]["elasticPolicy"]["maxReplicas"]) == (2, 4)
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    assert job["spec"]["runPolicy"] == {"cleanPodPolicy": "Running", "suspend": True, "ttlSecondsAfterFinished": 600,
                                        "activeDeadlineSeconds": 86400, "backoffLimit": 2}


def test_pod_template_overrides_merge() -> None:
    spec = validate_spec({**example("minimal.yaml").to_k8s(), "cluster": {"workers": 1, "podTemplateOverrides": {
        "metadata": {"annotations": {"sidecar.istio.io/inject": "false"}},
        "spec": {"hostNetwork": True, "volumes": [{"name": "extra", "emptyDir": {}}]}}}})
    template = desired.pytorch_job(OWNER, spec, 1)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    assert template["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
    assert template["spec"]["hostNetwork"] is True
    assert [v["name"] for v in template["spec"]["volumes"]][-1] == "extra"
    assert template["metadata"]["labels"]["llamaft.io/finetune"] == OWNER.name


def test_an_override_of_the_pytorch_container_patches_it_instead_of_adding_a_second() -> None:
    """The most common override (a volume mount on the training container) used to render two
    containers named `pytorch`, the second without an image: lists merge by Kubernetes' keys."""
    spec = validate_spec({**example("minimal.yaml").to_k8s(), "cluster": {"workers": 1, "env": [{"name": "A", "value": "1"}],
                          "podTemplateOverrides": {"spec": {
                              "containers": [{"name": "pytorch", "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                                              "env": [{"name": "A", "value": "2"}, {"name": "B", "value": "3"}],
                                              "ports": [{"containerPort": 8000, "name": "prom"}]},
                                             {"name": "sidecar", "image": "busybox"}],
                              "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}},
                                          {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}],
                              "tolerations": [{"key": "only", "operator": "Exists"}]}}}})
    pod = desired.pytorch_job(OWNER, spec, 1)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["pytorch", "sidecar"]
    pytorch = pod["containers"][0]
    assert pytorch["image"] == spec.cluster.image and pytorch["command"][0] == "torchrun"
    assert pytorch["volumeMounts"][-1] == {"name": "data", "mountPath": "/data"}
    assert [m["mountPath"] for m in pytorch["volumeMounts"]].count("/dev/shm") == 1
    env = {e["name"]: e.get("value") for e in pytorch["env"]}
    assert env["A"] == "2" and env["B"] == "3" and env["LLAMAFT_CONFIG"] == "/etc/llamaft/config.json"
    assert [p["containerPort"] for p in pytorch["ports"]] == [8000] and pytorch["ports"][0]["name"] == "prom"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"} and "data" in volumes
    assert pod["tolerations"] == [{"key": "only", "operator": "Exists"}], "lists without a merge key replace"
    assert validate_pytorchjob(desired.pytorch_job(OWNER, spec, 1)) == []


def test_strategic_merge_directives_and_nulls() -> None:
    from llamaft.render.podmerge import strategic_merge

    base = {"spec": {"volumes": [{"name": "a"}, {"name": "b"}], "hostNetwork": False, "dnsPolicy": "Default"}}
    patch = {"spec": {"volumes": [{"name": "a", "$patch": "delete"}, {"name": "c", "emptyDir": {}}], "hostNetwork": True,
                      "dnsPolicy": None}}
    assert strategic_merge(base, patch) == {"spec": {"volumes": [{"name": "b"}, {"name": "c", "emptyDir": {}}], "hostNetwork": True}}
    assert base["spec"]["volumes"] == [{"name": "a"}, {"name": "b"}], "inputs are not modified"


# A property-based sweep: every spec the API accepts renders a PyTorchJob the cluster accepts.
@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    workers = draw(st.integers(1, 32))
    gpus = draw(st.sampled_from([0, 1, 2, 4, 8]))
    strategy = draw(st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]))
    fsdp: dict[str, Any] = {"shardingStrategy": strategy, "mixedPrecision": draw(st.sampled_from(["bf16", "fp16", "fp32", "pure-bf16"])),
                            "activationCheckpointing": {"mode": draw(st.sampled_from(["none", "full", "selective"]))}}
    if strategy == "HYBRID_SHARD" and draw(st.booleans()):
        fsdp["hybridShard"] = {"shardGroupSize": max(gpus, 1), "replicaGroupSize": workers}
    cluster: dict[str, Any] = {"workers": workers, "gpusPerWorker": gpus,
                               "efaDevicesPerWorker": draw(st.sampled_from([0, 1, 4, 32])) if gpus else 0}
    if draw(st.booleans()) and "hybridShard" not in fsdp:
        cluster["elastic"] = {"minWorkers": draw(st.integers(1, workers)), "maxWorkers": draw(st.integers(workers, 64))}
    rendezvous: dict[str, Any] = {"backend": draw(st.sampled_from(["etcd-v2", "etcd", "c10d"])), "maxRestarts": draw(st.integers(0, 10))}
    if rendezvous["backend"] != "c10d" and draw(st.booleans()):
        rendezvous["endpoint"] = "etcd.infra.svc:2379"
    return {
        "model": {"source": draw(st.sampled_from(["meta-llama/Llama-2-7b-hf", "pvc://models/llama", "s3://b/m"]))},
        "dataset": {"format": "samsum", "source": draw(st.sampled_from(["knkarthick/samsum", "pvc://data/s.jsonl"]))},
        "training": draw(st.sampled_from([{"epochs": 2}, {"maxSteps": 100}])),
        "fsdp": fsdp, "cluster": cluster, "rendezvous": rendezvous,
        "runPolicy": {"suspend": draw(st.booleans()), "retryBudget": draw(st.integers(0, 5))},
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), attempt=st.integers(1, 50))
def test_any_accepted_spec_renders_a_valid_job(spec: dict[str, Any], attempt: int) -> None:
    try:
        parsed = validate_spec(spec)
    except SpecInvalid:
        return  # the API refuses it; nothing is rendered
    job = desired.pytorch_job(Owner("sweep-job", "ns", "abcdef12"), parsed, attempt)
    assert validate_pytorchjob(job) == [], json.dumps(spec)
    env = env_of(job)
    assert ("FI_PROVIDER" in env) == (parsed.cluster.efa_devices_per_worker > 0)


def test_the_kubeflow_checks_catch_broken_jobs() -> None:
    job = desired.pytorch_job(OWNER, example("minimal.yaml"), 1)
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    job["spec"]["elasticPolicy"]["rdzvId"] = "none"
    job["spec"]["elasticPolicy"]["nProcPerNode"] = 8
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] = "Sometimes"
    job["spec"]["runPolicy"]["unknownField"] = 1
    errors = "\n".join(validate_pytorchjob(job))
    for words in ("no container named 'pytorch'", "rdzvId must be set", "only one of spec.nprocPerNode",
                  "restartPolicy 'Sometimes' is not one of", "unknownField"):
        assert words in errors, errors


def test_attempt_names_fit_kubernetes_limits_for_the_longest_name() -> None:
    from llamaft.api.resource import MAX_ATTEMPTS, MAX_NAME_LENGTH

    owner = Owner("a" * MAX_NAME_LENGTH, "default", "0f5e1d2c-aaaa-bbbb-cccc-000000000000")
    job = owner.job_name(MAX_ATTEMPTS)
    assert len(f"{job}-worker-4095") == 63, "the training operator's per-worker Service name is a DNS-1035 label"
    assert owner.job_name(1) != Owner(owner.name, "default", "9999aaaa-0000").job_name(1), "incarnations never share a job name"


def test_a_retry_avoids_the_nodes_evidence_named_and_gets_the_grace_period() -> None:
    spec = example("llama2-7b.yaml")
    job = desired.pytorch_job(OWNER, spec, attempt=2, excluded_nodes=["node-b", "node-a"])
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-a", "node-b"]}]}]
    assert pod["terminationGracePeriodSeconds"] == spec.cluster.termination_grace_period_seconds == 120
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["LLAMAFT_TERMINATION_GRACE_SECONDS"] == "120"
    assert "affinity" not in desired.pytorch_job(OWNER, spec, attempt=1)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert validate_pytorchjob(job) == []
