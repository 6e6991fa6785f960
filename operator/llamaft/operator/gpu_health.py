"""GPU health from Prometheus: the job's XID errors and utilisation -> a GPUHealthy condition.

`assess` is pure; `query` is the one HTTP call (Prometheus' /api/v1/query).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llamaft.operator.http import HttpClient
from llamaft.render.monitoring import (
    HARDWARE_XIDS,
    LOW_UTILISATION_PERCENT,
    finetune_pod_selector,
    job_pod_selector,
)
from llamaft.render.naming import Owner

XID_MEANINGS = {
    13: "graphics engine exception (usually an application bug, e.g. an out-of-range access)",
    31: "GPU memory page fault (usually an application bug)",
    43: "GPU stopped processing (the application hit a fault)",
    48: "double-bit ECC error: the GPU needs a reset; drain the node",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed: replace the GPU",
    74: "NVLink error: check the links and the node",
    79: "GPU has fallen off the bus: drain the node and check the GPU",
    92: "high single-bit ECC error rate",
    94: "contained ECC error: restart the affected application",
    95: "uncontained ECC error: drain the node and reset the GPU",
    119: "GSP RPC timeout: reset the GPU",
    120: "GSP error: reset the GPU",
}


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Health:
    healthy: bool
    reason: str
    message: str
    nodes: tuple[str, ...] = ()
    """Hosts of the GPUs with a hardware XID (dcgm-exporter's `Hostname` label)."""


def query(url: str, expr: str, http: HttpClient | None = None) -> list[Sample]:
    """An instant query (HttpError when Prometheus cannot be reached or refuses it)."""
    body: dict[str, Any] = (http or HttpClient()).get_json(f"{url.rstrip('/')}/api/v1/query", fields={"query": expr})
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus query failed: {body.get('error')}")
    return [Sample(dict(r["metric"]), float(r["value"][1])) for r in body["data"]["result"]]


def queries(owner: Owner, job_name: str | None = None) -> tuple[str, str]:
    """(XID query, utilisation query) for the fine-tune's pods, or only the given attempt's: an
    XID on an earlier attempt's GPU already ended that attempt and must not end the next one."""
    sel = finetune_pod_selector(owner) if job_name is None else job_pod_selector(owner.namespace, job_name)
    xids = "|".join(str(x) for x in HARDWARE_XIDS)
    return (
        f'max by (pod, gpu, Hostname, err_code) (DCGM_FI_DEV_XID_ERRORS{{{sel}, err_code=~"{xids}"}}) > 0',
        f"avg(avg_over_time(DCGM_FI_DEV_GPU_UTIL{{{sel}}}[10m]))",
    )


def assess(xid: list[Sample], utilisation: list[Sample], running: bool) -> Health:
    """Hardware XIDs first (they need an operator's hands), then idle GPUs while running."""
    if xid:
        parts = []
        for s in sorted(xid, key=lambda s: (s.labels.get("pod", ""), s.labels.get("gpu", ""))):
            code = int(s.value)
            where = f"pod {s.labels.get('pod', '?')} GPU {s.labels.get('gpu', '?')}"
            if s.labels.get("Hostname"):
                where += f" on {s.labels['Hostname']}"
            parts.append(f"XID {code} on {where}: {XID_MEANINGS.get(code, 'see NVIDIA XID catalogue')}")
        hosts = tuple(sorted({s.labels["Hostname"] for s in xid if s.labels.get("Hostname")}))
        return Health(False, "XidError", "; ".join(parts), hosts)
    if running and utilisation and utilisation[0].value < LOW_UTILISATION_PERCENT:
        return Health(False, "LowUtilization",
                      f"GPUs averaged {utilisation[0].value:.0f}% busy over 10 minutes while running: "
                      "data loading, a straggler or a hung collective (NCCL timeout)")
    return Health(True, "Healthy", "no hardware XID errors; GPU utilisation normal" if utilisation else "no hardware XID errors")
