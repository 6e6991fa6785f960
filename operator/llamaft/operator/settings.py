"""Operator settings from the environment (the Helm chart sets them)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from llamaft.render.desired import ETCD_IMAGE


@dataclass(frozen=True)
class OperatorSettings:
    sync_interval_s: float = 15.0
    """How often an active fine-tune's progress is refreshed from its leader's /progress. Failures
    do not wait for it: events of the job and its pods wake the lifecycle at once."""
    retry_backoff_s: float = 10.0
    """The first retry of a run goes at once; the second waits this long, doubling per retry."""
    etcd_image: str = ETCD_IMAGE
    rendezvous_address_override: str | None = None
    """host:port the operator uses to reach every etcd (when it runs outside the cluster, e.g.
    through a port-forward); None: the in-cluster Service address."""
    progress_timeout_s: float = 2.0
    dashboard_labels: tuple[tuple[str, str], ...] = (("grafana_dashboard", "1"),)
    """Labels that make Grafana's dashboard sidecar load a ConfigMap (kube-prometheus-stack's default)."""
    prometheus_url: str | None = None
    """When set, running jobs get a GPUHealthy condition from DCGM metrics in this Prometheus."""
    metrics_port: int = 8080
    workers: int = 16
    """Threads that run lifecycle steps (each step is mostly blocking API round trips). The loop's
    default executor would give min(32, cores + 4): 6 on 2 cores, which queued a burst of creates."""

    @classmethod
    def from_env(cls) -> OperatorSettings:
        env = os.environ
        return cls(
            sync_interval_s=float(env.get("LLAMAFT_SYNC_INTERVAL", cls.sync_interval_s)),
            retry_backoff_s=float(env.get("LLAMAFT_RETRY_BACKOFF_SECONDS", cls.retry_backoff_s)),
            etcd_image=env.get("LLAMAFT_ETCD_IMAGE", ETCD_IMAGE),
            rendezvous_address_override=env.get("LLAMAFT_RENDEZVOUS_ADDRESS_OVERRIDE") or None,
            progress_timeout_s=float(env.get("LLAMAFT_PROGRESS_TIMEOUT", cls.progress_timeout_s)),
            prometheus_url=env.get("LLAMAFT_PROMETHEUS_URL") or None,
            dashboard_labels=tuple(sorted(json.loads(env["LLAMAFT_DASHBOARD_LABELS"]).items()))
            if env.get("LLAMAFT_DASHBOARD_LABELS") else cls.dashboard_labels,
            metrics_port=int(env.get("LLAMAFT_OPERATOR_METRICS_PORT", cls.metrics_port)),
            workers=max(1, int(env.get("LLAMAFT_WORKERS", cls.workers))),
        )
