"""The capacity plan of a LlamaFineTune: per-GPU memory and its verdict, the cheapest fixes, host
RAM while loading, checkpoint sizes and the expected speed. Pure functions, no torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from llamaft.api.flops import flops_per_token
from llamaft.api.quantity import parse_quantity
from llamaft.api.spec import (
    CheckpointingMode,
    DpoReference,
    DpoSpec,
    FsdpImplementation,
    LlamaFineTuneSpec,
    MixedPrecision,
    ShardingStrategy,
    TrainingMethod,
)
from llamaft.planner.catalog import GiB, GpuModel, InstanceType, gpu_model, instance_type
from llamaft.planner.memory import (
    COMPONENTS,
    Setup,
    master_bytes,
    op_sac_recomputed_fraction,
    setup_from_spec,
)
from llamaft.planner.replay import MemoryEstimate, estimate_memory
from llamaft.planner.shapes import ModelShape

# ------------------------------------------------------------------------------ assumptions
CUDA_CONTEXT_BYTES = 1 * GiB
"""Per GPU, outside PyTorch's allocator: the CUDA context (about 0.5 GiB with lazy module loading)
plus NCCL communicator buffers (a few hundred MiB). An assumption, stated in every plan."""
FRAGMENTATION = 0.10
"""The caching allocator reserves more than it hands out (block rounding, fragmentation): 10% of
the tensor peak is added. An assumption, stated in every plan."""
DEFAULT_MFU = 0.40
"""Model FLOPs utilisation assumed for the time estimate (torchtitan reports 33-39% for Llama 3.1 8B
with FSDP on H100 and 51-61% on A100); the trainer reports the real figure as `mfu`."""
HOST_BYTES_PER_GPU_PROCESS = 4 * GiB
"""Host RAM of one GPU training process besides the model (torch and CUDA libraries, the
tokenised dataset, the data loader). An assumption."""
HOST_BYTES_PER_CPU_PROCESS = 1 * GiB
TIGHT = 0.90
"""A plan above this fraction of the GPU's memory fits but is reported as tight."""

# Records in the training split of well-known hub datasets (from their dataset cards), to turn
# epochs into steps when sequences are padded (one record per sequence).
KNOWN_DATASET_RECORDS: dict[str, int] = {
    "knkarthick/samsum": 14732,  # huggingface.co/datasets/knkarthick/samsum: train 14,732 / val 818 / test 819
    "samsum": 14732,
    "tatsu-lab/alpaca": 52002,  # huggingface.co/datasets/tatsu-lab/alpaca: 52,002 rows
}


def gib(n: float) -> str:
    """Bytes for people: GiB with one decimal, MiB below 1 GiB."""
    if abs(n) < GiB:
        return f"{n / 2**20:,.1f} MiB"
    return f"{n / GiB:,.1f} GiB"


# ----------------------------------------------------------------------------------- GPU
@dataclass(frozen=True)
class GpuInfo:
    """The GPU a plan is for and where that came from."""

    model: GpuModel | None
    memory_bytes: int | None
    instance: InstanceType | None
    source: str
    warnings: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        if self.model is not None:
            return self.model.name
        return "GPU" if self.memory_bytes is None else f"GPU with {gib(self.memory_bytes)}"

    @property
    def peak_flops(self) -> float | None:
        return self.model.peak_bf16_flops if self.model is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name if self.model else None,
            "memoryBytes": self.memory_bytes,
            "peakBf16Flops": self.peak_flops,
            "instanceType": self.instance.name if self.instance else None,
            "source": self.source,
            "warnings": list(self.warnings),
        }


def resolve_gpu(spec: LlamaFineTuneSpec) -> GpuInfo:
    """The GPU from cluster.gpuModel / gpuMemory (overrides) or the instance type's catalog entry."""
    cluster = spec.cluster
    warnings: list[str] = []
    inst = instance_type(cluster.instance_type) if cluster.instance_type else None
    model: GpuModel | None = None
    source = ""
    if cluster.gpu_model:
        model = gpu_model(cluster.gpu_model)
        source = f"cluster.gpuModel {cluster.gpu_model}"
        if model is None:
            warnings.append(f"cluster.gpuModel {cluster.gpu_model!r} is not in the catalog "
                            f"({', '.join(sorted(_gpu_names()))}); set cluster.gpuMemory too")
    elif inst is not None:
        model = gpu_model(inst.gpu)
        source = f"instanceType {inst.name}"
    elif cluster.instance_type:
        warnings.append(f"instanceType {cluster.instance_type} is not in the catalog; "
                        "set cluster.gpuModel or cluster.gpuMemory")
    memory = model.memory_bytes if model else None
    if cluster.gpu_memory:
        memory = parse_quantity(cluster.gpu_memory)
        source = (source + ", " if source else "") + f"cluster.gpuMemory {cluster.gpu_memory}"
    if inst is not None and cluster.gpus_per_worker > inst.gpus:
        warnings.append(f"gpusPerWorker {cluster.gpus_per_worker} exceeds the {inst.gpus} GPUs of a {inst.name}: "
                        "the workers cannot be scheduled")
    if inst is not None and cluster.efa_devices_per_worker > inst.efa_devices:
        warnings.append(f"efaDevicesPerWorker {cluster.efa_devices_per_worker} exceeds the {inst.efa_devices} "
                        f"EFA devices of a {inst.name}")
    return GpuInfo(model, memory, inst, source or "unknown", tuple(warnings))


def float8_problem(spec: LlamaFineTuneSpec) -> str | None:
    """Why spec.fsdp.float8 cannot run on the spec's GPUs (no FP8 tensor cores), or None (float8
    off, the GPU has FP8, or the GPU is unknown: the trainer checks the device itself)."""
    if not spec.fsdp.float8.enabled or spec.cluster.gpus_per_worker == 0:
        return None
    gpu = resolve_gpu(spec)
    if gpu.model is None or gpu.model.fp8 is not False:
        return None
    from llamaft.planner.catalog import fp8_gpus, fp8_instance_types

    capability = gpu.model.compute_capability or (0, 0)
    where = f", from {gpu.source}" if gpu.source != "unknown" else ""
    return (f"spec.fsdp.float8.enabled: the {gpu.model.name} (compute capability {capability[0]}.{capability[1]}"
            f"{where}) has no FP8 tensor cores; float8 training needs compute capability 8.9 or newer: "
            f"{', '.join(fp8_gpus())} (instance types {', '.join(fp8_instance_types())}); "
            "set fsdp.float8.enabled to false or choose such GPUs")


def _gpu_names() -> list[str]:
    from llamaft.planner.catalog import GPUS

    return list(GPUS)


# --------------------------------------------------------------------------- host, disk
@dataclass(frozen=True)
class HostMemory:
    """Host RAM per node: every process has its baseline; while loading, each reads the weights
    tensor by tensor (llamaft_trainer/model/loading.py: its own slices, or rank 0 one tensor at a time
    for the broadcast), so it holds at most the largest tensor besides its shards; CPU offload
    keeps each rank's shards and optimizer state in host memory. DoRA's magnitudes are computed on
    the host from a copy of the rank's rows of each adapted weight, made after that tensor's read
    buffer is freed: within the same bound."""

    processes_per_node: int
    per_process_bytes: int
    loading_bytes: int
    """Per node while loading: one read buffer of the largest tensor (in the master dtype) per process."""
    offload_bytes_per_node: int
    node0_bytes: int
    other_node_bytes: int
    limit_bytes: int | None
    limit_source: str
    fits: bool | None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (
            "processes_per_node", "per_process_bytes", "loading_bytes", "offload_bytes_per_node",
            "node0_bytes", "other_node_bytes", "limit_bytes", "limit_source", "fits")}


@dataclass(frozen=True)
class CheckpointSize:
    model_bytes: int
    optimizer_bytes: int
    per_save_bytes: int
    keep_last: int
    disk_bytes: int
    """Peak on disk: keepLast complete checkpoints plus the one being written, plus the export."""
    export_bytes: int
    saves: int | None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (
            "model_bytes", "optimizer_bytes", "per_save_bytes", "keep_last", "disk_bytes", "export_bytes", "saves")}


@dataclass(frozen=True)
class Throughput:
    flops_per_token: float
    peak_flops_per_gpu: float | None
    gpus: int
    mfu_assumed: float
    recompute_factor: float
    """Hardware FLOPs / model FLOPs: activation recomputation repeats checkpointed forwards."""
    tokens_per_step: int
    tokens_per_second: float | None
    step_seconds: float | None
    total_steps: int | None
    total_seconds: float | None
    steps_note: str
    reference_seconds: float | None = None
    """DPO, full fine-tuning, precomputed reference: the pass of the initial model over every pair
    before the first step (included in total_seconds); None when no such pass or it cannot be told."""
    reference_note: str = ""

    @property
    def effective_mfu(self) -> float:
        return self.mfu_assumed / self.recompute_factor

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (
            "flops_per_token", "peak_flops_per_gpu", "gpus", "mfu_assumed", "recompute_factor", "tokens_per_step",
            "tokens_per_second", "step_seconds", "total_steps", "total_seconds", "steps_note", "reference_seconds",
            "reference_note")}
        d["effective_mfu"] = self.effective_mfu
        return d


@dataclass(frozen=True)
class Fix:
    title: str
    changes: dict[str, Any]
    """camelCase spec paths and their new values."""
    peak_bytes: int
    required_bytes: int
    saving_bytes: int
    fits: bool
    cost: str

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "changes": dict(self.changes), "peakBytes": self.peak_bytes,
                "requiredBytes": self.required_bytes, "savingBytes": self.saving_bytes, "fits": self.fits,
                "cost": self.cost}

    def changes_text(self) -> str:
        return ", ".join(f"remove {k}" if v is None else f"{k}: {_yaml_value(v)}" for k, v in self.changes.items())


def _yaml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(str(x) for x in v) + "]"
    return str(v)


@dataclass
class Plan:
    spec: LlamaFineTuneSpec
    shape: ModelShape
    setup: Setup
    gpu: GpuInfo
    memory: MemoryEstimate
    allowance_bytes: int
    required_bytes: int
    capacity_bytes: int | None
    fits: bool | None
    host: HostMemory
    checkpoint: CheckpointSize
    throughput: Throughput
    fixes: list[Fix] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    parameter_source: str = "analytic"

    @property
    def cpu_only(self) -> bool:
        return self.spec.cluster.gpus_per_worker == 0

    @property
    def tight(self) -> bool:
        return bool(self.fits and self.capacity_bytes and self.required_bytes > TIGHT * self.capacity_bytes)

    def cheapest_fix(self) -> Fix | None:
        return next((f for f in self.fixes if f.fits), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.shape.to_dict(),
            "parameters": self.memory.parameters,
            "parameterSource": self.parameter_source,
            "gpu": self.gpu.to_dict(),
            "memory": self.memory.to_dict(),
            "allowanceBytes": self.allowance_bytes,
            "requiredBytes": self.required_bytes,
            "capacityBytes": self.capacity_bytes,
            "fits": self.fits,
            "tight": self.tight,
            "host": self.host.to_dict(),
            "checkpoint": self.checkpoint.to_dict(),
            "throughput": self.throughput.to_dict(),
            "fixes": [f.to_dict() for f in self.fixes],
            "notes": list(self.notes),
            "assumptions": {
                "cudaContextBytes": CUDA_CONTEXT_BYTES, "fragmentation": FRAGMENTATION,
                "mfu": self.throughput.mfu_assumed, "hostBytesPerGpuProcess": HOST_BYTES_PER_GPU_PROCESS,
            },
        }


# ------------------------------------------------------------------------------ pieces
def allowance(peak_bytes: int, cpu_only: bool) -> int:
    if cpu_only:
        return 0
    return int(CUDA_CONTEXT_BYTES + FRAGMENTATION * peak_bytes)


def host_memory(spec: LlamaFineTuneSpec, shape: ModelShape, est: MemoryEstimate, gpu: GpuInfo) -> HostMemory:
    procs = max(spec.cluster.gpus_per_worker, 1)
    cpu_only = spec.cluster.gpus_per_worker == 0
    base = HOST_BYTES_PER_CPU_PROCESS if cpu_only else HOST_BYTES_PER_GPU_PROCESS
    m = master_bytes(spec.fsdp.mixed_precision)
    lora = spec.training.lora if spec.training.lora is not None and spec.training.lora.enabled else None
    adapters = shape.lora_parameters(lora.r, list(lora.target_modules), lora.use_dora) if lora else 0
    del adapters  # adapters are initialised in place: nothing is read for them
    largest = max(shape.vocab_size * shape.hidden_size, max(a * b for a, b in shape.linear_shapes().values()))
    loading = m * largest * procs
    if cpu_only:
        # on the CPU the training tensors themselves are host memory
        offload = est.peak_bytes * procs
    else:
        offload = est.host_offloaded_bytes * procs
    node0 = procs * base + loading + offload  # every node alike (no rank reads the whole model)
    other = node0
    limit: int | None = None
    limit_source = "unknown"
    if spec.cluster.resources.memory:
        limit = parse_quantity(spec.cluster.resources.memory)
        limit_source = f"cluster.resources.memory {spec.cluster.resources.memory}"
    elif gpu.instance is not None:
        limit = gpu.instance.host_memory_bytes
        limit_source = f"{gpu.instance.name} host memory"
    fits = None if limit is None else node0 <= limit
    return HostMemory(procs, base, loading, offload, node0, other, limit, limit_source, fits)


def checkpoint_size(spec: LlamaFineTuneSpec, shape: ModelShape, est: MemoryEstimate,
                    total_steps: int | None) -> CheckpointSize:
    """DCP saves the whole model state dict (frozen base weights too) in the master dtype and
    AdamW's two moments for the trainable parameters; keepLast complete ones stay, and the next
    is written before the oldest is deleted. The export is the model in model.dtype (LoRA: the
    adapter, in the master dtype)."""
    m = master_bytes(spec.fsdp.mixed_precision)
    model_bytes = m * est.parameters
    optimizer_bytes = 2 * m * est.trainable_parameters
    per_save = model_bytes + optimizer_bytes
    keep = spec.checkpointing.keep_last
    lora = spec.training.lora is not None and spec.training.lora.enabled
    export_dtype = {"bfloat16": 2, "float16": 2, "float32": 4}[spec.model.dtype.value]
    export = m * est.trainable_parameters if lora else export_dtype * est.parameters
    if not spec.checkpointing.export_hugging_face:
        export = 0
    saves = None
    if total_steps is not None:
        saves = total_steps // spec.checkpointing.every_n_steps + (1 if total_steps % spec.checkpointing.every_n_steps else 0)
    disk = per_save * (min(keep, saves) + 1 if saves is not None else keep + 1) + export
    return CheckpointSize(model_bytes, optimizer_bytes, per_save, keep, disk, export, saves)


def recompute_factor(shape: ModelShape, setup: Setup) -> float:
    """Checkpointed layers run their forward twice: 8/6 of their share of the model FLOPs. DPO
    under LoRA adds the reference's no-grad forward (adapters off) of every micro-batch: 2/6, and
    so does the live reference's (the frozen copy) under full fine-tuning."""
    reference = 2.0 / 6.0 if setup.dpo and (setup.lora or setup.dpo_live_reference) else 0.0
    return reference + _recompute_factor(shape, setup)


def _recompute_factor(shape: ModelShape, setup: Setup) -> float:
    if setup.ac_mode is CheckpointingMode.NONE:
        return 1.0
    layers = shape.num_layers
    ckpt = layers if setup.ac_mode is CheckpointingMode.FULL else len(range(0, layers, setup.ac_every))
    layer_share = layers * shape.layer_parameters / max(shape.parameters - shape.embedding_parameters, 1)
    if setup.ac_mode is CheckpointingMode.SELECTIVE_OP:
        # every layer, but only the matmuls the policy does not keep (op_sac_recomputed_fraction)
        return 1.0 + (2.0 / 6.0) * layer_share * op_sac_recomputed_fraction(shape, setup)
    return 1.0 + (2.0 / 6.0) * layer_share * ckpt / layers


def training_steps(spec: LlamaFineTuneSpec, records: int | None, dataset_tokens: int | None) -> tuple[int | None, str]:
    t = spec.training
    if t.max_steps is not None:
        return t.max_steps, f"maxSteps {t.max_steps}"
    assert t.epochs is not None
    world = spec.world_size
    seq = spec.dataset.max_seq_length
    train_fraction = 1.0 - spec.dataset.validation_split
    if spec.dataset.packing:
        if dataset_tokens is None:
            return None, (f"epochs {t.epochs} with packing: the number of sequences depends on the dataset's token "
                          "count (llamaft plan --dataset-tokens N gives the total)")
        sequences = int(dataset_tokens * train_fraction) // seq
        how = f"{dataset_tokens:,} tokens packed into {sequences:,} sequences of {seq}"
    else:
        if records is None:
            records = KNOWN_DATASET_RECORDS.get(spec.dataset.source.lower())
        if records is None:
            return None, (f"epochs {t.epochs}: the dataset's record count is unknown "
                          "(llamaft plan --dataset-records N)")
        sequences = int(records * train_fraction)
        how = f"{records:,} records, one padded sequence each"
    if t.global_batch_size is not None:  # the trainer's global order: the tail short of a step is left out
        return t.epochs * max(1, sequences // t.global_batch_size), f"epochs {t.epochs} over {how}"
    per_rank = math.ceil(sequences / world)
    batches = math.ceil(per_rank / t.per_device_batch_size)
    steps = t.epochs * max(1, batches // t.gradient_accumulation_steps)
    return steps, f"epochs {t.epochs} over {how}"


def throughput(spec: LlamaFineTuneSpec, shape: ModelShape, setup: Setup, gpu: GpuInfo, mfu: float,
               records: int | None, dataset_tokens: int | None) -> Throughput:
    fpt = flops_per_token(shape.parameters, shape.embedding_parameters, shape.num_layers, shape.q_dim, setup.seq)
    gpus = spec.cluster.workers * spec.cluster.gpus_per_worker
    factor = recompute_factor(shape, setup)
    # setup.batch counts sequences (DPO: two per pair); with globalBatchSize, that many items a step
    # whatever the world size (the micro-steps' fillers are no training)
    per_item = setup.batch // spec.training.per_device_batch_size
    tokens_per_step = spec.training.items_per_step(spec.world_size) * per_item * setup.seq
    peak = gpu.peak_flops if gpus else None
    # the assumed utilisation covers every FLOP the GPUs execute, recomputation included
    tps = mfu * peak * gpus / (fpt * factor) if peak else None
    step_seconds = tokens_per_step / tps if tps else None
    steps, note = training_steps(spec, records, dataset_tokens)
    total = steps * step_seconds if steps is not None and step_seconds is not None else None
    reference, reference_note = reference_pass(spec, fpt, mfu * peak * gpus if peak else None, records)
    if total is not None and reference is not None:
        total += reference
    return Throughput(fpt, peak, gpus, mfu, factor, tokens_per_step, tps, step_seconds, steps, total, note,
                      reference, reference_note)


def reference_pass(spec: LlamaFineTuneSpec, fpt: float, flops_per_second: float | None,
                   records: int | None) -> tuple[float | None, str]:
    """DPO's reference log-probabilities, timed: full fine-tuning with `reference: precomputed`
    scores every pair (training and validation) once with the initial model before the first step
    (dpo_step.precompute_reference: a no-grad forward, a third of a training step's FLOPs per
    token, two sequences per pair of at most maxSeqLength); LoRA's reference is a forward per
    micro-batch (recompute_factor), and so is `reference: live`'s frozen copy (its memory in the
    estimate). Seconds (None: no pass, or the pair count is unknown) and a note."""
    if spec.training.method is not TrainingMethod.DPO:
        return None, ""
    if spec.training.lora is not None and spec.training.lora.enabled:
        return None, ("DPO with LoRA: the reference is the base model with the adapters disabled, a no-grad forward "
                      "of every micro-batch (x1.33 the step's FLOPs, in the recomputation factor); nothing before "
                      "training, no second copy in memory")
    if (spec.training.dpo or DpoSpec()).reference is DpoReference.LIVE:
        return None, ("DPO, live reference: a frozen sharded copy of the initial model in the compute dtype (in the "
                      "memory above) runs a no-grad forward of every micro-batch (x1.33 the step's FLOPs, in the "
                      "recomputation factor); nothing before training, nothing stored")
    if records is None:
        records = KNOWN_DATASET_RECORDS.get(spec.dataset.source.lower())
    if records is None:
        return None, ("DPO, precomputed reference: before the first step one no-grad forward of the initial model scores "
                      "every pair (no second copy in memory); its time depends on the pair count "
                      "(llamaft plan --dataset-records N)")
    tokens = records * 2 * spec.dataset.max_seq_length
    if flops_per_second is None:
        return None, f"DPO, precomputed reference: one no-grad forward over {records:,} pairs before the first step"
    seconds = tokens * fpt / 3.0 / flops_per_second
    return seconds, (f"DPO, precomputed reference: one no-grad forward of the initial model over {records:,} pairs "
                     f"(2 sequences of at most {spec.dataset.max_seq_length} tokens each) before the first step, no "
                     f"second copy in memory; stored with the token store, so a retry or resume skips it")


# --------------------------------------------------------------------------------- fixes
def _candidate_patches(spec: LlamaFineTuneSpec) -> list[tuple[str, dict[str, Any], str]]:
    """(title, camelCase changes, cost), cheapest kind first: activation checkpointing, a smaller
    micro-batch with more accumulation, FULL_SHARD, CPU offload, LoRA, pure-bf16, more workers."""
    out: list[tuple[str, dict[str, Any], str]] = []
    fsdp, training = spec.fsdp, spec.training
    ac = fsdp.activation_checkpointing
    if ac.mode is CheckpointingMode.NONE:
        out.append(("selective activation checkpointing (every 2nd layer)",
                    {"fsdp.activationCheckpointing.mode": "selective", "fsdp.activationCheckpointing.everyNLayers": 2},
                    "recomputes half the layers' forward: about 15% more compute"))
    if ac.mode is not CheckpointingMode.FULL and not (ac.mode is CheckpointingMode.SELECTIVE and ac.every_n_layers == 1):
        out.append(("full activation checkpointing", {"fsdp.activationCheckpointing.mode": "full"},
                    "recomputes every layer's forward: about 30% more compute"))
    b, a = training.per_device_batch_size, training.gradient_accumulation_steps
    while b > 1:
        b //= 2
        factor = training.per_device_batch_size // b
        if training.global_batch_size is not None:  # the accumulation is derived from it
            out.append((f"micro-batch {b} (globalBatchSize {training.global_batch_size} kept: "
                        f"{-(-training.global_batch_size // (spec.world_size * b))} micro-steps per rank)",
                        {"training.perDeviceBatchSize": b}, "smaller matmuls, more micro-steps"))
            continue
        out.append((f"micro-batch {b} with {a * factor} accumulation steps (same global batch)",
                    {"training.perDeviceBatchSize": b, "training.gradientAccumulationSteps": a * factor},
                    "smaller matmuls; between micro-steps the trainer keeps unsharded gradients"))
    if fsdp.sharding_strategy is not ShardingStrategy.FULL_SHARD:
        detail = ""
        if fsdp.sharding_strategy is ShardingStrategy.HYBRID_SHARD:
            detail = f" instead of HYBRID_SHARD {shard_group_label(spec)}"
        else:
            detail = f" instead of {fsdp.sharding_strategy.value}"
        changes: dict[str, Any] = {"fsdp.shardingStrategy": "FULL_SHARD"}
        if fsdp.hybrid_shard is not None:
            changes["fsdp.hybridShard"] = None
        out.append((f"FULL_SHARD{detail}", changes, "all-gathers and reduce-scatters span every rank (inter-node traffic)"))
    if not fsdp.cpu_offload:
        changes = {"fsdp.cpuOffload": True}
        if fsdp.sharding_strategy is ShardingStrategy.NO_SHARD:
            changes["fsdp.shardingStrategy"] = "FULL_SHARD"
        out.append(("CPU offload of parameters, gradients and optimizer state", changes,
                    "optimizer step on the CPU and host-device copies: much slower"))
    if a > 1:
        out.append((f"gradientAccumulationSteps 1 instead of {a} (a {a}x smaller global batch)",
                    {"training.gradientAccumulationSteps": 1},
                    "changes the optimisation: retune the learning rate"))
    if training.lora is None or not training.lora.enabled:
        changes = {"training.lora.enabled": True, "training.lora.targetModules": ["q_proj", "v_proj"], "training.lora.r": 8}
        if fsdp.implementation is FsdpImplementation.FSDP1:
            changes["fsdp.implementation"] = "fsdp2"
        out.append(("LoRA adapters (r 8 on q_proj, v_proj) instead of full fine-tuning", changes,
                    "a different method: only adapters are trained"))
    if fsdp.mixed_precision in (MixedPrecision.BF16, MixedPrecision.FP32, MixedPrecision.FP16):
        out.append(("pure-bf16 (bf16 master weights and optimizer state)", {"fsdp.mixedPrecision": "pure-bf16"},
                    "less accurate updates"))
    more_workers_carry = training.global_batch_size is None or training.global_batch_size >= 2 * spec.world_size
    if fsdp.sharding_strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP) and spec.cluster.elastic is None \
            and more_workers_carry:
        out.append((f"{spec.cluster.workers * 2} workers instead of {spec.cluster.workers}",
                    {"cluster.workers": spec.cluster.workers * 2}, "twice the GPUs"))
    return out


def shard_group_label(spec: LlamaFineTuneSpec) -> str:
    from llamaft.planner.memory import shard_group_size

    return str(shard_group_size(spec))


def apply_changes(spec: LlamaFineTuneSpec, changes: dict[str, Any]) -> LlamaFineTuneSpec:
    """A copy of the spec with camelCase dotted paths set (None removes the field)."""
    body = spec.model_dump(by_alias=True, exclude_none=True, mode="json")
    for path, value in changes.items():
        node = body
        keys = path.split(".")
        for key in keys[:-1]:
            child = node.get(key)
            if not isinstance(child, dict):
                child = {}
                node[key] = child
            node = child
        if value is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return LlamaFineTuneSpec.model_validate(body)


def suggest_fixes(spec: LlamaFineTuneSpec, shape: ModelShape, base: MemoryEstimate, capacity: int) -> list[Fix]:
    """Every single change that lowers the peak, cheapest kind first, each with its saving and
    whether it fits (of the smaller micro-batches only the largest that fits is listed, else the
    one that saves most). A combination of changes cheaper than the cheapest single change that
    fits (or of any changes, when none fits alone) is put first when it fits."""
    cpu_only = spec.cluster.gpus_per_worker == 0
    patches = _candidate_patches(spec)
    fixes: list[Fix] = []
    batches: list[Fix] = []
    batch_slot: int | None = None
    first_fit: int | None = None
    for rank, (title, changes, cost) in enumerate(patches):
        est = _estimate(spec, shape, changes)
        if est is None:
            continue
        required = est.peak_bytes + allowance(est.peak_bytes, cpu_only)
        saving = base.peak_bytes - est.peak_bytes
        if saving <= 0:
            continue
        fix = Fix(title, changes, est.peak_bytes, required, saving, required <= capacity, cost)
        if fix.fits and first_fit is None:
            first_fit = rank
        if "training.perDeviceBatchSize" in changes:
            batch_slot = len(fixes) if batch_slot is None else batch_slot
            batches.append(fix)
        else:
            fixes.append(fix)
    if batches and batch_slot is not None:
        fitting = [f for f in batches if f.fits]
        chosen = fitting[0] if fitting else max(batches, key=lambda f: f.saving_bytes)
        fixes.insert(batch_slot, chosen)
    cheaper = patches if first_fit is None else patches[:first_fit]
    combined = _combine(spec, shape, base, capacity, cpu_only, cheaper)
    if combined is not None:
        fixes.insert(0, combined)
    return fixes


def _estimate(spec: LlamaFineTuneSpec, shape: ModelShape, changes: dict[str, Any]) -> MemoryEstimate | None:
    try:
        candidate = apply_changes(spec, changes)
    except ValueError:
        return None
    return estimate_memory(shape, setup_from_spec(candidate))


def _combine(spec: LlamaFineTuneSpec, shape: ModelShape, base: MemoryEstimate, capacity: int, cpu_only: bool,
             patches: list[tuple[str, dict[str, Any], str]]) -> Fix | None:
    """Two or more changes together: add them in cost order while each lowers the peak until it
    fits, then drop the most expensive ones that are not needed."""
    chosen: list[tuple[str, dict[str, Any]]] = []
    peak = base.peak_bytes

    def merged(items: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for _, patch in items:
            out.update(patch)
        return out

    def required(items: list[tuple[str, dict[str, Any]]]) -> tuple[int, int] | None:
        est = _estimate(spec, shape, merged(items))
        return None if est is None else (est.peak_bytes, est.peak_bytes + allowance(est.peak_bytes, cpu_only))

    fitted = False
    for title, patch, _ in patches:
        if "training.perDeviceBatchSize" in patch and any("training.perDeviceBatchSize" in p for _, p in chosen):
            continue
        result = required([*chosen, (title, patch)])
        if result is None or result[0] >= peak:
            continue
        chosen.append((title, patch))
        peak = result[0]
        if result[1] <= capacity:
            fitted = True
            break
    if not fitted or len(chosen) < 2:
        return None
    for item in reversed(chosen[:-1]):
        trial = [c for c in chosen if c is not item]
        result = required(trial)
        if result is not None and result[1] <= capacity:
            chosen = trial
    if len(chosen) < 2:
        return None
    final = required(chosen)
    assert final is not None
    return Fix(" + ".join(t for t, _ in chosen), merged(chosen), final[0], final[1], base.peak_bytes - final[0],
               True, "the costs of each change together")


# ----------------------------------------------------------------------------------- plan
def build_plan(spec: LlamaFineTuneSpec, shape: ModelShape, *, mfu: float = DEFAULT_MFU,
               dataset_records: int | None = None, dataset_tokens: int | None = None,
               parameter_source: str = "analytic", fixes: bool = True) -> Plan:
    cpu_only = spec.cluster.gpus_per_worker == 0
    setup = setup_from_spec(spec, device="cpu" if cpu_only else "cuda")
    est = estimate_memory(shape, setup)
    gpu = resolve_gpu(spec)
    allow = allowance(est.peak_bytes, cpu_only)
    required = est.peak_bytes + allow
    capacity = None if cpu_only else gpu.memory_bytes
    fits = None if capacity is None else required <= capacity
    tp = throughput(spec, shape, setup, gpu, mfu, dataset_records, dataset_tokens)
    notes = list(est.notes) + list(gpu.warnings)
    if spec.dataset.max_seq_length > shape.max_position_embeddings:
        notes.append(f"maxSeqLength {spec.dataset.max_seq_length} exceeds the model's max_position_embeddings "
                     f"{shape.max_position_embeddings}: the trainer will refuse it")
    if spec.fsdp.compile:
        notes.append("compile: true usually lowers activation memory; the estimate is for eager mode")
    if spec.fsdp.implementation is FsdpImplementation.FSDP1:
        notes.append("fsdp1 is estimated like fsdp2 (the same bytes, as flat parameters); measured for fsdp2 only")
    if spec.training.lora is not None and spec.training.lora.enabled:
        notes.append("LoRA: the time estimate uses the trainer's 6N FLOPs per token, which overstates the work "
                     "(frozen weights get no weight gradients), so it is conservative")
    plan = Plan(
        spec=spec, shape=shape, setup=setup, gpu=gpu, memory=est, allowance_bytes=allow, required_bytes=required,
        capacity_bytes=capacity, fits=fits, host=host_memory(spec, shape, est, gpu),
        checkpoint=checkpoint_size(spec, shape, est, tp.total_steps), throughput=tp, notes=notes,
        parameter_source=parameter_source,
    )
    if fixes and capacity is not None and not fits:
        plan.fixes = suggest_fixes(spec, shape, est, capacity)
    return plan


def component_label(name: str) -> str:
    return COMPONENTS.get(name, name)
