"""spec -> monitoring objects (pure): a PodMonitor for the trainer's /metrics, a PrometheusRule with
the job's alerts, and a Grafana dashboard ConfigMap, all filtered to this fine-tune's pods.

Pod names of every attempt match `<name>-<attempt>-worker-<index>`, so queries and alerts follow
the run across resubmissions. DCGM series carry `namespace` and `pod` labels when dcgm-exporter runs
with DCGM_EXPORTER_KUBERNETES=true and is scraped with honorLabels (the chart's ServiceMonitor).
"""

from __future__ import annotations

import json
from typing import Any

from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.render.naming import Owner

Obj = dict[str, Any]

# Hardware XIDs that mean the GPU or its links need attention (NVIDIA's XID catalogue).
HARDWARE_XIDS = (48, 63, 64, 74, 79, 92, 94, 95, 119, 120)
NO_PROGRESS_MINUTES = 15
LOW_UTILISATION_PERCENT = 20


def pod_selector(owner: Owner) -> str:
    """PromQL label matchers for every worker pod of every attempt of this incarnation of the
    fine-tune (pods are `<job>-worker-<i>`, jobs `<name>-<uid token>-<attempt>`)."""
    prefix = f"{owner.name}-{owner.token}" if owner.token else owner.name
    return f'namespace="{owner.namespace}", pod=~"{prefix}-[0-9]+-worker-[0-9]+"'


def _metadata(owner: Owner, spec: LlamaFineTuneSpec, name: str) -> Obj:
    """Monitoring objects carry the scrape-selector labels so the Prometheus instance selects them."""
    return {"name": name, "namespace": owner.namespace,
            "labels": {**owner.labels("monitoring"), **spec.monitoring.dcgm.scrape_selector}}


def pod_monitor(owner: Owner, spec: LlamaFineTuneSpec) -> Obj:
    """monitoring.coreos.com/v1 PodMonitor scraping the trainer's metrics port on every worker."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _metadata(owner, spec, f"{owner.name}-trainer"),
        "spec": {
            "selector": {"matchLabels": {"llamaft.io/finetune": owner.name, "app.kubernetes.io/component": "trainer"}},
            "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}],
        },
    }


def alert_rules(owner: Owner) -> list[Obj]:
    """The job's alerts, as Prometheus rule entries (also what `promtool test rules` exercises)."""
    sel = pod_selector(owner)
    labels = {"finetune": owner.name, "namespace": owner.namespace}
    xids = "|".join(str(x) for x in HARDWARE_XIDS)
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
            "expr": f'increase(kube_pod_container_status_restarts_total{{{sel}, container=~"pytorch|node"}}[15m]) > 0',
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
    sel = pod_selector(owner)
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
