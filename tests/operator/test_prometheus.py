"""Against a real Prometheus (Debian's package, on loopback) scraping the real trainer /metrics and
an endpoint replaying dcgm-exporter's text format for the job's pods: every dashboard query returns
data, and the operator turns a hardware XID into GPUHealthy=False with an explanation."""

from __future__ import annotations

import subprocess
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from llamaft.operator import gpu_health
from llamaft.render import monitoring
from llamaft.render.naming import Owner

from tests.conftest import need_binary
from tests.operator.conftest import Cluster, Operator, free_port, tiny_spec, wait_for
from tests.tiers import starts_processes

pytestmark = pytest.mark.slow
NAME, POD = "gpuh", "gpuh-1-worker-0"
IDLE_POD = "idle-1-worker-0"  # a second job whose GPUs are healthy but starved
GPU_LABELS = 'UUID="GPU-8f1c",device="nvidia{gpu}",modelName="NVIDIA H100 80GB HBM3",Hostname="node-7",container="pytorch",namespace="default",pod="{pod}"'


def dcgm_exposition(pod_name: str = POD) -> str:
    """dcgm-exporter's text format (DCGM_EXPORTER_KUBERNETES=true adds pod/namespace/container)."""
    lines = []
    values = {"DCGM_FI_DEV_GPU_UTIL": 7, "DCGM_FI_DEV_MEM_COPY_UTIL": 3, "DCGM_FI_DEV_SM_CLOCK": 1980,
              "DCGM_FI_DEV_GPU_TEMP": 61, "DCGM_FI_DEV_POWER_USAGE": 402.5}
    for metric, value in values.items():
        lines += [f"# HELP {metric} {metric}", f"# TYPE {metric} gauge"]
        lines += [f'{metric}{{gpu="{g}",{GPU_LABELS.format(gpu=g, pod=pod)}}} {value}' for g in range(4) for pod in (pod_name, IDLE_POD)]
    lines += ["# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.", "# TYPE DCGM_FI_DEV_XID_ERRORS gauge"]
    lines += [f'DCGM_FI_DEV_XID_ERRORS{{gpu="{g}",{GPU_LABELS.format(gpu=g, pod=pod)},err_code="{c}",err_msg="{m}"}} {c}'
              for pod, g, c, m in ((pod_name, 0, 0, "No Error"), (pod_name, 3, 79, "GPU has fallen off the bus"), (IDLE_POD, 0, 0, "No Error"))]
    return "\n".join(lines) + "\n"


EXPOSITION = {"text": ""}
"""What the replayed dcgm-exporter serves now (a test points its series at a real job's pod)."""


def serve() -> tuple[ThreadingHTTPServer, int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = EXPOSITION["text"].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, port


@pytest.fixture(scope="module")
@starts_processes
def prometheus() -> Iterator[str]:
    binary = need_binary("prometheus", "prometheus")
    from llamaft_trainer.report.metrics import ProgressPublisher

    progress = ProgressPublisher()
    progress.total_steps.set(100)
    progress.record_step({"step": 7, "epoch": 0, "loss": 2.5, "lr": 1e-5, "grad_norm": 1.0, "tokens_per_second": 900.0,
                          "tokens_per_second_per_device": 450.0, "mfu": 0.38, "peak_memory_bytes": 2**30, "tokens": 64,
                          "eta_seconds": 100})
    trainer_port = free_port()
    trainer = progress.serve(trainer_port)
    EXPOSITION["text"] = dcgm_exposition()
    dcgm, dcgm_port = serve()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                # As the chart's ServiceMonitor: honorLabels keeps dcgm-exporter's pod/namespace labels.
                {"job_name": "dcgm-exporter", "honor_labels": True, "static_configs": [{"targets": [f"127.0.0.1:{dcgm_port}"]}]},
                # As the PodMonitor: the target's pod and namespace become labels.
                {"job_name": "trainer", "static_configs": [{"targets": [f"127.0.0.1:{trainer_port}"],
                                                            "labels": {"namespace": "default", "pod": POD}}]},
            ],
        }))
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp}/data",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for("prometheus ready", lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=1).status == 200)
            wait_for("both targets scraped", lambda: len(gpu_health.query(url, "up == 1")) == 2, timeout=30)
            wait_for("series", lambda: gpu_health.query(url, "DCGM_FI_DEV_XID_ERRORS") and gpu_health.query(url, "llamaft_train_loss"))
            yield url
        finally:
            proc.terminate()
            proc.wait(10)
            trainer.shutdown()
            dcgm.shutdown()


def test_every_dashboard_query_returns_data(prometheus: str) -> None:
    owner = Owner(NAME, "default")
    for panel in monitoring.dashboard(owner)["panels"]:
        for target in panel["targets"]:
            assert gpu_health.query(prometheus, target["expr"]), f"{panel['title']}: {target['expr']}"
    other = Owner("someone-else", "default")
    assert not gpu_health.query(prometheus, monitoring.dashboard(other)["panels"][4]["targets"][0]["expr"])


def test_gpu_health_queries_find_the_xid(prometheus: str) -> None:
    xid, util = gpu_health.queries(Owner(NAME, "default"))
    health = gpu_health.assess(gpu_health.query(prometheus, xid), gpu_health.query(prometheus, util), running=True)
    assert not health.healthy and health.reason == "XidError"
    assert health.message == "XID 79 on pod gpuh-1-worker-0 GPU 3 on node-7: GPU has fallen off the bus: drain the node and check the GPU"


def test_low_utilisation_without_xid_through_prometheus(prometheus: str) -> None:
    xid, util = gpu_health.queries(Owner("idle", "default"))
    health = gpu_health.assess(gpu_health.query(prometheus, xid), gpu_health.query(prometheus, util), running=True)
    assert (health.healthy, health.reason) == (False, "LowUtilization") and "7% busy" in health.message


def test_assess_low_utilisation_and_healthy() -> None:
    low = gpu_health.assess([], [gpu_health.Sample({}, 7.0)], running=True)
    assert (low.healthy, low.reason) == (False, "LowUtilization") and "7% busy" in low.message
    assert gpu_health.assess([], [gpu_health.Sample({}, 7.0)], running=False).healthy
    assert gpu_health.assess([], [gpu_health.Sample({}, 85.0)], running=True).reason == "Healthy"


def test_a_hardware_xid_fails_the_attempt_and_the_next_avoids_the_node(prometheus: str, cluster: Cluster, kubeconfig: Path,
                                                                       tmp_path: Path) -> None:
    op = Operator(kubeconfig, tmp_path / "operator.log", LLAMAFT_PROMETHEUS_URL=prometheus).start()
    try:
        cluster.create(NAME, tiny_spec())
        job = wait_for("job", lambda: cluster.attempt_job(NAME, 1))["metadata"]["name"]
        pod = f"{job}-worker-0"
        EXPOSITION["text"] = dcgm_exposition(pod)  # the replayed exporter now reports the XID on this job's GPU
        wait_for("series of the job's pod", lambda: gpu_health.query(prometheus, f'DCGM_FI_DEV_XID_ERRORS{{pod="{pod}"}}'))
        cluster.set_job_status(job, [("Created", "PyTorchJobCreated", "c"), ("Running", "PyTorchJobRunning", "r")])
        condition = wait_for("GPUHealthy", lambda: next((c for c in cluster.status(NAME).get("conditions", [])
                                                         if c["type"] == "GPUHealthy"), None), timeout=40)
        assert condition["status"] == "False" and condition["reason"] == "XidError"
        assert f"XID 79 on pod {pod} GPU 3 on node-7: GPU has fallen off the bus" in condition["message"]
        status = wait_for("attempt 2", lambda: (s := cluster.status(NAME)).get("attempt") == 2 and s)
        assert status["failures"][0]["reason"] == "GPUXid" and status["excludedNodes"] == ["node-7"]
        second = wait_for("job 2", lambda: cluster.attempt_job(NAME, 2))
        affinity = second["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["affinity"]
        assert affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
            "matchExpressions"][0] == {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-7"]}
        cluster.wait_reasons(NAME, "XidError", "GPUXid", "NodeExcluded")
    finally:
        op.stop()
