"""spec.fsdp.float8 in the planner: FP8 capability in the catalog, the refusal on GPUs without FP8
(admission and `llamaft validate`), and float8 all-gather's smaller gathered parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
from llamaft.cli import main as cli_main
from llamaft.planner import admission, estimate_memory, setup_from_spec
from llamaft.planner.capacity import NO_FLOAT8
from llamaft.planner.catalog import GPUS, fp8_gpus, fp8_instance_types
from llamaft.planner.memory import float8_gathered_numel
from llamaft.planner.plan import float8_problem
from llamaft.planner.shapes import resolve_shape

from tests.planner.conftest import make_spec

FLOAT8 = {"fsdp.float8": {"enabled": True}}


def test_catalog_knows_which_gpus_have_fp8() -> None:
    assert fp8_gpus() == ["H100", "H100-PCIe", "H200", "L40S", "L4"]
    assert {g.name for g in GPUS.values() if g.fp8 is False} == {"A100-40GB", "A100-80GB", "A10G"}
    assert "p5.48xlarge" in fp8_instance_types() and "g6e.xlarge" in fp8_instance_types()
    assert not {"p4d.24xlarge", "p4de.24xlarge", "g5.xlarge"} & set(fp8_instance_types())


@pytest.mark.parametrize("instance", ["p4d.24xlarge", "p4de.24xlarge", "g5.48xlarge"])
def test_float8_is_refused_on_instance_types_without_fp8(instance: str) -> None:
    spec = make_spec(**FLOAT8, **{"cluster.instanceType": instance})
    verdict = admission(spec)
    assert (verdict.fits, verdict.reason, verdict.refuse) == (False, NO_FLOAT8, True)
    assert verdict.message.startswith("spec.fsdp.float8.enabled: ")
    assert f"instanceType {instance}" in verdict.message and "H100" in verdict.message
    assert "p5.48xlarge" in verdict.message


def test_float8_by_gpu_model_and_where_it_is_fine() -> None:
    onprem = make_spec(**FLOAT8, **{"cluster.instanceType": None, "cluster.gpuModel": "A100"})
    problem = float8_problem(onprem)
    assert problem is not None and "cluster.gpuModel A100" in problem
    for ok in (
        make_spec(**FLOAT8, **{"cluster.instanceType": "p5.48xlarge"}),
        make_spec(**FLOAT8, **{"cluster.instanceType": "g6e.48xlarge"}),
        make_spec(**FLOAT8, **{"cluster.instanceType": None}),  # unknown GPU: the trainer checks
        make_spec(**{"cluster.instanceType": "p4de.24xlarge"}),  # float8 off
    ):
        assert float8_problem(ok) is None
        assert admission(ok).reason != NO_FLOAT8


def test_llamaft_validate_refuses_float8_on_a100(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "ft.yaml"
    doc.write_text(
        "apiVersion: llamaft.io/v1alpha1\nkind: LlamaFineTune\nmetadata: {name: f8}\nspec:\n"
        "  model: {source: meta-llama/Llama-2-7b-hf}\n  dataset: {format: samsum, source: knkarthick/samsum}\n"
        "  fsdp: {float8: {enabled: true}}\n  cluster: {workers: 1, gpusPerWorker: 8, instanceType: p4de.24xlarge}\n"
        "  checkpointing: {directory: 's3://bucket/f8'}\n"
    )
    assert cli_main(["validate", str(doc)]) == 1  # the operator's refusal (--schema-only is the API server's alone)
    assert "spec.fsdp.float8.enabled: the A100-80GB" in capsys.readouterr().out
    doc.write_text(doc.read_text().replace("p4de.24xlarge", "p5.48xlarge"))
    assert cli_main(["validate", str(doc)]) == 0


def test_float8_all_gather_halves_the_converted_weights_gathered_bytes() -> None:
    shape = resolve_shape("meta-llama/Llama-2-7b-hf", None)
    bf16 = setup_from_spec(make_spec(**{"cluster.instanceType": "p5.48xlarge"}))
    f8 = setup_from_spec(make_spec(**FLOAT8, **{"cluster.instanceType": "p5.48xlarge"}))
    rowwise = setup_from_spec(make_spec(**{"fsdp.float8": {"enabled": True, "recipe": "rowwise", "allGather": False},
                                           "cluster.instanceType": "p5.48xlarge"}))
    assert f8.float8_all_gather and not rowwise.float8_all_gather and not bf16.float8_all_gather
    # Every Llama-2-7B projection divides 16: all 7 weights of a layer (202 M elements) gather in float8.
    h, i = shape.hidden_size, shape.intermediate_size
    assert float8_gathered_numel(shape, f8) == 4 * h * h + 3 * h * i
    a, b, r = estimate_memory(shape, bf16), estimate_memory(shape, f8), estimate_memory(shape, rowwise)
    assert b.components["gathered_parameters"] < a.components["gathered_parameters"]
    assert r.components == a.components  # rowwise: no float8 all-gather, same bytes
    for name in ("parameters", "optimizer"):
        assert b.components[name] == a.components[name]  # masters and optimizer state unchanged
    # Each gathered layer copy held at the forward peak takes 1 byte less per converted weight
    # element (bf16 -> float8): at least two copies (the layer and its prefetched successor).
    weights = 4 * h * h + 3 * h * i
    saved = a.phase_peaks["forward"] - b.phase_peaks["forward"]
    assert saved >= 2 * weights, (saved, weights)
    assert b.peak_bytes <= a.peak_bytes
