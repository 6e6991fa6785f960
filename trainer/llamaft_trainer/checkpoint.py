"""Checkpoint step: sharded DCP checkpoints, atomic completion, keep-last-K, resume, HF export.

Layout under `checkpointing.directory` (a path or an fsspec URI):
  step-00000200/               torch.distributed.checkpoint shards (model, optimizer, scheduler,
                               step, epoch, data position) plus rng-rank-<r>.pt per rank (its random
                               states and the fp16 gradient scaler: see _rng_state)
  step-00000200/COMPLETE       written by rank 0 after every rank finished; a directory without it
                               is an interrupted save and is never resumed from
  export/                      consolidated Hugging Face safetensors (or the LoRA adapter)
"""

from __future__ import annotations

import io
import json
import random
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

STEP_DIR = re.compile(r"^step-(\d{8})$")
COMPLETE = "COMPLETE"


@dataclass
class TrainState:
    """Everything besides model and optimizer that a resumed run needs to continue identically."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    tokens_seen: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Checkpointer:
    def __init__(self, directory: str, keep_last: int, rank: int) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(directory)
        self.directory = directory.rstrip("/")
        self.keep_last = keep_last
        self.rank = rank
        self.save_seconds: list[float] = []
        """How long each save of this run took: what a save on SIGTERM is expected to cost."""

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def _writer_path(self, name: str) -> str:
        return f"{self.directory}/{name}"

    def complete_steps(self) -> list[int]:
        """Steps that have a complete checkpoint, oldest first."""
        if not self.fs.exists(self.root):
            return []
        steps = []
        for entry in self.fs.ls(self.root, detail=False):
            match = STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if match and self.fs.exists(f"{entry.rstrip('/')}/{COMPLETE}"):
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest(self) -> int | None:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def save(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, state: TrainState, scaler: Any | None = None,
    ) -> str:
        started = time.perf_counter()
        name = f"step-{state.step:08d}"
        path = self._path(name)
        if self.rank == 0 and self.fs.exists(path):
            self.fs.rm(path, recursive=True)  # a leftover of an interrupted save of the same step
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        payload = {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": scheduler.state_dict(),
            "train": state.to_dict(),
        }
        save(payload, storage_writer=self._storage_writer(name))
        with self.fs.open(self._path(f"{name}/rng-rank-{self.rank}.pt"), "wb") as f:
            torch.save(_rng_state(scaler), f)
        dist.barrier()
        if self.rank == 0:
            with self.fs.open(self._path(f"{name}/{COMPLETE}"), "w") as f:
                f.write(json.dumps(state.to_dict()))
            self._prune()
        dist.barrier()
        self.save_seconds.append(time.perf_counter() - started)
        return self._writer_path(name)

    def load(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any | None = None,
    ) -> TrainState:
        """Restore everything a checkpoint holds; the random states last, so that nothing after this
        call but the next step draws from them."""
        name = f"step-{step:08d}"
        model_sd, optim_sd = get_state_dict(model, optimizer)
        payload: dict[str, Any] = {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": scheduler.state_dict(),
            "train": TrainState().to_dict(),
        }
        load(payload, storage_reader=self._storage_reader(name))
        set_state_dict(model, optimizer, model_state_dict=payload["model"], optim_state_dict=payload["optimizer"])
        scheduler.load_state_dict(payload["scheduler"])
        rng_path = self._path(f"{name}/rng-rank-{self.rank}.pt")
        if self.fs.exists(rng_path):
            with self.fs.open(rng_path, "rb") as f:
                _set_rng_state(torch.load(io.BytesIO(f.read()), weights_only=False), scaler)
        else:  # more ranks than the run that saved it: training continues, but not bit for bit
            print(f"llamaft_trainer: {name} has no random state for rank {self.rank}; dropout masks will differ "
                  "from an uninterrupted run", file=sys.stderr, flush=True)
        return TrainState(**{k: int(v) for k, v in payload["train"].items()})

    def _prune(self) -> None:
        """Delete complete checkpoints beyond keep_last and interrupted ones older than the newest."""
        steps = self.complete_steps()
        keep = set(steps[-self.keep_last :])
        newest = steps[-1] if steps else -1
        for entry in self.fs.ls(self.root, detail=False):
            match = STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if not match:
                continue
            step = int(match.group(1))
            if step not in keep and step <= newest:
                self.fs.rm(entry, recursive=True)

    def _storage_writer(self, name: str) -> Any:
        if "://" in self.directory and not self.directory.startswith("file://"):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            return FsspecWriter(self._writer_path(name))
        return FileSystemWriter(self._path(name))

    def _storage_reader(self, name: str) -> Any:
        if "://" in self.directory and not self.directory.startswith("file://"):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            return FsspecReader(self._writer_path(name))
        return FileSystemReader(self._path(name))


def _rng_state(scaler: Any | None = None) -> dict[str, Any]:
    """Every random state that can influence the next step, of this rank: Python's, NumPy's, torch's
    CPU generator and the generator of this rank's accelerator (dropout draws from the latter on a
    GPU, from the CPU one on the CPU). Data order needs none: the sampler seeds itself with
    seed + epoch and every loader has its own generator (data.py). Plus the fp16 gradient
    scaler's state (scale and growth tracker), which changes the steps' updates too."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    if scaler is not None:
        state["grad_scaler"] = scaler.state_dict()
    return state


def _set_rng_state(state: dict[str, Any], scaler: Any | None = None) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())
    if scaler is not None and state.get("grad_scaler"):
        scaler.load_state_dict(state["grad_scaler"])


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on rank 0's CPU (empty on the other ranks); every rank must call it.

    cpu_offload only when training on GPUs: with CPU tensors FSDP1's offload_to_cpu path frees the
    storage it then clones and segfaults (torch 2.13); on CPU there is nothing to offload anyway."""
    offload = torch.cuda.is_available()
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
