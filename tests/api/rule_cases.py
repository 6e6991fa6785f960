"""One broken document for each CEL rule of the CRD that tests/api/test_validation.BROKEN does not
break, so that every rule is broken at least once (tests/api/test_rule_cases.py checks llamaft's
verdict on each; tests/controlplane/test_verdicts.py the real API server's), and the transition
rules (oldSelf: what may not change once created), each as (old object, new object)."""

from __future__ import annotations

import copy
from typing import Any

from tests.api.test_validation import base, with_


def _with(**sections: Any) -> dict[str, Any]:
    """`base()` with whole spec sections replaced (training keeps epochs: 1 unless given)."""
    obj = base()
    for key, value in sections.items():
        obj["spec"][key] = value
    return obj


ELASTIC = {"workers": 2, "gpusPerWorker": 8, "elastic": {"minWorkers": 1, "maxWorkers": 4}}

# (case, object, the path llamaft names, words its message contains)
RULE_CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("explicit hybrid groups with an elastic world size",
     _with(cluster=ELASTIC, fsdp={"shardingStrategy": "HYBRID_SHARD", "hybridShard": {"shardGroupSize": 8, "replicaGroupSize": 2}}),
     "spec.fsdp.hybridShard", "cannot follow an elastic world size"),
    ("global batch below the elastic maximum", _with(cluster=ELASTIC, training={"epochs": 1, "globalBatchSize": 16}),
     "spec.training.globalBatchSize", "below elastic.maxWorkers x gpusPerWorker"),
    ("accumulation beside a global batch", _with(training={"epochs": 1, "globalBatchSize": 64, "gradientAccumulationSteps": 2}),
     "spec.training.gradientAccumulationSteps", "derived from globalBatchSize"),
    ("float8 under FSDP1", _with(fsdp={"implementation": "fsdp1", "float8": {"enabled": True}}),
     "spec.fsdp.float8.enabled", "set fsdp.implementation to fsdp2"),
    ("float8 with fp16", _with(fsdp={"mixedPrecision": "fp16", "float8": {"enabled": True}}),
     "spec.fsdp.float8.enabled", "not fp16"),
    ("float8 all-gather with rowwise scaling", _with(fsdp={"float8": {"enabled": True, "recipe": "rowwise", "allGather": True}}),
     "spec.fsdp.float8.allGather", "only with tensorwise scaling"),
    ("W&B online without a key", _with(tracking={"wandb": {"project": "p", "mode": "online"}}),
     "spec.tracking.wandb.apiKeySecret", "needs wandb.apiKeySecret"),
    ("metrics without samples", _with(evaluation={"metrics": ["rouge"], "samples": 0}),
     "spec.evaluation.samples", "set evaluation.samples"),
    ("Kueue and a gang", _with(scheduling={"queueName": "q", "gang": {}}), "spec.scheduling.gang", "set one of them"),
    ("a Kueue priority without a queue", _with(scheduling={"priorityClass": "high"}),
     "spec.scheduling.priorityClass", "needs queueName"),
    ("generations under FSDP1", _with(evaluation={"samples": 4}, fsdp={"implementation": "fsdp1"}),
     "spec.evaluation.samples", "fsdp2"),
    ("DoRA with the float8 all-gather",
     _with(training={"epochs": 1, "lora": {"useDora": True}}, fsdp={"float8": {"enabled": True, "allGather": True}}),
     "spec.fsdp.float8.allGather", "training.lora.useDora with fsdp.float8.allGather"),
    ("a global batch while streaming", _with(dataset={"format": "samsum", "source": "knkarthick/samsum", "streaming": True},
                                             training={"maxSteps": 10, "globalBatchSize": 64}),
     "spec.training.globalBatchSize", "streaming"),
    ("a global batch below the world size", _with(training={"epochs": 1, "globalBatchSize": 8}),
     "spec.training.globalBatchSize", "below workers x gpusPerWorker"),
    ("compile under FSDP1", _with(fsdp={"implementation": "fsdp1", "compile": True}), "spec.fsdp.compile", "fsdp2"),
]


def _changed(path: str, value: Any, old: dict[str, Any]) -> dict[str, Any]:
    new = copy.deepcopy(old)
    *parents, leaf = path.split(".")
    node = new
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return new


_CHECKPOINTS = with_("spec.checkpointing", {"volumeClaim": "ckpt", "directory": "/checkpoints/a"})

# (case, the object as created, the object as updated, the path llamaft names, words of the message)
TRANSITIONS: list[tuple[str, dict[str, Any], dict[str, Any], str, str]] = [
    ("another model", base(), _changed("spec.model.source", "meta-llama/Llama-2-13b-hf", base()),
     "spec.model.source", "model.source is immutable"),
    ("another checkpoint directory", _CHECKPOINTS, _changed("spec.checkpointing.directory", "/checkpoints/b", _CHECKPOINTS),
     "spec.checkpointing.directory", "checkpointing.directory is immutable"),
    ("another backend", base(), _changed("spec.backend", "TrainJob", base()), "spec.backend", "backend is immutable"),
]
