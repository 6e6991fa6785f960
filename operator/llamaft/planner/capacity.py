"""The admission verdict the operator asks for before it creates anything (and `llamaft validate`
prints): does the run fit, and if not, what is the biggest cost and the cheapest fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llamaft.api.spec import LlamaFineTuneSpec, PreflightMode
from llamaft.planner.plan import Plan, build_plan, component_label, float8_problem, gib
from llamaft.planner.shapes import UnknownShape, resolve_shape

FITS = "Fits"
WILL_NOT_FIT = "WillNotFit"
UNKNOWN_MODEL_SHAPE = "UnknownModelShape"
UNKNOWN_GPU = "UnknownGpu"
CPU_ONLY = "CpuOnly"
NO_FLOAT8 = "Float8Unsupported"


@dataclass(frozen=True)
class Admission:
    """fits: True/False, or None when it cannot be told (unknown shape or GPU, CPU-only run).
    reason: a CamelCase condition reason. message: one line for the condition and the event."""

    fits: bool | None
    reason: str
    message: str
    plan: Plan | None = None
    preflight: PreflightMode = PreflightMode.ENFORCE

    @property
    def refuse(self) -> bool:
        """The operator must not create the run: it will not fit and spec.preflight is Enforce."""
        return self.fits is False and self.preflight is PreflightMode.ENFORCE

    def to_dict(self) -> dict[str, Any]:
        return {"fits": self.fits, "reason": self.reason, "message": self.message, "refuse": self.refuse,
                "plan": self.plan.to_dict() if self.plan is not None else None}


def admission(spec: LlamaFineTuneSpec, model_config: dict[str, Any] | None = None) -> Admission:
    """Pure and fast (no torch, no I/O): the shape comes from `model_config` (a config.json dict
    the caller read) or the built-in table of well-known checkpoints."""
    try:
        shape = resolve_shape(spec.model.source, model_config)
    except UnknownShape as exc:
        return Admission(None, UNKNOWN_MODEL_SHAPE, f"cannot tell whether it fits: {exc}", None, spec.preflight)
    return verdict(build_plan(spec, shape))


def verdict(plan: Plan) -> Admission:
    spec = plan.spec
    est = plan.memory
    name, biggest = est.biggest_component()
    part = f"the biggest part is {component_label(name)} ({gib(biggest)})"
    problem = float8_problem(spec)
    if problem is not None:  # the trainer would refuse it at start on these GPUs anyway
        return Admission(False, NO_FLOAT8, problem, plan, spec.preflight)
    if plan.cpu_only:
        return Admission(
            None, CPU_ONLY,
            f"CPU-only run (gpusPerWorker 0): no GPU memory to check; each worker process holds about "
            f"{gib(est.peak_bytes)} of tensors at its peak ({part}) plus about "
            f"{gib(plan.host.per_process_bytes)} for the process itself",
            plan, spec.preflight,
        )
    need = (f"about {gib(plan.required_bytes)} per GPU ({gib(est.peak_bytes)} of tensors at the peak, "
            f"{_event(est.peak_event)}, + {gib(plan.allowance_bytes)} CUDA context and fragmentation)")
    if plan.capacity_bytes is None:
        return Admission(
            None, UNKNOWN_GPU,
            f"cannot tell whether it fits: the GPU is unknown ({_gpu_hint(spec)}); it needs {need}",
            plan, spec.preflight,
        )
    gpu = f"the {plan.gpu.name}'s {gib(plan.capacity_bytes)}"
    if not plan.fits:
        fix = plan.cheapest_fix()
        if fix is not None:
            advice = (f"cheapest fix: {fix.title} ({fix.changes_text()}) saves {gib(fix.saving_bytes)}, "
                      f"needing {gib(fix.required_bytes)}")
        else:
            advice = "no change tried makes it fit: use more or larger GPUs"
        return Admission(False, WILL_NOT_FIT, f"will not fit: needs {need}, more than {gpu}; {part}; {advice}",
                         plan, spec.preflight)
    if plan.host.fits is False and plan.host.limit_bytes is not None:
        return Admission(
            False, WILL_NOT_FIT,
            f"will not fit in host memory: each node needs about {gib(plan.host.node0_bytes)} "
            f"while loading ({gib(plan.host.loading_bytes)} of read buffers, "
            f"{plan.host.processes_per_node} x {gib(plan.host.per_process_bytes)} for the processes) but "
            f"{plan.host.limit_source} is {gib(plan.host.limit_bytes)}; raise cluster.resources.memory",
            plan, spec.preflight,
        )
    share = plan.required_bytes / plan.capacity_bytes
    tight = " (tight: little room for allocator variance)" if plan.tight else ""
    return Admission(
        True, FITS,
        f"fits: needs {need}, {share:.0%} of {gpu}{tight}; {part}",
        plan, spec.preflight,
    )


def _event(event: str) -> str:
    phase, _, detail = event.partition(":")
    return f"{detail} in {phase}" if phase in ("forward", "backward") else detail or phase


def _gpu_hint(spec: LlamaFineTuneSpec) -> str:
    if spec.cluster.instance_type:
        return (f"instanceType {spec.cluster.instance_type} is not in the catalog; set cluster.gpuModel "
                "(e.g. H100) or cluster.gpuMemory (e.g. 80Gi)")
    return "no cluster.instanceType, cluster.gpuModel or cluster.gpuMemory"
