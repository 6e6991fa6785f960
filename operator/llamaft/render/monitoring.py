"""spec -> monitoring objects (pure): a PodMonitor for the trainer's /metrics, a PrometheusRule with
the job's alerts, and a Grafana dashboard ConfigMap, all filtered to this fine-tune's pods on either
job backend.

Which pods. Every query and alert selects `namespace` and a `pod` regex matching exactly the pod
names the controllers create for any attempt of this incarnation (jobs `<name>-<uid token>-<attempt>`,
naming.Owner.job_name), on both backends (`pod_name_regex`): a run's backend is resolved by the
operator after these objects are rendered (`auto`), and the two name shapes cannot match each other's
pods. DCGM series carry only `namespace`, `pod` and `container` of the pod using the GPU (dcgm-exporter
with DCGM_EXPORTER_KUBERNETES=true, scraped with honorLabels as the chart's ServiceMonitor does), so
a name regex is the one selector they allow; the trainer's series get the same `pod` label from the
PodMonitor, and the same regex keeps the queries alike. A pod label (the finetune label) is not used
for the trainer series: an earlier incarnation's pods, still terminating, carry the same one.

Which port. The PodMonitor has one endpoint per backend; each finds targets only in its backend's pods
(Prometheus Operator v0.93.0, pkg/prometheus/promcfg.go generatePodMonitorConfig: `port` keeps the
targets whose `__meta_kubernetes_pod_container_port_name` matches, `portNumber` those whose
`..._port_number` does; Prometheus' pod discovery makes one target per *declared* container port):
- PyTorchJob: `port: metrics`, the name desired.pod_template declares on the `pytorch` container.
- TrainJob (`portNumber`: Prometheus Operator v0.79.0+, #7150; the vendored CRDs are v0.93.0):
  Kubeflow Trainer v2.3 cannot declare the metrics port (neither `spec.trainer` nor a
  runtimePatch's ContainerPatch has `ports`), so `portNumber` of the metrics port would find nothing
  (the CRD: "The Pod must declare the specified Port"). The one port the trainer container declares is
  the torch plugin's 29500 (torch.go: UpsertPort ContainerTrainerPort, on the `node` container): the
  endpoint selects that target and rewrites its `__address__` to the pod's address with the metrics
  port, which the CRD documents as the way to scrape a port that is not declared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llamaft.api.resource import MAX_ATTEMPTS
from llamaft.api.spec import Backend, LlamaFineTuneSpec
from llamaft.render import trainjob
from llamaft.render.backends import BACKENDS, TRAINER_CONTAINERS
from llamaft.render.naming import Owner

Obj = dict[str, Any]

# Hardware XIDs that mean the GPU or its links need attention (NVIDIA's XID catalogue).
HARDWARE_XIDS = (48, 63, 64, 74, 79, 92, 94, 95, 119, 120)
NO_PROGRESS_MINUTES = 15
LOW_UTILISATION_PERCENT = 20

METRICS_PORT_NAME = "metrics"
"""The metrics port's name on the PyTorchJob's trainer container (desired.pod_template)."""
PYTORCHJOB_CONTAINER = BACKENDS[Backend.PYTORCH_JOB.value].trainer_container
TRAINJOB_CONTAINER = BACKENDS[Backend.TRAIN_JOB.value].trainer_container

# ------------------------------------------------------------------------------- pod names
MAX_WORKER_INDEX_DIGITS = 4
"""cluster.workers and elastic.maxWorkers are at most 4096: worker/pod indices have 1-4 digits."""
MAX_GENERATED_NAME_LENGTH = 63 - 5
"""k8s.io/apiserver pkg/storage/names/generate.go: maxNameLength 63 - randomLength 5."""
GENERATED_SUFFIX = "[bcdfghjklmnpqrstvwxz2456789]{5}"
"""The 5 characters generateName appends: k8s.io/apimachinery pkg/util/rand String (alphanums
"bcdfghjklmnpqrstvwxz2456789")."""
DIGIT = "[0-9]"


def _atoms(text: str) -> list[str]:
    """One regex atom per character of a literal name (DNS labels: letters, digits, '-' need no escape)."""
    if not all(c.isalnum() or c == "-" for c in text):
        raise ValueError(f"{text!r} is not part of a Kubernetes object name (a DNS label)")
    return list(text)


def _pattern(atoms: list[str]) -> str:
    """Atoms joined, runs of the same class written once with a count (`[0-9]{3}`)."""
    out: list[str] = []
    index = 0
    while index < len(atoms):
        atom, run = atoms[index], 1
        while index + run < len(atoms) and atoms[index + run] == atom and atom.startswith("["):
            run += 1
        out.append(atom if run == 1 else f"{atom}{{{run}}}")
        index += run
    return "".join(out)


@dataclass(frozen=True)
class JobNames:
    """The names of some jobs: `literal`, the start they all share, then `rest` (a regex), and
    each length they can have spelled out character by character (`variants`: one regex atom per
    character), which is what a name cut short needs."""

    literal: str
    rest: str
    variants: tuple[tuple[str, ...], ...]

    @property
    def regex(self) -> str:
        return self.literal + self.rest


def attempt_jobs(owner: Owner) -> JobNames:
    """The job names of every attempt of this incarnation (naming.Owner.job_name,
    `<name>-<uid token>-<attempt>`, attempts 1..MAX_ATTEMPTS)."""
    prefix = f"{owner.name}-{owner.token}-" if owner.token else f"{owner.name}-"
    widths = range(1, len(str(MAX_ATTEMPTS)) + 1)
    return JobNames(prefix, f"{DIGIT}+", tuple((*_atoms(prefix), *[DIGIT] * width) for width in widths))


def one_job(job_name: str) -> JobNames:
    """One attempt's job name."""
    return JobNames(job_name, "", (tuple(_atoms(job_name)),))


def _digits(count: int) -> str:
    return DIGIT if count == 1 else f"{DIGIT}{{{count}}}"


def _pytorchjob_pods(jobs: JobNames) -> list[str]:
    return [f"{jobs.regex}-worker-{DIGIT}+"]


def _trainjob_pods(jobs: JobNames) -> list[str]:
    rjob = f"-{trainjob.NODE}-0"
    out: dict[str, None] = {}
    for job in jobs.variants:
        name = [*job, *_atoms(rjob)]
        for digits in range(1, MAX_WORKER_INDEX_DIGITS + 1):
            append = len(f"-{'0' * digits}-")
            if len(name) + append > MAX_GENERATED_NAME_LENGTH:
                cut = _pattern(name[:MAX_GENERATED_NAME_LENGTH - append])
                out[f"{cut}-{_digits(digits)}-{GENERATED_SUFFIX}"] = None
            else:
                out[f"{jobs.regex}{rjob}-{DIGIT}+-{GENERATED_SUFFIX}"] = None
    return list(out)


def pytorchjob_pod_regex(jobs: JobNames) -> str:
    """Pods of the given PyTorchJobs: `<job>-worker-<index>` (training-operator v1.9,
    pkg/controller.v1/common/pod.go createNewPod: `GenGeneralName(job.Name, rt, index)` with rt the
    lower-cased replica type; pkg/core/utils.go GenGeneralName joins them with '-'). Never cut:
    api.resource.MAX_NAME_LENGTH keeps the longest within 63 characters."""
    return "|".join(_pytorchjob_pods(jobs))


def trainjob_pod_regex(jobs: JobNames) -> str:
    """Pods of the given TrainJobs' trainer, `<jobset>-node-0-<index>-<5 random>`:
    - Trainer names the JobSet after the TrainJob, whose trainer replicated job is `node` with one
      replica (torch_distributed_runtime.yaml; PET_MASTER_ADDR `<job>-node-0-0.<job>` relies on it);
    - JobSet names its Jobs `<jobset>-<replicatedJob>-<jobIndex>` (jobset v0.12
      pkg/controllers/jobset_controller.go constructJob, placement.GenJobName);
    - the Job controller gives an Indexed Job's pods generateName `<job>-<index>-`, cutting the job
      name so that the prefix is at most MAX_GENERATED_NAME_LENGTH (kubernetes
      pkg/controller/job/indexed_job_utils.go podGenerateNameWithIndex, since v1.22), and the API
      server appends 5 random characters (GENERATED_SUFFIX). A long fine-tune name is cut, so each
      (job name length, index width) whose prefix is cut gets an alternative of its own."""
    return "|".join(_trainjob_pods(jobs))


def _either_backend(jobs: JobNames) -> str:
    """Both backends' pod names, the shared start written once."""
    alternatives = [*_pytorchjob_pods(jobs), *_trainjob_pods(jobs)]
    if not all(alt.startswith(jobs.literal) for alt in alternatives):  # a name cut inside the shared start
        return "|".join(alternatives)
    return f"{jobs.literal}(?:{'|'.join(alt[len(jobs.literal):] for alt in alternatives)})"


def pod_name_regex(owner: Owner) -> str:
    """Every trainer pod of every attempt of this incarnation, on either backend (see the module)."""
    return _either_backend(attempt_jobs(owner))


def job_pod_regex(job_name: str) -> str:
    """The trainer pods of one attempt's job (either backend: the name says which job, not which kind)."""
    return _either_backend(one_job(job_name))


def finetune_pod_selector(owner: Owner) -> str:
    """PromQL label matchers for every trainer pod of every attempt of this incarnation of the
    fine-tune, on either backend (`pod_name_regex`)."""
    return f'namespace="{owner.namespace}", pod=~"{pod_name_regex(owner)}"'


def job_pod_selector(namespace: str, job_name: str) -> str:
    """PromQL label matchers for the trainer pods of one attempt's job."""
    return f'namespace="{namespace}", pod=~"{job_pod_regex(job_name)}"'


def _metadata(owner: Owner, spec: LlamaFineTuneSpec, name: str) -> Obj:
    """Monitoring objects carry the scrape-selector labels so the Prometheus instance selects them."""
    return {"name": name, "namespace": owner.namespace,
            "labels": {**owner.labels("monitoring"), **spec.monitoring.dcgm.scrape_selector}}


def _keep_container(name: str) -> Obj:
    """A relabeling that keeps only the trainer container's targets (a sidecar of podTemplateOverrides
    may declare ports too)."""
    return {"sourceLabels": ["__meta_kubernetes_pod_container_name"], "regex": name, "action": "keep"}


def pod_metrics_endpoints(spec: LlamaFineTuneSpec) -> list[Obj]:
    """One endpoint per backend (see the module): each finds targets only in its backend's pods."""
    common = {"path": "/metrics", "interval": "15s"}
    return [
        {"port": METRICS_PORT_NAME, **common, "relabelings": [_keep_container(PYTORCHJOB_CONTAINER)]},
        {"portNumber": trainjob.MASTER_PORT, **common, "relabelings": [
            _keep_container(TRAINJOB_CONTAINER),
            # `host:29500` (net.JoinHostPort, so an IPv6 host keeps its brackets) -> `host:<metricsPort>`
            {"sourceLabels": ["__address__"], "regex": "(.+):[0-9]+", "targetLabel": "__address__",
             "replacement": f"${{1}}:{spec.monitoring.metrics_port}", "action": "replace"},
        ]},
    ]


def pod_monitor(owner: Owner, spec: LlamaFineTuneSpec) -> Obj:
    """monitoring.coreos.com/v1 PodMonitor scraping the trainer's metrics port on every worker of
    either backend; the selector's labels reach the pods of both (desired.pod_template's labels, which
    trainjob.train_job carries into the runtimePatch's pod metadata)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _metadata(owner, spec, f"{owner.name}-trainer"),
        "spec": {
            "selector": {"matchLabels": {"llamaft.io/finetune": owner.name, "app.kubernetes.io/component": "trainer"}},
            "podMetricsEndpoints": pod_metrics_endpoints(spec),
        },
    }


def alert_rules(owner: Owner) -> list[Obj]:
    """The job's alerts, as Prometheus rule entries (also what `promtool test rules` exercises)."""
    sel = finetune_pod_selector(owner)
    labels = {"finetune": owner.name, "namespace": owner.namespace}
    xids = "|".join(str(x) for x in HARDWARE_XIDS)
    containers = "|".join(TRAINER_CONTAINERS)
    return [
        {
            "alert": "LlamaFineTuneGPUXidError",
            "expr": f'max by (namespace, pod, gpu, Hostname) (DCGM_FI_DEV_XID_ERRORS{{{sel}, err_code=~"{xids}"}}) > 0',
            "for": "0m",
            "labels": {**labels, "severity": "critical"},
            "annotations": {
                "summary": "GPU {{ $labels.gpu }} of {{ $labels.pod }} reported hardware XID {{ $value }}",
                "description": "A hardware XID (e.g. 79: GPU fell off the bus, 48/94/95: ECC errors, 74: NVLink) "
                "usually needs the node drained and the GPU checked; the run resumes from its latest checkpoint.",
            },
        },
        {
            "alert": "LlamaFineTuneLowGPUUtilisation",
            "expr": f"avg by (namespace) (DCGM_FI_DEV_GPU_UTIL{{{sel}}}) < {LOW_UTILISATION_PERCENT}",
            "for": "10m",
            "labels": {**labels, "severity": "warning"},
            "annotations": {
                "summary": f"{owner.name}: GPUs below {LOW_UTILISATION_PERCENT}% busy for 10 minutes while running",
                "description": "Data loading, a straggler node or a hung collective (NCCL timeout) is starving the GPUs.",
            },
        },
        {
            "alert": "LlamaFineTuneNoProgress",
            "expr": f"time() - max(llamaft_train_last_progress_timestamp_seconds{{{sel}}}) > {NO_PROGRESS_MINUTES * 60}",
            "for": "0m",
            "labels": {**labels, "severity": "warning"},
            "annotations": {
                "summary": f"{owner.name}: no optimizer step for {NO_PROGRESS_MINUTES} minutes",
                "description": "The trainer is alive but not stepping: a hung collective, a deadlocked data loader or a "
                "checkpoint write that does not finish.",
            },
        },
        {
            "alert": "LlamaFineTuneRestarting",
            "expr": f'increase(kube_pod_container_status_restarts_total{{{sel}, container=~"{containers}"}}[15m]) > 0',
            "for": "0m",
            "labels": {**labels, "severity": "warning"},
            "annotations": {
                "summary": "{{ $labels.pod }} restarted in the last 15 minutes",
                "description": "The worker group restarts from the latest checkpoint; repeated restarts use up maxRestarts.",
            },
        },
    ]


def prometheus_rule(owner: Owner, spec: LlamaFineTuneSpec) -> Obj:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": _metadata(owner, spec, f"{owner.name}-alerts"),
        "spec": {"groups": [{"name": f"llamaft.{owner.namespace}.{owner.name}", "rules": alert_rules(owner)}]},
    }


def _panel(index: int, title: str, expr: str, unit: str, legend: str) -> Obj:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": title,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [{"refId": "A", "expr": expr, "legendFormat": legend}],
    }


def dashboard(owner: Owner) -> Obj:
    """The Grafana dashboard model: DCGM panels beside the trainer's loss, tokens/s, MFU, memory."""
    sel = finetune_pod_selector(owner)
    gpu = "{{pod}} GPU {{gpu}}"
    panels = [
        ("Training loss", f"max(llamaft_train_loss{{{sel}}})", "none", "loss"),
        ("Tokens per second (job)", f"max(llamaft_train_tokens_per_second{{{sel}}})", "short", "tokens/s"),
        ("MFU", f"max(llamaft_train_mfu{{{sel}}})", "percentunit", "MFU"),
        ("Peak memory (rank 0 of each worker)", f"llamaft_train_peak_memory_bytes{{{sel}}}", "bytes", "{{pod}}"),
        ("GPU utilisation", f"DCGM_FI_DEV_GPU_UTIL{{{sel}}}", "percent", gpu),
        ("Memory copy utilisation", f"DCGM_FI_DEV_MEM_COPY_UTIL{{{sel}}}", "percent", gpu),
        ("XID errors (last XID)", f"DCGM_FI_DEV_XID_ERRORS{{{sel}}}", "none", gpu),
        ("SM clock", f"DCGM_FI_DEV_SM_CLOCK{{{sel}}}", "hertz", gpu),
        ("GPU temperature", f"DCGM_FI_DEV_GPU_TEMP{{{sel}}}", "celsius", gpu),
        ("Power usage", f"DCGM_FI_DEV_POWER_USAGE{{{sel}}}", "watt", gpu),
    ]
    return {
        "uid": f"llamaft-{owner.namespace}-{owner.name}"[:40],
        "title": f"llamaft / {owner.namespace} / {owner.name}",
        "tags": ["llamaft", "fsdp", "dcgm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"}]},
        "panels": [_panel(i, *p) for i, p in enumerate(panels)],
    }


DEFAULT_DASHBOARD_LABELS = {"grafana_dashboard": "1"}


def dashboard_config_map(owner: Owner, sidecar_labels: dict[str, str] | None = None) -> Obj:
    """Loaded by Grafana's dashboard sidecar, which picks up ConfigMaps with its label
    (kube-prometheus-stack: grafana_dashboard=1; the chart's grafana.dashboardLabels)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"{owner.name}-dashboard",
            "namespace": owner.namespace,
            "labels": {**owner.labels("monitoring"), **(sidecar_labels or DEFAULT_DASHBOARD_LABELS)},
        },
        # Compact: json.dumps with indent runs the pure-Python encoder (0.28 vs 0.06 ms here), and
        # this is rendered on every apply of every fine-tune (Grafana does not care).
        "data": {f"llamaft-{owner.name}.json": json.dumps(dashboard(owner), sort_keys=True, separators=(",", ":"))},
    }


def monitoring_objects(owner: Owner, spec: LlamaFineTuneSpec, dashboard_labels: dict[str, str] | None = None) -> list[Obj]:
    """What the spec's monitoring section asks for (the trainer PodMonitor is always wanted)."""
    objs = [pod_monitor(owner, spec)]
    if spec.monitoring.dcgm.enabled:
        objs.append(prometheus_rule(owner, spec))
        if spec.monitoring.dcgm.dashboard:
            objs.append(dashboard_config_map(owner, dashboard_labels))
    return objs
