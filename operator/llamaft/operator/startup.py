"""Start-up and shutdown: kopf's settings, the memo's shared state, the clients, the metrics
server, and validation warmed up before the first LlamaFineTune arrives."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import time
from typing import Any

import kopf

from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.status import Phase
from llamaft.operator import persistence
from llamaft.operator.http import HttpClient
from llamaft.operator.kube import Kube, throttle_credential_refresh
from llamaft.operator.operator_metrics import FINETUNES
from llamaft.operator.settings import OperatorSettings
from llamaft.operator.specs import cached_spec
from llamaft.operator.state import OperatorState, operator_state
from llamaft.planner import admission
from llamaft.render.admission import PLACEHOLDER_UID, checked_children
from llamaft.render.naming import LABEL_FINETUNE, Owner

CHILD_SELECTORS = {
    ("kubeflow.org", "v1", "pytorchjobs"): LABEL_FINETUNE,
    ("trainer.kubeflow.org", "v1alpha1", "trainjobs"): LABEL_FINETUNE,
    ("", "v1", "pods"): f"{LABEL_FINETUNE},app.kubernetes.io/component=trainer",
    ("", "v1", "configmaps"): LABEL_FINETUNE,
    ("", "v1", "services"): LABEL_FINETUNE,
    ("apps", "v1", "deployments"): LABEL_FINETUNE,
    ("monitoring.coreos.com", "v1", "podmonitors"): LABEL_FINETUNE,
    ("monitoring.coreos.com", "v1", "prometheusrules"): LABEL_FINETUNE,
}
"""Server-side label selectors of the children's watches (the handlers' `labels=` filters below
say the same, but kopf applies those in this process)."""
WARM_UP_SPEC = {"model": {"source": "meta-llama/Llama-2-7b-hf"}, "dataset": {"format": "samsum", "source": "knkarthick/samsum"}}

def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    logger = kwargs["logger"]
    persistence.configure(settings)  # kopf's records in annotations (the status schema is structural)
    settings.posting.level = logging.INFO
    # cel-python logs every evaluation step at DEBUG: far too costly (and noisy) for an operator.
    logging.getLogger("celpy").setLevel(logging.WARNING)
    settings.execution.max_workers = 16
    operator_settings = OperatorSettings.from_env()
    for phase in Phase:
        FINETUNES.labels(phase.value).set(0)
    # Lifecycle steps block on API round trips: a pool of their own, sized by the settings (the
    # loop's default executor has min(32, cores + 4) threads: 6 on 2 cores, which queued bursts).
    memo["operator"] = OperatorState(
        operator_settings, http=HttpClient(),
        executor=concurrent.futures.ThreadPoolExecutor(operator_settings.workers, thread_name_prefix="lifecycle"))
    # The handlers' `labels=` filters are client-side: without these, kopf would stream every pod
    # (cluster-wide) and every ConfigMap, Service and Deployment to this process only to drop them.
    # settings.watching.label_selectors is passed to the API as the watch's labelSelector.
    for child, selector in CHILD_SELECTORS.items():
        settings.watching.label_selectors[child] = selector
    warm_up(memo, logger)
    from prometheus_client import start_http_server

    try:
        start_http_server(operator_settings.metrics_port)
        logger.info(f"operator metrics on :{operator_settings.metrics_port}/metrics")
    except OSError as exc:
        logger.warning(f"metrics port {operator_settings.metrics_port} unavailable: {exc}")

def warm_up(memo: kopf.Memo, logger: Any) -> None:
    """Load now what the first validation would load (the CRD schema and its CEL programs, the
    Kubernetes and Kubeflow schemas the children are checked against, about 2 s of CPU), so that
    the first LlamaFineTunes after a start do not all wait for it."""
    started = time.perf_counter()
    try:
        spec = cached_spec(memo, WARM_UP_SPEC)
        if isinstance(spec, LlamaFineTuneSpec):
            checked_children(Owner("warm-up", "default", PLACEHOLDER_UID), spec)
            admission(spec)
    except Exception as exc:  # only a cost moved earlier: never a reason not to start
        logger.warning(f"warm-up failed (the first validation pays for it): {exc}")
    logger.info(f"validation warmed up in {time.perf_counter() - started:.1f} s")
    # What is loaded by now (modules, the schemas and CEL programs: most of the heap) lives as long
    # as the process: out of the collector's generations, a full collection in a burst of creates
    # no longer walks it every time (docs.python.org/3/library/gc.html#gc.freeze).
    gc.collect()
    gc.freeze()

def shutdown(memo: kopf.Memo, **_: Any) -> None:
    executor = operator_state(memo).executor if "operator" in memo else None
    if executor is not None:
        executor.shutdown(wait=False, cancel_futures=True)

def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf and the kubernetes client read the same credentials (in-cluster or KUBECONFIG); the
    client the handlers use is made here, once the credentials are loaded."""
    from kubernetes import config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call]
    throttle_credential_refresh()
    operator_state(memo).kube = Kube()
    # In a pod, kopf's connection is the client's in-cluster one (KUBERNETES_SERVICE_HOST/PORT, as
    # client-go's InClusterConfig reads it), not login_with_service_account's fixed
    # https://kubernetes.default.svc, which needs cluster DNS and a Service proxy where the client's
    # address does not: one API server address for kopf's watches and the handlers' requests.
    return kopf.login_with_kubeconfig(**kwargs) or kopf.login_via_client(**kwargs)
