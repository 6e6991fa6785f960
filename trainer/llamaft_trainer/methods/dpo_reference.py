"""The precomputed DPO reference's files: where they live and how they are read and written, for
the token store's pairs (dpo_step.precompute_reference) and a stream's (preference_stream).

One float32 (chosen, rejected) row of the initial model's summed completion log-probabilities per
pair, in `<store or stream folder>/reference/<reference_key>/{train,validation}.f32`, written once
(through a partial file renamed into place, so a reader never sees half of one) and read back by
later attempts bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from llamaft.api.spec import TrainingJobConfig

from llamaft_trainer.data.records import digest

REFERENCE_DIR = "reference"
"""Under the token store's (or the stream's) folder: <folder>/reference/<key>/{train,validation}.f32."""


def reference_key(cfg: TrainingJobConfig) -> str:
    """What the initial model's log-probabilities depend on besides the stored pairs."""
    return digest(cfg.model.model_dump(mode="json", by_alias=True), cfg.fsdp.mixed_precision.value)


def read_reference(path: Path, n: int) -> np.ndarray[Any, Any] | None:
    """The [n, 2] rows at `path`, or None (no file, or not n rows: another set's)."""
    try:
        values = np.fromfile(path, dtype=np.float32)
    except OSError:
        return None
    return values.reshape(n, 2) if values.size == 2 * n else None


def write_reference(path: Path, values: np.ndarray[Any, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    np.ascontiguousarray(values, dtype=np.float32).tofile(partial)
    os.replace(partial, path)
