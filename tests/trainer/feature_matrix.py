"""The trainer's features, their values and what the API refuses, in ONE place (issue #41).

Each `Factor` is a feature the LlamaFineTune API accepts; each of its `Value`s is the spec fragment
that selects it (deep-merged over `base_spec`). `REFUSED` lists the pairs of values the API refuses
(with the fields its error names and why the trainer cannot run them); `covering_rows` asks
allpairspy for the fewest rows that hold every other pair of values at least once.

A new feature joins by adding a `Factor` here (and, when the trainer cannot run some of its pairs,
a CEL rule in llamaft/api/spec.py and its `Refusal`s): tests/trainer/test_feature_matrix.py then
checks that the API refuses exactly the declared pairs, that every generated row validates, that
every allowed pair is covered, and runs every row as a real fine-tune.

What is not a factor here, and why:
- processes per worker: on CPU (`cluster.gpusPerWorker: 0`) the spec gives each worker one process,
  so `world` (workers) is the process count; two torchrun agents rendezvousing (`llamaft run
  --local`, etcd) are tests/trainer/test_local_run.py's subject, not a trainer feature.
- HYBRID_SHARD's default groups (one node's processes as a shard group): the matrix runs a world
  on one torchrun node, where that default is 1 replica x 2 shards (FULL_SHARD in effect), so the
  value sets the groups 2 workers would get (shard 1 x replica 2) explicitly.
- MLflow and W&B: each needs a server or a service process (tests/trainer/report/test_tracking.py); the
  tracker factor is TensorBoard (which `llamaft run --local` writes by default) or none.
"""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.trainer.conftest import base_config

FIRST_STEPS = 4
"""Optimizer steps of a row's first launch (it ends with a checkpoint and an eval)."""
RESUMED_STEPS = 6
"""maxSteps of the second launch, which resumes from the first one's checkpoint."""
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "targetModules": ["q_proj", "v_proj", "down_proj"]}
HYBRID_2X1 = {"shardGroupSize": 1, "replicaGroupSize": 2}
"""What HYBRID_SHARD's default groups are on 2 single-process workers: 2 replicas of 1 rank."""


@dataclass(frozen=True)
class Value:
    """One value of a factor and the spec fragment (camelCase, under `spec`) that selects it."""

    name: str
    fragment: Mapping[str, Any]


@dataclass(frozen=True)
class Factor:
    """A feature of the API: its name and every value the matrix tries."""

    name: str
    values: tuple[Value, ...]

    def value(self, name: str) -> Value:
        for value in self.values:
            if value.name == name:
                return value
        raise KeyError(f"factor {self.name} has no value {name!r}: {[v.name for v in self.values]}")


def _fsdp(**fields: Any) -> dict[str, Any]:
    return {"fsdp": fields}


FACTORS: tuple[Factor, ...] = (
    Factor("adapter", (
        Value("none", {}),
        Value("lora", {"training": {"lora": LORA}}),
        # DoRA exported merged and as an adapter: both export paths of peft models.
        Value("dora", {"training": {"lora": {**LORA, "useDora": True, "export": "both"}}}),
    )),
    Factor("evaluation", (
        Value("off", {}),
        Value("generations", {"evaluation": {"samples": 2, "maxNewTokens": 6}}),
        Value("rouge", {"evaluation": {"samples": 2, "maxNewTokens": 6, "metrics": ["rouge"]}}),
    )),
    Factor("packing", (
        Value("on", {"dataset": {"packing": True}}),  # bfd: each example attends to itself only
        Value("concatenate", {"dataset": {"packing": True, "packingStrategy": "concatenate"}}),
        Value("off", {"dataset": {"packing": False}}),
    )),
    Factor("implementation", (
        Value("fsdp2", _fsdp(implementation="fsdp2")),
        Value("fsdp1", _fsdp(implementation="fsdp1")),
    )),
    Factor("strategy", (
        Value("FULL_SHARD", _fsdp(shardingStrategy="FULL_SHARD")),
        Value("SHARD_GRAD_OP", _fsdp(shardingStrategy="SHARD_GRAD_OP")),
        Value("HYBRID_SHARD", _fsdp(shardingStrategy="HYBRID_SHARD", hybridShard=HYBRID_2X1)),
        Value("NO_SHARD", _fsdp(shardingStrategy="NO_SHARD")),
    )),
    Factor("precision", tuple(Value(p, _fsdp(mixedPrecision=p)) for p in ("fp32", "bf16", "pure-bf16", "fp16"))),
    Factor("checkpointing", tuple(
        Value(mode, _fsdp(activationCheckpointing={"mode": mode, "everyNLayers": 2}))
        for mode in ("none", "full", "selective", "selective-op")
    )),
    Factor("lossChunks", (
        Value("1", {"training": {"lossChunks": 1}}),
        Value("2", {"training": {"lossChunks": 2}}),
    )),
    Factor("float8", (
        Value("off", {}),
        # On CPU the trainer emulates float8 (torchao emulate=True): the same casts, scales and
        # FSDP2 float8 all-gather, matmuls in high precision.
        Value("tensorwise", _fsdp(float8={"enabled": True, "recipe": "tensorwise", "allGather": True})),
        Value("rowwise", _fsdp(float8={"enabled": True, "recipe": "rowwise", "allGather": False})),
    )),
    Factor("compile", (
        Value("off", _fsdp(compile=False)),
        Value("on", _fsdp(compile=True)),
    )),
    Factor("tracker", (
        Value("none", {}),
        Value("tensorboard", {"tracking": {"tensorboard": {}}}),
    )),
    Factor("world", (
        Value("1", {"cluster": {"workers": 1, "gpusPerWorker": 0}}),
        Value("2", {"cluster": {"workers": 2, "gpusPerWorker": 0}}),
    )),
)
BY_NAME = {factor.name: factor for factor in FACTORS}

Row = Mapping[str, str]
"""A combination: factor name -> value name (every factor, or a prefix of FACTORS while generating)."""


@dataclass(frozen=True)
class Refusal:
    """A pair of values the API refuses: the error names `fields` (under `spec.`); `why` the
    trainer cannot run it."""

    first: tuple[str, str]
    second: tuple[str, str]
    fields: tuple[str, ...]
    why: str

    def matches(self, row: Row) -> bool:
        return all(row.get(factor) == value for factor, value in (self.first, self.second))

    @property
    def name(self) -> str:
        return f"{self.first[0]}={self.first[1]}+{self.second[0]}={self.second[1]}"


def _refuse(first: str, first_values: Sequence[str], second: str, second_values: Sequence[str],
            fields: tuple[str, ...], why: str) -> list[Refusal]:
    return [Refusal((first, a), (second, b), fields, why) for a in first_values for b in second_values]


REFUSED: tuple[Refusal, ...] = (
    *_refuse("adapter", ["lora", "dora"], "implementation", ["fsdp1"], ("spec.fsdp.implementation",),
             "peft's adapters are sharded with FSDP2 only (LORA_FSDP1_RULE)"),
    *_refuse("evaluation", ["generations", "rouge"], "implementation", ["fsdp1"], ("spec.evaluation.samples",),
             "generations run on the FSDP2-sharded model (EVALUATION_FSDP2_RULE)"),
    *_refuse("float8", ["tensorwise", "rowwise"], "implementation", ["fsdp1"], ("spec.fsdp.float8.enabled",),
             "torchao's float8 scales and all-gather are FSDP2's"),
    *_refuse("float8", ["tensorwise", "rowwise"], "precision", ["fp16"], ("spec.fsdp.float8.enabled",),
             "torchao's float8 training keeps bf16 or fp32 high precision, not fp16 with loss scaling"),
    *_refuse("strategy", ["HYBRID_SHARD"], "world", ["1"], ("spec.fsdp.shardingStrategy", "spec.fsdp.hybridShard"),
             "HYBRID_SHARD replicates across groups: it needs at least 2 processes (HYBRID_WORLD_RULE)"),
    # Found by this matrix: peft's DoRA calls `.dequantize()` on a torchao weight, which FSDP2's float8
    # all-gather hands it as a Float8TrainingTensor ("aten.dequantize.self is not supported").
    *_refuse("adapter", ["dora"], "float8", ["tensorwise"], ("spec.fsdp.float8.allGather",),
             "DoRA's weight norm cannot read a float8 all-gathered weight (DORA_FLOAT8_RULE)"),
    # Found by this matrix: FSDP1's state dict keeps torch.compile's `_orig_mod` in the layers' names:
    # the checkpoint does not resume ("Missing key") and the export does not load.
    *_refuse("compile", ["on"], "implementation", ["fsdp1"], ("spec.fsdp.compile",),
             "FSDP1 + torch.compile checkpoints and exports carry _orig_mod names"),
)


def allowed(row: Row) -> bool:
    """Whether no refused pair is in `row` (a partial row is judged on the factors it has)."""
    return not any(refusal.matches(row) for refusal in REFUSED)


def _merge(into: dict[str, Any], fragment: Mapping[str, Any]) -> None:
    for key, value in fragment.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def base_spec(model: Path, directory: Path) -> dict[str, Any]:
    """What every row shares: the tiny-model run of tests/trainer (conftest.base_config) on CPU
    workers, exporting at the end and resuming from its directory."""
    spec = base_config(model, directory, training={"maxSteps": FIRST_STEPS},
                       checkpointing={"exportHuggingFace": True, "resume": True})
    spec.update({"cluster": {"workers": 1, "gpusPerWorker": 0}, "rendezvous": {"backend": "c10d"}})
    return spec


def spec_for(row: Row, model: Path, directory: Path) -> dict[str, Any]:
    """The LlamaFineTune `.spec` of a row: the base with each value's fragment merged in."""
    spec = base_spec(model, directory)
    for factor in FACTORS:
        if factor.name in row:
            _merge(spec, factor.value(row[factor.name]).fragment)
    return spec


COSTLY = ("compile", "on")
"""A value that makes a row cost much more than the others (torch.compile on CPU: about 30 s more per
launch under load, Dynamo tracing each layer for training, eval and every generation length; the
aot_eager backend costs as much): placed on the fewest rows that hold all its pairs."""


def covering_rows() -> list[dict[str, str]]:
    """Few rows that hold every allowed pair of values. allpairspy's greedy generator covers the
    factors but the costly one's (its filter sees each partial row and drops it when it holds a
    refused pair); the costly value then goes on the fewest of those rows that hold its pairs
    (greedy set cover), the rest get the factor's other value; last, rows for any pair still
    missing. allpairspy 2.5.1 stops early when a filter is given and leaves valid pairs out
    (thombashi/allpairspy issue #2; its fix, PR #10, is not released): the last step covers those."""
    from allpairspy import AllPairs

    costly_factor, costly_value = COSTLY
    others = [factor for factor in FACTORS if factor.name != costly_factor]
    names = [factor.name for factor in others]
    parameters = OrderedDict((factor.name, [value.name for value in factor.values]) for factor in others)

    def keep(values: list[str]) -> bool:
        return allowed(dict(zip(names, values, strict=False)))

    rows = [dict(zip(names, row, strict=True)) for row in AllPairs(parameters, filter_func=keep)]
    cheap = next(v.name for v in BY_NAME[costly_factor].values if v.name != costly_value)
    wanted = {(factor.name, value.name) for factor in others for value in factor.values
              if allowed({costly_factor: costly_value, factor.name: value.name})}
    chosen: set[int] = set()
    while True:
        gains = {index: len({(f, row[f]) for f in names} & wanted) for index, row in enumerate(rows)
                 if index not in chosen and allowed({**row, costly_factor: costly_value})}
        best = max(gains, key=lambda index: gains[index], default=None)
        if best is None or gains[best] == 0:
            break
        chosen.add(best)
        wanted -= {(f, rows[best][f]) for f in names}
    ordered = [{f.name: (costly_value if index in chosen else cheap) if f.name == costly_factor else row[f.name]
                for f in FACTORS} for index, row in enumerate(rows)]
    missing = _missing_pairs(ordered)
    ordered += [_completed(seed, missing) for seed in REQUIRED
                if not any(all(row[k] == v for k, v in seed.items()) for row in ordered)]
    return ordered + _rows_for_lost_pairs(ordered)


REQUIRED: tuple[dict[str, str], ...] = (
    # The wrappers the sharding plan picks when nothing needs FSDP: each takes more than a pair of
    # values, so pairwise coverage alone may miss them.
    {"world": "2", "strategy": "NO_SHARD", "implementation": "fsdp2", "precision": "fp32", "float8": "off"},  # DDP
    {"world": "1", "implementation": "fsdp2", "precision": "fp32", "float8": "off"},  # no wrapper
)
"""Partial rows the matrix holds whatever the pairwise generator chose."""


def _covered(rows: Sequence[Row]) -> set[tuple[tuple[str, str], tuple[str, str]]]:
    return {(a, b) for a, b in value_pairs() if any(row[a[0]] == a[1] and row[b[0]] == b[1] for row in rows)}


Pair = tuple[tuple[str, str], tuple[str, str]]


def _missing_pairs(rows: Sequence[Row]) -> list[Pair]:
    return [pair for pair in value_pairs() if allowed(dict(pair)) and pair not in _covered(rows)]


def _completed(seed: Row, missing: Sequence[Pair]) -> dict[str, str]:
    """`seed` with each other factor set to the allowed value that covers the most `missing` pairs
    with the values already chosen (ties: the first, the cheap value of COSTLY)."""
    row = dict(seed)
    for factor in FACTORS:
        if factor.name in row:
            continue
        candidates = [v.name for v in factor.values if allowed({**row, factor.name: v.name})]
        if not candidates:
            raise ValueError(f"no value of {factor.name} is allowed with {row}: a refusal of three values?")
        row[factor.name] = max(candidates, key=lambda v, f=factor.name: sum(  # type: ignore[misc]
            1 for a, b in missing if (a == (f, v) and row.get(b[0]) == b[1]) or (b == (f, v) and row.get(a[0]) == a[1])
        ))
    return {name: row[name] for name in (f.name for f in FACTORS)}


def _rows_for_lost_pairs(rows: Sequence[Row]) -> list[dict[str, str]]:
    """Greedy completion: a row per lost pair still missing (see `_completed`)."""
    missing = _missing_pairs(rows)
    added: list[dict[str, str]] = []
    while missing:
        row = _completed(dict(missing[0]), missing)
        added.append(row)
        missing = [pair for pair in missing if not (row[pair[0][0]] == pair[0][1] and row[pair[1][0]] == pair[1][1])]
    return added


def row_name(index: int, row: Row) -> str:
    """A short unique name (a directory name too): the row's number and its values that differ
    from each factor's first value."""
    parts = [f"{factor.name}-{row[factor.name]}" for factor in FACTORS if row[factor.name] != factor.values[0].name]
    return f"r{index:02d}-" + "-".join(parts) if parts else f"r{index:02d}-defaults"


def value_pairs() -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
    """Every pair of values of two different factors."""
    for first, second in itertools.combinations(FACTORS, 2):
        for a, b in itertools.product(first.values, second.values):
            yield (first.name, a.name), (second.name, b.name)
