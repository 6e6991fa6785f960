"""End-to-end on a real cluster: runs only when KUBECONFIG points at one (skipped otherwise).

Needs the Kubeflow training operator (PyTorchJob CRD) installed; the TrainJob case needs Kubeflow
Trainer v2.3 with its `torch-distributed` ClusterTrainingRuntime (skipped otherwise). It installs llamaft's CRD, runs
`llamaft operator` from this checkout against the cluster, applies the tiny example in a fresh
namespace and checks the PyTorchJob, status and clean-up. With LLAMAFT_E2E_IMAGE set to a trainer
image that contains the tiny model at /opt/llamaft/.local-assets/tiny-llama (build it with
`llamaft make-tiny-model` into the image), it also waits for the fine-tune to succeed.

    KUBECONFIG=~/.kube/config LLAMAFT_E2E_IMAGE=registry/llamaft-trainer:dev .venv/bin/pytest tests/e2e
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def _cluster_or_skip() -> Any:
    if not os.environ.get("KUBECONFIG"):
        pytest.skip("e2e: set KUBECONFIG to a real cluster to run")
    from kubernetes import client, config

    config.load_kube_config()
    api = client.ApiClient()
    try:
        client.VersionApi(api).get_code()
        client.ApiextensionsV1Api(api).read_custom_resource_definition("pytorchjobs.kubeflow.org")
    except Exception as exc:  # unreachable cluster or no training operator
        pytest.skip(f"e2e: cluster not usable ({exc}); install the Kubeflow training operator")
    return api


@pytest.fixture(scope="module")
def api() -> Any:
    return _cluster_or_skip()


@pytest.fixture(scope="module")
def namespace(api: Any) -> Iterator[str]:
    from kubernetes import client

    name = f"llamaft-e2e-{uuid.uuid4().hex[:6]}"
    subprocess.run(["kubectl", "apply", "-f", str(REPO / "crds")], check=True)
    client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
    yield name
    client.CoreV1Api(api).delete_namespace(name)


@pytest.fixture(scope="module")
def operator(namespace: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[bytes]]:
    log = (tmp_path_factory.mktemp("e2e") / "operator.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "llamaft.cli", "operator", "--standalone", "--namespace", namespace],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    yield proc
    proc.terminate()
    proc.wait(30)


def _wait(fn: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except Exception:
            pass
        time.sleep(2)
    raise AssertionError("timed out")


def tiny_body() -> tuple[dict[str, Any], str | None]:
    """examples/tiny.yaml, pointed at the e2e image's model and data when LLAMAFT_E2E_IMAGE is set."""
    body = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    image = os.environ.get("LLAMAFT_E2E_IMAGE")
    if image:
        body["spec"]["cluster"]["image"] = image
        body["spec"]["model"]["source"] = "/opt/llamaft/.local-assets/tiny-llama"
        body["spec"]["dataset"]["source"] = "/opt/llamaft/examples/data/samsum-tiny.jsonl"
        body["spec"]["checkpointing"]["directory"] = "/tmp/checkpoints"
    return body, image


def test_tiny_example_on_a_cluster(api: Any, namespace: str, operator: subprocess.Popen[bytes]) -> None:
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    body, image = tiny_body()
    created = custom.create_namespaced_custom_object("llamaft.io", "v1alpha1", namespace, "llamafinetunes", body)
    job_name = f"tiny-local-{created['metadata']['uid'].replace('-', '')[:4]}-1"  # naming.Owner.job_name
    job = _wait(lambda: custom.get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", job_name), 120)
    assert job["spec"]["elasticPolicy"]["rdzvId"].endswith("-1")
    status = _wait(lambda: (s := custom.get_namespaced_custom_object("llamaft.io", "v1alpha1", namespace, "llamafinetunes",
                                                                     "tiny-local").get("status", {})).get("jobName") and s, 60)
    assert status["phase"] in ("Creating", "Running", "Succeeded")
    if image:
        done = _wait(lambda: (s := custom.get_namespaced_custom_object("llamaft.io", "v1alpha1", namespace, "llamafinetunes",
                                                                       "tiny-local")["status"])["phase"] == "Succeeded" and s, 1200)
        assert done["progress"]["step"] == done["progress"]["totalSteps"]
    custom.delete_namespaced_custom_object("llamaft.io", "v1alpha1", namespace, "llamafinetunes", "tiny-local")
    _wait(lambda: not custom.list_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs")["items"], 120)




def test_tiny_example_as_a_trainjob(api: Any, namespace: str, operator: subprocess.Popen[bytes]) -> None:
    """backend: TrainJob on a cluster with Kubeflow Trainer v2: the TrainJob, its status and clean-up
    (and, with LLAMAFT_E2E_IMAGE, the whole run)."""
    from kubernetes import client

    custom = client.CustomObjectsApi(api)
    try:
        client.ApiextensionsV1Api(api).read_custom_resource_definition("trainjobs.trainer.kubeflow.org")
        custom.get_cluster_custom_object("trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes", "torch-distributed")
    except Exception as exc:
        pytest.skip(f"e2e: no Kubeflow Trainer v2 with the torch-distributed runtime ({exc})")
    body, image = tiny_body()
    body["metadata"]["name"] = "tiny-trainjob"
    body["spec"]["backend"] = "TrainJob"
    created = custom.create_namespaced_custom_object("llamaft.io", "v1alpha1", namespace, "llamafinetunes", body)
    job_name = f"tiny-trainjob-{created['metadata']['uid'].replace('-', '')[:4]}-1"  # naming.Owner.job_name
    job = _wait(lambda: custom.get_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", namespace, "trainjobs", job_name), 120)
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    status = _wait(lambda: (s := custom.get_namespaced_custom_object("llamaft.io", "v1alpha1", namespace, "llamafinetunes",
                                                                     "tiny-trainjob").get("status", {})).get("jobName") and s, 60)
    assert status["backend"] == "TrainJob" and status["phase"] in ("Creating", "Running", "Succeeded")
    if image:
        done = _wait(lambda: (s := custom.get_namespaced_custom_object("llamaft.io", "v1alpha1", namespace, "llamafinetunes",
                                                                       "tiny-trainjob")["status"])["phase"] == "Succeeded" and s, 1200)
        assert done["progress"]["step"] == done["progress"]["totalSteps"]
    custom.delete_namespaced_custom_object("llamaft.io", "v1alpha1", namespace, "llamafinetunes", "tiny-trainjob")
    _wait(lambda: not custom.list_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", namespace, "trainjobs")["items"], 120)
