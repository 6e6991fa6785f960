"""Capacity planning for a LlamaFineTune: will it fit on its GPUs, what to change when it does not,
how much host RAM and disk it needs, and how long it will take. Pure Python (no torch), so the
operator can call `admission(spec)` before it creates anything; `llamaft plan FILE` prints the
whole plan. See docs/capacity-planning.md for the model behind the numbers and its measured error.
"""

from llamaft.planner.capacity import (
    CPU_ONLY,
    FITS,
    UNKNOWN_GPU,
    UNKNOWN_MODEL_SHAPE,
    WILL_NOT_FIT,
    Admission,
    admission,
    verdict,
)
from llamaft.planner.catalog import GPUS, INSTANCES, GpuModel, InstanceType, gpu_model, instance_type
from llamaft.planner.memory import Setup, setup_from_spec
from llamaft.planner.plan import Fix, Plan, build_plan
from llamaft.planner.replay import MemoryEstimate, estimate_memory
from llamaft.planner.shapes import (
    ModelShape,
    UnknownShape,
    known_shape,
    meta_parameter_count,
    read_model_config,
    resolve_shape,
    shape_from_config,
)

__all__ = [
    "CPU_ONLY",
    "FITS",
    "GPUS",
    "INSTANCES",
    "UNKNOWN_GPU",
    "UNKNOWN_MODEL_SHAPE",
    "WILL_NOT_FIT",
    "Admission",
    "Fix",
    "GpuModel",
    "InstanceType",
    "MemoryEstimate",
    "ModelShape",
    "Plan",
    "Setup",
    "UnknownShape",
    "admission",
    "build_plan",
    "estimate_memory",
    "gpu_model",
    "instance_type",
    "known_shape",
    "meta_parameter_count",
    "read_model_config",
    "resolve_shape",
    "setup_from_spec",
    "shape_from_config",
    "verdict",
]
