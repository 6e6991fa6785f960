"""`llamaft render` prints exactly what the operator would create."""

from __future__ import annotations

import pytest
import yaml
from llamaft.cli import main

from tests.conftest import EXAMPLES
from tests.operator.kubeflow_rules import validate_pytorchjob


def test_render_prints_every_object_in_creation_order(capsys: pytest.CaptureFixture[str]) -> None:
    path = next(p for p in EXAMPLES if p.name == "llama2-70b.yaml")
    assert main(["render", str(path), "--namespace", "ml", "--attempt", "2"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["ConfigMap", "Deployment", "Service", "PodMonitor", "PrometheusRule", "ConfigMap", "PyTorchJob"]
    assert all(d["metadata"]["namespace"] == "ml" for d in docs)
    job = docs[-1]
    assert job["metadata"]["name"] == "llama2-70b-samsum-2" and validate_pytorchjob(job) == []


def test_render_rejects_an_invalid_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune", "metadata": {"name": "x"},
                                   "spec": {"model": {"source": "m"}, "dataset": {"format": "csv", "source": "d"}}}))
    assert main(["render", str(bad)]) == 1
    assert "spec.dataset.format: 'csv' is not one of: samsum, alpaca, jsonl" in capsys.readouterr().err
