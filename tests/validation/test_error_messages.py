"""Bad specs, case by case, with the exact message expected: what the API server rejects at
admission (schema, patterns, CEL rules), and what only the rendered children show (render.admission.child_errors).
Every message names the field and says what to do."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.validation import SpecInvalid, validate_resource
from llamaft.render.admission import child_errors

from tests.api.test_validation import base as api_base


def base() -> dict[str, Any]:
    """tests.api's object, its results accepted as lost with the pod (checkpointing.discardWithPod):
    the cases here are of other fields (where the results go: tests/render/test_storage.py)."""
    obj = api_base()
    obj["spec"]["checkpointing"] = {"discardWithPod": True}
    return obj


def check_children(spec: LlamaFineTuneSpec, name: str, namespace: str) -> list[str]:
    """render.admission.child_errors as `<spec field>: <problem and fix>` lines (what `llamaft validate`
    prints); a test helper, moved here from the admission checker, which had no other caller."""
    return [str(e) for e in child_errors(spec, name, namespace)]


def with_(*changes: tuple[str, Any]) -> dict[str, Any]:
    """`base()` with each dotted path (under the object root) set."""
    obj = base()
    for path, value in changes:
        *parents, leaf = path.split(".")
        node = obj
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return obj


def _deep(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {"a": 1}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


LABEL_VALUE = "must be a label value: at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
PVC = ("pvc:// sources look like pvc://<claim>/<path>, with <claim> the name of a PersistentVolumeClaim in this namespace "
       "(lowercase letters, digits, '-' and '.'), e.g. pvc://models/llama-2-7b")
COLLIDES = ("directory collides with a path the worker pod already mounts or needs (/dev/shm, the config at /etc/llamaft, "
            "pvc:// inputs under /mnt/pvc, /proc, /sys, the download cache at /var/cache/llamaft) or a parent of one: mount the claim elsewhere, e.g. /checkpoints/my-run")
SNAKE = "(field names are camelCase) known fields: "
CLUSTER_FIELDS = ("efaDevicesPerWorker, elastic, env, gpuMemory, gpuModel, gpusPerWorker, image, imagePullPolicy, "
                  "instanceType, nodeSelector, podTemplateOverrides, priorityClassName, resources, sharedMemorySize, "
                  "terminationGracePeriodSeconds, tolerations, workers")
OVERRIDE_FIX = ("fix or remove it in podTemplateOverrides (merged into the worker pod template as a strategic merge "
                "patch: containers, volumes and env by name)")
TEMPLATE = "in the PyTorchJob ok-ffff-1, spec.pytorchReplicaSpecs.Worker.template"
PREFERENCE = {"format": "preference", "source": "org/pairs"}
DPO = {"epochs": 1, "method": "dpo"}

# (case, object, the exact errors `validate_resource` raises)
ADMISSION: list[tuple[str, dict[str, Any], list[str]]] = [
    # strict types: no coercion
    ("workers as a string", with_(("spec.cluster.workers", "2")),
     ["spec.cluster.workers: must be an integer, got the string '2' (write 2 without quotes)"]),
    ("seed as a boolean", with_(("spec.training", {"epochs": 1, "seed": True})),
     ["spec.training.seed: must be an integer, got the boolean true"]),
    ("packing as a string", with_(("spec.dataset.packing", "true")),
     ["spec.dataset.packing: must be true or false, got the string 'true' (write true without quotes)"]),
    ("packing as 1", with_(("spec.dataset.packing", 1)),
     ["spec.dataset.packing: must be true or false, got the number 1"]),
    ("learning rate as a string", with_(("spec.training", {"epochs": 1, "learningRate": "0.01"})),
     ["spec.training.learningRate: must be a number, got the string '0.01' (write 0.01 without quotes)"]),
    ("workers 2.5", with_(("spec.cluster.workers", 2.5)),
     ["spec.cluster.workers: must be an integer, got the number 2.5 (a whole number)"]),
    ("image as a number", with_(("spec.cluster.image", 7)),
     ["spec.cluster.image: must be a string, got the number 7 (quote it: '7')"]),
    ("a label value as a number", with_(("metadata.labels", {"team": 1})),
     ["metadata.labels: 'team': must be a string, got the number 1 (quote it: '1')"]),
    ("fsdp as a list", with_(("spec.fsdp", ["FULL_SHARD"])),
     ["spec.fsdp: must be a mapping (key: value), got a list"]),
    # camelCase only
    ("fsdp.cpu_offload", with_(("spec.fsdp", {"cpu_offload": True})),
     [f"spec.fsdp.cpu_offload: unknown field; did you mean 'cpuOffload'? {SNAKE}activationCheckpointing, compile, "
      "cpuOffload, float8, hybridShard, implementation, mixedPrecision, shardingStrategy, wrapPolicy"]),
    ("run_policy", with_(("spec.run_policy", {"suspend": True})),
     [f"spec.run_policy: unknown field; did you mean 'runPolicy'? {SNAKE}backend, cache, checkpointing, cluster, dataset, evaluation, fsdp, model, "
      "monitoring, preflight, rendezvous, runPolicy, scheduling, tracking, trainJob, training"]),
    ("dataset.validation_split", with_(("spec.dataset.validation_split", 0.1)),
     [f"spec.dataset.validation_split: unknown field; did you mean 'validationSplit'? {SNAKE}chatTemplate, fieldMapping, format, "
      "maxSeqLength, packing, packingStrategy, promptTemplate, revision, source, split, streaming, trainOn, validationSplit"]),
    # checkpoint directory on a claim
    ("checkpoints at /dev/shm", with_(("spec.checkpointing", {"directory": "/dev/shm", "volumeClaim": "ckpt"})),
     [f"spec.checkpointing.directory: {COLLIDES}"]),
    ("checkpoints at the config mount", with_(("spec.checkpointing", {"directory": "/etc/llamaft", "volumeClaim": "ckpt"})),
     [f"spec.checkpointing.directory: {COLLIDES}"]),
    ("checkpoints at a parent of /dev/shm", with_(("spec.checkpointing", {"directory": "/dev/", "volumeClaim": "ckpt"})),
     [f"spec.checkpointing.directory: {COLLIDES}"]),
    ("checkpoints relative", with_(("spec.checkpointing", {"directory": "checkpoints/run", "volumeClaim": "ckpt"})),
     ["spec.checkpointing.directory: with volumeClaim, directory is where the claim is mounted: make it an absolute "
      "path such as /checkpoints/my-run (an fsspec URI such as s3://bucket/run needs no volumeClaim)"]),
    ("checkpoints with ..", with_(("spec.checkpointing", {"directory": "/ckpt/../etc", "volumeClaim": "ckpt"})),
     ["spec.checkpointing.directory: directory must not contain '.' or '..' path segments: write the absolute path, "
      "e.g. /checkpoints/my-run"]),
    # pvc:// sources
    ("pvc with an empty claim", with_(("spec.model.source", "pvc:///x")), [f"spec.model.source: {PVC}"]),
    ("pvc claim not a DNS name", with_(("spec.dataset.source", "pvc://My_Claim/data.jsonl")), [f"spec.dataset.source: {PVC}"]),
    ("pvc tokenizer", with_(("spec.model.tokenizer", "pvc:///models/tok")), [f"spec.model.tokenizer: {PVC}"]),
    # label values and DNS names
    ("instanceType over 63", with_(("spec.cluster.instanceType", "p" * 64)),
     [f"spec.cluster.instanceType: String should have at most 63 characters (got '{'p' * 58}…')"]),
    ("instanceType with a space", with_(("spec.cluster.instanceType", "p4de 24xlarge")),
     [f"spec.cluster.instanceType: {LABEL_VALUE} (got 'p4de 24xlarge')"]),
    ("nodeSelector value over 63", with_(("spec.cluster.nodeSelector", {"gpu": "a" * 64})),
     [f"spec.cluster.nodeSelector.gpu: String should have at most 63 characters (got '{'a' * 58}…')"]),
    ("nodeSelector value with a space", with_(("spec.cluster.nodeSelector", {"gpu": "a 100"})),
     [f"spec.cluster.nodeSelector.gpu: {LABEL_VALUE} (got 'a 100')"]),
    ("priorityClassName not a DNS name", with_(("spec.cluster.priorityClassName", "High Priority")),
     ["spec.cluster.priorityClassName: must be a DNS-1123 subdomain: lowercase letters, digits, '-' and '.', starting "
      "and ending with a letter or digit (got 'High Priority')"]),
    ("image with a leading space", with_(("spec.cluster.image", " ghcr.io/llamaft/trainer:0.1.0")),
     ["spec.cluster.image: must not contain spaces or other whitespace (an image reference such as "
      "ghcr.io/llamaft/trainer:0.1.0) (got ' ghcr.io/llamaft/trainer:0.1.0')"]),
    # tolerations
    ("toleration Exists with a value", with_(("spec.cluster.tolerations", [{"key": "gpu", "operator": "Exists", "value": "x"}])),
     ["spec.cluster.tolerations[0].value: operator Exists matches every value of the key: remove value, or use operator: Equal"]),
    ("tolerationSeconds with NoSchedule", with_(("spec.cluster.tolerations", [
        {"key": "gpu", "value": "x", "effect": "NoSchedule", "tolerationSeconds": 60}])),
     ["spec.cluster.tolerations[0].tolerationSeconds: tolerationSeconds only applies to effect NoExecute: set effect: "
      "NoExecute or remove tolerationSeconds"]),
    ("toleration without key nor Exists", with_(("spec.cluster.tolerations", [{"value": "x"}])),
     ["spec.cluster.tolerations[0].operator: a toleration without key must use operator Exists (it then tolerates every "
      "taint): set key or operator: Exists"]),
    # ports and quantities
    ("rendezvous port 0", with_(("spec.rendezvous", {"endpoint": "etcd.infra:0"})),
     ["spec.rendezvous.endpoint: must be host:port with a port from 1 to 65535, e.g. etcd.infra.svc:2379 (got 'etcd.infra:0')"]),
    ("rendezvous port 99999", with_(("spec.rendezvous", {"endpoint": "etcd.infra:99999"})),
     ["spec.rendezvous.endpoint: must be host:port with a port from 1 to 65535, e.g. etcd.infra.svc:2379 (got "
      "'etcd.infra:99999')"]),
    ("cpu 0", with_(("spec.cluster.resources", {"cpu": "0"})),
     ["spec.cluster.resources.cpu: must be a Kubernetes quantity greater than 0, e.g. 64Gi, 500Mi, 8 or 500m (got '0')"]),
    ("memory 0Gi", with_(("spec.cluster.resources", {"memory": "0Gi"})),
     ["spec.cluster.resources.memory: must be a Kubernetes quantity greater than 0, e.g. 64Gi, 500Mi, 8 or 500m (got '0Gi')"]),
    ("sharedMemorySize 0", with_(("spec.cluster.sharedMemorySize", "0")),
     ["spec.cluster.sharedMemorySize: must be a Kubernetes quantity greater than 0, e.g. 64Gi, 500Mi, 8 or 500m (got '0')"]),
    ("metricsPort is the c10d port", with_(("spec.rendezvous", {"backend": "c10d"}), ("spec.monitoring", {"metricsPort": 29400})),
     ["spec.monitoring.metricsPort: metricsPort 29400 is the c10d rendezvous port on worker 0: choose another metricsPort"]),
    # environment
    ("env overrides LLAMAFT_CONFIG", with_(("spec.cluster.env", [{"name": "LLAMAFT_CONFIG", "value": "/tmp/x.json"}])),
     ["spec.cluster.env[0].name: LLAMAFT_CONFIG is set by the operator (the config and spec paths, metrics port, grace period, the run identity of its trackers) or "
      "by the training operator (PET_*, MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK): remove it from cluster.env"]),
    ("env sets a PET_ variable", with_(("spec.cluster.env", [{"name": "PET_NNODES", "value": "4"}])),
     ["spec.cluster.env[0].name: PET_NNODES is set by the operator (the config and spec paths, metrics port, grace period, the run identity of its trackers) or by "
      "the training operator (PET_*, MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK): remove it from cluster.env"]),
    ("HF token as a literal env value", with_(("spec.cluster.env", [{"name": "HF_TOKEN", "value": "hf_" + "x" * 34}])),
     ["spec.cluster.env[0].value: HF_TOKEN holds a secret: a literal value is readable by anyone who can read this "
      "LlamaFineTune; put it in a Secret (the Hugging Face token: spec.model.hfTokenSecret) and remove it from cluster.env"]),
    ("an HF token under another name", with_(("spec.cluster.env", [{"name": "HUB_AUTH", "value": "hf_" + "x" * 34}])),
     ["spec.cluster.env[0].value: the value looks like a Hugging Face token: put the token in a Secret and set "
      "spec.model.hfTokenSecret"]),
    ("an API key as a literal", with_(("spec.cluster.env", [{"name": "WANDB_API_KEY", "value": "abc"}])),
     ["spec.cluster.env[0].value: WANDB_API_KEY holds a secret: a literal value is readable by anyone who can read this "
      "LlamaFineTune; put it in a Secret (the Hugging Face token: spec.model.hfTokenSecret) and remove it from cluster.env"]),
    # training and scale
    ("warmupSteps above maxSteps", with_(("spec.training", {"maxSteps": 100, "warmupSteps": 200})),
     ["spec.training.warmupSteps: warmupSteps exceeds maxSteps: the learning rate would never reach learningRate; "
      "lower warmupSteps"]),
    ("elastic 4096 workers x 64 GPUs", with_(("spec.cluster", {"workers": 4096, "gpusPerWorker": 64,
                                                               "elastic": {"minWorkers": 1, "maxWorkers": 4096}})),
     ["spec.cluster.elastic.maxWorkers: elastic.maxWorkers x gpusPerWorker processes: at most 65536 are supported: "
      "lower elastic.maxWorkers"]),
    ("4096 workers x 64 GPUs", with_(("spec.cluster", {"workers": 4096, "gpusPerWorker": 64})),
     ["spec.cluster.workers: workers x gpusPerWorker processes: at most 65536 are supported: use fewer workers"]),
    ("HYBRID_SHARD on 1 worker with 0 GPUs", with_(("spec.cluster", {"workers": 1, "gpusPerWorker": 0}),
                                                   ("spec.fsdp", {"shardingStrategy": "HYBRID_SHARD"})),
     ["spec.fsdp.shardingStrategy: HYBRID_SHARD shards inside groups and replicates across them: it needs at least 2 "
      "processes (workers x gpusPerWorker); on one process use FULL_SHARD"]),
    ("ttlSecondsAfterFinished 2^31 (int32 in Kubeflow)", with_(("spec.runPolicy", {"ttlSecondsAfterFinished": 2**31})),
     ["spec.runPolicy.ttlSecondsAfterFinished: Input should be less than or equal to 2147483647 (got 2147483648)"]),
    ("workers 10^30", with_(("spec.cluster.workers", 10**30)),
     ["spec.cluster.workers: must be an integer, got the number 1e+30 (too large for an integer)"]),
    ("minNumParams 10^30", with_(("spec.fsdp", {"wrapPolicy": {"type": "sizeBased", "minNumParams": 10**18}})),
     ["spec.fsdp.wrapPolicy.minNumParams: Input should be less than or equal to 1000000000000000 (got 1000000000000000000)"]),
    # monitoring labels
    ("scrapeSelector with an invalid value", with_(("spec.monitoring", {"dcgm": {"scrapeSelector": {"release": "kube prometheus"}}})),
     [f"spec.monitoring.dcgm.scrapeSelector.release: {LABEL_VALUE} (got 'kube prometheus')"]),
    # preference tuning (issue 38)
    ("dpo on samsum", with_(("spec.training", DPO)),
     ["spec.dataset.format: training.method dpo learns from pairs of a chosen and a rejected completion: set "
      "dataset.format: preference (records with prompt, chosen and rejected), or training.method: sft"]),
    ("preference data with sft", with_(("spec.dataset", PREFERENCE)),
     ["spec.training.method: dataset.format preference holds pairs for preference tuning, which training.method sft "
      "cannot learn from: set training.method: dpo, or use a format of single responses (jsonl, chat) for sft"]),
    ("dpo with packing", with_(("spec.dataset", {**PREFERENCE, "packing": True}), ("spec.training", DPO)),
     ["spec.dataset.packing: training.method dpo never packs: a pair's chosen and rejected sequences are one example "
      "and go through the model side by side, each padded on its own: set dataset.packing to false"]),
    ("dpo settings with sft", with_(("spec.training", {"epochs": 1, "dpo": {"beta": 0.5}})),
     ["spec.training.dpo: training.dpo configures preference tuning, but training.method is sft: set "
      "training.method: dpo or remove training.dpo"]),
    ("dpo beta 0", with_(("spec.dataset", PREFERENCE), ("spec.training", {**DPO, "dpo": {"beta": 0}})),
     ["spec.training.dpo.beta: Input should be greater than 0 (got 0)"]),
    ("dpo loss hinge", with_(("spec.dataset", PREFERENCE), ("spec.training", {**DPO, "dpo": {"loss": "hinge"}})),
     ["spec.training.dpo.loss: 'hinge' is not one of: sigmoid, ipo"]),
    ("dpo reference copy", with_(("spec.dataset", PREFERENCE), ("spec.training", {**DPO, "dpo": {"reference": "copy"}})),
     ["spec.training.dpo.reference: 'copy' is not one of: precomputed, live"]),
    ("method ppo", with_(("spec.training", {"epochs": 1, "method": "ppo"})),
     ["spec.training.method: 'ppo' is not one of: sft, dpo"]),
    ("preference with a promptTemplate", with_(("spec.dataset", {**PREFERENCE, "promptTemplate": "{q}"}), ("spec.training", DPO)),
     ["spec.dataset.promptTemplate: format preference tokenizes each record's prompt, chosen and rejected as they are "
      "(TRL's preference format), not through promptTemplate: remove promptTemplate"]),
    ("preference with two prompt fields", with_(("spec.dataset", {**PREFERENCE, "fieldMapping": {"prompt": ["a", "b"]}}),
                                                ("spec.training", DPO)),
     ["spec.dataset.fieldMapping.prompt: format preference reads the prompt from one field: give fieldMapping.prompt "
      "one name, e.g. [question] (default prompt)"]),
    ("preference with trainOn", with_(("spec.dataset", {**PREFERENCE, "trainOn": "assistant"}), ("spec.training", DPO)),
     ["spec.dataset.format: chatTemplate and trainOn apply to format chat only (chatTemplate also to format "
      "preference): set format: chat or remove them"]),
    # metadata
    ("unknown metadata field", with_(("metadata.lables", {"a": "b"})),
     ["metadata.lables: unknown field; did you mean 'labels'? known fields: name, namespace, labels, annotations"]),
    ("invalid namespace", with_(("metadata.namespace", "Team_A")),
     ["metadata.namespace: must be a DNS-1123 label of at most 63 characters (lowercase letters, digits and '-', starting "
      "and ending with a letter or digit), got 'Team_A'"]),
    ("invalid label value", with_(("metadata.labels", {"team": "ml research"})),
     [f"metadata.labels: 'team': {LABEL_VALUE} (got 'ml research')"]),
    ("invalid label key", with_(("metadata.labels", {"-team": "ml"})),
     ["metadata.labels: invalid key '-team': its name must be at most 63 letters, digits, '-', '_' or '.', starting and "
      "ending with a letter or digit"]),
    ("name one character too long", with_(("metadata.name", "a" * 43)),
     ["metadata.name: metadata.name must be a DNS-1035 label (lowercase letters, digits, '-', starting with a letter) of "
      "at most 42 characters, so child objects (e.g. the Service `<name>-<uid>-<attempt>-worker-<index>`) fit in 63"]),
]

# (case, object, the exact problems `check_children` reports for an admitted spec)
RENDERED: list[tuple[str, dict[str, Any], list[str]]] = [
    ("podTemplateOverrides with scalar containers", with_(("spec.cluster.podTemplateOverrides", {"spec": {"containers": "x"}})),
     [f"spec.cluster.podTemplateOverrides.spec.containers: must be of type array, got 'x' ({TEMPLATE}.spec.containers): "
      f"{OVERRIDE_FIX}"]),
    ("podTemplateOverrides with an unknown pod field", with_(("spec.cluster.podTemplateOverrides", {"spec": {"hostNetwrok": True}})),
     [f"spec.cluster.podTemplateOverrides.spec.hostNetwrok: unknown field ({TEMPLATE}.spec.hostNetwrok): {OVERRIDE_FIX}"]),
    # Issue 13 merges overrides strategically: naming the pytorch container patches it, so no second
    # pytorch container can appear; a container without a name would be one, and is refused.
    ("podTemplateOverrides with a container without a name", with_(("spec.cluster.podTemplateOverrides", {
        "spec": {"containers": [{"image": "ghcr.io/x/y:1"}]}})),
     [f"spec.cluster.podTemplateOverrides.spec.containers[0]: 'name' is a required property ({TEMPLATE}.spec."
      f"containers[1]): {OVERRIDE_FIX}"]),
    ("podTemplateOverrides with an unknown field in the pytorch container", with_(("spec.cluster.podTemplateOverrides", {
        "spec": {"containers": [{"name": "pytorch", "imagePullPolicie": "Always"}]}})),
     [f"spec.cluster.podTemplateOverrides.spec.containers[0].imagePullPolicie: unknown field ({TEMPLATE}.spec."
      f"containers[0].imagePullPolicie): {OVERRIDE_FIX}"]),
    ("podTemplateOverrides with an unknown field deep in the pytorch container's env", with_((
        "spec.cluster.podTemplateOverrides", {"spec": {"containers": [{"name": "pytorch", "env": [
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}, "configMap": {}}}]}]}})),
     [f"spec.cluster.podTemplateOverrides.spec.containers[0].env[0].valueFrom.configMap: unknown field ({TEMPLATE}.spec."
      f"containers[0].env[17].valueFrom.configMap): {OVERRIDE_FIX}"]),
    ("podTemplateOverrides with a toleration the API server refuses", with_(("spec.cluster.podTemplateOverrides", {
        "spec": {"tolerations": [{"key": "gpu", "operator": "Exists", "value": "x"}]}})),
     [f"spec.cluster.podTemplateOverrides.spec.tolerations[0].value: must be empty when operator is Exists ({TEMPLATE}."
      f"spec.tolerations[0].value): {OVERRIDE_FIX}"]),
    ("podTemplateOverrides with a volume without name", with_(("spec.cluster.podTemplateOverrides", {
        "spec": {"volumes": [{"emptyDir": {}}]}})),
     [f"spec.cluster.podTemplateOverrides.spec.volumes[0]: 'name' is a required property ({TEMPLATE}.spec.volumes[3]): "
      f"{OVERRIDE_FIX}"]),
    ("podTemplateOverrides nested 500 levels", with_(("spec.cluster.podTemplateOverrides", {"x": _deep(500)})),
     ["spec.cluster.podTemplateOverrides.x.a.a.a.a.a.a.a.a.a.a.a…: nested more than 64 levels deep; no field of a pod "
      "template nests that deep: remove it"]),
    ("nodeSelector key with a space", with_(("spec.cluster.nodeSelector", {"gpu type": "a100"})),
     ["spec.cluster.nodeSelector[gpu type]: not a label key: its name must be at most 63 letters, digits, '-', '_' or "
      f"'.', starting and ending with a letter or digit ({TEMPLATE}.spec.nodeSelector[gpu type]): use a node label, e.g. "
      "nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3"]),
    ("nodeSelector key with a prefix that is not a DNS name", with_(("spec.cluster.nodeSelector", {"Example_com/gpu": "a100"})),
     ["spec.cluster.nodeSelector[Example_com/gpu]: not a label key: its prefix (before '/') must be a DNS-1123 subdomain "
      f"of at most 253 characters, e.g. example.com ({TEMPLATE}.spec.nodeSelector[Example_com/gpu]): use a node label, "
      "e.g. nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3"]),
    ("scrapeSelector with an invalid key", with_(("spec.monitoring", {"dcgm": {"scrapeSelector": {"release name": "x"}}})),
     [f"spec.monitoring.dcgm.scrapeSelector[release name]: not a label key: its name must be at most 63 letters, digits, "
      f"'-', '_' or '.', starting and ending with a letter or digit (in the {kind} {name}, metadata.labels[release name]): "
      "use a label your Prometheus selects monitoring objects by, e.g. release: kube-prometheus-stack"
      for kind, name in (("PodMonitor", "ok-trainer"), ("PrometheusRule", "ok-alerts"))]),
    ("promptTemplate with an unclosed brace", with_(("spec.dataset.promptTemplate", "Summarize: {dialogue\nSummary: ")),
     ["spec.dataset.promptTemplate: not a valid Python format string (unmatched '{' in format spec): write a "
      "literal brace as {{ or }}, a record field as {field}"]),
    ("promptTemplate with attribute access", with_(("spec.dataset.promptTemplate", "Summarize: {record.dialogue}\n")),
     ["spec.dataset.promptTemplate: {record.dialogue} uses attribute access or indexing, which records do not support: "
      "use the record field's name only, e.g. {record}"]),
    ("promptTemplate with a positional field", with_(("spec.dataset.promptTemplate", "Summarize: {}\n")),
     ["spec.dataset.promptTemplate: positional fields ({} or {0}) have no value: name a record field, e.g. {dialogue}"]),
    ("LoRA targetModules that name no module", with_(("spec.training", {"epochs": 1, "lora": {"targetModules": ["q_proj", "qkv"]}})),
     ["spec.training.lora.targetModules[1]: 'qkv' names no module of a Llama model, so LoRA would fail when the model "
      "loads: use q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (attention and MLP projections), "
      "lm_head or embed_tokens"]),
]


@pytest.mark.parametrize(("obj", "expected"), [c[1:] for c in ADMISSION], ids=[c[0] for c in ADMISSION])
def test_admission_rejects_with_the_exact_message(obj: dict[str, Any], expected: list[str]) -> None:
    with pytest.raises(SpecInvalid) as info:
        validate_resource(obj)
    assert [str(e) for e in info.value.errors] == expected


@pytest.mark.parametrize(("obj", "expected"), [c[1:] for c in RENDERED], ids=[c[0] for c in RENDERED])
def test_rendered_children_are_checked_with_the_exact_message(obj: dict[str, Any], expected: list[str]) -> None:
    spec = validate_resource(obj)  # the API server admits it ...
    assert check_children(spec, obj["metadata"]["name"], "default") == expected  # ... the cluster would not run it


def test_the_table_covers_the_issue() -> None:
    assert len(ADMISSION) + len(RENDERED) >= 60


@pytest.mark.parametrize("change", [
    ("spec.cluster.workers", None), ("spec.fsdp", None), ("spec.training", None), ("spec.cluster.elastic", None),
    ("spec.model.revision", None), ("spec.cluster.nodeSelector", None), ("spec.runPolicy", None),
])
def test_null_is_pruned_and_the_default_applies(change: tuple[str, Any]) -> None:
    """As the API server prunes nulls of non-nullable fields before defaulting."""
    obj = with_(change)
    spec = validate_resource(obj)
    assert spec == validate_resource(_without(base(), change[0]))
    assert check_children(spec, "ok", "default") == []


def _without(obj: dict[str, Any], path: str) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    *parents, leaf = path.split(".")
    node = obj
    for part in parents:
        node = node.setdefault(part, {})
    node.pop(leaf, None)
    return obj


def test_an_override_of_the_pytorch_container_patches_it() -> None:
    from llamaft.render.desired import pytorch_job
    from llamaft.render.naming import Owner

    obj = with_(("spec.cluster.podTemplateOverrides", {"spec": {"containers": [{"name": "pytorch", "image": "ghcr.io/x/y:1"}]}}))
    spec = validate_resource(obj)
    assert check_children(spec, "ok", "default") == []
    containers = pytorch_job(Owner("ok", "default"), spec, 1)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert [(c["name"], c["image"]) for c in containers] == [("pytorch", "ghcr.io/x/y:1")]


def test_whole_floats_are_integers_as_kubectl_sends_them() -> None:
    assert validate_resource(with_(("spec.cluster.workers", 4.0))).cluster.workers == 4
    assert validate_resource(with_(("spec.training", {"epochs": 1, "learningRate": 1}))).training.learning_rate == 1.0


def test_every_case_names_a_field_and_no_rule_fails_to_evaluate() -> None:
    for _, _obj, expected in ADMISSION + RENDERED:
        for line in expected:
            path, _, message = line.partition(": ")
            assert path.startswith(("spec.", "metadata.")) and message, line
            assert "could not be evaluated" not in message
