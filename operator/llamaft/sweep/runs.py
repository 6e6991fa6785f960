"""The runs of a sweep: the file's LlamaFineTune once per size, each checked as the API server and
the operator would check it before any run starts (one bad size refuses the whole sweep, naming the
size, the field and the fix, instead of failing on the cluster an hour in).

What differs between the sizes and the file, and why:
- `metadata.name` `<sweep>-w<N>`, labels `llamaft.io/sweep` and `llamaft.io/sweep-workers`: one run
  per size, found again by label (`kubectl get finetunes -l llamaft.io/sweep=<sweep>`);
- `spec.cluster.workers` N, and `spec.fsdp.hybridShard.replicaGroupSize` N where the file shards
  within a worker (shardGroupSize = gpusPerWorker): the mesh must cover the ranks;
- `spec.training.maxSteps` (`--max-steps`; epochs dropped): every size does the same steps;
- `spec.checkpointing`: a directory of the size's own, no resume and no export: a size never
  resumes another size's (or an earlier sweep's) checkpoint, which would leave no step to time,
  and the export is not what is measured;
- `spec.cluster.elastic` dropped: a sweep measures fixed sizes.
Everything else (model, data, precision, sharding, tracking, scheduling) is the file's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llamaft.api.documents import read_documents
from llamaft.api.resource import MAX_NAME_LENGTH
from llamaft.api.spec import LlamaFineTuneSpec
from llamaft.api.validation import FieldError, SpecInvalid, validate_resource

SWEEP_LABEL = "llamaft.io/sweep"
WORKERS_LABEL = "llamaft.io/sweep-workers"
MAX_SIZES = 32


class SweepError(Exception):
    """Input a sweep cannot run: every line names the option or field and the fix."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


@dataclass(frozen=True)
class SizedRun:
    """One size of the sweep: the LlamaFineTune object to create and its validated spec."""

    workers: int
    name: str
    body: dict[str, Any]
    spec: LlamaFineTuneSpec

    @property
    def devices(self) -> int:
        """Ranks of the run on a cluster (workers x GPUs per worker; a CPU worker is one rank)."""
        return self.workers * max(self.spec.cluster.gpus_per_worker, 1)


@dataclass(frozen=True)
class SweepPlan:
    sweep: str
    """The sweep's name: the runs' label value and their name prefix."""
    source: str
    """The file the sweep is of."""
    max_steps: int
    namespace: str | None
    """The file's metadata.namespace (None: the caller's default)."""
    model: str
    runs: list[SizedRun]
    notes: list[str] = field(default_factory=list)
    """What was changed beyond the sizes' own fields, to print."""


def parse_sizes(text: str) -> list[int]:
    """`--workers 1,2,4,8,16`: distinct sizes, ascending."""
    sizes: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise SweepError([f"--workers: {part!r} is not a worker count: give counts of at least 1 separated by "
                              "commas, e.g. --workers 1,2,4,8,16"])
        sizes.add(int(part))
    if len(sizes) > MAX_SIZES:
        raise SweepError([f"--workers: {len(sizes)} sizes; a sweep runs at most {MAX_SIZES}"])
    return sorted(sizes)


def plan_sweep(path: str | Path, sizes: list[int], max_steps: int, *, name: str | None = None,
               check_children: bool = True) -> SweepPlan:
    """Every size's LlamaFineTune, validated (SweepError lists every problem, size by size).
    `check_children`: also render and check the objects the operator would create for each."""
    if max_steps < 1:
        raise SweepError([f"--max-steps: {max_steps}: give at least 1 (steps per size; the first is not timed)"])
    docs = read_documents(path)
    if len(docs) != 1:
        raise SweepError([f"{path}: a sweep is of exactly one LlamaFineTune document, the file has {len(docs)}"])
    doc = docs[0]
    if doc.errors:
        raise SweepError([f"{doc.label}: {e}" for e in doc.errors])
    try:
        base_spec = validate_resource(doc.body)
    except SpecInvalid as exc:
        raise SweepError([f"{doc.label}: {e}" for e in exc.errors]) from exc
    base = doc.body
    sweep = name or str(base["metadata"]["name"])
    longest = max(len(f"{sweep}-w{n}") for n in sizes)
    if longest > MAX_NAME_LENGTH:
        raise SweepError([f"--name: the runs are named <sweep>-w<workers>, and {sweep}-w{max(sizes)} has {longest} "
                          f"characters (at most {MAX_NAME_LENGTH}): pass a shorter --name"])
    namespace = base["metadata"].get("namespace")
    notes: list[str] = []
    if base_spec.cluster.elastic is not None:
        notes.append("spec.cluster.elastic is left out: a sweep measures fixed sizes")
    warmup = base_spec.training.warmup_steps
    if warmup > max_steps:
        notes.append(f"spec.training.warmupSteps {warmup} is lowered to --max-steps {max_steps} (the learning rate's "
                     "ramp does not change the work of a step)")
    runs: list[SizedRun] = []
    errors: list[str] = []
    for workers in sizes:
        body = sized_body(base, base_spec, sweep=sweep, workers=workers, max_steps=max_steps)
        try:
            spec = validate_resource(body)
        except SpecInvalid as exc:
            errors += [f"--workers {workers}: {e}" for e in exc.errors]
            continue
        if check_children:
            errors += [f"--workers {workers}: {e}" for e in _children(spec, body, namespace)]
        runs.append(SizedRun(workers, str(body["metadata"]["name"]), body, spec))
    if errors:
        raise SweepError(errors)
    return SweepPlan(sweep, str(path), max_steps, namespace, base_spec.model.source, runs, notes)


def sized_body(base: dict[str, Any], base_spec: LlamaFineTuneSpec, *, sweep: str, workers: int,
               max_steps: int) -> dict[str, Any]:
    """The file's object at `workers` workers (the module docstring says what changes and why)."""
    body = copy.deepcopy(base)
    body.pop("status", None)
    meta = body["metadata"]
    for key in ("uid", "resourceVersion", "generation", "creationTimestamp", "managedFields", "ownerReferences",
                "generateName"):
        meta.pop(key, None)
    meta["name"] = f"{sweep}-w{workers}"
    meta["labels"] = {**(meta.get("labels") or {}), SWEEP_LABEL: sweep, WORKERS_LABEL: str(workers)}
    spec = body["spec"]
    cluster = spec.setdefault("cluster", {})
    cluster.pop("elastic", None)
    cluster["workers"] = workers
    training = spec.setdefault("training", {})
    training.pop("epochs", None)
    training["maxSteps"] = max_steps
    if base_spec.training.warmup_steps > max_steps:
        training["warmupSteps"] = max_steps
    hybrid = base_spec.fsdp.hybrid_shard
    if hybrid is not None and hybrid.shard_group_size == max(base_spec.cluster.gpus_per_worker, 1):
        spec["fsdp"]["hybridShard"]["replicaGroupSize"] = workers
    checkpointing = spec.setdefault("checkpointing", {})
    checkpointing["directory"] = f"{base_spec.checkpointing.directory.rstrip('/')}/sweep/{sweep}-w{workers}"
    checkpointing["resume"] = False
    checkpointing["exportHuggingFace"] = False
    return body


def _children(spec: LlamaFineTuneSpec, body: dict[str, Any], namespace: str | None) -> list[FieldError]:
    """The operator's own check of what it would create (llamaft.render.admission)."""
    from llamaft.render.admission import child_errors

    return child_errors(spec, str(body["metadata"]["name"]), namespace or "default")
