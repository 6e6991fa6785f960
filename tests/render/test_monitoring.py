"""Monitoring objects: valid against the Prometheus Operator CRDs, alert rules pass `promtool check
rules` and `promtool test rules` (firing and not firing), every dashboard query is valid PromQL and
filters to the job's pods."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml
from llamaft.api.validation import validate_resource
from llamaft.render import monitoring
from llamaft.render.naming import Owner

from tests.conftest import EXAMPLES, REFERENCE, need_binary
from tests.operator.kubeflow_rules import schema_errors

OWNER = Owner("ft", "team-a", "abcdef12")
PROM_CRDS = REFERENCE / "prometheus-operator"
REQUIRED_DCGM = ["DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_XID_ERRORS",
                 "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE"]


def spec() -> Any:
    return validate_resource(yaml.safe_load(next(p for p in EXAMPLES if p.name == "llama2-7b.yaml").read_text()))


def promtool() -> str:
    return need_binary("promtool", "prometheus")


def test_objects_validate_against_the_prometheus_operator_crds() -> None:
    objs = {o["kind"]: o for o in monitoring.monitoring_objects(OWNER, spec())}
    assert set(objs) == {"PodMonitor", "PrometheusRule", "ConfigMap"}
    assert schema_errors(objs["PodMonitor"], PROM_CRDS / "monitoring.coreos.com_podmonitors.yaml", "v1") == []
    assert schema_errors(objs["PrometheusRule"], PROM_CRDS / "monitoring.coreos.com_prometheusrules.yaml", "v1") == []
    assert objs["ConfigMap"]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert objs["PodMonitor"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_schema_check_catches_a_broken_pod_monitor() -> None:
    broken = monitoring.pod_monitor(OWNER, spec())
    broken["spec"]["podMetricsEndpoints"][0]["scheme"] = "gopher"
    broken["spec"]["selectr"] = {}
    errors = "\n".join(schema_errors(broken, PROM_CRDS / "monitoring.coreos.com_podmonitors.yaml", "v1"))
    assert "gopher" in errors and "selectr" in errors


def test_dashboard_panels_filter_to_the_job_and_cover_the_metrics() -> None:
    board = monitoring.dashboard(OWNER)
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert all(monitoring.finetune_pod_selector(OWNER) in e for e in exprs)
    for metric in [*REQUIRED_DCGM, "llamaft_train_loss", "llamaft_train_tokens_per_second", "llamaft_train_mfu",
                   "llamaft_train_peak_memory_bytes"]:
        assert any(metric in e for e in exprs), metric
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and all(p["gridPos"]["w"] > 0 for p in board["panels"])


def _rules_file(tmp_path: Path, groups: list[dict[str, Any]]) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return path


def test_alert_rules_and_dashboard_queries_pass_promtool_check(tmp_path: Path) -> None:
    tool = promtool()
    rule = monitoring.prometheus_rule(OWNER, spec())
    queries = [{"record": f"llamaft:panel_{i}", "expr": t["expr"]}
               for i, p in enumerate(monitoring.dashboard(OWNER)["panels"]) for t in p["targets"]]
    path = _rules_file(tmp_path, [*rule["spec"]["groups"], {"name": "dashboard-queries", "rules": queries}])
    out = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 14 rules found" in out.stdout


def test_alerts_fire_and_stay_quiet_as_intended(tmp_path: Path) -> None:
    tool = promtool()
    rules = _rules_file(tmp_path, monitoring.prometheus_rule(OWNER, spec())["spec"]["groups"])
    pod, other = 'namespace="team-a", pod="ft-abcd-2-worker-0"', 'namespace="team-b", pod="ft-abcd-2-worker-0"'
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": f'DCGM_FI_DEV_XID_ERRORS{{{pod}, gpu="3", Hostname="node-7", err_code="79"}}', "values": "0 0 79 79"},
                {"series": f'DCGM_FI_DEV_XID_ERRORS{{{other}, gpu="0", Hostname="node-9", err_code="79"}}', "values": "79 79 79 79"},
                {"series": f'DCGM_FI_DEV_XID_ERRORS{{{pod}, gpu="1", Hostname="node-7", err_code="13"}}', "values": "13 13 13 13"},
                {"series": f'DCGM_FI_DEV_GPU_UTIL{{{pod}, gpu="0"}}', "values": "90 90 5x20"},
                {"series": f'llamaft_train_last_progress_timestamp_seconds{{{pod}}}', "values": "0x30"},
                {"series": f'kube_pod_container_status_restarts_total{{{pod}, container="pytorch"}}', "values": "0x25 1 1 1 1"},
                {"series": f'kube_pod_container_status_restarts_total{{{other}, container="pytorch"}}', "values": "0 1 2 3 4 5"},
            ],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": "LlamaFineTuneGPUXidError", "exp_alerts": []},
                {"eval_time": "3m", "alertname": "LlamaFineTuneGPUXidError", "exp_alerts": [{
                    "exp_labels": {"severity": "critical", "finetune": "ft", "namespace": "team-a", "pod": "ft-abcd-2-worker-0",
                                   "gpu": "3", "Hostname": "node-7"},
                    "exp_annotations": {
                        "summary": "GPU 3 of ft-abcd-2-worker-0 reported hardware XID 79",
                        "description": monitoring.alert_rules(OWNER)[0]["annotations"]["description"]},
                }]},
                {"eval_time": "5m", "alertname": "LlamaFineTuneLowGPUUtilisation", "exp_alerts": []},
                {"eval_time": "15m", "alertname": "LlamaFineTuneLowGPUUtilisation", "exp_alerts": [{
                    "exp_labels": {"severity": "warning", "finetune": "ft", "namespace": "team-a"},
                    "exp_annotations": monitoring.alert_rules(OWNER)[1]["annotations"]}]},
                {"eval_time": "10m", "alertname": "LlamaFineTuneNoProgress", "exp_alerts": []},
                {"eval_time": "5m", "alertname": "LlamaFineTuneRestarting", "exp_alerts": []},
                {"eval_time": "28m", "alertname": "LlamaFineTuneRestarting", "exp_alerts": [{
                    "exp_labels": {"severity": "warning", "finetune": "ft", "namespace": "team-a", "pod": "ft-abcd-2-worker-0",
                                   "container": "pytorch"},
                    "exp_annotations": {"summary": "ft-abcd-2-worker-0 restarted in the last 15 minutes",
                                        "description": monitoring.alert_rules(OWNER)[3]["annotations"]["description"]}}]},
                {"eval_time": "20m", "alertname": "LlamaFineTuneNoProgress", "exp_alerts": [{
                    "exp_labels": {"severity": "warning", "finetune": "ft", "namespace": "team-a"},
                    "exp_annotations": monitoring.alert_rules(OWNER)[2]["annotations"]}]},
            ],
        }],
    }
    path = tmp_path / "tests.yaml"
    path.write_text(yaml.safe_dump(tests))
    out = subprocess.run([tool, "test", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
