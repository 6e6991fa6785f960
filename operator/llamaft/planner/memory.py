"""Per-rank GPU memory of one training step, by component, for the trainer as it is written.

The estimate (replay.py's `estimate_memory`, with the costs this module gives) replays one
optimizer step of `llamaft_trainer` (model.py -> parallelize.py -> train.py) as a sequence of
allocations and frees and keeps the largest total, with what made it up. Nothing is fitted: every
term below is a tensor the code allocates, with its dtype.

What it follows (FSDP2, `fully_shard` per decoder layer plus the root, as parallelize.py does):
  * parameters: the master copy in fp32 (pure-bf16: bf16) sharded over the shard group, each
    tensor's dim 0 padded to a multiple of the group size; frozen base weights under LoRA too.
  * gradients and AdamW's exp_avg/exp_avg_sq: the same sharding and dtype, trainable tensors only.
  * all-gathers: a unit's parameters in the compute dtype (bf16; fp32 for fp32) while it runs,
    twice over during the copy-out; the next unit prefetched in backward (and in forward on CUDA,
    where the all-gather stream runs ahead); every decoder layer but the last is resharded after
    forward (FULL_SHARD, HYBRID_SHARD, NO_SHARD), none is (SHARD_GRAD_OP); the root (embedding,
    final norm, LM head) is resharded after forward and gathered again for backward.
  * gradient reduction: a unit's unsharded gradients (compute dtype) and the reduce-scatter input
    in the reduce dtype (fp32 for bf16/fp16); on CUDA the previous unit's buffer is still held
    while the next unit's backward runs.
  * gradient accumulation: train.py turns gradient sync off on all but the last micro-step, so
    FSDP2 keeps every trainable parameter's *unsharded* gradient in the reduce dtype between
    micro-steps (FSDPParam.to_accumulated_grad_if_needed); this is usually the largest cost of
    gradientAccumulationSteps > 1 and is shown as its own component.
  * activations: the tensors Hugging Face's LlamaDecoderLayer saves for backward under autograd,
    per token (RMSNorm's fp32 upcast, q/k/v after RoPE, the attention output, the SwiGLU
    intermediates, ...), which depend on which weights are trainable (LoRA freezes the base and
    the norms), on LoRA dropout (a mask and a copy per adapted projection), on the attention
    implementation (sdpa/flash: no T x T matrix; eager: the softmax in fp32 and its bf16 copy;
    GQA heads repeated when sdpa gets a padding mask) and on activation checkpointing (a
    checkpointed layer keeps only its input; backward recomputes one layer at a time).
  * DoRA (lora.useDora): one trainable magnitude per output row of each adapted projection (with
    its gradient and AdamW state); per token, the base and adapter outputs the magnitude scales
    (saved for its gradient); and in every forward (again in a checkpointed layer's recompute) a
    weight-sized temporary per projection: peft builds the dense adapter from lora_B(lora_A(eye))
    and takes the norm of W + s*BA (`dora_temporary_bytes`).
  * logits and loss: train.py computes `logits[:, :-1].float()` and cross-entropy: bf16 logits,
    an fp32 copy and log-softmax's fp32 output in forward; in backward the saved log-softmax plus
    two fp32 gradients (12 bytes per vocabulary entry per token at the peak). With
    training.lossChunks N (methods/sft.py) the same tensors exist for one slice of the sequence at a
    time (the largest: ceil(seq / N) positions), in forward and again in backward's recompute of
    each slice, and nothing vocabulary-wide is kept between them.
  * selective-op checkpointing: each layer keeps its input, the odd-numbered matmul outputs and
    the attention kernel's outputs (`op_sac_saved_bytes`); backward recomputes the rest.
  * DPO (training.method dpo, dpo_step.py): perDeviceBatchSize counts pairs, and a micro-batch's
    chosen and rejected sequences go through the policy in ONE forward, so activations and logits
    are those of 2 x pairs sequences (`Setup.batch` counts sequences). The LM head runs over every
    position (lossChunks does not slice it); log-softmax runs in fp32 on `lossChunks` slices, each
    slice's output saved for backward (all of them by the end of forward: the whole fp32
    log-softmax); the bf16 logits are freed once the log-probabilities are summed; backward
    builds the logits' gradient slice by slice (a full-size gradient per slice, summed). The
    reference costs no GPU memory at the peak: precomputed, it is read from disk; under LoRA it is
    a no-grad forward (adapters off) before the policy's, with nothing saved. `reference: live`
    (full fine-tuning, dpo_step.frozen) holds a second sharded parameter set in the compute dtype
    (FSDP's param_dtype; no gradient, no optimizer state) all the time, and before each policy
    forward runs a no-grad forward of it: its units gathered as the policy's are, each layer's
    output replacing its input (nothing saved), then its logits (the LM head over every position)
    and one fp32 log-softmax slice at a time; what remains is two numbers per sequence.
  * optimizer step: AdamW's foreach implementation (the trainer asks for it on every device)
    allocates one temporary the size of the trainable shard (sqrt of exp_avg_sq).
  * CPU offload: parameters, gradients and optimizer state live in host memory (and the step runs
    there); the GPU keeps the gathered units, activations and reduction buffers.

FSDP1 (`implementation: fsdp1`) is estimated with the same terms (it shards the same bytes, as
flat parameters). `compile: true` usually lowers activation memory; it is not modelled.

The "tensor peak" is what `torch.cuda.max_memory_allocated` reports (the CPU bench measures the
same quantity as live tensor storage); the CUDA context, NCCL buffers and allocator fragmentation
come on top as the stated allowance in plan.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamaft.api import sharding
from llamaft.api.spec import (
    AttentionImplementation,
    CheckpointingMode,
    DpoReference,
    DpoSpec,
    Float8Recipe,
    FsdpImplementation,
    LlamaFineTuneSpec,
    MixedPrecision,
    ShardingStrategy,
    TrainingJobConfig,
    TrainingMethod,
    WrapPolicyType,
)
from llamaft.planner.shapes import LORA_MODULES, ModelShape

TRAINER_SYNCS_EVERY_MICRO_STEP = True
"""Mirrors llamaft_trainer.train.micro_step_sync (api.sharding.GradientSync): sharded gradients are
reduce-scattered on every micro-step, so they stay sharded between micro-steps (False models a
trainer that turned gradient sync off until the last micro-step, keeping them unsharded). Flip
when the trainer changes."""

LOGITS_NOTE_SHARE = 0.25
"""Above this share of the peak, the logits get a note suggesting training.lossChunks."""

COMPONENTS: dict[str, str] = {
    "parameters": "sharded parameters (master copy)",
    "reference": "DPO live reference (frozen sharded copy)",
    "gradients": "sharded gradients",
    "optimizer": "optimizer state (AdamW exp_avg, exp_avg_sq)",
    "accumulated_gradients": "unsharded gradients kept between micro-steps",
    "gathered_parameters": "all-gathered parameters (units in use + prefetch)",
    "reduce_buffers": "unit gradients + reduce-scatter buffers",
    "activations": "activations saved for backward",
    "temporaries": "recomputation + backward temporaries",
    "logits": "logits + cross-entropy",
    "optimizer_temporaries": "optimizer-step temporaries",
}


@dataclass(frozen=True)
class Setup:
    """The settings the estimate depends on (built from a spec with `setup_from_spec`)."""

    strategy: ShardingStrategy
    world_size: int
    shard_size: int
    precision: MixedPrecision
    batch: int
    seq: int
    accumulation: int = 1
    ac_mode: CheckpointingMode = CheckpointingMode.NONE
    ac_every: int = 2
    attention: AttentionImplementation = AttentionImplementation.SDPA
    packing: bool = True
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = ()
    lora_dropout: float = 0.0
    lora_dora: bool = False
    """DoRA (peft use_dora) on the adapted projections."""
    cpu_offload: bool = False
    implementation: FsdpImplementation = FsdpImplementation.FSDP2
    wrap_min_params: int | None = None
    """None: one unit per decoder layer; else only layers with at least this many parameters."""
    device: str = "cuda"
    """`cuda` (streams overlap: forward prefetch) or `cpu` (what the CPU bench runs)."""
    float8_all_gather: bool = False
    """fsdp.float8 tensorwise with allGather: FSDP2 all-gathers the converted linears' weights
    in float8 (1 byte per element instead of the compute dtype's)."""
    loss_chunks: int = 1
    """training.lossChunks: the LM head and cross-entropy over this many slices of the sequence."""
    dpo: bool = False
    """training.method dpo: `batch` is 2 x perDeviceBatchSize sequences (a pair's chosen and
    rejected in one forward) and the logits follow dpo.sequence_logps (module docstring)."""
    dpo_live_reference: bool = False
    """training.dpo.reference live under full fine-tuning: the frozen sharded copy and its no-grad
    forward per micro-batch (module docstring)."""
    sync_between_micro_steps: bool = False
    """False: as train.py does today, gradient sync is off on all but the last micro-step, so FSDP2
    keeps unsharded gradients between micro-steps. True: a trainer that reduce-scatters every
    micro-step (sharded gradients accumulate instead)."""

    @property
    def lora(self) -> bool:
        return self.lora_rank is not None


def shard_group_size(spec: LlamaFineTuneSpec) -> int:
    """Ranks a parameter is sharded over, as the trainer's sharding plan decides (llamaft.api.sharding)."""
    return sharding.shard_size(spec.fsdp, spec.world_size, max(spec.cluster.gpus_per_worker, 1))


def setup_from_spec(spec: LlamaFineTuneSpec | TrainingJobConfig, *, world_size: int | None = None,
                    shard_size: int | None = None, device: str = "cuda") -> Setup:
    """The estimate's settings for a spec (a TrainingJobConfig needs world and shard sizes)."""
    if isinstance(spec, LlamaFineTuneSpec):
        world_size = spec.world_size if world_size is None else world_size
        shard_size = shard_group_size(spec) if shard_size is None else shard_size
    if world_size is None or shard_size is None:
        raise ValueError("world_size and shard_size are needed for a TrainingJobConfig")
    lora = spec.training.lora if spec.training.lora is not None and spec.training.lora.enabled else None
    fsdp = spec.fsdp
    dpo = spec.training.method is TrainingMethod.DPO
    live = dpo and lora is None and (spec.training.dpo or DpoSpec()).reference is DpoReference.LIVE
    return Setup(
        strategy=fsdp.sharding_strategy,
        world_size=world_size,
        shard_size=shard_size,
        precision=fsdp.mixed_precision,
        batch=spec.training.per_device_batch_size * (2 if dpo else 1),
        seq=spec.dataset.max_seq_length,
        accumulation=spec.training.micro_steps(world_size),
        ac_mode=fsdp.activation_checkpointing.mode,
        ac_every=fsdp.activation_checkpointing.every_n_layers,
        attention=spec.model.attn_implementation,
        packing=spec.dataset.packing and not dpo,
        lora_rank=lora.r if lora else None,
        lora_targets=tuple(lora.target_modules) if lora else (),
        lora_dropout=lora.dropout if lora else 0.0,
        lora_dora=lora.use_dora if lora else False,
        cpu_offload=fsdp.cpu_offload,
        implementation=fsdp.implementation,
        wrap_min_params=fsdp.wrap_policy.min_num_params if fsdp.wrap_policy.type is WrapPolicyType.SIZE_BASED else None,
        device=device,
        float8_all_gather=fsdp.float8.enabled and fsdp.float8.recipe is Float8Recipe.TENSORWISE
        and fsdp.float8.all_gather and fsdp.implementation is FsdpImplementation.FSDP2,
        loss_chunks=spec.training.loss_chunks,
        dpo=dpo,
        dpo_live_reference=live,
        sync_between_micro_steps=TRAINER_SYNCS_EVERY_MICRO_STEP,
    )


# ------------------------------------------------------------------------------- dtypes
def compute_bytes(p: MixedPrecision) -> int:
    """Bytes per element of gathered parameters and activations (FSDP param_dtype)."""
    return 4 if p is MixedPrecision.FP32 else 2


def master_bytes(p: MixedPrecision) -> int:
    """Bytes per element of the sharded master parameters, their gradients and AdamW state."""
    return 2 if p is MixedPrecision.PURE_BF16 else 4


def reduce_bytes(p: MixedPrecision) -> int:
    """Bytes per element of gradient reduction (FSDP reduce_dtype)."""
    return 2 if p is MixedPrecision.PURE_BF16 else 4


# -------------------------------------------------------------------------------- units
@dataclass(frozen=True)
class Unit:
    """One FSDP unit: its parameters as the rank sees them."""

    name: str
    numel: int
    trainable: int
    padded: int
    """Elements of the unit after padding each tensor's dim 0 to the shard group (all-gather size)."""
    padded_trainable: int
    count: int = 1
    """How many identical units (decoder layers)."""

    def shard(self, group: int) -> int:
        return self.padded // group

    def shard_trainable(self, group: int) -> int:
        return self.padded_trainable // group


def _padded(shape: tuple[int, ...], group: int) -> int:
    rows = -(-shape[0] // group) * group
    rest = 1
    for d in shape[1:]:
        rest *= d
    return rows * rest


def _tensors_layer(shape: ModelShape, setup: Setup) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, trainable) of one decoder layer's tensors, LoRA adapters included."""
    full = not setup.lora
    tensors = [(s, full) for _, s in shape.layer_tensors()]
    if setup.lora and setup.lora_rank:
        linear = shape.linear_shapes()
        for target in setup.lora_targets:
            if target in linear:
                out_f, in_f = linear[target]
                tensors.append(((setup.lora_rank, in_f), True))
                tensors.append(((out_f, setup.lora_rank), True))
                if setup.lora_dora:
                    tensors.append(((out_f,), True))  # the DoRA magnitude, one per output row
    return tensors


def _unit(name: str, tensors: list[tuple[tuple[int, ...], bool]], group: int, implementation: FsdpImplementation,
          count: int = 1) -> Unit:
    numel = sum(_numel(s) for s, _ in tensors)
    trainable = sum(_numel(s) for s, t in tensors if t)
    if implementation is FsdpImplementation.FSDP1:
        # One flat parameter per unit, padded to a multiple of the group.
        padded = -(-numel // group) * group
        padded_trainable = -(-trainable // group) * group if trainable else 0
    else:
        padded = sum(_padded(s, group) for s, _ in tensors)
        padded_trainable = sum(_padded(s, group) for s, t in tensors if t)
    return Unit(name, numel, trainable, padded, padded_trainable, count)


FLOAT8_DIVISOR = 16
"""llamaft_trainer/parallel/float8.py converts a linear only when in and out features are multiples of 16."""


def float8_gathered_numel(shape: ModelShape, setup: Setup) -> int:
    """Padded elements of one decoder layer's weights that FSDP2 all-gathers in float8 (the
    converted projections; LoRA's base layers too, never its adapters, norms or biases)."""
    if not setup.float8_all_gather:
        return 0
    return sum(
        _padded((out_f, in_f), setup.shard_size)
        for out_f, in_f in shape.linear_shapes().values()
        if out_f % FLOAT8_DIVISOR == 0 and in_f % FLOAT8_DIVISOR == 0
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def units(shape: ModelShape, setup: Setup) -> tuple[Unit, Unit, int]:
    """(decoder-layer unit, root unit, number of layers wrapped as their own unit)."""
    group = setup.shard_size
    layer = _tensors_layer(shape, setup)
    layer_numel = sum(_numel(s) for s, _ in layer)
    wrapped = shape.num_layers
    if setup.wrap_min_params is not None and layer_numel < setup.wrap_min_params:
        wrapped = 0
    root_tensors = [(s, not setup.lora) for _, s in shape.root_tensors()]
    root_tensors += layer * (shape.num_layers - wrapped)
    layer_unit = _unit("decoder layer", layer, group, setup.implementation, count=wrapped)
    root_unit = _unit("root", root_tensors, group, setup.implementation)
    return layer_unit, root_unit, wrapped


# -------------------------------------------------------------------------- activations
def is_checkpointed(index: int, setup: Setup) -> bool:
    if setup.ac_mode in (CheckpointingMode.FULL, CheckpointingMode.SELECTIVE_OP):
        return True
    return setup.ac_mode is CheckpointingMode.SELECTIVE and index % setup.ac_every == 0


def layer_matmuls(shape: ModelShape, setup: Setup) -> list[tuple[str, int, int, int]]:
    """Every aten.mm of one decoder layer's forward, in order: (what, output elements per token,
    output elements per forward, multiply-adds per token). Each projection's base matmul; on a
    LoRA-adapted one then lora_A and lora_B (peft lora.Linear: base_layer(x) first); with DoRA
    first the dense adapter lora_B(lora_A(eye(in))) (in x r, then in x out, once per forward:
    DoraLinearLayer.forward) before lora_A(x) and lora_B. Attention's own products are batched
    matmuls (eager) or one SDPA kernel, not aten.mm."""
    targets = set(setup.lora_targets) & set(LORA_MODULES) if setup.lora else set()
    r = setup.lora_rank or 0
    out: list[tuple[str, int, int, int]] = []
    for name, (out_f, in_f) in shape.linear_shapes().items():
        out.append((name, out_f, 0, out_f * in_f))
        if name in targets:
            if setup.lora_dora:
                out += [(f"{name} DoRA eye @ A", 0, in_f * r, 0), (f"{name} DoRA (eye A) @ B", 0, in_f * out_f, 0)]
            out += [(f"{name} lora_A", r, 0, r * in_f), (f"{name} lora_B", out_f, 0, out_f * r)]
    return out


def op_sac_saved_bytes(shape: ModelShape, setup: Setup, tokens: int) -> float:
    """What one decoder layer keeps under `selective-op` (llamaft_trainer.parallel.parallelize.op_sac_context,
    torchtitan's op-level policy): its input (the checkpoint's), the outputs of the odd-numbered
    matmuls of its forward (`layer_matmuls`: q, v, gate and down for a full fine-tune) and the
    attention kernel's outputs (sdpa/flash: the output and the fp32 log-sum-exp per head; eager
    attention is recomputed). Everything else is recomputed in backward. With DoRA, the dense
    adapters built from eye() are among the kept matmul outputs: weight-sized, once per layer.
    (Measured on CPU in tests/trainer/parallel/test_parallelize.py: the same bytes.)"""
    c = compute_bytes(setup.precision)
    per_token = float(shape.hidden_size)
    per_forward = 0.0
    for index, (_, width, constant, _) in enumerate(layer_matmuls(shape, setup), start=1):
        if index % 2 == 1:
            per_token += width
            per_forward += constant
    total = c * (per_token * tokens + per_forward)
    if setup.attention is not AttentionImplementation.EAGER:
        total += (c * shape.q_dim + 4 * shape.num_heads) * tokens
    return total


def op_sac_recomputed_fraction(shape: ModelShape, setup: Setup) -> float:
    """The share of a decoder layer's matmul work `selective-op` runs again in backward (the
    even-numbered matmuls, `layer_matmuls`); `full` recomputes all of it."""
    matmuls = layer_matmuls(shape, setup)
    work = sum(m[3] for m in matmuls)
    again = sum(m[3] for index, m in enumerate(matmuls, start=1) if index % 2 == 0)
    return again / work if work else 0.0


def layer_activation_bytes_per_token(shape: ModelShape, setup: Setup) -> float:
    """Bytes one decoder layer saves for backward per token (not checkpointed).

    HF LlamaDecoderLayer under autograd, compute dtype c:
      RMSNorm (x2): fp32 upcast of its input (4h), the normalised value (c*h, saved to multiply by a
        trainable weight), its output (c*h, saved by the projections whose weight is trainable).
      attention: q and k after RoPE, v (c * head dims; k/v repeated to all heads for eager, and for
        sdpa when it gets a padding mask), sdpa/flash: output (c*q_dim) + log-sum-exp (fp32 per
        head); eager: softmax in fp32 plus its cast (per key position); o_proj input (c*q_dim,
        separate from the sdpa output on CPU; the same storage on CUDA).
      MLP: gate output, silu(gate), up output (3 * c*i), down_proj input (c*i when trainable).
      LoRA on a projection: dropout mask (1 byte) + dropped input (c) when dropout > 0 (else the
        shared input is saved), and the rank-r intermediate (c*r).
      DoRA on it too: the base output and the adapter output (2 * c*out), which the trainable
        magnitude multiplies (peft DoraLinearLayer.forward: (m/||W||-1) * base + m/||W|| * lora;
        autograd's saved_tensors_hooks on a peft DoRA Linear 64 -> 96 in fp32: 768 bytes per token
        more than LoRA, with or without dropout).
    """
    c = compute_bytes(setup.precision)
    h, i, q, kv = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim
    full = not setup.lora
    targets = set(setup.lora_targets) & set(LORA_MODULES) if setup.lora else set()
    p = setup.lora_dropout
    r = setup.lora_rank or 0

    def input_saved(module: str) -> bool:
        return full or (module in targets and p == 0)

    outputs = {name: out_f for name, (out_f, _) in shape.linear_shapes().items()}

    def lora_extra(module: str, in_dim: int) -> float:
        if module not in targets:
            return 0.0
        dora = 2 * c * outputs[module] if setup.lora_dora else 0.0
        return (in_dim * (1 + c) if p > 0 else 0.0) + c * r + dora

    total = 0.0
    # input_layernorm + the q/k/v inputs
    total += 4 * h + (c * h if full else 0) + (c * h if any(input_saved(m) for m in ("q_proj", "k_proj", "v_proj")) else 0)
    total += lora_extra("q_proj", h) + lora_extra("k_proj", h) + lora_extra("v_proj", h)
    attn = setup.attention
    grouped = shape.num_kv_heads < shape.num_heads
    if attn is AttentionImplementation.EAGER:
        total += 3 * c * q  # q, k and v repeated to every head
        total += 4 * shape.num_heads * setup.seq  # softmax output (fp32), per key position
        if c != 4:
            total += c * shape.num_heads * setup.seq  # its cast back to the compute dtype
        total += c * q if input_saved("o_proj") else 0  # contiguous copy of the attention output
    else:
        expand = grouped and attn is AttentionImplementation.SDPA and not setup.packing
        kvd = q if expand else kv
        total += c * (q + 2 * kvd) + c * q + 4 * shape.num_heads  # q, k, v, output, log-sum-exp
        if input_saved("o_proj") and setup.device == "cpu":
            total += c * q  # the CPU kernel's output is not in o_proj's layout: a contiguous copy
    total += lora_extra("o_proj", q)
    # post_attention_layernorm + the gate/up inputs
    total += 4 * h + (c * h if full else 0) + (c * h if any(input_saved(m) for m in ("gate_proj", "up_proj")) else 0)
    total += lora_extra("gate_proj", h) + lora_extra("up_proj", h)
    total += 3 * c * i + (c * i if input_saved("down_proj") else 0) + lora_extra("down_proj", i)
    return total


def shared_activation_bytes(shape: ModelShape, setup: Setup) -> float:
    """Tensors held once per micro-batch: inputs (ids, labels, mask: int64), the rotary cos/sin
    tables (compute dtype) and the 4-D attention mask (eager always; sdpa when padding)."""
    c = compute_bytes(setup.precision)
    tokens = setup.batch * setup.seq
    total = 24.0 * tokens + 2 * c * shape.head_dim * tokens
    if setup.attention is AttentionImplementation.EAGER or (
        setup.attention is AttentionImplementation.SDPA and not setup.packing
    ):
        total += c * setup.batch * setup.seq * setup.seq
    return total


def final_norm_bytes_per_token(shape: ModelShape, setup: Setup) -> float:
    c = compute_bytes(setup.precision)
    full = not setup.lora
    return 4 * shape.hidden_size + (2 * c * shape.hidden_size if full else 0)


def backward_temporaries_per_token(shape: ModelShape, setup: Setup) -> float:
    """Gradients of activations alive while one layer runs backward: the SwiGLU gradients
    (3 * c*i) and two of width h, or the attention's (eager: the T x T gradients in fp32)."""
    c = compute_bytes(setup.precision)
    h, i, q, kv = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim
    mlp = c * (3 * i + 2 * h)
    if setup.attention is AttentionImplementation.EAGER:
        attn = (c + 8) * shape.num_heads * setup.seq + c * 3 * q
    else:
        attn = c * (2 * q + 2 * kv) + (4 * q if setup.device == "cuda" else 0)
    return float(max(mlp, attn))


def dora_temporary_bytes(shape: ModelShape, setup: Setup) -> float:
    """DoRA's forward of one adapted projection (peft DoraLinearLayer.forward/get_weight_norm),
    every forward and not per token: eye(in) (in x in), lora_A of it (in x r), the dense adapter
    BA, s*BA and W + s*BA (out x in each), in the compute dtype, alive together until the norm is
    taken; one projection at a time, so the largest targeted one."""
    if not (setup.lora and setup.lora_dora):
        return 0.0
    c = compute_bytes(setup.precision)
    r = setup.lora_rank or 0
    linear = shape.linear_shapes()
    sizes = [c * (i * i + i * r + 3 * o * i) for t in setup.lora_targets if t in linear for o, i in [linear[t]]]
    return float(max(sizes, default=0))


def forward_temporaries_per_token(shape: ModelShape, setup: Setup, checkpointed: bool) -> float:
    """Extra tensors alive inside one layer's forward beyond what it saves (the residual stream; a
    checkpointed layer's SwiGLU intermediates, which are computed but not kept)."""
    c = compute_bytes(setup.precision)
    extra = 2 * c * shape.hidden_size
    if checkpointed:
        extra += 3 * c * shape.intermediate_size
    return float(extra)


# ---------------------------------------------------------------------------- timeline
