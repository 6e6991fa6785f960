"""spec.training.globalBatchSize (issue 39): accepted where every rank gets at least one sequence
per step, refused by CEL naming the field (with a static message: the API server's cost estimate
refuses a messageExpression that prints numbers) where the world size, or an elastic run's largest
one, exceeds it; gradientAccumulationSteps is derived, so setting both is refused; a streamed
dataset cannot follow a global order. `llamaft validate` refuses what the API server refuses (the
same CEL rules, evaluated by api.validation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from llamaft.api import crd as crdgen
from llamaft.api.validation import SpecInvalid, validate_resource
from llamaft.cli import main

from tests.api.test_validation import base


def spec_with(global_batch: int, workers: int = 2, gpus: int = 8, elastic: tuple[int, int] | None = None,
              **training: Any) -> dict[str, Any]:
    obj = base()
    obj["spec"]["cluster"] = {"workers": workers, "gpusPerWorker": gpus,
                              **({"elastic": {"minWorkers": elastic[0], "maxWorkers": elastic[1]}} if elastic else {})}
    obj["spec"]["training"] = {"epochs": 1, "globalBatchSize": global_batch, **training}
    return obj


def errors(obj: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecInvalid) as caught:
        validate_resource(obj)
    return [str(e) for e in caught.value.errors]


def test_accepted_when_every_rank_gets_a_sequence_uneven_splits_included() -> None:
    assert validate_resource(spec_with(16)).training.global_batch_size == 16
    # 2 x 8 = 16 ranks, 4 per device: 1 micro-step, uneven (the short ranks run a filler)
    assert validate_resource(spec_with(17, perDeviceBatchSize=4)).training.global_batch_size == 17
    assert validate_resource(spec_with(24, workers=2, elastic=(1, 3))).training.global_batch_size == 24
    assert validate_resource(spec_with(3, workers=3, gpus=0)).training.global_batch_size == 3
    assert validate_resource(base()).training.global_batch_size is None


BELOW_THE_WORLD = (
    "spec.training.globalBatchSize: globalBatchSize is below workers x gpusPerWorker ranks: every rank needs at "
    "least one sequence per step; set globalBatchSize >= workers x gpusPerWorker, or use fewer workers"
)


def test_below_the_world_size_is_refused_naming_the_bound() -> None:
    assert errors(spec_with(12)) == [BELOW_THE_WORLD]
    assert errors(spec_with(4, workers=1)) == [BELOW_THE_WORLD]
    # one sequence short of the world size is refused; the world size itself is accepted (above)
    assert errors(spec_with(15)) == [BELOW_THE_WORLD]


def test_an_elastic_run_is_checked_at_its_largest_size() -> None:
    assert errors(spec_with(20, workers=2, elastic=(1, 3))) == [
        "spec.training.globalBatchSize: globalBatchSize is below elastic.maxWorkers x gpusPerWorker ranks, the most "
        "this run may get: every rank needs at least one sequence per step; set globalBatchSize >= elastic.maxWorkers "
        "x gpusPerWorker or lower elastic.maxWorkers"
    ]


def test_accumulation_is_derived_and_streaming_refused() -> None:
    (message,) = errors(spec_with(32, gradientAccumulationSteps=2))
    assert message.startswith("spec.training.gradientAccumulationSteps: gradientAccumulationSteps is derived from "
                              "globalBatchSize")
    assert message.endswith("or remove globalBatchSize to set the accumulation steps per rank yourself")
    obj = spec_with(32, maxSteps=10)
    del obj["spec"]["training"]["epochs"]
    obj["spec"]["dataset"]["streaming"] = True
    (message,) = errors(obj)
    assert message.startswith("spec.training.globalBatchSize: training.globalBatchSize takes each step's items from "
                              "one global order")


def test_the_crd_carries_the_field_and_rules() -> None:
    schema = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    training = schema["properties"]["training"]
    assert training["properties"]["globalBatchSize"]["minimum"] == 1
    paths = [r.get("fieldPath") for r in schema["x-kubernetes-validations"]]
    assert paths.count(".training.globalBatchSize") == 3
    assert any(r.get("fieldPath") == ".gradientAccumulationSteps" for r in training["x-kubernetes-validations"])


def test_llamaft_validate_and_plan_refuse_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "small-batch.yaml"
    path.write_text(yaml.safe_dump(spec_with(12)))
    for command in (["validate", "--schema-only"], ["plan"]):
        assert main([*command, str(path)]) != 0
        out = capsys.readouterr()
        assert BELOW_THE_WORLD in out.out + out.err
    path.write_text(yaml.safe_dump(spec_with(16)))
    assert main(["validate", "--schema-only", str(path)]) == 0
