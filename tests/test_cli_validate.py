"""`llamaft validate`'s exit status is the cluster's verdict: non-zero when the API server or the
operator would refuse a document (where the results go and capacity included); --schema-only is
the API server's verdict alone."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from llamaft.cli import main

from tests.conftest import REPO

MINIMAL = yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text())
LLAMA_70B = yaml.safe_load((REPO / "examples" / "llama2-70b.yaml").read_text())


def write(tmp_path: Path, body: dict[str, Any], name: str = "ft.yaml", **spec: Any) -> Path:
    body = copy.deepcopy(body)
    for key, value in spec.items():
        body["spec"][key] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(body))
    return path


def in_container_only(tmp_path: Path, **spec: Any) -> Path:
    """examples/minimal.yaml as it was: the default /checkpoints, no volumeClaim."""
    return write(tmp_path, MINIMAL, "lost.yaml", checkpointing={**spec})


def hybrid_70b(tmp_path: Path, **spec: Any) -> Path:
    """Llama-2-70B sharded within each 8-GPU node: ~140 GB a GPU (examples/llama2-70b.yaml's comment)."""
    return write(tmp_path, LLAMA_70B, "hsdp.yaml", fsdp={**LLAMA_70B["spec"]["fsdp"], "shardingStrategy": "HYBRID_SHARD",
                                                          "hybridShard": {"shardGroupSize": 8, "replicaGroupSize": 16}},
                 **spec)


def test_results_only_in_the_container_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(in_container_only(tmp_path))]) == 1
    out = capsys.readouterr().out
    assert "spec.checkpointing.directory: /checkpoints: the checkpoints and the final export would be written to the " \
           "container's own filesystem" in out
    assert "spec.checkpointing.volumeClaim" in out and "discardWithPod: true" in out and ": ok" not in out
    assert main(["validate", str(in_container_only(tmp_path, discardWithPod=True))]) == 0
    assert main(["validate", str(in_container_only(tmp_path, directory="s3://bucket/run"))]) == 0
    assert main(["validate", str(REPO / "examples" / "minimal.yaml")]) == 0


def test_a_run_the_operator_refuses_for_capacity_fails_validation(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(hybrid_70b(tmp_path))]) == 1
    out = capsys.readouterr().out
    assert ": refused by the operator (llama2-70b-samsum: 16 worker(s) x 8 GPU(s), HYBRID_SHARD, bf16)" in out
    assert "capacity: WillNotFit [the operator will refuse it]" in out
    # preflight Warn: the operator only warns, so the run starts
    assert main(["validate", str(hybrid_70b(tmp_path, preflight="Warn"))]) == 0
    assert "[spec.preflight Warn: the operator only warns]" in capsys.readouterr().out


def test_schema_only_is_the_api_servers_verdict_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The operator's refusals (results in the container, capacity) are not --schema-only's; the
    schema's are."""
    assert main(["validate", "--schema-only", str(in_container_only(tmp_path)), str(hybrid_70b(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "capacity:" not in out and "spec.checkpointing" not in out
    assert out.count("  schema only: the API server would accept it; the operator's checks were not run") == 2
    bad = write(tmp_path, MINIMAL, "bad.yaml", cluster={"workers": 0})
    assert main(["validate", "--schema-only", str(bad)]) == 1
    assert "spec.cluster.workers" in capsys.readouterr().out


def test_the_help_says_what_schema_only_leaves_out(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "only the API server's verdict" in text and "not that the run starts" in text
    assert "Exit status 0 when every document would be accepted and run" in text


def test_local_runs_write_to_this_machine_and_are_not_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A local directory without a claim is what `llamaft run --local` and `sweep --local` are for:
    the storage refusal is the cluster's (validate and a cluster sweep still refuse it)."""
    from llamaft import local
    from llamaft.sweep import on_this_machine

    path = write(tmp_path, MINIMAL, "here.yaml", checkpointing={"directory": str(tmp_path / "ckpt")},
                 cluster={"workers": 1, "gpusPerWorker": 0})
    plan, _ = local.plan(path, nproc_per_worker=1, run_dir=tmp_path / "run")
    assert plan.checkpoints == str(tmp_path / "ckpt")
    planned: list[Any] = []

    def measured(sweep: Any, directory: Path) -> list[Any]:
        planned.append(sweep)
        raise KeyboardInterrupt  # planning passed: stop before anything runs

    monkeypatch.setattr(on_this_machine, "run", measured)
    assert main(["sweep", str(path), "--local", "--workers", "1", "--max-steps", "1", "--output", str(tmp_path / "o")]) == 130
    assert [r.workers for r in planned[0].runs] == [1]
    assert main(["validate", str(path)]) == 1
    assert main(["sweep", str(path), "--workers", "1", "--max-steps", "1"]) == 2
    assert "spec.checkpointing.directory" in capsys.readouterr().err
