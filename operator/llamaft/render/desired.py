"""spec -> desired objects. Pure functions: no API calls, no clock, no randomness.

Choices, and why:
- Replica layout: Workers only, with an elasticPolicy. Under torchrun every node is the same
  program and ranks come from the rendezvous, so a distinguished Master pod buys nothing; the
  training operator requires a Worker spec for elastic jobs and derives PET_NNODES, PET_RDZV_* and
  PET_MAX_RESTARTS from the elasticPolicy.
- Managed etcd per job (not per namespace): a rendezvous reset or an etcd restart can never touch
  another job's rendezvous, which is exactly the failure the shared-etcd reference deployment has;
  the etcd is owned by the LlamaFineTune and goes away with it. It costs one small pod per job.
- restartPolicy Never and cleanPodPolicy Running: torchrun's own `maxRestarts` restarts the worker
  group in place (fast, no rescheduling); when a pod ends anyway, the training operator fails the
  job instead of restarting that one pod, and the llamaft operator decides for the whole gang from
  the evidence (lifecycle.py, failures.py): a new attempt from the newest checkpoint, or Failed.
  One policy, one budget (runPolicy.retryBudget). The Failed job keeps its failed pods for
  `kubectl logs`; its running pods are removed so they release their GPUs.
- Nodes named by earlier failures (status.excludedNodes) are kept out with required node affinity.
- The training config is a ConfigMap the operator owns, mounted read-only; the trainer reads it
  with the same pydantic model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llamaft.api.quantity import quantity_value
from llamaft.api.sources import CACHE_MOUNT, PVC_MOUNT_ROOT, SourceKind, parse_source
from llamaft.api.spec import KUEUE_TOPOLOGY_ANNOTATIONS, LlamaFineTuneSpec, RendezvousBackend
from llamaft.render.naming import (
    C10D_PORT,
    CONFIG_FILE,
    CONFIG_MOUNT,
    ETCD_CLIENT_PORT,
    LABEL_ATTEMPT,
    SPEC_FILE,
    Owner,
)
from llamaft.render.podmerge import strategic_merge

ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
"""etcd 3.6 dropped the v2 API that torchrun's etcd backends use: stay on 3.5.x."""

Obj = dict[str, Any]


# --------------------------------------------------------------------------------- config map
def config_texts(spec: LlamaFineTuneSpec) -> tuple[str, str]:
    """The config map's two texts, (the trainer's config, the whole spec), as indented JSON (people
    read them with kubectl). They depend on the spec alone, so a caller that renders many objects
    from one template may keep them per spec content (admission.CheckCache.config_texts)."""
    return (json.dumps(spec.training_config().to_k8s(), indent=2, sort_keys=True),
            json.dumps(spec.to_k8s(), indent=2, sort_keys=True))


def config_map(owner: Owner, spec: LlamaFineTuneSpec, texts: tuple[str, str] | None = None) -> Obj:
    """The trainer's part of the spec, as JSON, for every worker; and the whole spec, which the
    trainer reads only to log it as the tracker run's parameters (the cluster fields too: a
    comparison of runs of several sizes needs `cluster.workers`). `texts`: config_texts(spec), when
    the caller kept them."""
    config_text, spec_text = texts if texts is not None else config_texts(spec)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": owner.config_map, "namespace": owner.namespace, "labels": owner.labels("config")},
        "data": {CONFIG_FILE: config_text, SPEC_FILE: spec_text},
    }


# ---------------------------------------------------------------------------------- rendezvous
def uses_managed_etcd(spec: LlamaFineTuneSpec) -> bool:
    return spec.rendezvous.backend is not RendezvousBackend.C10D and spec.rendezvous.endpoint is None


def rendezvous_endpoint(owner: Owner, spec: LlamaFineTuneSpec, attempt: int) -> tuple[str, int]:
    """(host, port) the workers rendezvous on."""
    if spec.rendezvous.backend is RendezvousBackend.C10D:
        # c10d rendezvouses on worker 0's headless Service, created by the training operator.
        return f"{owner.job_name(attempt)}-worker-0", C10D_PORT
    if spec.rendezvous.endpoint is not None:
        host, port = spec.rendezvous.endpoint.rsplit(":", 1)
        return host, int(port)
    return f"{owner.etcd}.{owner.namespace}.svc", ETCD_CLIENT_PORT


def etcd_objects(owner: Owner, image: str = ETCD_IMAGE) -> list[Obj]:
    """A single-member etcd with the v2 API on (Deployment + Service), data in memory: rendezvous
    state is ephemeral by design and is reset before every run attempt anyway."""
    labels = owner.labels("rendezvous")
    selector = {"app.kubernetes.io/instance": owner.name, "app.kubernetes.io/component": "rendezvous"}
    url = f"http://0.0.0.0:{ETCD_CLIENT_PORT}"
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": owner.etcd, "namespace": owner.namespace, "labels": labels},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 65534, "fsGroup": 65534},
                    "containers": [
                        {
                            "name": "etcd",
                            "image": image,
                            "command": [
                                "etcd", "--name", "rendezvous", "--data-dir", "/var/run/etcd/data",
                                "--listen-client-urls", url,
                                "--advertise-client-urls", f"http://{owner.etcd}.{owner.namespace}.svc:{ETCD_CLIENT_PORT}",
                                "--listen-peer-urls", "http://0.0.0.0:2380", "--enable-v2",
                            ],
                            "ports": [{"name": "client", "containerPort": ETCD_CLIENT_PORT}],
                            "readinessProbe": {
                                "httpGet": {"path": "/health", "port": ETCD_CLIENT_PORT},
                                "periodSeconds": 5,
                            },
                            "livenessProbe": {
                                "httpGet": {"path": "/health", "port": ETCD_CLIENT_PORT},
                                "periodSeconds": 20, "failureThreshold": 6,
                            },
                            "resources": {
                                "requests": {"cpu": "100m", "memory": "128Mi"},
                                "limits": {"memory": "512Mi"},
                            },
                            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                "capabilities": {"drop": ["ALL"]}},
                            "volumeMounts": [{"name": "data", "mountPath": "/var/run/etcd"}],
                        }
                    ],
                    "volumes": [{"name": "data", "emptyDir": {"medium": "Memory", "sizeLimit": "256Mi"}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": owner.etcd, "namespace": owner.namespace, "labels": labels},
        "spec": {
            "selector": selector,
            "ports": [{"name": "client", "port": ETCD_CLIENT_PORT, "targetPort": ETCD_CLIENT_PORT}],
        },
    }
    return [deployment, service]


# ------------------------------------------------------------------------------------ the job
def _tracking_env(spec: LlamaFineTuneSpec) -> list[Obj]:
    """The trackers' credentials, as their client libraries' own variables, from the spec's
    Secrets (optional keys: a Secret holds either a token or a username and password)."""
    env: list[Obj] = []
    mlflow, wandb = spec.tracking.mlflow, spec.tracking.wandb
    if mlflow is not None and mlflow.credentials_secret:
        for name, key in (("MLFLOW_TRACKING_TOKEN", "token"), ("MLFLOW_TRACKING_USERNAME", "username"),
                          ("MLFLOW_TRACKING_PASSWORD", "password")):
            env.append({"name": name, "valueFrom": {"secretKeyRef": {"name": mlflow.credentials_secret, "key": key,
                                                                     "optional": True}}})
    if wandb is not None and wandb.api_key_secret is not None:
        ref = wandb.api_key_secret
        env.append({"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return env


def threads_per_process(spec: LlamaFineTuneSpec) -> int:
    """CPU threads each trainer process may use (OMP_NUM_THREADS): the worker's CPU share
    (cluster.resources.cpu, requests = limits) split among its processes, one when the share is
    not known (torchrun's own default for several processes a node). A `cluster.env` entry for
    OMP_NUM_THREADS still wins (it comes later in the container's env)."""
    if spec.cluster.resources.cpu is None:
        return 1
    return max(1, int(quantity_value(spec.cluster.resources.cpu) // max(spec.cluster.gpus_per_worker, 1)))


def _env(owner: Owner, spec: LlamaFineTuneSpec) -> list[Obj]:
    env: list[Obj] = [
        # Which fine-tune this is: one tracker run per LlamaFineTune, continued by every attempt.
        {"name": "LLAMAFT_RUN_NAME", "value": owner.name},
        {"name": "LLAMAFT_RUN_NAMESPACE", "value": owner.namespace},
        {"name": "LLAMAFT_RUN_UID", "value": owner.uid},
        {"name": "LLAMAFT_IMAGE", "value": spec.cluster.image},
        {"name": "LLAMAFT_CONFIG", "value": f"{CONFIG_MOUNT}/{CONFIG_FILE}"},
        {"name": "LLAMAFT_SPEC", "value": f"{CONFIG_MOUNT}/{SPEC_FILE}"},
        {"name": "LLAMAFT_METRICS_PORT", "value": str(spec.monitoring.metrics_port)},
        # The pod's name for status.leaderPod (HOSTNAME is the hostname, which JobSet's pods set apart).
        {"name": "LLAMAFT_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        # The trainer saves a checkpoint on SIGTERM only when the grace period leaves time for it.
        {"name": "LLAMAFT_TERMINATION_GRACE_SECONDS", "value": str(spec.cluster.termination_grace_period_seconds)},
        # torchrun forwards SIGTERM to its workers and SIGKILLs them after this (default 30 s):
        # let them use the whole grace period the kubelet gives the pod.
        {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(spec.cluster.termination_grace_period_seconds)},
        {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "1"},
        # A fresh store for each attempt's workers. By default torchrun's c10d rendezvous hands the
        # workers its own TCPStore, the same server for every restart with no per-attempt prefix
        # (torch 2.13 dynamic_rendezvous.py `next_rendezvous`, rendezvous.py `_create_c10d_store`:
        # "We create a new TCPStore for every retry", which the shared store does not): a restart's
        # init_process_group reads the dead workers' gloo/NCCL addresses and fails with "Connection
        # refused", or waits out the collective timeout (pytorch/pytorch#135712). With this, rank 0
        # of each attempt hosts its own store on a port the rendezvous picks per round.
        {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"},
        {"name": "OMP_NUM_THREADS", "value": str(threads_per_process(spec))},
        {"name": "TOKENIZERS_PARALLELISM", "value": "false"},
    ]
    if spec.cluster.efa_devices_per_worker > 0:
        env += [
            {"name": "FI_PROVIDER", "value": "efa"},
            {"name": "FI_EFA_USE_DEVICE_RDMA", "value": "1"},
            {"name": "NCCL_SOCKET_IFNAME", "value": "^lo,docker"},
        ]
    # The download cache (huggingface_hub's and datasets', and llamaft's own for fsspec URIs):
    # on spec.cache.volumeClaim every node and attempt shares one copy; otherwise an emptyDir.
    env += [
        {"name": "LLAMAFT_CACHE", "value": CACHE_MOUNT},
        {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/huggingface"},
        {"name": "LLAMAFT_CACHE_SHARED", "value": "1" if spec.cache.volume_claim else "0"},
    ]
    secret = spec.model.hf_token_secret
    if secret is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}})
    env += _tracking_env(spec)
    env += [{"name": e.name, "value": e.value} for e in spec.cluster.env]
    return env


def _resources(spec: LlamaFineTuneSpec) -> Obj:
    limits: dict[str, str] = {}
    if spec.cluster.gpus_per_worker:
        limits["nvidia.com/gpu"] = str(spec.cluster.gpus_per_worker)
    if spec.cluster.efa_devices_per_worker:
        limits["vpc.amazonaws.com/efa"] = str(spec.cluster.efa_devices_per_worker)
    if spec.cluster.resources.cpu:
        limits["cpu"] = spec.cluster.resources.cpu
    if spec.cluster.resources.memory:
        limits["memory"] = spec.cluster.resources.memory
    return {"requests": dict(limits), "limits": dict(limits)} if limits else {}


def _volumes(owner: Owner, spec: LlamaFineTuneSpec) -> tuple[list[Obj], list[Obj]]:
    volumes: list[Obj] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.cluster.shared_memory_size}},
        {"name": "config", "configMap": {"name": owner.config_map}},
    ]
    mounts: list[Obj] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
    ]
    if spec.cache.volume_claim:
        volumes.append({"name": "llamaft-cache", "persistentVolumeClaim": {"claimName": spec.cache.volume_claim}})
    else:
        volumes.append({"name": "llamaft-cache", "emptyDir": {}})
    mounts.append({"name": "llamaft-cache", "mountPath": CACHE_MOUNT})
    if spec.checkpointing.volume_claim:
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": spec.checkpointing.volume_claim}})
        mounts.append({"name": "checkpoints", "mountPath": spec.checkpointing.directory})
    claims: list[str] = []
    for text in (spec.model.source, spec.model.tokenizer, spec.dataset.source):
        if text is None:
            continue
        src = parse_source(text)
        if src.kind is SourceKind.PVC and src.claim not in claims and src.claim is not None:
            claims.append(src.claim)
    for index, claim in enumerate(claims):
        volumes.append({"name": f"input-{index}", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": f"input-{index}", "mountPath": f"{PVC_MOUNT_ROOT}/{claim}", "readOnly": True})
    return volumes, mounts


def cache_condition(spec: LlamaFineTuneSpec) -> tuple[str, str, str]:
    """The SharedCache condition (status, reason, message): whether downloads happen once per run."""
    if spec.cache.volume_claim:
        return ("True", "VolumeClaim", f"model and dataset files are downloaded once per run into the claim "
                f"{spec.cache.volume_claim} (mounted at {CACHE_MOUNT} on every worker)")
    return ("False", "NoVolumeClaim", "each node downloads the model and dataset files into its own emptyDir, again on "
            "every attempt (a retry moves to other nodes); set spec.cache.volumeClaim to a ReadWriteMany claim to "
            "download them once per run")


def _avoid_nodes(excluded: Sequence[str]) -> Obj:
    """Required node affinity that keeps the workers off nodes earlier failures named."""
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": sorted(excluded)}]}
    ]}}}


def pod_template(owner: Owner, spec: LlamaFineTuneSpec, attempt: int, excluded_nodes: Sequence[str] = ()) -> Obj:
    volumes, mounts = _volumes(owner, spec)
    node_selector = dict(spec.cluster.node_selector)
    if spec.cluster.instance_type:
        node_selector["node.kubernetes.io/instance-type"] = spec.cluster.instance_type
    container: Obj = {
        "name": "pytorch",  # the training operator requires this name
        "image": spec.cluster.image,
        "imagePullPolicy": spec.cluster.image_pull_policy.value,
        # torchrun takes --nnodes, --nproc-per-node and every --rdzv-* from the PET_* variables
        # the training operator sets from the elasticPolicy and nprocPerNode.
        "command": ["torchrun", "-m", "llamaft_trainer", "--config", f"{CONFIG_MOUNT}/{CONFIG_FILE}"],
        "env": _env(owner, spec),
        "ports": [{"name": "metrics", "containerPort": spec.monitoring.metrics_port}],
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    resources = _resources(spec)
    if resources:
        container["resources"] = resources
    pod_spec: Obj = {
        "containers": [container], "volumes": volumes,
        "terminationGracePeriodSeconds": spec.cluster.termination_grace_period_seconds,
    }
    if excluded_nodes:
        pod_spec["affinity"] = _avoid_nodes(excluded_nodes)
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if spec.cluster.tolerations:
        pod_spec["tolerations"] = [t.to_k8s() for t in spec.cluster.tolerations]
    if spec.cluster.priority_class_name:
        pod_spec["priorityClassName"] = spec.cluster.priority_class_name
    if spec.scheduling.gang is not None:
        pod_spec["schedulerName"] = spec.scheduling.gang.scheduler_name
    labels = {**owner.labels("trainer"), LABEL_ATTEMPT: str(attempt)}
    template: Obj = {"metadata": {"labels": labels}, "spec": pod_spec}
    annotations = topology_annotations(spec)
    if annotations:
        template["metadata"]["annotations"] = annotations
    if spec.cluster.pod_template_overrides:
        template = strategic_merge(template, spec.cluster.pod_template_overrides)
    return template


def topology_annotations(spec: LlamaFineTuneSpec) -> dict[str, str]:
    """Kueue's topology-aware scheduling request on the worker pod template (the PodSet's template
    for both backends: Kueue reads a PyTorchJob's replica templates and a TrainJob's JobSet, into
    which Trainer merges our runtimePatch's pod metadata). Kueue docs, concepts/topology_aware_scheduling
    ("User-facing APIs"); kueue pkg/controller/jobframework/tas_validation.go checks the value as a
    label name and allows one such annotation per PodSet."""
    topology = spec.scheduling.topology
    if topology is None or not spec.scheduling.queue_name:
        return {}
    return {KUEUE_TOPOLOGY_ANNOTATIONS[topology.mode]: topology.level}


KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"


def kueue_labels(spec: LlamaFineTuneSpec) -> dict[str, str]:
    """Kueue's labels for the job (kueue.sigs.k8s.io docs, "Run a PyTorchJob" / "Run a TrainJob":
    the LocalQueue in metadata.labels; Kueue's webhook suspends the job at creation and Kueue
    unsuspends it on admission, so the job is rendered with the user's own suspend value)."""
    labels = {}
    if spec.scheduling.queue_name:
        labels[KUEUE_QUEUE_LABEL] = spec.scheduling.queue_name
        if spec.scheduling.priority_class:
            labels[KUEUE_PRIORITY_LABEL] = spec.scheduling.priority_class
    return labels


def pytorch_job(owner: Owner, spec: LlamaFineTuneSpec, attempt: int, excluded_nodes: Sequence[str] = ()) -> Obj:
    """The Kubeflow PyTorchJob (kubeflow.org/v1) for one run attempt."""
    host, port = rendezvous_endpoint(owner, spec, attempt)
    cluster = spec.cluster
    low = cluster.elastic.min_workers if cluster.elastic else cluster.workers
    high = cluster.elastic.max_workers if cluster.elastic else cluster.workers
    run_policy: Obj = {"cleanPodPolicy": "Running", "suspend": spec.run_policy.suspend}
    if spec.run_policy.ttl_seconds_after_finished is not None:
        run_policy["ttlSecondsAfterFinished"] = spec.run_policy.ttl_seconds_after_finished
    if spec.run_policy.active_deadline_seconds is not None:
        run_policy["activeDeadlineSeconds"] = spec.run_policy.active_deadline_seconds
    if spec.run_policy.backoff_limit is not None:
        run_policy["backoffLimit"] = spec.run_policy.backoff_limit
    rdzv_conf = []
    if spec.rendezvous.backend is not RendezvousBackend.C10D:
        rdzv_conf.append({"key": "protocol", "value": "http"})
    gang = spec.scheduling.gang
    if gang is not None:
        # Volcano / scheduler-plugins PodGroup: every worker or none (kubeflow.org/v1 SchedulingPolicy).
        policy: Obj = {"minAvailable": low}
        if gang.queue:
            policy["queue"] = gang.queue
        if gang.priority_class:
            policy["priorityClass"] = gang.priority_class
        if gang.schedule_timeout_seconds is not None:
            policy["scheduleTimeoutSeconds"] = gang.schedule_timeout_seconds
        run_policy["schedulingPolicy"] = policy
    labels = {**owner.labels("trainer"), LABEL_ATTEMPT: str(attempt), **kueue_labels(spec)}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": owner.job_name(attempt), "namespace": owner.namespace, "labels": labels},
        "spec": {
            "nprocPerNode": str(max(cluster.gpus_per_worker, 1)),
            "elasticPolicy": {
                "rdzvBackend": spec.rendezvous.backend.value,
                "rdzvHost": host,
                "rdzvPort": port,
                "rdzvId": owner.rendezvous_id(attempt),
                "minReplicas": low,
                "maxReplicas": high,
                "maxRestarts": spec.rendezvous.max_restarts,
                **({"rdzvConf": rdzv_conf} if rdzv_conf else {}),
            },
            "runPolicy": run_policy,
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": cluster.workers,
                    "restartPolicy": "Never",
                    "template": pod_template(owner, spec, attempt, excluded_nodes),
                }
            },
        },
    }
