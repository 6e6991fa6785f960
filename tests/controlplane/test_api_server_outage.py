"""An API server outage as clusters have one: the kube-apiserver process stopped and a new one
started on the same etcd and port. The operator (installed by the chart, as its ServiceAccount)
rides it out: its watches come back and a fine-tune created after the outage gets its job.

A restarting API server answers before it is ready, and until its authorizer's informers have
synced it refuses every ServiceAccount with 403 (kube-apiserver serves requests from the moment
it listens; /readyz waits for the sync, but a client that connects directly does not ask it).
The emulator never did this. The operator retries them (kopf's request retries, the lifecycle's
next step); no 403 may come before the outage or after the first fine-tune created after it got
its job (then the authorizer is synced)."""

from __future__ import annotations

import time
from pathlib import Path

from kubernetes import config

from tests.controlplane.cluster import ControlPlane
from tests.controlplane.test_chart_install import assert_never_forbidden, install_chart
from tests.operator.conftest import Cluster, tiny_spec, wait_for

OUTAGE_S = 10.0
"""Longer than kopf's watch timeouts are short: the operator sees its streams fail and reconnects."""


def test_the_operator_rides_out_an_api_server_restart(control_plane: ControlPlane, namespace: str, tmp_path: Path) -> None:
    operator, _ = install_chart(control_plane, namespace, tmp_path / "operator.log")
    admin = config.new_client_from_config(str(control_plane.admin_kubeconfig))
    cluster = Cluster(admin, namespace)
    operator.start()
    try:
        cluster.create("before", tiny_spec())
        wait_for("the first fine-tune's job", lambda: cluster.attempt_job("before", 1), timeout=60)

        before_outage = len(operator.logs())
        control_plane.stop_apiserver()
        time.sleep(OUTAGE_S)
        assert operator.proc is not None and operator.proc.poll() is None, "the operator exited during the outage"
        control_plane.start_apiserver()
        admin = config.new_client_from_config(str(control_plane.admin_kubeconfig))
        cluster = Cluster(admin, namespace)

        cluster.create("after", tiny_spec())
        job = wait_for("the job of the fine-tune created after the outage", lambda: cluster.attempt_job("after", 1),
                       timeout=90)
        recovered = len(operator.logs())
        assert job["metadata"]["ownerReferences"][0]["name"] == "after"
        assert cluster.attempt_job("before", 1) is not None, "the first fine-tune's job is gone"
        assert cluster.attempt_job("before", 2) is None, "the outage started a second attempt of the first fine-tune"
        time.sleep(2)  # a sync interval or two of the operator's, with the authorizer synced
    finally:
        operator.stop()
    log = operator.logs()
    assert_never_forbidden(log[:before_outage])
    assert_never_forbidden(log[recovered:])
