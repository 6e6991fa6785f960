"""estimate_memory: one optimizer step replayed as allocations and frees, in steps.

memory.py says what each tensor costs (the units, the activations, the temporaries, by dtype);
this module replays a step with those costs: the sizes a micro-step moves (`StepSizes`), each
micro-step as the trainer runs it (`MicroStep`: the live DPO reference's forward, the forward, the
loss, the backward, the optimizer step), and the notes that explain the peak. `Timeline` keeps the
largest total and what made it up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llamaft.api.spec import CheckpointingMode, ShardingStrategy
from llamaft.planner.memory import (
    COMPONENTS,
    LOGITS_NOTE_SHARE,
    Setup,
    Unit,
    backward_temporaries_per_token,
    compute_bytes,
    dora_temporary_bytes,
    final_norm_bytes_per_token,
    float8_gathered_numel,
    forward_temporaries_per_token,
    is_checkpointed,
    layer_activation_bytes_per_token,
    layer_matmuls,
    master_bytes,
    op_sac_saved_bytes,
    reduce_bytes,
    shared_activation_bytes,
    units,
)
from llamaft.planner.shapes import LORA_MODULES, ModelShape


class Timeline:
    """Live bytes by component; remembers the largest total and what made it up."""

    def __init__(self) -> None:
        self.live: dict[str, float] = dict.fromkeys(COMPONENTS, 0.0)
        self.peak = 0.0
        self.at_peak: dict[str, float] = dict(self.live)
        self.peak_event = ""
        self.phase_peaks: dict[str, float] = {}

    def add(self, component: str, amount: float, event: str | None = None) -> None:
        self.live[component] += amount
        if event is not None:
            self.mark(event)

    def sub(self, component: str, amount: float) -> None:
        self.live[component] -= amount

    def mark(self, event: str) -> None:
        total = sum(self.live.values())
        phase = event.split(":", 1)[0]
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0.0), total)
        if total > self.peak:
            self.peak = total
            self.at_peak = dict(self.live)
            self.peak_event = event


@dataclass
class MemoryEstimate:
    """Per-rank GPU tensor memory at the peak of a steady-state optimizer step."""

    peak_bytes: int
    components: dict[str, int]
    peak_event: str
    phase_peaks: dict[str, int]
    parameters: int
    trainable_parameters: int
    shard_size: int
    layer_unit_parameters: int
    root_unit_parameters: int
    host_offloaded_bytes: int
    """Per rank, in host memory with cpuOffload (sharded parameters, gradients, optimizer state)."""
    persistent_bytes: int
    """Sharded parameters + optimizer state held on the GPU all the time."""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "peakBytes": self.peak_bytes,
            "components": dict(self.components),
            "peakEvent": self.peak_event,
            "phasePeaks": dict(self.phase_peaks),
            "parameters": self.parameters,
            "trainableParameters": self.trainable_parameters,
            "shardGroupSize": self.shard_size,
            "hostOffloadedBytes": self.host_offloaded_bytes,
            "notes": list(self.notes),
        }

    def biggest_component(self) -> tuple[str, int]:
        name = max(self.components, key=lambda k: self.components[k])
        return name, self.components[name]



@dataclass(frozen=True)
class StepSizes:
    """The bytes one micro-step moves on a rank, computed once from the shape and the setup."""

    shape: ModelShape
    setup: Setup
    layer: Unit
    root: Unit
    wrapped: int
    c: int
    """Compute dtype bytes."""
    m: int
    """Master (parameter, gradient, optimizer state) dtype bytes."""
    rd: int
    """Reduce dtype bytes."""
    tokens: int
    trainable: int
    shard_trainable: int
    params_bytes: float
    reference_bytes: float
    opt_bytes: float
    grads_total: float
    on_gpu: float
    """0 with cpuOffload (what is sharded lives in host memory), else 1."""
    act_layer: float
    act_ckpt: float
    act_recomputed: float
    dora_tmp: float
    shared: float
    norm_act: float
    bwd_tmp: float
    chunked: bool
    logits_c: float
    logits_f: float
    full_c: float
    full_f: float
    part: float
    embed_grad: float
    head_grad: float

    @property
    def cuda(self) -> bool:
        return self.setup.device == "cuda"

    @property
    def reshard(self) -> bool:
        return self.setup.strategy is not ShardingStrategy.SHARD_GRAD_OP

    @property
    def offload(self) -> bool:
        return self.setup.cpu_offload


def step_sizes(shape: ModelShape, setup: Setup) -> StepSizes:
    """The units, the sharded state, the activations per layer and the logits of one micro-step."""
    layer, root, wrapped = units(shape, setup)
    group = setup.shard_size
    c = compute_bytes(setup.precision)
    m = master_bytes(setup.precision)
    tokens = setup.batch * setup.seq
    shard_numel = layer.shard(group) * layer.count + root.shard(group)
    shard_trainable = layer.shard_trainable(group) * layer.count + root.shard_trainable(group)

    act_layer = layer_activation_bytes_per_token(shape, setup) * tokens
    act_ckpt: float = c * shape.hidden_size * tokens
    if setup.ac_mode is CheckpointingMode.SELECTIVE_OP:
        # the layer keeps its input and the selected op outputs; the recompute rebuilds the rest
        act_ckpt = op_sac_saved_bytes(shape, setup, tokens)
        act_recomputed = max(act_layer - act_ckpt, 0.0) + c * shape.hidden_size * tokens
    else:
        act_recomputed = act_layer
    vocab = shape.vocab_size
    chunked = setup.loss_chunks > 1
    # lossChunks: one slice of the sequence at a time (the largest, where it does not divide)
    logit_tokens = setup.batch * -(-setup.seq // setup.loss_chunks) if chunked else tokens
    logits_c = c * vocab * logit_tokens
    # DPO: the LM head over every position; lossChunks slices only log-softmax (`part`, the largest)
    full_c = c * vocab * tokens
    if setup.dpo:
        logits_c = full_c  # the logits' gradient, released after the LM head's backward as for SFT
    embed_grad = c * shape.embedding_parameters if not setup.lora else 0.0  # the LM head trains without LoRA
    return StepSizes(
        shape=shape, setup=setup, layer=layer, root=root, wrapped=wrapped, c=c, m=m, rd=reduce_bytes(setup.precision),
        tokens=tokens, trainable=layer.trainable * layer.count + root.trainable, shard_trainable=shard_trainable,
        params_bytes=m * shard_numel, reference_bytes=c * shard_numel if setup.dpo_live_reference else 0.0,
        opt_bytes=2 * m * shard_trainable, grads_total=m * shard_trainable, on_gpu=0.0 if setup.cpu_offload else 1.0,
        act_layer=act_layer, act_ckpt=act_ckpt, act_recomputed=act_recomputed,
        dora_tmp=dora_temporary_bytes(shape, setup), shared=shared_activation_bytes(shape, setup),
        norm_act=final_norm_bytes_per_token(shape, setup) * tokens,
        bwd_tmp=backward_temporaries_per_token(shape, setup) * tokens, chunked=chunked,
        logits_c=logits_c, logits_f=4.0 * vocab * logit_tokens, full_c=full_c, full_f=4.0 * vocab * tokens,
        part=4.0 * vocab * setup.batch * -(-setup.seq // setup.loss_chunks),
        embed_grad=embed_grad, head_grad=0.0 if shape.tie_word_embeddings else embed_grad,
    )


def micro_steps(setup: Setup) -> list[tuple[bool, bool, bool, bool]]:
    """The micro-steps of one optimizer step that can make the peak, as (accumulated, sync,
    grads_present, step): one; or, with accumulation, a first and a last one (and one between,
    whose gradients are kept unsharded) as the trainer syncs them."""
    if setup.accumulation <= 1:
        return [(False, True, False, True)]
    if setup.sync_between_micro_steps:
        return [(False, True, False, False), (False, True, True, True)]
    steps = [(False, False, False, True), (True, setup.accumulation == 2, False, True)]
    if setup.accumulation > 2:
        steps.append((True, True, False, True))
    return steps


class MicroStep:
    """One micro-step on the timeline: what is resident at its start, the live DPO reference's
    forward, the forward through the units, the loss, the backward with its reductions and, on
    the last micro-step, the optimizer step."""

    def __init__(self, s: StepSizes, tl: Timeline, *, accumulated: bool, sync: bool, grads_present: bool,
                 step: bool) -> None:
        self.s, self.tl = s, tl
        self.accumulated, self.sync, self.grads_present, self.step = accumulated, sync, grads_present, step
        self.gathered: set[int] = set()
        self.saved_per_layer: list[float] = []
        self.root_gathered = s.c * s.root.padded
        # float8 all-gather: the converted weights arrive as 1-byte float8 (torchao casts each
        # shard before the all-gather); masters, gradients and optimizer state are unchanged.
        self.layer_gather = s.c * s.layer.padded - (s.c - 1) * float8_gathered_numel(s.shape, s.setup)

    def run(self) -> None:
        self.resident()
        if self.s.setup.dpo_live_reference:
            self.reference_forward()
        self.forward()
        if self.s.setup.dpo:
            self.dpo_loss()
        else:
            self.cross_entropy()
        self.backward()
        if self.sync and self.step:
            self.optimizer_step()

    def gather(self, index: int, event: str) -> None:
        if index in self.gathered or index >= self.s.wrapped or index < 0:
            return
        self.tl.add("gathered_parameters", 2 * self.layer_gather, event)
        self.tl.sub("gathered_parameters", self.layer_gather)
        self.gathered.add(index)

    def release(self, index: int) -> None:
        if index in self.gathered:
            self.gathered.discard(index)
            self.tl.sub("gathered_parameters", self.layer_gather)

    def resident(self) -> None:
        """What is live when the micro-step starts: the sharded state, and the inputs."""
        s, tl = self.s, self.tl
        tl.live = dict.fromkeys(COMPONENTS, 0.0)
        tl.add("parameters", s.on_gpu * s.params_bytes)
        tl.add("reference", s.on_gpu * s.reference_bytes)
        tl.add("optimizer", s.on_gpu * s.opt_bytes)
        if self.grads_present:
            tl.add("gradients", s.on_gpu * s.grads_total)
        if self.accumulated:
            tl.add("accumulated_gradients", s.rd * s.trainable)
        tl.add("activations", s.shared, "forward:inputs")

    def reference_forward(self) -> None:
        """DPO's live reference, no grad (memory.py's docstring): transient, gone before the
        policy's forward."""
        s, tl, c = self.s, self.tl, self.s.c
        hidden = c * s.shape.hidden_size * s.tokens
        ref_root = c * s.root.padded
        ref_layer = c * s.layer.padded
        tl.add("gathered_parameters", ref_root + (2 if s.cuda else 1) * ref_layer)
        layer_tmp = hidden + forward_temporaries_per_token(s.shape, s.setup, True) * s.tokens  # as a checkpointed layer's
        tl.add("temporaries", layer_tmp, "reference:layer forward")
        tl.sub("temporaries", layer_tmp)
        tl.sub("gathered_parameters", (2 if s.cuda else 1) * ref_layer)
        tl.add("logits", s.full_c + (s.part if c != 4 else 0.0) + s.part, "reference:log-softmax")
        tl.sub("logits", s.full_c + (s.part if c != 4 else 0.0) + s.part)
        tl.sub("gathered_parameters", ref_root)  # dpo_step resharded it

    def forward(self) -> None:
        """The root's all-gather, each decoder layer (prefetching the next on CUDA), the LM head."""
        s, tl, c = self.s, self.tl, self.s.c
        tl.add("gathered_parameters", 2 * self.root_gathered, "forward:root all-gather")
        tl.sub("gathered_parameters", self.root_gathered)
        tl.add("temporaries", c * s.shape.hidden_size * s.tokens)  # embedding output
        for index in range(s.shape.num_layers):
            ckpt = is_checkpointed(index, s.setup)
            self.gather(index, f"forward:layer {index} all-gather")
            if s.cuda:
                self.gather(index + 1, f"forward:layer {index + 1} prefetch")
            saved = s.act_ckpt if ckpt else s.act_layer
            tmp = forward_temporaries_per_token(s.shape, s.setup, ckpt) * s.tokens + s.dora_tmp
            tl.add("activations", saved)
            tl.add("temporaries", tmp, f"forward:layer {index}")
            tl.sub("temporaries", tmp)
            self.saved_per_layer.append(saved)
            if s.reshard and index < s.wrapped - 1:
                self.release(index)
        tl.sub("temporaries", c * s.shape.hidden_size * s.tokens)
        tl.add("activations", s.norm_act)
        tl.add("logits", s.logits_c, "forward:lm_head")
        if s.reshard:
            tl.sub("gathered_parameters", self.root_gathered)

    def dpo_loss(self) -> None:
        """dpo.sequence_logps under autograd (memory.py's docstring), forward and backward."""
        s, tl, c, part = self.s, self.tl, self.s.c, self.s.part
        copy = part if c != 4 else 0.0  # .float() of a bf16 slice; a view in fp32
        tl.add("logits", s.full_f - part)  # the earlier slices' saved log-softmax outputs
        tl.add("logits", copy + part, "loss:DPO log-softmax forward")
        tl.sub("logits", copy + s.full_c)  # log-probabilities summed: the logits are no longer referenced
        # backward, a slice at a time: the gathered gradient and log-softmax's (fp32), cast to the
        # compute dtype, padded to the logits' full size and summed into the logits' gradient
        slice_grad = s.full_c if s.chunked else 0.0
        tl.add("logits", s.full_c + 2 * part + c * part / 4 + slice_grad, "loss:DPO log-softmax backward")
        tl.sub("logits", 2 * part + c * part / 4 + slice_grad + s.full_f)
        tl.mark("loss:logits gradient")

    def cross_entropy(self) -> None:
        """SFT's cross-entropy, forward and backward (a slice at a time with lossChunks)."""
        s, tl, c = self.s, self.tl, self.s.c
        logits_c, logits_f = s.logits_c, s.logits_f
        if c != 4:
            tl.add("logits", logits_f)
        tl.add("logits", logits_f, "loss:cross-entropy forward")
        # token_loss_sum returns: the bf16 logits and the fp32 copy are released
        tl.sub("logits", logits_c + (logits_f if c != 4 else 0.0))
        if s.chunked:
            # a checkpointed slice keeps no log-softmax; backward recomputes one slice at a time
            tl.sub("logits", logits_f)
            tl.add("logits", logits_c + (logits_f if c != 4 else 0.0) + logits_f, "loss:slice recompute")
            tl.sub("logits", logits_c + (logits_f if c != 4 else 0.0))
        # -------- backward: cross-entropy (saved log-softmax + two fp32 gradients)
        tl.add("logits", 2 * logits_f, "loss:cross-entropy backward")
        tl.sub("logits", 2 * logits_f)  # saved output and nll gradient released
        tl.add("logits", logits_c, "loss:logits gradient")
        tl.sub("logits", logits_f)

    def backward(self) -> None:
        """The LM head, each decoder layer in reverse (recompute, reduce-scatter or keep the
        gradients), the embedding, the root's reduction."""
        s, tl, c, rd = self.s, self.tl, self.s.c, self.s.rd
        layer, root, group = s.layer, s.root, s.setup.shard_size
        if s.reshard:
            tl.add("gathered_parameters", 2 * self.root_gathered, "backward:root all-gather")
            tl.sub("gathered_parameters", self.root_gathered)
        root_grads = 0.0
        tl.add("reduce_buffers", s.head_grad)
        root_grads += s.head_grad
        tl.add("temporaries", c * s.shape.hidden_size * s.tokens, "backward:lm_head")
        tl.sub("logits", s.logits_c)
        tl.sub("activations", s.norm_act)
        held_rs = 0.0
        for index in reversed(range(s.shape.num_layers)):
            ckpt = is_checkpointed(index, s.setup)
            is_unit = index < s.wrapped
            self.gather(index, f"backward:layer {index} all-gather")
            self.gather(index - 1, f"backward:layer {index - 1} prefetch")
            recompute = s.act_recomputed + s.dora_tmp if ckpt else 0.0
            unit_grads = c * layer.trainable if is_unit else 0.0
            tl.add("temporaries", recompute + s.bwd_tmp)
            tl.add("reduce_buffers", unit_grads, f"backward:layer {index}")
            tl.sub("temporaries", recompute + s.bwd_tmp)
            tl.sub("activations", self.saved_per_layer[index])
            if not is_unit:
                # part of the root: its gradients wait for the root's reduce-scatter
                tl.add("reduce_buffers", c * layer.trainable)
                root_grads += c * layer.trainable
                continue
            if self.sync:
                rs = rd * layer.padded_trainable
                tl.add("reduce_buffers", rs, f"backward:layer {index} reduce-scatter")
                if not self.grads_present:
                    tl.add("gradients", s.on_gpu * s.m * layer.shard_trainable(group))
                tl.sub("reduce_buffers", unit_grads)
                if self.accumulated:
                    tl.sub("accumulated_gradients", rd * layer.trainable)
                if s.cuda:
                    tl.sub("reduce_buffers", held_rs)
                    held_rs = rs
                else:
                    tl.sub("reduce_buffers", rs)
            else:
                tl.sub("reduce_buffers", unit_grads)
                if not self.accumulated:
                    tl.add("accumulated_gradients", rd * layer.trainable, f"backward:layer {index} keep gradients")
            self.release(index)
        tl.sub("reduce_buffers", held_rs)
        # embedding backward, then the root's reduction (final callback)
        tl.add("reduce_buffers", s.embed_grad if not s.shape.tie_word_embeddings else 0.0, "backward:embedding")
        root_grads += s.embed_grad if not s.shape.tie_word_embeddings else 0.0
        if self.sync:
            rs = rd * root.padded_trainable
            tl.add("reduce_buffers", rs, "backward:root reduce-scatter")
            if not self.grads_present:
                tl.add("gradients", s.on_gpu * s.m * root.shard_trainable(group))
            tl.sub("reduce_buffers", rs + root_grads)
            if self.accumulated:
                tl.sub("accumulated_gradients", rd * root.trainable)
        else:
            tl.sub("reduce_buffers", root_grads)
            if not self.accumulated:
                tl.add("accumulated_gradients", rd * root.trainable)
        tl.sub("gathered_parameters", self.root_gathered)
        for index in list(self.gathered):
            self.release(index)
        tl.sub("activations", s.shared)

    def optimizer_step(self) -> None:
        """AdamW's foreach step (on the GPU unless offloaded), then the gradients are freed."""
        s, tl = self.s, self.tl
        if not s.offload:
            tl.add("optimizer_temporaries", s.m * s.shard_trainable, "optimizer:AdamW step")
            tl.sub("optimizer_temporaries", s.m * s.shard_trainable)
        tl.mark("optimizer:step done")
        tl.sub("gradients", s.on_gpu * s.grads_total)


def estimate_memory(shape: ModelShape, setup: Setup) -> MemoryEstimate:
    """Replay one optimizer step (all its micro-steps) and return the per-rank peak: the sizes, the
    micro-steps on one timeline, the notes that explain the peak."""
    s = step_sizes(shape, setup)
    tl = Timeline()
    for accumulated, sync, grads_present, step in micro_steps(setup):
        MicroStep(s, tl, accumulated=accumulated, sync=sync, grads_present=grads_present, step=step).run()
    return MemoryEstimate(
        peak_bytes=int(round(tl.peak)),
        components={k: int(round(v)) for k, v in tl.at_peak.items()},
        peak_event=tl.peak_event,
        phase_peaks={k: int(round(v)) for k, v in tl.phase_peaks.items()},
        parameters=s.layer.numel * s.layer.count + s.root.numel,
        trainable_parameters=int(s.trainable),
        shard_size=setup.shard_size,
        layer_unit_parameters=s.layer.numel,
        root_unit_parameters=s.root.numel,
        host_offloaded_bytes=int(s.params_bytes + s.reference_bytes + s.opt_bytes + s.grads_total) if s.offload else 0,
        persistent_bytes=int(s.on_gpu * (s.params_bytes + s.reference_bytes + s.opt_bytes)),
        notes=notes(s, tl),
    )


def notes(s: StepSizes, tl: Timeline) -> list[str]:
    """What a reader of the peak should know: kept gradients, DPO's sequences and logits, the
    logits' share, selective-op with DoRA, a model wrapped whole, LoRA targets, DoRA's temporary."""
    shape, setup, c = s.shape, s.setup, s.c
    vocab, tokens, trainable = shape.vocab_size, s.tokens, s.trainable
    out: list[str] = []
    if setup.accumulation > 1 and not setup.sync_between_micro_steps:
        out.append(
            f"gradientAccumulationSteps {setup.accumulation}: the trainer turns gradient sync off between "
            f"micro-steps, so each rank keeps all {trainable:,} trainable parameters' gradients unsharded "
            f"({_gib(s.rd * trainable)} in the reduce dtype)"
        )
    logits_at_peak = tl.at_peak["logits"]
    if setup.dpo:
        out.append(
            f"DPO: perDeviceBatchSize {setup.batch // 2} pairs is a micro-batch of {setup.batch} sequences "
            f"(chosen and rejected in one forward): activations and logits for {tokens:,} tokens"
        )
        if logits_at_peak >= LOGITS_NOTE_SHARE * tl.peak:
            out.append(
                f"logits and log-softmax are {_gib(logits_at_peak)} of the {_gib(tl.peak)} peak (vocabulary "
                f"{vocab:,} x {tokens:,} tokens per micro-batch): DPO runs the LM head over the whole sequence and "
                f"keeps its fp32 log-softmax for backward whatever training.lossChunks says (which slices only the "
                f"fp32 copy); a smaller perDeviceBatchSize with more gradientAccumulationSteps, or a shorter "
                f"maxSeqLength, lowers it"
            )
    elif not s.chunked and logits_at_peak >= LOGITS_NOTE_SHARE * tl.peak:
        out.append(
            f"logits and cross-entropy are {_gib(logits_at_peak)} of the {_gib(tl.peak)} peak (vocabulary "
            f"{vocab:,} x {tokens:,} tokens per micro-batch): training.lossChunks: N computes them one slice of "
            f"the sequence at a time, dividing that by about N for one more LM head forward"
        )
    if setup.ac_mode is CheckpointingMode.SELECTIVE_OP and setup.lora_dora:
        kept = sum(m[2] for i, m in enumerate(layer_matmuls(shape, setup), start=1) if i % 2 == 1)
        out.append(
            f"selective-op with useDora keeps the dense DoRA adapters it builds (every second matmul is kept): "
            f"{_gib(c * kept * shape.num_layers)} over the layers"
        )
    if setup.wrap_min_params is not None and s.wrapped < shape.num_layers:
        out.append(
            f"wrapPolicy sizeBased: decoder layers have {s.layer.numel:,} parameters, fewer than minNumParams "
            f"{setup.wrap_min_params:,}, so the whole model is one FSDP unit (gathered at once)"
        )
    if setup.lora:
        unknown = [t for t in setup.lora_targets if t not in LORA_MODULES]
        if unknown:
            out.append(f"LoRA targets {unknown} are not Llama projections; not counted")
        if setup.lora_dora and s.dora_tmp:
            out.append(f"useDora: every forward of an adapted projection builds its dense adapter and the "
                       f"norm of the adapted weight, a temporary of up to {_gib(s.dora_tmp)} per rank")
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"
