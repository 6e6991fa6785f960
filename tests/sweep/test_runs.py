"""`llamaft sweep`'s runs: what each size changes of the file, and every refusal naming the option
or field (before anything starts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from llamaft.sweep.runs import SWEEP_LABEL, WORKERS_LABEL, SweepError, parse_sizes, plan_sweep


def write(tmp: Path, spec: dict[str, Any] | None = None, name: str = "blog-7b", **metadata: Any) -> Path:
    body = {
        "apiVersion": "llamaft.io/v1alpha1", "kind": "LlamaFineTune",
        "metadata": {"name": name, "uid": "abc", "resourceVersion": "7", **metadata},
        "spec": {
            "model": {"source": "meta-llama/Llama-2-7b-hf"},
            "dataset": {"source": "Samsung/samsum", "format": "samsum"},
            "training": {"epochs": 3, "warmupSteps": 100},
            "cluster": {"workers": 4, "gpusPerWorker": 8, "instanceType": "p4de.24xlarge"},
            "checkpointing": {"directory": "s3://bucket/blog"},
            **(spec or {}),
        },
        "status": {"phase": "Succeeded"},
    }
    path = tmp / "finetune.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_each_size_is_the_file_at_that_size_with_its_own_checkpoints(tmp_path: Path) -> None:
    plan = plan_sweep(write(tmp_path, labels={"team": "nlp"}), [1, 2, 16], 50)
    assert [r.name for r in plan.runs] == ["blog-7b-w1", "blog-7b-w2", "blog-7b-w16"]
    assert [r.devices for r in plan.runs] == [8, 16, 128]
    for run in plan.runs:
        meta, spec = run.body["metadata"], run.body["spec"]
        assert meta["labels"] == {"team": "nlp", SWEEP_LABEL: "blog-7b", WORKERS_LABEL: str(run.workers)}
        assert "uid" not in meta and "resourceVersion" not in meta and "status" not in run.body
        assert spec["cluster"]["workers"] == run.workers == run.spec.cluster.workers
        assert spec["training"] == {"maxSteps": 50, "warmupSteps": 50}
        assert spec["checkpointing"] == {"directory": f"s3://bucket/blog/sweep/{run.name}", "resume": False,
                                         "exportHuggingFace": False}
        assert run.spec.model.source == "meta-llama/Llama-2-7b-hf" and run.spec.cluster.instance_type == "p4de.24xlarge"
    assert plan.notes == ["spec.training.warmupSteps 100 is lowered to --max-steps 50 (the learning rate's ramp "
                          "does not change the work of a step)"]


def test_hybrid_sharding_within_a_worker_follows_the_size(tmp_path: Path) -> None:
    path = write(tmp_path, {"fsdp": {"shardingStrategy": "HYBRID_SHARD", "hybridShard": {"shardGroupSize": 8, "replicaGroupSize": 4}}})
    plan = plan_sweep(path, [1, 3], 20, name="hsdp")
    assert [r.spec.fsdp.hybrid_shard.replica_group_size for r in plan.runs if r.spec.fsdp.hybrid_shard] == [1, 3]
    assert [r.name for r in plan.runs] == ["hsdp-w1", "hsdp-w3"]


def test_elastic_is_left_out(tmp_path: Path) -> None:
    path = write(tmp_path, {"cluster": {"workers": 2, "gpusPerWorker": 8, "elastic": {"minWorkers": 2, "maxWorkers": 4}}})
    plan = plan_sweep(path, [1, 8], 20)
    assert all(r.spec.cluster.elastic is None for r in plan.runs) and [r.workers for r in plan.runs] == [1, 8]
    assert "spec.cluster.elastic is left out: a sweep measures fixed sizes" in plan.notes


def test_a_size_the_cluster_would_refuse_refuses_the_sweep_naming_the_size_and_field(tmp_path: Path) -> None:
    # Sharded over 16 ranks (2 workers x 8): the mesh cannot cover 1 or 3 workers.
    path = write(tmp_path, {"fsdp": {"shardingStrategy": "HYBRID_SHARD", "hybridShard": {"shardGroupSize": 16, "replicaGroupSize": 1}},
                            "cluster": {"workers": 2, "gpusPerWorker": 8}})
    with pytest.raises(SweepError) as exc:
        plan_sweep(path, [1, 2, 3], 10)
    assert sorted({line.split(":")[0] for line in exc.value.lines}) == ["--workers 1", "--workers 3"]
    assert all("hybridShard" in line for line in exc.value.lines), exc.value.lines


@pytest.mark.parametrize(("text", "sizes"), [("1,2,4,8,16", [1, 2, 4, 8, 16]), ("4, 1,4", [1, 4])])
def test_sizes(text: str, sizes: list[int]) -> None:
    assert parse_sizes(text) == sizes


@pytest.mark.parametrize("text", ["0", "1,x", "", "1,-2", "2.5"])
def test_bad_sizes_name_the_option(text: str) -> None:
    with pytest.raises(SweepError, match=r"^--workers: .* e\.g\. --workers 1,2,4,8,16"):
        parse_sizes(text)


def test_bad_input_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(SweepError, match=r"--name: .* pass a shorter --name"):
        plan_sweep(write(tmp_path), [1, 16], 5, name="n" * 40)
    with pytest.raises(SweepError, match=r"--max-steps"):
        plan_sweep(write(tmp_path), [1], 0)
    bad = write(tmp_path, {"training": {"epochs": 1, "learningRate": 7.0}})
    with pytest.raises(SweepError, match=r"spec.training.learningRate"):
        plan_sweep(bad, [1], 5)
    two = tmp_path / "two.yaml"
    two.write_text(write(tmp_path).read_text() + "---\n" + write(tmp_path).read_text())
    with pytest.raises(SweepError, match="exactly one LlamaFineTune document, the file has 2"):
        plan_sweep(two, [1], 5)
