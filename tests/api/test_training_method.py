"""spec.training.method, spec.training.dpo and dataset.format preference (issue 38): defaults, an
accepted DPO spec, the same spec refused where it cannot work (the exact messages are in
tests/validation/test_error_messages.py), and the CRD carrying fields and rules."""

from __future__ import annotations

from typing import Any

import pytest
from llamaft.api import crd as crdgen
from llamaft.api.spec import (
    DatasetFormat,
    DpoLoss,
    DpoReference,
    LlamaFineTuneSpec,
    TrainingJobConfig,
    TrainingMethod,
)
from llamaft.api.validation import SpecInvalid, validate_resource

from tests.api.test_validation import base


def dpo_object(**dpo: Any) -> dict[str, Any]:
    obj = base()
    obj["spec"]["dataset"] = {
        "format": "preference", "source": "org/pairs", "chatTemplate": "llama3",
        "fieldMapping": {"prompt": ["question"], "chosen": "good", "rejected": "bad"},
    }
    obj["spec"]["training"] = {"epochs": 1, "method": "dpo", **({"dpo": dpo} if dpo else {})}
    return obj


def test_sft_is_the_default_and_dpo_settings_default_to_trl() -> None:
    spec = LlamaFineTuneSpec.model_validate(base()["spec"])
    assert spec.training.method is TrainingMethod.SFT
    assert spec.training.dpo is None
    assert spec.dataset.field_mapping.chosen == "chosen" and spec.dataset.field_mapping.rejected == "rejected"
    dpo = LlamaFineTuneSpec.model_validate(dpo_object(beta=0.1)["spec"]).training.dpo
    assert dpo is not None
    # TRL's DPOConfig defaults: beta 0.1, loss_type ["sigmoid"].
    assert (dpo.beta, dpo.loss, dpo.reference) == (0.1, DpoLoss.SIGMOID, DpoReference.PRECOMPUTED)


def test_a_dpo_spec_is_accepted_and_reaches_the_trainer() -> None:
    config = validate_resource(dpo_object(beta=0.25, loss="ipo", reference="live")).training_config()
    assert isinstance(config, TrainingJobConfig)
    assert config.dataset.format is DatasetFormat.PREFERENCE
    assert config.dataset.field_mapping.prompt == ["question"]
    assert config.training.method is TrainingMethod.DPO
    assert config.training.dpo is not None
    assert (config.training.dpo.beta, config.training.dpo.loss, config.training.dpo.reference) == (
        0.25, DpoLoss.IPO, DpoReference.LIVE)


@pytest.mark.parametrize(("change", "path"), [
    (lambda o: o["spec"]["dataset"].update(format="chat", fieldMapping={}), "spec.dataset.format"),
    (lambda o: o["spec"]["training"].update(method="sft"), "spec.training.method"),
    (lambda o: o["spec"]["dataset"].update(packing=True), "spec.dataset.packing"),
])
def test_one_change_away_from_a_dpo_spec_is_refused_at_one_field(change: Any, path: str) -> None:
    obj = dpo_object()
    change(obj)
    with pytest.raises(SpecInvalid) as info:
        validate_resource(obj)
    assert [e.path for e in info.value.errors] == [path]


def test_the_crd_has_the_fields_and_the_rules() -> None:
    spec = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    training = spec["properties"]["training"]["properties"]
    assert training["method"]["enum"] == ["sft", "dpo"] and training["method"]["default"] == "sft"
    dpo = training["dpo"]["properties"]
    assert dpo["beta"]["default"] == 0.1 and dpo["beta"]["exclusiveMinimum"] is True
    assert dpo["loss"]["enum"] == ["sigmoid", "ipo"]
    assert dpo["reference"]["enum"] == ["precomputed", "live"]
    assert "preference" in spec["properties"]["dataset"]["properties"]["format"]["enum"]
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert "self.training.method != 'dpo' || self.dataset.format == 'preference'" in rules
    assert "self.training.method != 'dpo' || !self.dataset.packing" in rules
