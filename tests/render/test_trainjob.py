"""spec -> Kubeflow Trainer v2 TrainJob (llamaft.render.trainjob), without any server: shape,
wiring, the rendezvous flags, what Trainer cannot express, validity against the vendored v2.3 CRD
and webhook rules (every example and a property-based sweep), and the TrainJob's status as a phase."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llamaft.api.spec import Backend, EnvVar, LlamaFineTuneSpec
from llamaft.api.status import Phase, read_status
from llamaft.api.validation import SpecInvalid, validate_resource, validate_spec
from llamaft.cli import main
from llamaft.operator import lifecycle
from llamaft.render import backends, desired, trainjob
from llamaft.render.admission import child_errors
from llamaft.render.naming import Owner
from llamaft.render.schemas import schema_errors

from tests.conftest import EXAMPLES, REFERENCE, REPO
from tests.operator.kubeflow_rules import crd_schema
from tests.render.test_desired import specs as pytorchjob_specs

OWNER = Owner("llama2-7b-samsum", "team-a", "0f5e1c2a-1111-2222-3333-444455556666")
TRAINER = REFERENCE / "kubeflow-trainer-v2.3"
TRAINJOB_CRD = TRAINER / "trainer.kubeflow.org_trainjobs.yaml"
RUNTIME = yaml.safe_load((TRAINER / "torch_distributed_runtime.yaml").read_text())
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DOMAIN_PREFIXED_PATH = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/\S+$")


def example(name: str) -> LlamaFineTuneSpec:
    return validate_resource(yaml.safe_load((REPO / "examples" / name).read_text()))


def with_spec(spec: LlamaFineTuneSpec, **changes: Any) -> LlamaFineTuneSpec:
    """`spec` with camelCase changes merged in and validated again (as the API server would)."""
    body = spec.to_k8s()
    for key, value in changes.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    return validate_spec(body)


def runtime_containers() -> dict[str, set[str]]:
    """The torch-distributed runtime's replicated jobs and their containers (what runtimePatches may name)."""
    return {rj["name"]: {c["name"] for c in rj["template"]["spec"]["template"]["spec"]["containers"]}
            for rj in RUNTIME["spec"]["template"]["spec"]["replicatedJobs"]}


def validate_trainjob(job: dict[str, Any]) -> list[str]:
    """Every problem Kubernetes and Kubeflow Trainer v2.3 would report for a TrainJob on the
    torch-distributed runtime, as strings (empty: accepted): the CRD schema (unknown fields are
    errors), its root CEL rules on the name, the list-map keys, and the webhooks' rules (torch
    plugin: reserved env names; JobSet plugin: runtimePatches managers, jobs, containers, env)."""
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft7Validator(crd_schema(str(TRAINJOB_CRD), "v1alpha1")).iter_errors(job)]
    name = job.get("metadata", {}).get("name", "")
    if not DNS1035.match(name) or len(name) > 63:
        errors.append(f"metadata.name {name!r} must be an RFC 1035 label of at most 63 characters")
    spec = job.get("spec", {})
    trainer = spec.get("trainer", {})
    env_names = [e["name"] for e in trainer.get("env", [])]
    if len(env_names) != len(set(env_names)):
        errors.append(f"trainer.env: duplicate names {env_names}")
    reserved = sorted(set(env_names) & trainjob.TORCHRUN_RESERVED_ENV)
    if reserved:
        errors.append(f"trainer.env: must not have reserved envs, invalid envs configured: {reserved}")
    jobs = runtime_containers()
    for patch in spec.get("runtimePatches", []):
        if not DOMAIN_PREFIXED_PATH.match(patch.get("manager", "")):
            errors.append(f"runtimePatches: manager {patch.get('manager')!r} is not a domain-prefixed path")
        for rjob in patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {}).get("replicatedJobs", []):
            if rjob["name"] not in jobs:
                errors.append(f"runtimePatches: replicated job {rjob['name']!r} does not exist in the runtime")
                continue
            pod = rjob.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
            for key in ("containers", "initContainers", "volumes"):
                names = [c.get("name") for c in pod.get(key, [])]
                if len(names) != len(set(names)):
                    errors.append(f"runtimePatches: duplicate {key} {names}")
            for container in pod.get("containers", []) + pod.get("initContainers", []):
                if container.get("name") not in jobs[rjob["name"]]:
                    errors.append(f"runtimePatches: container {container.get('name')!r} does not exist in the runtime")
                if container.get("name") == trainjob.NODE and container.get("env"):
                    errors.append("runtimePatches: must not have envs for the node container")
                mounts = [m["name"] for m in container.get("volumeMounts", [])]
                if len(mounts) != len(set(mounts)):
                    errors.append(f"runtimePatches: duplicate volumeMounts {mounts}")
                volumes = {v["name"] for v in pod.get("volumes", [])}
                errors += [f"runtimePatches: mount of a missing volume {m!r}" for m in mounts if m not in volumes]
    return errors


def pod_patch(job: dict[str, Any]) -> dict[str, Any]:
    node: Any = job
    for part in trainjob.POD_PATCH_PATH:
        node = node[part]
    return dict(node)


def env_of(job: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in job["spec"]["trainer"]["env"]}


def torchrun_args(command: list[str]) -> Any:
    """The command as torchrun itself parses it (flags, then the PET_* defaults)."""
    run = pytest.importorskip("torch.distributed.run")
    assert command[0] == "torchrun"
    return run.get_args_parser().parse_args(command[1:])


# ---------------------------------------------------------------------------- the upstream facts
def test_the_vendored_upstream_says_what_the_renderer_assumes() -> None:
    """torch-distributed: one replicated job `node` whose container `node` is the trainer (the
    ancestor label); the torch plugin injects the PET_* variables and the master address; the
    progress guide names the three variables; the CRD's patchable pod and container fields."""
    assert runtime_containers() == {trainjob.NODE: {trainjob.NODE}}
    rjob = RUNTIME["spec"]["template"]["spec"]["replicatedJobs"][0]
    assert rjob["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    plugin = (TRAINER / "torch_plugin.go.txt").read_text()
    for constant in ("TorchEnvNumNodes", "TorchEnvNumProcPerNode", "TorchEnvNodeRank", "TorchEnvMasterAddr",
                     "TorchEnvMasterPort", "TorchRunReservedEnvNames"):
        assert f"constants.{constant}" in plugin
    assert 'fmt.Sprintf("%s-%s-0-0.%s", trainJob.Name, constants.Node, trainJob.Name)' in plugin
    guide = (TRAINER / "trainjob-progress.md").read_text()
    assert all(name in guide for name in ("KUBEFLOW_TRAINER_SERVER_URL", "KUBEFLOW_TRAINER_SERVER_CA_CERT",
                                          "KUBEFLOW_TRAINER_SERVER_TOKEN", "trainerStatus"))
    crd = yaml.safe_load(TRAINJOB_CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    patch: Any = crd["properties"]["spec"]["properties"]["runtimePatches"]["items"]
    for part in ("trainingRuntimeSpec", "template", "spec", "replicatedJobs", "template", "spec", "template", "spec"):
        patch = patch["properties"][part]
        patch = patch.get("items", patch)
    assert set(patch["properties"]) == trainjob.POD_PATCH_FIELDS
    assert set(patch["properties"]["containers"]["items"]["properties"]) == trainjob.CONTAINER_PATCH_FIELDS


def test_the_asset_is_the_vendored_upstream_crd() -> None:
    asset = REPO / "operator" / "llamaft" / "assets" / "trainer.kubeflow.org_trainjobs.yaml"
    assert asset.read_bytes() == TRAINJOB_CRD.read_bytes()


# ------------------------------------------------------------------------------------ rendering
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_renders_a_valid_trainjob(path: Any) -> None:
    body = yaml.safe_load(path.read_text())
    spec = validate_resource(body)
    job = trainjob.train_job(OWNER, spec, attempt=1)
    assert validate_trainjob(job) == []
    assert schema_errors(job) == []  # the operator's own check (llamaft.render.admission), package data
    assert child_errors(spec, body["metadata"]["name"], "team-a", backend=Backend.TRAIN_JOB) == []


def test_llama2_7b_trainjob_wiring() -> None:
    spec = with_spec(example("llama2-7b.yaml"), cluster={
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "nodeSelector": {"topology.kubernetes.io/zone": "us-east-1a"}})
    job = trainjob.train_job(OWNER, spec, attempt=3, excluded_nodes=["node-b", "node-a"])
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job["metadata"]["name"] == "llama2-7b-samsum-0f5e-3"
    assert job["metadata"]["labels"]["llamaft.io/finetune"] == "llama2-7b-samsum"
    assert job["metadata"]["labels"]["llamaft.io/attempt"] == "3"
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                         "name": "torch-distributed"}
    assert job["spec"]["suspend"] is False
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 8)
    assert trainer["image"] == spec.cluster.image
    limits = {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "4", "cpu": "90", "memory": "1000Gi"}
    assert trainer["resourcesPerNode"] == {"requests": limits, "limits": limits}
    env = env_of(job)
    assert env["FI_PROVIDER"] == "efa" and env["LLAMAFT_CONFIG"] == "/etc/llamaft/config.json"
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    patch = job["spec"]["runtimePatches"]
    assert [p["manager"] for p in patch] == ["llamaft.io/operator"]
    assert [rj["name"] for rj in patch[0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]] == ["node"]
    template = pod_patch(job)
    labels = template["metadata"]["labels"]
    assert labels["llamaft.io/finetune"] == "llama2-7b-samsum" and labels["app.kubernetes.io/component"] == "trainer"
    pod = template["spec"]
    assert [c["name"] for c in pod["containers"]] == ["node"] and set(pod["containers"][0]) == {"name", "volumeMounts"}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts == {"dshm": "/dev/shm", "config": "/etc/llamaft", "checkpoints": "/checkpoints/llama2-7b-samsum",
                      "llamaft-cache": "/var/cache/llamaft"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert volumes["config"]["configMap"]["name"] == "llama2-7b-samsum-config"
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "fsx-checkpoints"
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p4de.24xlarge",
                                   "topology.kubernetes.io/zone": "us-east-1a"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["terminationGracePeriodSeconds"] == 120
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-a", "node-b"]}]}]
    assert validate_trainjob(job) == []


def test_the_worker_pod_is_the_pytorchjobs() -> None:
    """One pod description for both backends: the TrainJob carries desired.pod_template's pieces."""
    spec = example("llama2-13b.yaml")
    pod = desired.pod_template(OWNER, spec, 1)
    container = pod["spec"]["containers"][0]
    job = trainjob.train_job(OWNER, spec, 1)
    patch = pod_patch(job)
    assert job["spec"]["trainer"]["env"] == container["env"]
    assert job["spec"]["trainer"]["image"] == container["image"]
    assert job["spec"]["trainer"].get("resourcesPerNode") == container.get("resources")
    assert patch["metadata"]["labels"] == pod["metadata"]["labels"]
    assert patch["spec"]["volumes"] == pod["spec"]["volumes"]
    assert patch["spec"]["containers"][0]["volumeMounts"] == container["volumeMounts"]
    assert job["spec"]["trainer"]["command"][-4:] == container["command"][1:]


def test_pvc_inputs_suspend_runtime_and_deadline() -> None:
    spec = with_spec(example("minimal.yaml"), model={"source": "pvc://models/llama-2-7b"},
                     dataset={"format": "samsum", "source": "pvc://data/samsum.jsonl"},
                     runPolicy={"suspend": True, "activeDeadlineSeconds": 7200},
                     trainJob={"runtimeRef": {"name": "llama-fsdp", "kind": "TrainingRuntime"}})
    job = trainjob.train_job(OWNER, spec, 1)
    assert job["spec"]["suspend"] is True and job["spec"]["activeDeadlineSeconds"] == 7200
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime", "name": "llama-fsdp"}
    pod = pod_patch(job)["spec"]
    claims = {v["name"]: v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"checkpoints": {"claimName": "fsx-checkpoints"},  # examples/minimal.yaml's checkpoint claim
                      "input-0": {"claimName": "models", "readOnly": True}, "input-1": {"claimName": "data", "readOnly": True}}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["input-0"] == {"name": "input-0", "mountPath": "/mnt/pvc/models", "readOnly": True}
    assert "resourcesPerNode" not in job["spec"]["trainer"] or job["spec"]["trainer"]["resourcesPerNode"]
    assert validate_trainjob(job) == []


def test_pod_template_overrides_reach_the_pod_through_runtime_patches() -> None:
    spec = with_spec(example("minimal.yaml"), cluster={"podTemplateOverrides": {
        "metadata": {"annotations": {"sidecar.istio.io/inject": "false"}, "labels": {"team": "ml"}},
        "spec": {"serviceAccountName": "trainer-sa", "volumes": [{"name": "cache", "emptyDir": {}}],
                 "containers": [{"name": "pytorch", "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                                 "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
                                 "securityContext": {"allowPrivilegeEscalation": False}}]}}})
    job = trainjob.train_job(OWNER, spec, 1)
    template = pod_patch(job)
    assert template["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
    assert template["metadata"]["labels"]["team"] == "ml" and template["metadata"]["labels"]["llamaft.io/finetune"]
    pod = template["spec"]
    assert pod["serviceAccountName"] == "trainer-sa" and {"name": "cache", "emptyDir": {}} in pod["volumes"]
    node = pod["containers"][0]
    assert node["name"] == "node" and node["securityContext"] == {"allowPrivilegeEscalation": False}
    assert {"name": "cache", "mountPath": "/cache"} in node["volumeMounts"] and "env" not in node
    assert env_of(job)["NCCL_DEBUG"] == "INFO", "env goes to trainer.env: Trainer refuses it in runtimePatches"
    assert validate_trainjob(job) == [] and child_errors(spec, OWNER.name, "team-a", backend=Backend.TRAIN_JOB) == []


def test_overrides_trainer_cannot_take_are_reported_on_the_override() -> None:
    spec = with_spec(example("minimal.yaml"), cluster={"podTemplateOverrides": {"spec": {
        "hostNetwork": True,
        "containers": [{"name": "pytorch", "env": [{"name": "PET_MASTER_ADDR", "value": "x"}], "imagePullPolicy": "Always"},
                       {"name": "sidecar", "image": "busybox"}]}}})
    errors = {e.path: e.message for e in child_errors(spec, OWNER.name, "team-a", backend=Backend.TRAIN_JOB)}
    overrides = "spec.cluster.podTemplateOverrides.spec"
    assert "unknown field" in errors[f"{overrides}.hostNetwork"]
    assert "unknown field" in errors[f"{overrides}.containers[0].imagePullPolicy"]
    assert "PET_MASTER_ADDR is set by Kubeflow Trainer's torch plugin" in errors[f"{overrides}.containers[0].env[0].name"]
    assert "can only patch containers the runtime defines" in errors[f"{overrides}.containers[1].name"]
    assert child_errors(spec, OWNER.name, "team-a") == [], "the PyTorchJob takes all of them"


def test_trainer_env_has_unique_names_and_the_last_definition_wins() -> None:
    spec = with_spec(example("minimal.yaml"), cluster={"env": [{"name": "OMP_NUM_THREADS", "value": "4"}]})
    job = trainjob.train_job(OWNER, spec, 1)
    names = [e["name"] for e in job["spec"]["trainer"]["env"]]
    assert names.count("OMP_NUM_THREADS") == 1 and env_of(job)["OMP_NUM_THREADS"] == "4"
    assert validate_trainjob(job) == []


# ------------------------------------------------------------------------------- the rendezvous
def test_managed_etcd_passes_the_rendezvous_explicitly() -> None:
    spec = with_spec(example("llama2-7b.yaml"), cluster={"elastic": {"minWorkers": 1, "maxWorkers": 4}})
    command = trainjob.train_job(OWNER, spec, attempt=3)["spec"]["trainer"]["command"]
    args = torchrun_args(command)
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("etcd-v2", "llama2-7b-samsum-etcd.team-a.svc:2379")
    assert args.rdzv_id == OWNER.rendezvous_id(3) == "team-a-llama2-7b-samsum-0f5e1c2a-3"
    assert (args.nnodes, args.max_restarts, args.rdzv_conf) == ("1:4", 3, "protocol=http")
    assert args.module and args.training_script == "llamaft_trainer"
    assert args.training_script_args == ["--config", "/etc/llamaft/config.json"]
    ids = {torchrun_args(trainjob.train_job(OWNER, spec, a)["spec"]["trainer"]["command"]).rdzv_id for a in (1, 2)}
    assert len(ids) == 2, "a new attempt rendezvouses under a new id"


def test_an_external_etcd_is_used_as_is() -> None:
    spec = with_spec(example("minimal.yaml"), rendezvous={"backend": "etcd", "endpoint": "etcd.infra.svc:2379"})
    assert spec.cluster.elastic is None
    args = torchrun_args(trainjob.train_job(OWNER, spec, 1)["spec"]["trainer"]["command"])
    assert (args.rdzv_backend, args.rdzv_endpoint, args.nnodes) == ("etcd", "etcd.infra.svc:2379", f"{spec.cluster.workers}:{spec.cluster.workers}")


def test_c10d_uses_the_master_address_trainer_injects() -> None:
    spec = example("tiny.yaml")
    assert spec.rendezvous.backend.value == "c10d"
    command = trainjob.train_job(OWNER, spec, 1)["spec"]["trainer"]["command"]
    assert not any(arg.startswith("--rdzv") or arg == "--nnodes" for arg in command), command
    args = torchrun_args(command)
    assert args.rdzv_backend == "static" and args.max_restarts == spec.rendezvous.max_restarts
    assert trainjob.MASTER_PORT == 29500


# ---------------------------------------------------------------------- what Trainer cannot do
def test_a_reserved_env_name_is_refused_naming_the_field() -> None:
    """The API refuses PET_* in cluster.env already; the renderer refuses it too (a spec built in code)."""
    spec = example("minimal.yaml")
    bad = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"env": [
        EnvVar(name="NCCL_DEBUG", value="INFO"), EnvVar(name="PET_NNODES", value="3")]})})
    with pytest.raises(trainjob.TrainJobSpecError) as raised:
        trainjob.train_job(OWNER, bad, 1)
    assert raised.value.problems[0][0] == "spec.cluster.env[1].name"
    assert "PET_NNODES is reserved under the TrainJob backend" in str(raised.value)
    errors = child_errors(bad, OWNER.name, "team-a", backend=Backend.TRAIN_JOB)
    assert [e.path for e in errors] == ["spec.cluster.env[1].name"]


@pytest.mark.parametrize(("changes", "field"), [
    ({"cluster": {"priorityClassName": "high"}}, "spec.cluster.priorityClassName"),
    ({"cluster": {"imagePullPolicy": "Always"}}, "spec.cluster.imagePullPolicy"),
    ({"runPolicy": {"ttlSecondsAfterFinished": 60}}, "spec.runPolicy.ttlSecondsAfterFinished"),
    ({"runPolicy": {"backoffLimit": 2}}, "spec.runPolicy.backoffLimit"),
    ({"rendezvous": {"backend": "c10d"}, "cluster": {"workers": 2, "elastic": {"minWorkers": 1, "maxWorkers": 2}}},
     "spec.cluster.elastic"),
])
def test_what_trainer_cannot_express_is_refused_on_its_field(changes: dict[str, Any], field: str) -> None:
    spec = with_spec(example("minimal.yaml"), **changes)
    errors = child_errors(spec, OWNER.name, "team-a", backend=Backend.TRAIN_JOB)
    assert [e.path for e in errors] == [field] and "backend" in errors[0].message + field
    assert child_errors(spec, OWNER.name, "team-a") == [], "the PyTorchJob backend carries it out"
    with pytest.raises(trainjob.TrainJobSpecError):
        trainjob.train_job(OWNER, spec, 1)


def test_names_are_checked_for_the_jobset_hostnames() -> None:
    spec = with_spec(example("minimal.yaml"), cluster={"workers": 4096, "gpusPerWorker": 8})
    errors = child_errors(spec, "a" * 43, "default", backend=Backend.TRAIN_JOB)
    assert errors[0].path == "metadata.name"
    assert "Kubeflow Trainer (JobSet) names a trainer pod's hostname" in errors[0].message
    assert "at most 42 characters" in errors[0].message


# --------------------------------------------------------------------------- property-based sweep
@st.composite
def trainjob_specs(draw: st.DrawFn) -> dict[str, Any]:
    """test_desired's sweep, plus the fields that go through runtimePatches and spec.trainer."""
    spec = draw(pytorchjob_specs())
    cluster = spec["cluster"]
    if draw(st.booleans()):
        cluster["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    if draw(st.booleans()):
        cluster["nodeSelector"] = {"pool": draw(st.sampled_from(["gpu", "a100", "h100-spot"]))}
    if draw(st.booleans()):
        cluster["instanceType"] = draw(st.sampled_from(["p4de.24xlarge", "p5.48xlarge"]))
    cluster["resources"] = draw(st.sampled_from([{}, {"cpu": "8"}, {"cpu": "90", "memory": "1000Gi"}]))
    cluster["env"] = draw(st.sampled_from([[], [{"name": "NCCL_DEBUG", "value": "INFO"}],
                                           [{"name": "OMP_NUM_THREADS", "value": "4"}]]))
    if draw(st.booleans()):
        cluster["priorityClassName"] = "high"  # refused: Trainer cannot set it
    if draw(st.booleans()):
        spec["checkpointing"] = {"directory": "/checkpoints/run", "volumeClaim": "ckpt"}
    if draw(st.booleans()):
        spec["model"]["hfTokenSecret"] = {"name": "hf"}
    if draw(st.booleans()):
        spec["trainJob"] = {"runtimeRef": draw(st.sampled_from([{"name": "torch-distributed"},
                                                                {"name": "custom", "kind": "TrainingRuntime"}]))}
    if draw(st.booleans()):
        spec["runPolicy"]["activeDeadlineSeconds"] = draw(st.integers(1, 2**31 - 1))
    spec["backend"] = "TrainJob"
    return spec


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=trainjob_specs(), attempt=st.integers(1, 50), excluded=st.lists(st.sampled_from(["n1", "n2", "n3"]), max_size=2))
def test_any_accepted_spec_renders_a_valid_trainjob(spec: dict[str, Any], attempt: int, excluded: list[str]) -> None:
    try:
        parsed = validate_spec(spec)
    except SpecInvalid:
        return  # the API refuses it; nothing is rendered
    owner = Owner("sweep-job", "ns", "abcdef12")
    if trainjob.unsupported(parsed):
        with pytest.raises(trainjob.TrainJobSpecError):
            trainjob.train_job(owner, parsed, attempt, excluded)
        return
    job = trainjob.train_job(owner, parsed, attempt, excluded)
    assert validate_trainjob(job) == [], json.dumps(spec)
    command = job["spec"]["trainer"]["command"]
    etcd = parsed.rendezvous.backend.value != "c10d"
    assert ("--rdzv-id" in command) == ("--rdzv-backend" in command) == ("--rdzv-endpoint" in command) == etcd
    if etcd:
        assert command[command.index("--rdzv-id") + 1] == owner.rendezvous_id(attempt)
    assert job["spec"]["trainer"]["numNodes"] == parsed.cluster.workers
    assert ("FI_PROVIDER" in env_of(job)) == (parsed.cluster.efa_devices_per_worker > 0)
    assert pod_patch(job)["metadata"]["labels"]["llamaft.io/finetune"] == "sweep-job"


# ------------------------------------------------------------------------------- `llamaft render`
def test_render_prints_the_trainjob_instead_of_the_pytorchjob(capsys: pytest.CaptureFixture[str]) -> None:
    path = next(p for p in EXAMPLES if p.name == "llama2-70b.yaml")
    assert main(["render", str(path), "--namespace", "ml", "--attempt", "2", "--backend", "TrainJob"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Deployment", "Service", "PodMonitor", "PrometheusRule", "ConfigMap", "TrainJob"]
    assert docs[-1]["metadata"]["name"] == "llama2-70b-samsum-2" and validate_trainjob(docs[-1]) == []


def test_render_refuses_what_trainer_cannot_do(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    body = yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text())
    body["spec"].setdefault("cluster", {})["priorityClassName"] = "high"
    path = tmp_path / "ft.yaml"
    path.write_text(yaml.safe_dump(body))
    assert main(["render", str(path), "--backend", "TrainJob"]) == 1
    assert "spec.cluster.priorityClassName: the TrainJob backend cannot set" in capsys.readouterr().err
    assert main(["render", str(path)]) == 0


# ----------------------------------------------------------------------------------- the status
def train_job_obj(*conditions: tuple[str, str, str], jobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": [{"type": t, "status": s, "reason": r, "message": f"{t} message"}
                                             for t, s, r in conditions]}
    if jobs is not None:
        status["jobsStatus"] = jobs
    return {"apiVersion": trainjob.API_VERSION, "kind": "TrainJob", "metadata": {"name": "ft-1"}, "status": status}


def node(**counts: int) -> dict[str, Any]:
    return {"name": "node", "active": 0, "ready": 0, "succeeded": 0, "failed": 0, "suspended": 0, **counts}


def test_job_phase_reads_trainjob_conditions_and_jobs_status() -> None:
    phase = backends.phase_of_job
    assert phase(train_job_obj())[:2] == (Phase.CREATING, "TrainJobCreated")
    assert phase(train_job_obj(jobs=[node()]))[:2] == (Phase.CREATING, "JobsCreated")
    assert phase(train_job_obj(jobs=[node(active=1)]))[0] is Phase.RUNNING
    assert phase(train_job_obj(jobs=[node(active=1, ready=1)]))[0] is Phase.RUNNING
    assert phase(train_job_obj(("Suspended", "True", "Suspended"), jobs=[node(suspended=1)]))[:2] == (Phase.SUSPENDED, "Suspended")
    resumed = train_job_obj(("Suspended", "False", "Resumed"), jobs=[node(active=1)])
    assert phase(resumed)[0] is Phase.RUNNING
    complete = train_job_obj(("Suspended", "False", "Resumed"), ("Complete", "True", "AllJobsCompleted"), jobs=[node(succeeded=1)])
    assert phase(complete) == (Phase.SUCCEEDED, "AllJobsCompleted", "Complete message")
    failed = train_job_obj(("Complete", "True", "x"), ("Failed", "True", "DeadlineExceeded"), jobs=[node(failed=1)])
    assert phase(failed)[:2] == (Phase.FAILED, "DeadlineExceeded")
    other = [{"name": "dataset-initializer", "active": 0, "succeeded": 1}, node()]
    assert phase(train_job_obj(jobs=other))[0] is Phase.CREATING, "the trainer's Job decides, not an initializer's"
    # a PyTorchJob is read as before
    pytorch = {"kind": "PyTorchJob", "status": {"conditions": [{"type": "Running", "status": "True", "reason": "PyTorchJobRunning"}]}}
    assert phase(pytorch)[:2] == (Phase.RUNNING, "PyTorchJobRunning")


def test_lifecycle_decides_on_a_failed_trainjob_like_on_a_pytorchjob() -> None:
    spec = example("minimal.yaml")
    now = datetime(2026, 11, 29, 20, 0, tzinfo=UTC)
    status = {"phase": "Running", "attempt": 1, "retriesUsed": 0, "startTime": "2026-11-29T19:00:00Z"}
    failed = train_job_obj(("Failed", "True", "FailedJobs"), jobs=[node(failed=1)])
    failed["status"]["conditions"][0]["message"] = "jobset failed due to a failed job"
    decision = lifecycle.decide(lifecycle.Observed(spec=spec, status=read_status(status), now=now, job_name="minimal-1", job=failed))
    assert decision.start_attempt == 2 and decision.status["phase"] == "Restarting" and decision.delete_jobs == ["minimal-1"]
    assert decision.retry is not None and decision.retry.reason == "JobFailed" and decision.retry.retryable
    running = train_job_obj(jobs=[node(active=1)])
    decision = lifecycle.decide(lifecycle.Observed(spec=spec, status=read_status(status), now=now, job_name="minimal-1", job=running))
    assert decision.status.get("phase") == "Running" and decision.start_attempt is None


def test_pod_selector_uses_the_jobset_labels() -> None:
    assert trainjob.pod_selector("ft-0f5e-3") == (
        "jobset.sigs.k8s.io/jobset-name=ft-0f5e-3,jobset.sigs.k8s.io/replicatedjob-name=node")
