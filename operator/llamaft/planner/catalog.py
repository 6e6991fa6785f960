"""GPU catalog: instance types -> GPU model, count, host memory and EFA devices; GPU models ->
memory and dense bf16 peak FLOP/s. Every number carries its source.

Sources:
  [aws-it]  AWS EC2 instance types, https://aws.amazon.com/ec2/instance-types/ (accelerated
            computing) as transcribed in torchx's named resources,
            https://github.com/meta-pytorch/torchx/blob/main/torchx/specs/named_resources_aws.py
            (vCPUs, GPUs, host memory GiB, vpc.amazonaws.com/efa devices).
  [a100]    NVIDIA A100 Tensor Core GPU datasheet: BF16 Tensor Core 312 TFLOPS dense (624 with
            sparsity); 40 GB HBM2 / 80 GB HBM2e.
  [h100]    NVIDIA H100 Tensor Core GPU datasheet: H100 SXM BF16 Tensor Core 1,979 TFLOPS with
            sparsity, i.e. 989.5 dense; 80 GB HBM3. H100 PCIe 1,513 with sparsity (756.5 dense).
  [h200]    NVIDIA H200 Tensor Core GPU datasheet: H200 SXM BF16 1,979 TFLOPS with sparsity
            (989.5 dense); 141 GB HBM3e.
  [l40s]    NVIDIA L40S datasheet: BF16 Tensor 362.05 TFLOPS dense (733 with sparsity); 48 GB GDDR6.
  [a10]     NVIDIA A10 datasheet: BF16 Tensor 125 TFLOPS dense (250 with sparsity); 24 GB GDDR6.
            AWS publishes no separate figure for its A10G variant; the A10's is used (as the
            trainer's metrics do).
  [l4]      NVIDIA L4 datasheet: BF16 Tensor 121 TFLOPS dense (242 with sparsity); 24 GB GDDR6.
  [smi]     Memory the driver reports (nvidia-smi memory.total), which is what CUDA can allocate
            from: H100 80GB HBM3 81559 MiB, H200 143771 MiB, L40S 46068 MiB, A10G 23028 MiB,
            L4 23034 MiB, A100-SXM4-80GB 81920 MiB, A100-SXM4-40GB 40960 MiB (as printed by
            nvidia-smi on those GPUs in public logs).
  [cc]      NVIDIA CUDA GPU compute capabilities, https://developer.nvidia.com/cuda-gpus: A100 8.0,
            A10G (A10) 8.6, L4 and L40S 8.9 (Ada), H100 and H200 9.0 (Hopper). FP8 tensor cores
            (float8 matmuls, torch._scaled_mm) need 8.9 or newer.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

MiB = 2**20
GiB = 2**30
FP8_MIN_CAPABILITY = (8, 9)
"""The oldest compute capability with FP8 tensor cores (llamaft_trainer/parallel/float8.py checks the same)."""


@dataclass(frozen=True)
class GpuModel:
    name: str
    memory_bytes: int
    peak_bf16_flops: float | None
    """Dense (no sparsity) bf16 tensor-core peak; None when unknown (then no time estimate)."""
    source: str
    compute_capability: tuple[int, int] | None = None
    """CUDA compute capability [cc]; None when unknown."""

    @property
    def fp8(self) -> bool | None:
        """FP8 tensor cores (spec.fsdp.float8): compute capability 8.9 or newer; None when unknown."""
        if self.compute_capability is None:
            return None
        return self.compute_capability >= FP8_MIN_CAPABILITY

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpu: str
    gpus: int
    vcpus: int
    host_memory_bytes: int
    efa_devices: int
    source: str = "aws-it"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


GPUS: dict[str, GpuModel] = {
    g.name: g
    for g in (
        GpuModel("A100-40GB", 40960 * MiB, 312e12, "a100, smi, cc", (8, 0)),
        GpuModel("A100-80GB", 81920 * MiB, 312e12, "a100, smi, cc", (8, 0)),
        GpuModel("H100", 81559 * MiB, 989.5e12, "h100 (SXM), smi, cc", (9, 0)),
        GpuModel("H100-PCIe", 81559 * MiB, 756.5e12, "h100 (PCIe), smi (80 GB), cc", (9, 0)),
        GpuModel("H200", 143771 * MiB, 989.5e12, "h200 (SXM), smi, cc", (9, 0)),
        GpuModel("L40S", 46068 * MiB, 362.05e12, "l40s, smi, cc", (8, 9)),
        GpuModel("A10G", 23028 * MiB, 125e12, "a10, smi, cc", (8, 6)),
        GpuModel("L4", 23034 * MiB, 121e12, "l4, smi, cc", (8, 9)),
    )
}

# Aliases users write in cluster.gpuModel (matched after lower-casing and dropping spaces, "_",
# "nvidia" and "tensorcore"): A100 alone means the 80 GB part (p4de, most on-prem A100 nodes).
_ALIASES = {
    "a100": "A100-80GB", "a10080gb": "A100-80GB", "a10080g": "A100-80GB", "a100sxm480gb": "A100-80GB",
    "a10040gb": "A100-40GB", "a10040g": "A100-40GB", "a100sxm440gb": "A100-40GB",
    "h100": "H100", "h10080gb": "H100", "h100sxm": "H100", "h100sxm5": "H100", "h10080gbhbm3": "H100",
    "h100pcie": "H100-PCIe", "h200": "H200", "h200sxm": "H200", "h200141gb": "H200",
    "l40s": "L40S", "a10g": "A10G", "a10": "A10G", "l4": "L4",
}


def _norm(text: str) -> str:
    text = text.lower().replace("nvidia", "").replace("tensorcore", "")
    return re.sub(r"[\s_\-]", "", text)


def fp8_gpus() -> list[str]:
    """Catalog GPUs with FP8 tensor cores."""
    return [g.name for g in GPUS.values() if g.fp8]


def fp8_instance_types() -> list[str]:
    """Catalog instance types whose GPUs have FP8 tensor cores."""
    return [i.name for i in INSTANCES.values() if GPUS[i.gpu].fp8]


def gpu_model(name: str) -> GpuModel | None:
    """A catalog GPU by name or alias (`A100-80GB`, `a100 80g`, `NVIDIA H100 80GB HBM3`, `h200`)."""
    key = _norm(name)
    for gpu in GPUS.values():
        if _norm(gpu.name) == key:
            return gpu
    alias = _ALIASES.get(key)
    return GPUS[alias] if alias else None


def _instances() -> dict[str, InstanceType]:
    # name: (gpu, gpus, vcpus, host memory GiB, EFA devices)   -- all from [aws-it]
    table: dict[str, tuple[str, int, int, int, int]] = {
        "p4d.24xlarge": ("A100-40GB", 8, 96, 1152, 4),
        "p4de.24xlarge": ("A100-80GB", 8, 96, 1152, 4),
        "p5.48xlarge": ("H100", 8, 192, 2048, 32),
        "p5e.48xlarge": ("H200", 8, 192, 2048, 32),
        "p5en.48xlarge": ("H200", 8, 192, 2048, 16),
        "g5.xlarge": ("A10G", 1, 4, 16, 0),
        "g5.2xlarge": ("A10G", 1, 8, 32, 0),
        "g5.4xlarge": ("A10G", 1, 16, 64, 0),
        "g5.8xlarge": ("A10G", 1, 32, 128, 1),
        "g5.12xlarge": ("A10G", 4, 48, 192, 1),
        "g5.16xlarge": ("A10G", 1, 64, 256, 1),
        "g5.24xlarge": ("A10G", 4, 96, 384, 1),
        "g5.48xlarge": ("A10G", 8, 192, 768, 1),
        "g6e.xlarge": ("L40S", 1, 4, 32, 0),
        "g6e.2xlarge": ("L40S", 1, 8, 64, 0),
        "g6e.4xlarge": ("L40S", 1, 16, 128, 0),
        "g6e.8xlarge": ("L40S", 1, 32, 256, 0),
        "g6e.12xlarge": ("L40S", 4, 48, 384, 0),
        "g6e.16xlarge": ("L40S", 1, 64, 512, 0),
        "g6e.24xlarge": ("L40S", 4, 96, 768, 2),
        "g6e.48xlarge": ("L40S", 8, 192, 1536, 4),
    }
    return {
        name: InstanceType(name, gpu, gpus, vcpus, mem * GiB, efa)
        for name, (gpu, gpus, vcpus, mem, efa) in table.items()
    }


INSTANCES = _instances()


def instance_type(name: str) -> InstanceType | None:
    return INSTANCES.get(name.strip().lower())


