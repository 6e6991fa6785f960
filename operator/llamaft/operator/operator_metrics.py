"""The operator's own Prometheus metrics (served on LLAMAFT_OPERATOR_METRICS_PORT; the trainer's are
llamaft_trainer/report/metrics.py)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("llamaft_operator_reconciles_total", "Handler runs by handler and result", ["handler", "result"])
RECONCILE_SECONDS = Histogram(
    "llamaft_operator_reconcile_seconds", "Handler latency", ["handler"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
FINETUNES = Gauge("llamaft_operator_finetunes", "LlamaFineTunes by phase", ["phase"])
RENDEZVOUS_RESETS = Counter("llamaft_operator_rendezvous_resets_total", "Rendezvous resets by outcome", ["outcome"])
RETRIES = Counter("llamaft_operator_retries_total", "Runs resubmitted after a recoverable failure", ["reason"])
