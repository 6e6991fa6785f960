"""`llamaft render` prints exactly what the operator would create."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from llamaft.cli import main

from tests.conftest import EXAMPLES, REPO
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


MINIMAL = yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text())
UID = "3f2a9c4e-1b7d-4e6a-9c1f-0a2b3c4d5e6f"


def _write(tmp_path: Path, name: str = "ft.yaml", **spec: Any) -> Path:
    body = copy.deepcopy(MINIMAL)
    body["spec"].update(spec)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(body))
    return path


# (case, spec fields, a phrase stderr names the refusal with)
REFUSED = [
    ("results only in the container", {"checkpointing": {"directory": "/checkpoints"}},
     "spec.checkpointing.directory: /checkpoints: the checkpoints and the final export would be written to the container's"),
    ("a child the cluster rejects", {"cluster": {"workers": 2, "podTemplateOverrides": {"spec": {"hostNetwork": "yes"}}}},
     "spec.cluster.podTemplateOverrides.spec.hostNetwork"),
    ("capacity, preflight Enforce", {"cluster": {"workers": 1, "instanceType": "g5.48xlarge"},
                                     "fsdp": {"activationCheckpointing": {"mode": "none"}}},
     "capacity: WillNotFit [the operator will refuse it]"),
]


@pytest.mark.parametrize(("name", "spec", "phrase"), REFUSED, ids=[r[0] for r in REFUSED])
def test_render_of_a_spec_the_operator_refuses_fails_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   name: str, spec: dict[str, Any], phrase: str) -> None:
    path = _write(tmp_path, **spec)
    assert main(["render", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and f"error: {phrase}" in err, err
    assert "error: the operator would refuse this LlamaFineTune; --force prints its objects all the same" in err
    assert main(["render", str(path), "--force"]) == 0
    out, err = capsys.readouterr()
    assert [d["kind"] for d in yaml.safe_load_all(out)][-1] == "PyTorchJob"
    assert f"warning: {phrase}" in err and "(printed anyway: --force)" in err


def test_force_cannot_render_what_the_schema_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(_write(tmp_path, cluster={"workers": 0})), "--force"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "spec.cluster.workers" in err and "no objects to render, even with --force" in err


@pytest.mark.parametrize("backend", ["PyTorchJob", "TrainJob"])
def test_render_with_uid_is_what_the_operator_creates(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      backend: str) -> None:
    """--uid: the job the operator's step creates for a CR of that uid (the same Owner and backend
    render: job name, LLAMAFT_RUN_UID, rendezvous id); without it the names have no uid token."""
    from llamaft.api.spec import Backend
    from llamaft.api.validation import validate_resource
    from llamaft.render.backends import backend_for
    from llamaft.render.naming import Owner

    path = REPO / "examples" / "minimal.yaml"
    assert main(["render", str(path), "--uid", UID, "--attempt", "3", "--namespace", "ml", "--backend", backend]) == 0
    job = list(yaml.safe_load_all(capsys.readouterr().out))[-1]
    owner = Owner("llama2-7b-minimal", "ml", UID)
    assert job == backend_for(Backend(backend)).render(owner, validate_resource(MINIMAL), 3)  # as step._start_attempt
    assert job["metadata"]["name"] == owner.job_name(3) == "llama2-7b-minimal-3f2a-3"
    text = yaml.safe_dump(job)
    assert "ml-llama2-7b-minimal-3f2a9c4e-3" in text and UID in text  # rendezvous id, LLAMAFT_RUN_UID

    assert main(["render", str(path), "--attempt", "3", "--namespace", "ml", "--backend", backend]) == 0
    job = list(yaml.safe_load_all(capsys.readouterr().out))[-1]
    assert job["metadata"]["name"] == "llama2-7b-minimal-3"
    assert "ml-llama2-7b-minimal-local-3" in yaml.safe_dump(job)


def test_render_refuses_a_uid_that_is_not_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", str(REPO / "examples" / "minimal.yaml"), "--uid", "abc"]) == 2
    assert "--uid 'abc' is not a uid" in capsys.readouterr().err
