"""`llamaft plan` output: the plan as text a person reads before spending GPU hours."""

from __future__ import annotations

from llamaft.api.spec import CheckpointingMode
from llamaft.planner.capacity import Admission
from llamaft.planner.catalog import GiB
from llamaft.planner.memory import COMPONENTS, master_bytes
from llamaft.planner.plan import CUDA_CONTEXT_BYTES, FRAGMENTATION, HOST_BYTES_PER_GPU_PROCESS, Plan, gib


def _g(n: float) -> str:
    return f"{n / GiB:,.2f}"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _setup_line(plan: Plan) -> str:
    s, spec = plan.setup, plan.spec
    ac = s.ac_mode.value
    if s.ac_mode is CheckpointingMode.SELECTIVE:
        ac += f" (every {s.ac_every} layers)"
    lora = f", LoRA r {s.lora_rank} on {', '.join(s.lora_targets)}" if s.lora else ", full fine-tuning"
    group = f" (shard groups of {s.shard_size})" if s.shard_size != s.world_size else ""
    accumulation = f"accumulation {s.accumulation}"
    if (g := spec.training.global_batch_size) is not None:
        accumulation = f"global batch {g}: {s.accumulation} micro-step(s) per rank"
    return (f"  {s.strategy.value} over {s.world_size} rank(s){group}, {s.precision.value}{lora}, "
            f"activation checkpointing {ac}, micro-batch {s.batch} x {s.seq} tokens"
            f"{f' ({s.batch // 2} DPO pairs: chosen + rejected)' if s.dpo else ''}, {accumulation}, "
            f"{s.attention.value}, {'packing' if s.packing else 'padding'}"
            f"{', CPU offload' if s.cpu_offload else ''}{', ' + spec.fsdp.implementation.value if spec.fsdp.implementation.value != 'fsdp2' else ''}")


def render_plan(name: str, plan: Plan, adm: Admission) -> str:
    spec, est, shape = plan.spec, plan.memory, plan.shape
    lines: list[str] = []
    lines.append(f"{name}: {shape.name}: {est.parameters:,} parameters ({plan.parameter_source}), "
                 f"{shape.num_layers} layers, hidden {shape.hidden_size}, vocab {shape.vocab_size:,}"
                 + (f"; trainable {est.trainable_parameters:,}" if est.trainable_parameters != est.parameters else ""))
    cluster = spec.cluster
    if plan.cpu_only:
        lines.append(f"  {cluster.workers} worker(s) x 1 CPU process (gpusPerWorker 0)")
    else:
        where = f" on {plan.gpu.instance.name}" if plan.gpu.instance else ""
        inst = plan.gpu.instance
        detail = (f" ({inst.gpus} x {inst.gpu}, {inst.host_memory_bytes // GiB:,} GiB host memory, "
                  f"{inst.efa_devices} EFA)") if inst else ""
        lines.append(f"  {cluster.workers} worker(s) x {cluster.gpus_per_worker} GPU(s) = {spec.world_size} ranks"
                     f"{where}{detail}; GPU: {plan.gpu.name} (from {plan.gpu.source})")
    lines.append(_setup_line(plan))
    lines.append("")
    where_peak = est.peak_event.replace(":", ": ", 1)
    lines.append(f"{'GPU memory per rank' if not plan.cpu_only else 'Tensor memory per process'} at the peak ({where_peak})")
    for key, label in COMPONENTS.items():
        value = est.components.get(key, 0)
        if value:
            lines.append(f"  {label:<52} {_g(value):>10} GiB")
    lines.append(f"  {'tensor peak (torch.cuda.max_memory_allocated)':<52} {_g(est.peak_bytes):>10} GiB")
    if not plan.cpu_only:
        frag = plan.allowance_bytes - CUDA_CONTEXT_BYTES
        lines.append(f"  {'+ CUDA context and NCCL buffers (assumed)':<52} {_g(CUDA_CONTEXT_BYTES):>10} GiB")
        lines.append(f"  {f'+ allocator fragmentation (assumed {FRAGMENTATION:.0%})':<52} {_g(frag):>10} GiB")
        capacity = f" of {_g(plan.capacity_bytes)} GiB ({plan.gpu.name})" if plan.capacity_bytes else " (GPU memory unknown)"
        lines.append(f"  {'= needed per GPU':<52} {_g(plan.required_bytes):>10} GiB{capacity}")
    phases = ", ".join(f"{k} {_g(v)}" for k, v in est.phase_peaks.items())
    lines.append(f"  peaks by phase (GiB): {phases}")
    lines.append("")
    lines.append(f"Verdict: {adm.reason}: {adm.message}")
    if plan.fixes:
        lines.append("Changes that lower the peak, cheapest kind first:")
        for index, fix in enumerate(plan.fixes, 1):
            state = "fits" if fix.fits else "not enough"
            lines.append(f"  {index}. {fix.title}: saves {gib(fix.saving_bytes)} -> needs {gib(fix.required_bytes)} "
                         f"[{state}]")
            lines.append(f"       set {fix.changes_text()}; cost: {fix.cost}")
    lines.append("")
    host = plan.host
    lines.append("Host RAM per node while loading (weights streamed tensor by tensor into each rank's shards)")
    base = f"{host.processes_per_node} process(es) x {gib(host.per_process_bytes)} (assumed)"
    offload = f" + {gib(host.offload_bytes_per_node)} {'of tensors' if plan.cpu_only else 'offloaded shards'}" \
        if host.offload_bytes_per_node else ""
    master = "fp32" if master_bytes(spec.fsdp.mixed_precision) == 4 else "bf16"
    lines.append(f"  every node: {base} + {gib(host.loading_bytes)} read buffers (the largest tensor, {master}, per "
                 f"process){offload} = {gib(host.node0_bytes)}")
    if host.limit_bytes is not None:
        state = "ok" if host.fits else "TOO LITTLE"
        lines.append(f"  limit: {host.limit_source} = {gib(host.limit_bytes)}: {state}")
    ck = plan.checkpoint
    lines.append("")
    lines.append("Checkpoints (DCP: whole model state in the master dtype + AdamW moments)")
    lines.append(f"  per save: {gib(ck.per_save_bytes)} (model {gib(ck.model_bytes)}, optimizer {gib(ck.optimizer_bytes)})"
                 + (f", {ck.saves} save(s) in the run" if ck.saves is not None else ""))
    lines.append(f"  on disk at most: keepLast {ck.keep_last} + the one being written"
                 f"{' + the export ' + gib(ck.export_bytes) if ck.export_bytes else ''} = {gib(ck.disk_bytes)}")
    tp = plan.throughput
    lines.append("")
    lines.append(f"Time (an assumption, not a measurement: the GPUs run at {tp.mfu_assumed:.0%} of their bf16 peak)")
    lines.append(f"  {tp.flops_per_token / 1e9:,.1f} GFLOP per token (6N + attention, the trainer's MFU formula); "
                 f"activation recomputation adds x{tp.recompute_factor:.2f} -> {tp.effective_mfu:.0%} MFU as the trainer "
                 "reports it")
    if tp.tokens_per_second is not None and tp.step_seconds is not None and tp.peak_flops_per_gpu:
        lines.append(f"  {tp.gpus} GPU(s) x {tp.peak_flops_per_gpu / 1e12:,.0f} TFLOP/s bf16 peak -> about "
                     f"{tp.tokens_per_second:,.0f} tokens/s ({tp.tokens_per_second / max(tp.gpus, 1):,.0f} per GPU); "
                     f"{tp.tokens_per_step:,} tokens per optimizer step -> {tp.step_seconds:,.2f} s per step")
        if tp.reference_seconds is not None:
            lines.append(f"  + the DPO reference pass before training: about {_duration(tp.reference_seconds)}")
        if tp.total_seconds is not None and tp.total_steps is not None:
            with_reference = " with the reference pass" if tp.reference_seconds is not None else ""
            lines.append(f"  {tp.total_steps:,} steps ({tp.steps_note}) -> about {_duration(tp.total_seconds)}"
                         f"{with_reference}")
        else:
            lines.append(f"  total: {tp.steps_note}")
    else:
        lines.append("  no estimate: the GPU's peak FLOP/s is unknown (CPU-only, or not in the catalog)")
    if tp.reference_note:
        lines.append(f"  {tp.reference_note}")
    if plan.notes:
        lines.append("")
        lines.append("Notes")
        lines.extend(f"  - {note}" for note in plan.notes)
    lines.append("")
    lines.append(f"Assumptions: CUDA context + NCCL {gib(CUDA_CONTEXT_BYTES)} per GPU, fragmentation "
                 f"{FRAGMENTATION:.0%} of the tensor peak, {gib(HOST_BYTES_PER_GPU_PROCESS)} host RAM per GPU "
                 "process, MFU as above (docs/capacity-planning.md)")
    return "\n".join(lines)
