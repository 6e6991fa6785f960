"""Helpers for the planner tests: specs built from a small dict with dotted overrides."""

from __future__ import annotations

from typing import Any

from llamaft.api.spec import LlamaFineTuneSpec


def make_spec(**overrides: Any) -> LlamaFineTuneSpec:
    """A Llama-2-7B spec on one p4de node, with camelCase dotted-path overrides
    (`make_spec(**{"fsdp.mixedPrecision": "fp32"})`); a None value removes the field."""
    body: dict[str, Any] = {
        "model": {"source": "meta-llama/Llama-2-7b-hf"},
        "dataset": {"format": "samsum", "source": "knkarthick/samsum", "maxSeqLength": 4096, "packing": True},
        "training": {"maxSteps": 100, "perDeviceBatchSize": 1},
        "fsdp": {"shardingStrategy": "FULL_SHARD", "mixedPrecision": "bf16", "activationCheckpointing": {"mode": "full"}},
        "cluster": {"workers": 1, "gpusPerWorker": 8, "instanceType": "p4de.24xlarge"},
    }
    for path, value in overrides.items():
        node = body
        keys = path.split(".")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return LlamaFineTuneSpec.model_validate(body)
