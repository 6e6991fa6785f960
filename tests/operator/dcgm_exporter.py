"""A real Prometheus scraping a replayed dcgm-exporter whose exposition a test sets, and the XID a
GPU of a pod reports there: the GPU-health evidence (llamaft.operator.gpu_health) on clusters
whose pods have no GPUs. A pytest fixture (`dcgm`, module scope) for the modules that import it."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import yaml
from llamaft.operator import gpu_health
from llamaft_trainer.process.local_etcd import free_port

from tests.conftest import need_binary
from tests.operator.conftest import wait_for
from tests.tiers import starts_processes

T = TypeVar("T")


@pytest.fixture(scope="module")
@starts_processes
def dcgm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """(Prometheus URL, {"text": exposition}): the exposition starts empty (no GPU series at all,
    as for CPU pods) and a test sets it (`xid_on`)."""
    from tests.operator.test_prometheus import EXPOSITION, serve

    binary = need_binary("prometheus", "prometheus")
    EXPOSITION["text"] = ""
    server, dcgm_port = serve()
    tmp = tmp_path_factory.mktemp("prometheus")
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": "dcgm-exporter", "honor_labels": True, "static_configs": [{"targets": [f"127.0.0.1:{dcgm_port}"]}]}]}))
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp}/data",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("prometheus scraping", lambda: gpu_health.query(url, "up == 1"), timeout=30)
        yield url, EXPOSITION
    finally:
        proc.terminate()
        proc.wait(10)
        server.shutdown()


def xid_on(exposition: dict[str, str], pod: str, node: str, until: Callable[[], T], namespace: str = "default") -> T:
    """dcgm-exporter reports XID 79 ("fallen off the bus") on a GPU of `pod` (on `node`, in
    `namespace`) until `until` returns; then no GPU series again."""
    labels = f'gpu="0",UUID="GPU-1",Hostname="{node}",container="pytorch",namespace="{namespace}",pod="{pod}"'
    exposition["text"] = ("# TYPE DCGM_FI_DEV_XID_ERRORS gauge\n"
                          f'DCGM_FI_DEV_XID_ERRORS{{{labels},err_code="79",err_msg="GPU has fallen off the bus"}} 79\n')
    try:
        return until()
    finally:
        exposition["text"] = ""


__all__ = ["dcgm", "xid_on"]
