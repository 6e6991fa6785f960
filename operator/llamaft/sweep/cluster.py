"""The sizes of a sweep run on a cluster: one LlamaFineTune per size, created through the
Kubernetes API and run by the operator like any other fine-tune; their final `status.performance`
is the sweep's figures.

One after another by default: sizes that run at once compete for the same GPUs and network, and a
queue (Kueue) would admit them in its own order; `--at-once` creates them all (a cluster with room
for every size, or a queue that should decide). The runs stay on the cluster when the sweep ends
(their status is the record; `kubectl delete finetunes -l llamaft.io/sweep=<sweep>` removes them
with every child); none is created when any of their names is taken.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llamaft.api import resource
from llamaft.sweep.point import Point, from_performance
from llamaft.sweep.runs import SWEEP_LABEL, SizedRun, SweepError, SweepPlan

TERMINAL = ("Succeeded", "Failed")
_IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def connect(kubeconfig: str | None = None, context: str | None = None) -> tuple[Any, str]:
    """(ApiClient, the context's namespace): the kubeconfig (KUBECONFIG, ~/.kube/config), else the
    pod's service account when this runs in a cluster."""
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise SweepError([f"a sweep on a cluster needs the kubernetes client (pip install 'llamaft[sweep]'): {exc}; "
                          "or run the sizes here with --local"]) from exc
    # KUBECONFIG as it is now (the client reads it once, when it is imported); a list is merged.
    kubeconfig = kubeconfig or os.environ.get("KUBECONFIG") or None
    try:
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        chosen = next((c for c in contexts if c["name"] == context), None) if context else active
        if chosen is None:
            raise SweepError([f"--context: no context {context!r} in the kubeconfig; it has "
                              f"{', '.join(c['name'] for c in contexts)}"])
        api = config.new_client_from_config(config_file=kubeconfig, context=context)  # type: ignore[no-untyped-call]
        return api, str(chosen.get("context", {}).get("namespace") or "default")
    except SweepError:
        raise
    except Exception as kube_error:
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except Exception:
            raise SweepError([f"no cluster to run the sizes on ({type(kube_error).__name__}: {kube_error}): set "
                              "KUBECONFIG or pass --kubeconfig, or run them here with --local"]) from kube_error
        namespace = _IN_CLUSTER_NAMESPACE.read_text().strip() if _IN_CLUSTER_NAMESPACE.exists() else "default"
        return client.ApiClient(), namespace


class ClusterRuns:
    """The sweep's LlamaFineTunes in one namespace."""

    def __init__(self, api: Any, namespace: str, sweep: str) -> None:
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api)
        self.namespace, self.sweep = namespace, sweep

    def _args(self) -> tuple[str, str, str, str]:
        return resource.GROUP, resource.VERSION, self.namespace, resource.PLURAL

    def taken(self, names: list[str]) -> list[str]:
        """The names of `names` that exist already."""
        from kubernetes.client.exceptions import ApiException

        found = []
        for name in names:
            try:
                self.custom.get_namespaced_custom_object(*self._args(), name)
                found.append(name)
            except ApiException as exc:
                if exc.status != 404:
                    raise SweepError([f"cannot read LlamaFineTune {self.namespace}/{name}: {exc.status} {exc.reason}"]) from exc
        return found

    def create(self, run: SizedRun) -> None:
        from kubernetes.client.exceptions import ApiException

        body = {**run.body, "metadata": {**run.body["metadata"], "namespace": self.namespace}}
        try:
            self.custom.create_namespaced_custom_object(*self._args(), body)
        except ApiException as exc:
            raise SweepError([f"{run.name}: the API server refused it ({exc.status} {exc.reason}): {exc.body}"]) from exc

    def statuses(self) -> dict[str, dict[str, Any]]:
        """Every run of this sweep: name -> status."""
        items: Any = self.custom.list_namespaced_custom_object(*self._args(), label_selector=f"{SWEEP_LABEL}={self.sweep}")
        return {i["metadata"]["name"]: dict(i.get("status") or {}) for i in items.get("items", [])}


def _line(name: str, status: dict[str, Any]) -> str:
    progress = status.get("progress") or {}
    text = f"llamaft sweep: {name}: {status.get('phase', 'Pending')}"
    if progress.get("stepOfTotal"):
        text += f" step {progress['stepOfTotal']}"
    if progress.get("tokensPerSecond"):
        text += f", {progress['tokensPerSecond']:,.0f} tok/s"
    if status.get("phase") in TERMINAL and status.get("message"):
        text += f": {status['message']}"
    return text


def wait(runs: ClusterRuns, names: list[str], *, poll_s: float, timeout_s: float,
         say: Callable[[str], None] = print) -> dict[str, dict[str, Any] | None]:
    """Until every run in `names` is Succeeded or Failed, or `timeout_s` passed (None for a run
    that had not ended); prints a line whenever a run's phase or step changes."""
    deadline = time.monotonic() + timeout_s
    shown: dict[str, str] = {}
    ended: dict[str, dict[str, Any] | None] = {}
    while True:
        current = runs.statuses()
        for name in names:
            status = current.get(name)
            if status is None or name in ended:
                continue
            line = _line(name, status)
            if shown.get(name) != line:
                say(line)
                shown[name] = line
            if status.get("phase") in TERMINAL:
                ended[name] = status
        if len(ended) == len(names) or time.monotonic() >= deadline:
            return {name: ended.get(name) for name in names}
        time.sleep(poll_s)


def point(run: SizedRun, status: dict[str, Any] | None, timeout_s: float) -> Point:
    if status is None:
        return Point(run.workers, run.name, "TimedOut", message=f"not finished after {timeout_s:g} s (--timeout); it is "
                                                                "still on the cluster")
    if status.get("phase") != "Succeeded":
        failures = status.get("failures") or []
        reason = f" ({failures[-1].get('reason')})" if failures else ""
        return Point(run.workers, run.name, "Failed", message=f"{status.get('message') or 'failed'}{reason}"[:300])
    return from_performance(run.workers, run.name, status.get("performance"))


def run(plan: SweepPlan, api: Any, namespace: str, *, at_once: bool, poll_s: float, timeout_s: float) -> list[Point]:
    """Create the sizes (after checking no name is taken), wait for them, and collect the points."""
    runs = ClusterRuns(api, namespace, plan.sweep)
    taken = runs.taken([r.name for r in plan.runs])
    if taken:
        raise SweepError([f"LlamaFineTune {namespace}/{name} exists already (an earlier sweep?): delete the earlier "
                          f"runs (kubectl delete finetunes -n {namespace} -l {SWEEP_LABEL}={plan.sweep}) or pass "
                          "another --name" for name in taken])
    points: list[Point] = []
    if at_once:
        for sized in plan.runs:
            runs.create(sized)
        print(f"llamaft sweep: created {', '.join(r.name for r in plan.runs)} in {namespace}", flush=True)
        ended = wait(runs, [r.name for r in plan.runs], poll_s=poll_s, timeout_s=timeout_s)
        return [point(r, ended[r.name], timeout_s) for r in plan.runs]
    for index, sized in enumerate(plan.runs, start=1):
        runs.create(sized)
        print(f"llamaft sweep: size {index}/{len(plan.runs)}: created {namespace}/{sized.name} "
              f"({sized.workers} worker(s))", flush=True)
        ended = wait(runs, [sized.name], poll_s=poll_s, timeout_s=timeout_s)
        points.append(point(sized, ended[sized.name], timeout_s))
    return points
