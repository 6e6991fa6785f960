"""Monitoring follows the trainer on both job backends (issue #36): the PodMonitor's scrape reaches
the metrics port of PyTorchJob and TrainJob pods alike, and every alert and dashboard query selects
exactly the pods each controller creates for the fine-tune's attempts, and no other pods.

The pods are built as the controllers build them (labels, container ports, names; the pods the real
training operator, Trainer and JobSet make pass the same selection in tests/controlplane:
runs.assert_monitored), and the
PodMonitor is turned into the Prometheus scrape configuration Prometheus Operator would generate for
it, with Prometheus' pod discovery replaced by a static target list of what it would discover:
- Prometheus discovery/kubernetes/pod.go buildPod: no target for a pod without an IP; one target
  per *declared* container port (`__address__` = net.JoinHostPort(podIP, port)), one port-less
  target per container that declares none, each with the pod's and the container's meta labels;
- Prometheus Operator v0.93.0 pkg/prometheus/promcfg.go generatePodMonitorConfig: job name
  `podMonitor/<ns>/<name>/<endpoint index>`, the monitor's own namespace (no namespaceSelector),
  the running filter, keep rules for the selector, the port keep rule (`port` on the port name,
  `portNumber` on the port number), namespace/container/pod/job/endpoint labels, the endpoint's
  relabelings (generateRelabelConfig), the sharding rules of one shard.
Then a real Prometheus scrapes the trainer's real metrics server (llamaft_trainer.report.metrics.ProgressPublisher,
as tests/operator/test_prometheus.py does) on each pod's own loopback address, and a replayed
dcgm-exporter / kube-state-metrics endpoint; `promtool test rules` checks every alert against
series named after each backend's pods.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from llamaft.api.validation import validate_resource
from llamaft.operator import gpu_health
from llamaft.render import desired, monitoring, trainjob
from llamaft.render.naming import Owner
from llamaft_trainer.process.local_etcd import free_port

from tests.conftest import EXAMPLES, need_binary
from tests.operator.conftest import wait_for
from tests.operator.sim import (
    CONTAINER,
    CONTROLLER_NAME,
    DEFAULT_PORT,
    DEFAULT_PORT_NAME,
    OPERATOR_NAME,
    REPLICA_INDEX,
    REPLICA_TYPE,
    pod_port,
)
from tests.operator.sim import JOB_NAME as PYTORCHJOB_NAME_LABEL
from tests.operator.sim_fixtures import torch_distributed_runtime
from tests.operator.sim_trainjob import COMPLETION_INDEX, JOB_INDEX, JOBSET_NAME, REPLICATED_JOB, jobset_spec
from tests.operator.sim_trainjob import JOB_NAME as BATCH_JOB_NAME

Obj = dict[str, Any]
NS = "team-a"
RANDOM_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
"""k8s.io/apimachinery pkg/util/rand String: what generateName appends (5 of these)."""
MAX_GENERATED_NAME_LENGTH = 63 - 5
"""k8s.io/apiserver pkg/storage/names/generate.go: maxNameLength - randomLength."""
LONG_NAME = "long-fine-tune-name-" + "x" * 22  # api.resource.MAX_NAME_LENGTH (42): TrainJob pod names get cut


def spec(backend: str, metrics_port: int = 8000) -> Any:
    body = yaml.safe_load(next(p for p in EXAMPLES if p.name == "llama3-8b-chat.yaml").read_text())
    body["spec"]["backend"] = backend
    body["spec"].setdefault("monitoring", {})["metricsPort"] = metrics_port
    return validate_resource(body)


# --------------------------------------------------------------------- pods as controllers make them
def pytorchjob_pod_name(job: str, index: int) -> str:
    """training-operator v1.9 pkg/core/utils.go GenGeneralName(job, "worker", index)."""
    return f"{job}-worker-{index}"


def indexed_job_pod_name(job: str, index: int, rng: random.Random) -> str:
    """kubernetes pkg/controller/job/indexed_job_utils.go podGenerateNameWithIndex, then the API
    server's generateName (apiserver pkg/storage/names SimpleNameGenerator: 5 random characters)."""
    append = f"-{index}-"
    prefix = job + append
    if len(prefix) > MAX_GENERATED_NAME_LENGTH:
        prefix = prefix[:MAX_GENERATED_NAME_LENGTH - len(append)] + append
    return prefix + "".join(rng.choice(RANDOM_ALPHABET) for _ in range(5))


def trainjob_pod_name(job: str, index: int, rng: random.Random) -> str:
    """Trainer: JobSet named after the TrainJob; JobSet: Job `<jobset>-node-0` (constructJob); the
    Job controller: an Indexed Job's pod (`indexed_job_pod_name`)."""
    return indexed_job_pod_name(f"{job}-{trainjob.NODE}-0", index, rng)


def _running(pod: Obj, ip: str) -> Obj:
    for container in pod["spec"]["containers"]:
        for port in container.get("ports") or []:
            port.setdefault("protocol", "TCP")  # the API server's default
    pod["status"] = {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
    return pod


def pytorchjob_pod(owner: Owner, parsed: Any, attempt: int, index: int, ip: str) -> Obj:
    """A Worker pod of the attempt's PyTorchJob as training-operator v1.9 creates it (labels of
    pkg/controller.v1/common/pod.go, the default port the PyTorch controller adds, as the sim has it)."""
    job = desired.pytorch_job(owner, parsed, attempt)
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    labels = {**template["metadata"]["labels"], OPERATOR_NAME: CONTROLLER_NAME, PYTORCHJOB_NAME_LABEL: job["metadata"]["name"],
              REPLICA_TYPE: "worker", REPLICA_INDEX: str(index)}
    pod_spec = template["spec"]
    for container in pod_spec["containers"]:
        if container["name"] == CONTAINER:
            container["ports"] = [*container.get("ports", []), {"name": DEFAULT_PORT_NAME, "containerPort": DEFAULT_PORT}]
    name = pytorchjob_pod_name(job["metadata"]["name"], index)
    return _running({"metadata": {"name": name, "namespace": owner.namespace, "labels": labels}, "spec": pod_spec}, ip)


def trainjob_pod(owner: Owner, parsed: Any, attempt: int, index: int, ip: str, rng: random.Random) -> Obj:
    """A trainer pod of the attempt's TrainJob as Trainer v2.3 + JobSet + the Job controller create it:
    the JobSet's `node` pod template (the runtime with our runtimePatch merged, the torch plugin's
    port 29500: tests/operator/sim_trainjob.jobset_spec) and the labels JobSet and the Job add."""
    job = trainjob.train_job(owner, parsed, attempt)
    name = job["metadata"]["name"]
    rjob = next(r for r in jobset_spec(job, torch_distributed_runtime())["replicatedJobs"] if r["name"] == trainjob.NODE)
    template = rjob["template"]["spec"]["template"]
    labels = {**template["metadata"]["labels"], JOBSET_NAME: name, REPLICATED_JOB: trainjob.NODE, JOB_INDEX: "0",
              BATCH_JOB_NAME: f"{name}-{trainjob.NODE}-0", COMPLETION_INDEX: str(index)}
    pod_name = trainjob_pod_name(name, index, rng)
    return _running({"metadata": {"name": pod_name, "namespace": owner.namespace, "labels": labels}, "spec": template["spec"]}, ip)


# ------------------------------------------------------------- the PodMonitor as Prometheus sees it
def _sanitize(name: str) -> str:
    """promcfg.go sanitizeLabelName (and Prometheus' strutil.SanitizeLabelName for meta labels)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def discovered_targets(pods: list[Obj]) -> list[Obj]:
    """What Prometheus' pod role discovers (discovery/kubernetes/pod.go buildPod, podLabels): a static
    target group per target, `__address__` separately, the rest as labels (an empty value is left out:
    relabelling reads a missing label as empty)."""
    groups = []
    for pod in pods:
        ip = pod.get("status", {}).get("podIP")
        if not ip:
            continue
        meta = pod["metadata"]
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))
        pod_labels = {"__meta_kubernetes_namespace": meta["namespace"], "__meta_kubernetes_pod_name": meta["name"],
                      "__meta_kubernetes_pod_ip": ip, "__meta_kubernetes_pod_phase": pod["status"]["phase"],
                      "__meta_kubernetes_pod_ready": str(ready).lower()}
        for key, value in (meta.get("labels") or {}).items():
            pod_labels[f"__meta_kubernetes_pod_label_{_sanitize(key)}"] = value
            pod_labels[f"__meta_kubernetes_pod_labelpresent_{_sanitize(key)}"] = "true"
        containers = [(c, False) for c in pod["spec"]["containers"]] + [(c, True) for c in pod["spec"].get("initContainers", [])]
        for container, init in containers:
            labels = {**pod_labels, "__meta_kubernetes_pod_container_name": container["name"],
                      "__meta_kubernetes_pod_container_init": str(init).lower()}
            if not container.get("ports"):
                groups.append({"targets": [ip], "labels": labels})
                continue
            for port in container["ports"]:
                port_labels = {"__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                               "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                               "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "")}
                host = f"[{ip}]" if ":" in ip else ip
                groups.append({"targets": [f"{host}:{port['containerPort']}"],
                               "labels": {**labels, **{k: v for k, v in port_labels.items() if v}}})
    return groups


RELABEL_KEYS = {"sourceLabels": "source_labels", "separator": "separator", "targetLabel": "target_label",
                "regex": "regex", "modulus": "modulus", "replacement": "replacement", "action": "action"}
IMPLEMENTED_ENDPOINT_FIELDS = {"port", "portNumber", "targetPort", "path", "interval", "relabelings", "filterRunning",
                               "honorLabels", "scrapeTimeout", "scheme"}
IMPLEMENTED_SPEC_FIELDS = {"selector", "podMetricsEndpoints"}


def generate_relabel_config(relabelings: list[Obj]) -> list[Obj]:
    """promcfg.go generateRelabelConfig: the CRD's camelCase fields, the action lower-cased."""
    out = []
    for item in relabelings:
        unknown = set(item) - set(RELABEL_KEYS)
        assert not unknown, f"relabeling fields this derivation does not implement: {unknown}"
        out.append({RELABEL_KEYS[k]: (v.lower() if k == "action" else v) for k, v in item.items()})
    return out


def scrape_configs(monitor: Obj, pods: list[Obj]) -> list[Obj]:
    """generatePodMonitorConfig for each endpoint, the targets `discovered_targets` of the monitor's
    namespace. Fails on a PodMonitor field it does not implement, so that a change to the rendered
    PodMonitor cannot be silently ignored here."""
    meta, spec_ = monitor["metadata"], monitor["spec"]
    assert set(spec_) <= IMPLEMENTED_SPEC_FIELDS, set(spec_) - IMPLEMENTED_SPEC_FIELDS
    selector = spec_["selector"]
    targets = discovered_targets([p for p in pods if p["metadata"]["namespace"] == meta["namespace"]])
    out = []
    for index, ep in enumerate(spec_["podMetricsEndpoints"]):
        assert set(ep) <= IMPLEMENTED_ENDPOINT_FIELDS, set(ep) - IMPLEMENTED_ENDPOINT_FIELDS
        relabel: list[Obj] = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
        if ep.get("filterRunning", True):
            relabel.append({"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"})
        for key in sorted(selector.get("matchLabels") or {}):
            relabel.append({"action": "keep", "source_labels": [f"__meta_kubernetes_pod_label_{_sanitize(key)}",
                                                                f"__meta_kubernetes_pod_labelpresent_{_sanitize(key)}"],
                            "regex": f"({selector['matchLabels'][key]});true"})
        for exp in selector.get("matchExpressions") or []:
            key = _sanitize(exp["key"])
            if exp["operator"] in ("In", "NotIn"):
                relabel.append({"action": "keep" if exp["operator"] == "In" else "drop",
                                "source_labels": [f"__meta_kubernetes_pod_label_{key}", f"__meta_kubernetes_pod_labelpresent_{key}"],
                                "regex": f"({'|'.join(exp['values'])});true"})
            else:
                relabel.append({"action": "keep" if exp["operator"] == "Exists" else "drop",
                                "source_labels": [f"__meta_kubernetes_pod_labelpresent_{key}"], "regex": "true"})
        if ep.get("port"):
            relabel.append({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": ep["port"]})
        elif ep.get("portNumber"):
            relabel.append({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_number"],
                            "regex": str(ep["portNumber"])})
        elif ep.get("targetPort") is not None:
            source = "name" if isinstance(ep["targetPort"], str) else "number"
            relabel.append({"action": "keep", "source_labels": [f"__meta_kubernetes_pod_container_port_{source}"],
                            "regex": str(ep["targetPort"])})
        relabel += [{"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                    {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"}]
        if ep.get("port") or ep.get("targetPort") is not None:
            relabel.append({"target_label": "endpoint", "replacement": str(ep.get("port") or ep["targetPort"])})
        relabel += generate_relabel_config(ep.get("relabelings") or [])
        relabel += [  # appendShardingRelabelingWithLabel, one shard ($(SHARD) is 0)
            {"source_labels": ["__address__", "__tmp_hash"], "target_label": "__tmp_hash", "regex": "(.+);",
             "replacement": "$1", "action": "replace"},
            {"source_labels": ["__tmp_hash"], "target_label": "__tmp_hash", "modulus": 1, "action": "hashmod"},
            {"source_labels": ["__tmp_hash", "__tmp_disable_sharding"], "regex": "0;|.+;.+", "action": "keep"},
        ]
        config: Obj = {"job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/{index}", "static_configs": targets,
                       "relabel_configs": relabel}
        for field, key in (("honorLabels", "honor_labels"), ("interval", "scrape_interval"), ("scrapeTimeout", "scrape_timeout"),
                           ("path", "metrics_path"), ("scheme", "scheme")):
            if field in ep:
                config[key] = ep[field]
        out.append(config)
    return out


def relabelled_addresses(config: Obj) -> list[tuple[str, str]]:
    """(pod, address before relabelling) of every target the config's keep and drop rules on
    discovery labels let through (the quick test's stand-in for Prometheus; the slow tests run the
    whole configuration in a real one)."""
    kept = []
    for group in config["static_configs"]:
        labels = {"__address__": group["targets"][0], **group["labels"]}
        ok = True
        for rule in config["relabel_configs"]:
            if rule.get("action") not in ("keep", "drop") or rule["source_labels"][0].startswith("__tmp"):
                continue
            value = ";".join(labels.get(s, "") for s in rule["source_labels"])
            match = re.fullmatch(rule["regex"], value) is not None
            ok = ok and (match if rule["action"] == "keep" else not match)
        if ok:
            kept.append((labels["__meta_kubernetes_pod_name"], labels["__address__"]))
    return kept


# ----------------------------------------------------------------------------------- the quick ones
def test_each_backends_pods_yield_exactly_their_trainer_target() -> None:
    """The port keep rules: one target per trainer pod on each backend (today's `port: metrics`
    found none in a TrainJob pod: no container there declares that name)."""
    rng = random.Random(1)
    owner = Owner("chat", NS, "5e1f0c2a-0000-4000-8000-000000000001")
    pt = [pytorchjob_pod(owner, spec("PyTorchJob"), 2, i, f"127.0.3.{i + 1}") for i in range(2)]
    tj = [trainjob_pod(owner, spec("TrainJob"), 3, i, f"127.0.4.{i + 1}", rng) for i in range(2)]
    monitor = monitoring.pod_monitor(owner, spec("PyTorchJob"))
    kept = [k for config in scrape_configs(monitor, pt + tj) for k in relabelled_addresses(config)]
    assert sorted(pod for pod, _ in kept) == sorted(p["metadata"]["name"] for p in pt + tj)
    # the TrainJob pods declare only Trainer's 29500, so the metrics port cannot be asked for by number either
    by_number = {**monitor, "spec": {**monitor["spec"], "podMetricsEndpoints": [{"portNumber": 8000}]}}
    assert [k for c in scrape_configs(by_number, tj) for k in relabelled_addresses(c)] == []


def test_pod_name_regex_matches_every_attempts_pods_of_both_backends_and_nothing_else() -> None:
    """Names generated by the controllers' rules (including cut ones of a 42-character name, 1- to
    3-digit attempts, 1- to 4-digit indices) match; another incarnation's, another fine-tune's and
    other namespaces' do not. Python's `re` and Prometheus' RE2 agree on this subset of syntax."""
    rng = random.Random(7)
    for name in ("chat", LONG_NAME):
        owner = Owner(name, NS, "5e1f0c2a-0000-4000-8000-000000000001")
        old = Owner(name, NS, "77aa0c2a-0000-4000-8000-000000000001")
        longer = Owner(f"{name[:36]}-2", NS, "5e1f0c2a-0000-4000-8000-000000000002")
        selector = re.fullmatch(r'namespace="([^"]+)", pod=~"([^"]+)"', monitoring.finetune_pod_selector(owner))
        assert selector is not None and selector[1] == NS, monitoring.finetune_pod_selector(owner)
        regex = re.compile(selector[2])
        for attempt in (1, 9, 10, 99, 100, 999):
            for index in (0, 7, 10, 999, 1000, 4095):
                for who, match in ((owner, True), (old, False), (longer, False)):
                    job = who.job_name(attempt)
                    for pod in (pytorchjob_pod_name(job, index), trainjob_pod_name(job, index, rng)):
                        assert (regex.fullmatch(pod) is not None) is match, (name, pod, regex.pattern)


def test_one_attempts_gpu_health_selector_matches_that_attempts_pods_only() -> None:
    """The operator's GPUHealthy queries look at the current attempt's pods only (an XID on an
    earlier attempt's GPU already ended that attempt), on either backend."""
    rng = random.Random(5)
    for name in ("chat", LONG_NAME):
        owner = Owner(name, NS, "5e1f0c2a-0000-4000-8000-000000000001")
        xid_query, util_query = gpu_health.queries(owner, owner.job_name(12))
        selector = re.search(r'pod=~"([^"]+)"', util_query)
        assert selector is not None and f'namespace="{NS}"' in util_query and selector[0] in xid_query
        regex = re.compile(selector[1])
        for attempt in (1, 2, 12, 120):
            job = owner.job_name(attempt)
            for index in (0, 1, 1000):
                for pod in (pytorchjob_pod_name(job, index), trainjob_pod_name(job, index, rng)):
                    assert (regex.fullmatch(pod) is not None) is (attempt == 12), (pod, regex.pattern)


# --------------------------------------------------------------------------------- promtool rules
def _series(metric: str, pod: str, values: str, namespace: str = NS, **labels: str) -> Obj:
    extra = "".join(f', {k}="{v}"' for k, v in labels.items())
    return {"series": f'{metric}{{namespace="{namespace}", pod="{pod}"{extra}}}', "values": values}


def test_alerts_select_each_backends_pods_and_no_others(tmp_path: Path) -> None:
    """`promtool test rules`: per backend, each alert fires for the fine-tune's pods (PyTorchJob
    `<job>-worker-<i>`, TrainJob `<job>-node-0-<i>-<suffix>`, a cut one of a long name) and the
    series of pods that must not match (the previous incarnation's, another fine-tune's, another
    namespace's) neither fire an alert nor hide one (the aggregating alerts)."""
    tool = need_binary("promtool", "prometheus")
    rng = random.Random(3)
    suites: list[tuple[Path, list[Obj]]] = []
    for name in ("chat", LONG_NAME):
        owner = Owner(name, NS, "5e1f0c2a-0000-4000-8000-000000000001")
        old = Owner(name, NS, "77aa0c2a-0000-4000-8000-000000000001")
        other = Owner(f"{name[:36]}-b", NS, "5e1f0c2a-0000-4000-8000-000000000003")
        rules = monitoring.alert_rules(owner)
        path = tmp_path / f"rules-{len(suites)}.yaml"
        path.write_text(yaml.safe_dump({"groups": [{"name": f"g{len(suites)}", "rules": rules}]}))
        tests: list[Obj] = []
        suites.append((path, tests))
        backends: dict[str, tuple[Callable[[str, int], str], str]] = {
            "PyTorchJob": (pytorchjob_pod_name, "pytorch"),
            "TrainJob": (lambda job, i: trainjob_pod_name(job, i, rng), "node"),
        }
        for backend, (pod_name, container) in backends.items():
            mine = [pod_name(owner.job_name(attempt), index) for attempt, index in ((1, 0), (12, 1), (100, 1000))]
            decoys = [(NS, pod_name(old.job_name(1), 0)), (NS, pod_name(other.job_name(1), 0)),
                      ("team-b", pod_name(owner.job_name(1), 0))]
            annotations = {r["alert"]: r["annotations"] for r in rules}
            base = {"finetune": name, "namespace": NS}
            for low, label in ((True, "mine low"), (False, "decoys low")):
                mine_util, decoy_util = ("5x20", "95x20") if low else ("95x20", "5x20")
                mine_seen, decoy_seen = ("0x30", "1e10x30") if low else ("1e10x30", "0x30")  # last progress: stale or fresh
                series = []
                for pod in mine:
                    series += [_series("DCGM_FI_DEV_XID_ERRORS", pod, "79x20", gpu="0", Hostname="n1", err_code="79"),
                               _series("DCGM_FI_DEV_GPU_UTIL", pod, mine_util, gpu="0"),
                               _series("llamaft_train_last_progress_timestamp_seconds", pod, mine_seen, container=container),
                               _series("kube_pod_container_status_restarts_total", pod, "0+1x30", container=container)]
                for namespace, pod in decoys:
                    series += [_series("DCGM_FI_DEV_XID_ERRORS", pod, "79x20", namespace, gpu="0", Hostname="n2", err_code="79"),
                               _series("DCGM_FI_DEV_GPU_UTIL", pod, decoy_util, namespace, gpu="0"),
                               _series("llamaft_train_last_progress_timestamp_seconds", pod, decoy_seen, namespace, container=container),
                               _series("kube_pod_container_status_restarts_total", pod, "0+1x30", namespace, container=container)]
                xid = [{"exp_labels": {**base, "severity": "critical", "pod": pod, "gpu": "0", "Hostname": "n1"},
                        "exp_annotations": {"summary": f"GPU 0 of {pod} reported hardware XID 79",
                                            "description": annotations["LlamaFineTuneGPUXidError"]["description"]}}
                       for pod in mine]
                restarts = [{"exp_labels": {**base, "severity": "warning", "pod": pod, "container": container},
                             "exp_annotations": {"summary": f"{pod} restarted in the last 15 minutes",
                                                 "description": annotations["LlamaFineTuneRestarting"]["description"]}}
                            for pod in mine]
                fired = [{"exp_labels": {**base, "severity": "warning"}, "exp_annotations": annotations[a]} for a in
                         ("LlamaFineTuneLowGPUUtilisation", "LlamaFineTuneNoProgress")]
                tests.append({
                    "name": f"{name} {backend} {label}", "interval": "1m", "input_series": series,
                    "alert_rule_test": [
                        {"eval_time": "20m", "alertname": "LlamaFineTuneGPUXidError", "exp_alerts": xid},
                        {"eval_time": "20m", "alertname": "LlamaFineTuneRestarting", "exp_alerts": restarts},
                        {"eval_time": "19m", "alertname": "LlamaFineTuneLowGPUUtilisation", "exp_alerts": [fired[0]] if low else []},
                        {"eval_time": "19m", "alertname": "LlamaFineTuneNoProgress", "exp_alerts": [fired[1]] if low else []},
                    ]})
    failures = []
    for index, (path, tests) in enumerate(suites):
        spec_file = tmp_path / f"tests-{index}.yaml"
        spec_file.write_text(yaml.safe_dump({"rule_files": [str(path)], "evaluation_interval": "1m", "tests": tests}))
        out = subprocess.run([tool, "test", "rules", str(spec_file)], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            failures.append(out.stdout[-4000:] + out.stderr[-2000:])
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------------ a real Prometheus
@dataclass
class Fleet:
    """Who runs where in the scraped 'cluster'."""

    url: str
    owners: dict[str, Owner]
    pods: dict[str, list[str]]
    """owner key -> its trainer pods (the ones its queries must return)."""
    decoys: list[str]
    """Pods no query of the owners may return (the previous incarnation's, another fine-tune's)."""
    containers: dict[str, str]
    addresses: dict[str, str]
    """pod -> where its trainer serves /metrics (its IP and the spec's metrics port)."""


def _dcgm_exposition(pods: list[tuple[str, str]], busy: set[str], scrapes: int) -> str:
    """dcgm-exporter's text format (pod/namespace/container of the GPU's pod) and kube-state-metrics'
    restart counter, for every pod; the `busy` pods' GPUs are 95% busy, the others' 7%; the counter
    grows with each scrape."""
    lines = []
    gauges = {"DCGM_FI_DEV_GPU_UTIL": 7, "DCGM_FI_DEV_MEM_COPY_UTIL": 3, "DCGM_FI_DEV_SM_CLOCK": 1980,
              "DCGM_FI_DEV_GPU_TEMP": 61, "DCGM_FI_DEV_POWER_USAGE": 402.5, "DCGM_FI_DEV_XID_ERRORS": 79}
    for metric, value in gauges.items():
        lines += [f"# HELP {metric} {metric}", f"# TYPE {metric} gauge"]
        for pod, container in pods:
            xid = ',err_code="79",err_msg="GPU has fallen off the bus"' if metric == "DCGM_FI_DEV_XID_ERRORS" else ""
            shown = (95 if pod in busy else 7) if metric == "DCGM_FI_DEV_GPU_UTIL" else value
            lines.append(f'{metric}{{gpu="0",UUID="GPU-1",Hostname="node-1",namespace="{NS}",pod="{pod}",container="{container}"{xid}}} {shown}')
    lines += ["# HELP kube_pod_container_status_restarts_total restarts", "# TYPE kube_pod_container_status_restarts_total counter"]
    lines += [f'kube_pod_container_status_restarts_total{{namespace="{NS}",pod="{pod}",container="{container}"}} {scrapes}'
              for pod, container in pods]
    return "\n".join(lines) + "\n"


def _serve_exposition(pods: list[tuple[str, str]], busy: set[str]) -> tuple[ThreadingHTTPServer, int]:
    scrapes = {"n": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            scrapes["n"] += 1
            body = _dcgm_exposition(pods, busy, scrapes["n"]).encode()
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


def query(url: str, expr: str) -> list[Obj]:
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]  # type: ignore[no-any-return]


def _trainer_metrics(ip: str, port: int, stale: bool) -> Any:
    """The trainer's own metrics server (llamaft_trainer.report.metrics.ProgressPublisher) on the pod's address, as
    LLAMAFT_METRICS_HOST pins it, after one optimizer step."""
    from llamaft_trainer.report.metrics import ProgressPublisher

    progress = ProgressPublisher()
    progress.total_steps.set(100)
    progress.record_step({"step": 7, "epoch": 0, "loss": 2.5, "lr": 1e-5, "grad_norm": 1.0, "tokens_per_second": 900.0,
                          "tokens_per_second_per_device": 450.0, "mfu": 0.38, "peak_memory_bytes": 2**30, "tokens": 64,
                          "eta_seconds": 100})
    if stale:
        progress.last_progress.set(time.time() - 3600)
    previous = os.environ.get("LLAMAFT_METRICS_HOST")
    os.environ["LLAMAFT_METRICS_HOST"] = ip
    try:
        return progress.serve(port)
    finally:
        if previous is None:
            del os.environ["LLAMAFT_METRICS_HOST"]
        else:
            os.environ["LLAMAFT_METRICS_HOST"] = previous


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """Two fine-tunes, one per backend (the TrainJob one with a name long enough to be cut), each with
    two trainer pods; a previous incarnation of the first still running a TrainJob pod (it carries the
    same finetune label, so the first's PodMonitor scrapes it too) and another fine-tune's pod. Every pod
    serves the trainer's metrics on its own loopback address and the spec's metrics port; Prometheus
    scrapes them through the configs derived from the rendered PodMonitors."""
    binary = need_binary("prometheus", "prometheus")
    metrics_port = pod_port()  # bound on each pod's own address
    rng = random.Random(11)
    chat = Owner("chat", NS, "5e1f0c2a-0000-4000-8000-000000000001")
    long = Owner(LONG_NAME, NS, "0b2c0c2a-0000-4000-8000-000000000002")
    old_chat = Owner("chat", NS, "77aa0c2a-0000-4000-8000-000000000001")
    other = Owner("chat-b", NS, "5e1f0c2a-0000-4000-8000-000000000003")
    pt, tj = spec("PyTorchJob", metrics_port), spec("TrainJob", metrics_port)
    block = 100 + os.getpid() % 100  # an address block of this process's own
    ips = iter(f"127.{block}.7.{i}" for i in range(2, 250))
    pods = {
        "chat": [pytorchjob_pod(chat, pt, 2, i, next(ips)) for i in range(2)],
        "long": [trainjob_pod(long, tj, 100, i, next(ips), rng) for i in range(2)],
        "old": [trainjob_pod(old_chat, tj, 1, 0, next(ips), rng)],
        "other": [pytorchjob_pod(other, pt, 1, 0, next(ips))],
    }
    every = [p for group in pods.values() for p in group]
    container = {p["metadata"]["name"]: p["spec"]["containers"][0]["name"] for p in every}
    # The fine-tunes' own pods look stuck and idle, the decoys busy and stepping: a query that let a
    # decoy in would miss the fine-tune's stall (max) or low utilisation (avg).
    decoys = {p["metadata"]["name"] for p in pods["old"] + pods["other"]}
    servers = [_trainer_metrics(p["status"]["podIP"], metrics_port, stale=key in ("chat", "long"))
               for key, group in pods.items() for p in group]
    dcgm, dcgm_port = _serve_exposition([(name, c) for name, c in container.items()], decoys)
    monitors = [monitoring.pod_monitor(chat, pt), monitoring.pod_monitor(long, tj), monitoring.pod_monitor(other, pt)]
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {"job_name": "dcgm-exporter", "honor_labels": True, "static_configs": [{"targets": [f"127.0.0.1:{dcgm_port}"]}]},
                *[{**c, "scrape_interval": "1s"} for m in monitors for c in scrape_configs(m, every)],
            ],
        }))
        check = subprocess.run([need_binary("promtool", "prometheus"), "check", "config", str(config)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp}/data",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for("prometheus ready", lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=1).status == 200)
            # Every trainer target of the monitors is up (6: chat's 2, long's 2, old chat's 1, other's 1).
            wait_for("every trainer target scraped", lambda: len(query(url, 'up{job=~".+/.+-trainer"} == 1')) == 6, timeout=60)
            wait_for("series", lambda: query(url, "DCGM_FI_DEV_XID_ERRORS") and len(query(url, "llamaft_train_loss")) == 6)
            time.sleep(3)  # a few restart-counter samples, for increase()
            yield Fleet(url, {"chat": chat, "long": long},
                        {"chat": [p["metadata"]["name"] for p in pods["chat"]], "long": [p["metadata"]["name"] for p in pods["long"]]},
                        [p["metadata"]["name"] for p in pods["old"] + pods["other"]], container,
                        {p["metadata"]["name"]: f"{p['status']['podIP']}:{metrics_port}" for p in every})
        finally:
            proc.terminate()
            proc.wait(10)
            for server in servers:
                server.shutdown()
            dcgm.shutdown()


def _pods(result: list[Obj]) -> set[str]:
    return {r["metric"].get("pod", "") for r in result}


@pytest.mark.slow
def test_the_trainer_is_scraped_on_both_backends(fleet: Fleet) -> None:
    """Through the derived configs: each monitor's targets are its fine-tune's pods, on the metrics
    port (the TrainJob pods' declared 29500 rewritten), labelled with pod, container and namespace."""
    up = query(fleet.url, 'up{job=~".+/.+-trainer"}')
    by_job: dict[str, set[str]] = {}
    for series in up:
        assert series["value"][1] == "1", series
        by_job.setdefault(series["metric"]["job"], set()).add(series["metric"]["pod"])
        assert series["metric"]["instance"] == fleet.addresses[series["metric"]["pod"]]
        assert series["metric"]["container"] == fleet.containers[series["metric"]["pod"]]
    assert by_job[f"{NS}/chat-trainer"] == {*fleet.pods["chat"], fleet.decoys[0]}  # the old incarnation carries the label
    assert by_job[f"{NS}/{LONG_NAME}-trainer"] == set(fleet.pods["long"])


@pytest.mark.slow
def test_every_dashboard_query_and_alert_returns_the_fine_tunes_pods_only(fleet: Fleet) -> None:
    for key, owner in fleet.owners.items():
        mine = set(fleet.pods[key])
        for panel in monitoring.dashboard(owner)["panels"]:
            expr = panel["targets"][0]["expr"]
            result = query(fleet.url, expr)
            assert result, f"{key}: {panel['title']}: {expr}"
            if "pod" in result[0]["metric"]:
                assert _pods(result) == mine, (key, panel["title"], _pods(result))
        rules = {r["alert"]: r["expr"] for r in monitoring.alert_rules(owner)}
        assert _pods(query(fleet.url, rules["LlamaFineTuneGPUXidError"])) == mine, key
        assert _pods(query(fleet.url, rules["LlamaFineTuneRestarting"])) == mine, key
        assert query(fleet.url, rules["LlamaFineTuneLowGPUUtilisation"]), key
        assert query(fleet.url, rules["LlamaFineTuneNoProgress"]), key
    selectors = [monitoring.finetune_pod_selector(o) for o in fleet.owners.values()]
    for decoy in fleet.decoys:
        for sel in selectors:
            assert not query(fleet.url, f'{{__name__=~".+", pod="{decoy}", {sel}}}'), (decoy, sel)
