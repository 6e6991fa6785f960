"""Checkpoint step: sharded DCP checkpoints, atomic completion, keep-last-K, resume, HF export.

Layout under `checkpointing.directory` (a path or an fsspec URI):
  step-00000200/               torch.distributed.checkpoint shards (model, optimizer, scheduler,
                               step, epoch, data position) plus rng-rank-<r>.pt per rank (its random
                               states and the fp16 gradient scaler: see _rng_state)
  step-00000200/COMPLETE       written by rank 0 once every rank's part is written; a directory
                               without it is an interrupted save and is never resumed from
  export/                      consolidated Hugging Face safetensors (or the LoRA adapter)

Only DCP's public API: `dcp.save` / `dcp.async_save` / `dcp.load` with `checkpoint_id` (a local path
picks FileSystemWriter/Reader, any other fsspec URI DCP's fsspec storage: torch 2.13
`torch/distributed/checkpoint/_storage_utils.py` `_storage_setup`), and `Stateful` wrappers of the
model, the optimizer (`torch.distributed.checkpoint.state_dict`), the scheduler and the train state,
as torchtitan's CheckpointManager does. The keys (`model`, `optimizer`, `scheduler`, `train`) are
those of the earlier layout, so older checkpoints still resume.

Asynchronous saves (`checkpointing.async`, the default): the training loop waits only while the state
is copied ("staged") to host memory; the write runs on a background thread (`dcp.async_save`) and
then, still in the background, every rank commits it (see `Checkpointer._commit`): each rank writes
its random state, waits for its part of the write, the ranks agree over an all-reduce that all of
them succeeded, rank 0 writes COMPLETE and prunes, and a second all-reduce tells every rank it is
marked. DCP's collectives and these run on a dedicated gloo process group, so they never interleave
with the training collectives of the main thread on the default group. One save is in flight at a
time: the next save (and the end of training) first waits for the previous one. A crash during the
background write leaves that step's directory without COMPLETE: only that checkpoint is lost. The
staging buffers (one host copy of this rank's shards and optimizer state) are allocated by the first
save and reused by the next ones (`_stager_for`).
"""

from __future__ import annotations

import io
import json
import random
import re
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import fsspec
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from llamaft_trainer.parallel.float8 import plain_weights
from llamaft_trainer.process.errors import ConfigError

STEP_DIR = re.compile(r"^step-(\d{8})$")
COMPLETE = "COMPLETE"
ASYNC_GROUP_TIMEOUT_S = 1800.0
"""Least timeout of the checkpoint process group: its collectives wait for the slowest rank's write
(a peer that died is found sooner by the training collectives, which use collectiveTimeoutSeconds)."""


@dataclass
class TrainState(Stateful):
    """Everything besides model and optimizer that a resumed run needs to continue identically."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    """This rank's micro-batches of the epoch: where its DistributedSampler share continues."""
    tokens_seen: int = 0
    items_in_epoch: int = 0
    """training.globalBatchSize: the epoch's training items consumed by all ranks together
    (global_order.py), what a resume on any world size continues from."""
    global_order: bool = False
    """Whether the run takes its steps from a global order: only then does a checkpoint hold
    `items_in_epoch` (so the checkpoints of other runs keep their keys, and still load)."""

    def to_dict(self) -> dict[str, int]:
        saved = {"step": self.step, "epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch, "tokens_seen": self.tokens_seen}
        if self.global_order:
            saved["items_in_epoch"] = self.items_in_epoch
        return saved

    def state_dict(self) -> dict[str, Any]:
        return self.to_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, value in state_dict.items():
            setattr(self, key, int(value))


class ModelState(Stateful):
    """The model's (sharded) state dict through torch.distributed.checkpoint.state_dict."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    """The optimizer's state dict, keyed by parameter names (torch.distributed.checkpoint.state_dict)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)  # type: ignore[return-value]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)  # type: ignore[arg-type]


class SchedulerState(Stateful):
    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)


@dataclass(frozen=True)
class RunState:
    """What a checkpoint holds, as the objects the run trains: given to the Checkpointer once
    (torchtitan's CheckpointManager holds its states the same way), saved and restored in place."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train: TrainState
    scaler: Any | None = None
    """fp16's gradient scaler: its scale rides with the random states."""

    def payload(self) -> dict[str, Any]:
        """DCP's state dict of Statefuls (dcp.load calls load_state_dict in sorted key order:
        model, optimizer, scheduler, train)."""
        return {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optimizer),
            "scheduler": SchedulerState(self.scheduler),
            "train": self.train,
        }


@dataclass(frozen=True)
class Staged:
    """What `Checkpointer.save` returns: the save has started (async) or is complete (sync)."""

    step: int
    path: str
    stall_seconds: float
    """How long the call blocked the training loop (waiting for the previous save included)."""
    waited_seconds: float
    """The part of stall_seconds spent waiting for the previous save to finish."""
    background: bool
    """True: the write continues in the background; `poll` / `wait` report its completion."""


@dataclass(frozen=True)
class Completed:
    """A checkpoint that is complete on storage (its COMPLETE marker exists)."""

    step: int
    path: str
    stall_seconds: float
    """How long the training loop was blocked by this save (sync: all of it)."""
    write_seconds: float
    """From the start of the write to the COMPLETE marker (async: in the background)."""
    background: bool


@dataclass
class _InFlight:
    step: int
    path: str
    stall_seconds: float
    waited_seconds: float
    future: Future[float]


class Checkpointer:
    def __init__(
        self, directory: str, keep_last: int, rank: int, *, run: RunState | None = None, async_save: bool = False,
        device: torch.device | None = None, timeout_s: float = ASYNC_GROUP_TIMEOUT_S,
    ) -> None:
        """`run`: what `save` writes and `load` restores (None: a checkpointer that only lists and
        prunes). `async_save`: save in the background (needs an initialised process group: it
        creates a gloo group for the checkpoint's collectives, a collective call on every rank).
        `device`: where the flags of a synchronous save's all-reduces live (the default group's device)."""
        self.run = run
        self.fs, self.root = fsspec.core.url_to_fs(directory)
        self.directory = directory.rstrip("/")
        self.keep_last = keep_last
        self.rank = rank
        self.save_seconds: list[float] = []
        """How long each save of this run took, staging and write: what a save on SIGTERM is expected to cost."""
        self.async_save = async_save and dist.is_available() and dist.is_initialized()
        self._group: Any = None
        self._flag_device = device if device is not None else torch.device("cpu")
        self._executor: ThreadPoolExecutor | None = None
        self._stager: Any = None
        self._stager_chosen = False
        if self.async_save:
            # torch 2.13 async_save runs DCP's collectives on `process_group` or the default group,
            # from its own thread; the default group is busy with training collectives, so give
            # checkpoints their own gloo group (torchtitan does the same). CPU: async_save asserts it.
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(timeout_s, ASYNC_GROUP_TIMEOUT_S)))
            self._flag_device = torch.device("cpu")
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llamaft-checkpoint")
        self._in_flight: _InFlight | None = None
        self._completed: list[Completed] = []

    # ------------------------------------------------------------------ paths and listing
    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def _writer_path(self, name: str) -> str:
        return f"{self.directory}/{name}"

    def _checkpoint_id(self, name: str) -> str:
        """What DCP gets: a local path (FileSystemWriter/Reader) or the URI (its fsspec storage)."""
        if "://" in self.directory and not self.directory.startswith("file://"):
            return self._writer_path(name)
        return self._path(name)

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

    def _run(self) -> RunState:
        if self.run is None:
            raise RuntimeError("this Checkpointer was made without the run's state (run=RunState(...)): it cannot save or load")
        return self.run

    # ------------------------------------------------------------------ saving
    def save(self, *, blocking: bool = False) -> Staged:
        """Save the run at its current step (collective: every rank calls it at the same step).

        Async (and not `blocking`): waits for the previous save, stages a copy of the state and
        returns while the write goes on; `poll` / `wait` report its completion. Otherwise the save
        is complete (or has raised) when this returns. A failed earlier save raises here."""
        run = self._run()
        state, model = run.train, run.model
        started = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - started
        name = f"step-{state.step:08d}"
        path = self._path(name)
        if self.rank == 0 and self.fs.exists(path):
            self.fs.rm(path, recursive=True)  # a leftover of an interrupted save of the same step
        dist.barrier()
        rng = io.BytesIO()
        torch.save(_rng_state(run.scaler), rng)
        marker = json.dumps(state.to_dict())
        payload = run.payload()
        checkpoint_id = self._checkpoint_id(name)
        if self.async_save and not blocking:
            if not self._stager_chosen:
                self._stager, self._stager_chosen = _stager_for(model), True
            response = dcp_async_save(
                payload, checkpoint_id=checkpoint_id, process_group=self._group, async_stager=self._stager,
            )
            if isinstance(response, AsyncSaveResponse):  # a stager that stages in the background
                response.staging_completion.result()
                upload = response.upload_completion
            else:
                upload = response
            write_started = time.perf_counter()
            stall = write_started - started
            assert self._executor is not None
            future = self._executor.submit(self._commit, name, marker, rng.getvalue(), upload.result, write_started)
            self._in_flight = _InFlight(state.step, self._writer_path(name), stall, waited, future)
            return Staged(state.step, self._writer_path(name), stall, waited, True)

        def write() -> None:
            dcp_save(payload, checkpoint_id=checkpoint_id, process_group=self._group)

        write_seconds = self._commit(name, marker, rng.getvalue(), write, time.perf_counter())
        stall = time.perf_counter() - started
        self.save_seconds.append(stall - waited)
        self._completed.append(Completed(state.step, self._writer_path(name), stall, write_seconds, False))
        return Staged(state.step, self._writer_path(name), stall, waited, False)

    def _commit(self, name: str, marker: str, rng: bytes, write: Callable[[], Any], started: float) -> float:
        """Finish a save on every rank (the background thread of an async save): this rank's random
        state, its part of the write, then agreement and the COMPLETE marker. Returns the seconds
        from `started`; raises on every rank when any rank's part failed or the marker could not
        be written, so the ranks always reach the same verdict.

        DCP's save returns on a rank only after the coordinator gathered every rank's write result
        and wrote `.metadata` (torch 2.13 state_dict_saver.py `_save_state_dict`: `all_reduce("write",
        ...)`, utils.py `_DistWrapper.all_reduce`), and raises on every rank if any failed; the
        all-reduce here adds the rng files, written outside DCP."""
        error: BaseException | None = None
        try:
            self.fs.makedirs(self._path(name), exist_ok=True)
            with self.fs.open(self._path(f"{name}/rng-rank-{self.rank}.pt"), "wb") as f:
                f.write(rng)
            write()
        except Exception as exc:
            error = exc
        if not self._everywhere(error is None):
            raise error or RuntimeError(f"checkpoint {name}: another rank failed to write its part (see its log)")
        if self.rank == 0:
            try:
                with self.fs.open(self._path(f"{name}/{COMPLETE}"), "w") as f:
                    f.write(marker)
            except Exception as exc:
                error = exc
        if not self._everywhere(error is None):
            raise error or RuntimeError(f"checkpoint {name}: rank 0 could not write its {COMPLETE} marker (see its log)")
        if self.rank == 0:
            try:
                self._prune()
            except Exception as exc:  # leftovers are harmless: the next save prunes again
                print(f"llamaft_trainer: pruning old checkpoints failed: {exc!r}", file=sys.stderr, flush=True)
        return time.perf_counter() - started

    def _everywhere(self, ok: bool) -> bool:
        flag = torch.tensor([1.0 if ok else 0.0], device=self._flag_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item() > 0)

    def _collect(self) -> None:
        """Move the finished in-flight save to the completed list (raises if it failed)."""
        assert self._in_flight is not None
        flight, self._in_flight = self._in_flight, None
        write_seconds = flight.future.result()
        self.save_seconds.append(flight.stall_seconds - flight.waited_seconds + write_seconds)
        self._completed.append(Completed(flight.step, flight.path, flight.stall_seconds, write_seconds, True))

    @property
    def in_flight_step(self) -> int | None:
        return self._in_flight.step if self._in_flight is not None else None

    def poll(self) -> list[Completed]:
        """Checkpoints completed since the last call, oldest first. Local and non-blocking (no
        collective): a rank may see a completion a step before another. A failed background save
        stays in flight here; `wait` (or the next `save`) raises it on every rank."""
        flight = self._in_flight
        if flight is not None and flight.future.done() and flight.future.exception() is None:
            self._collect()
        done, self._completed = self._completed, []
        return done

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the in-flight save: True when none is left, False when `timeout` passed first
        (it goes on in the background). Raises the save's error, on every rank alike."""
        if self._in_flight is None:
            return True
        try:
            self._in_flight.future.result(timeout)
        except FutureTimeout:
            return False
        self._collect()
        return True

    def close(self) -> None:
        """After the last save: finish it (raises if it failed) and release the checkpoint process
        group. A save abandoned by a stop (still running) is left alone: the process exits and the
        step stays without COMPLETE."""
        if self._in_flight is not None and not self._in_flight.future.done():
            return
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None

    # ------------------------------------------------------------------ loading
    def load(self, step: int) -> TrainState:
        """Restore everything a checkpoint holds into the run, in place; the random states last, so
        that nothing after this call but the next step draws from them. Returns the run's TrainState."""
        run = self._run()
        name = f"step-{step:08d}"
        try:
            dcp_load(run.payload(), checkpoint_id=self._checkpoint_id(name))
        except CheckpointException as exc:  # DCP's planning error of every rank, a BaseException
            missing = "Missing key in checkpoint state_dict: train.items_in_epoch"
            if run.train.global_order and any(missing in str(error) for error, _ in exc.failures.values()):
                raise ConfigError(
                    f"spec.training.globalBatchSize: {name} was written by a run without it, whose data position is "
                    "per rank; resume it without globalBatchSize (on the same world size), or start the run again "
                    "with checkpointing.resume: false or another checkpointing.directory"
                ) from exc
            raise
        rng_path = self._path(f"{name}/rng-rank-{self.rank}.pt")
        if self.fs.exists(rng_path):
            with self.fs.open(rng_path, "rb") as f:
                _set_rng_state(torch.load(io.BytesIO(f.read()), weights_only=False), run.scaler)
        else:  # more ranks than the run that saved it: training continues, but not bit for bit
            print(f"llamaft_trainer: {name} has no random state for rank {self.rank}; dropout masks will differ "
                  "from an uninterrupted run", file=sys.stderr, flush=True)
        return run.train

    def _prune(self) -> None:
        """Delete complete checkpoints beyond keep_last and interrupted ones older than the newest.
        Runs right after a save is marked, before the next one starts: the newest complete one is
        always kept and nothing newer (an in-flight save) is touched."""
        steps = self.complete_steps()
        keep = set(steps[-self.keep_last :])
        newest = steps[-1] if steps else -1
        for entry in self.fs.ls(self.root, detail=False):
            match = STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if not match:
                continue
            step = int(match.group(1))
            if step not in keep and step < newest:
                self.fs.rm(entry, recursive=True)


def _stager_for(model: nn.Module) -> Any:
    """How async_save copies the state before training goes on; one stager per Checkpointer, so its
    host buffers are allocated by the first save and reused by the next ones (a fresh copy pays for
    the allocation: ~1 s instead of ~0.25 s for 630 MB on this CPU). The cost: one host copy of this
    rank's weights and optimizer state stays allocated between saves.

    CPU: the stager async_save builds when given none (torch 2.13 state_dict_saver.py `async_save`:
    `DefaultStager(StagingOptions(False, False, False, False))`: no pinned or shared memory, a
    blocking copy), kept instead of rebuilt per save. FSDP1: `BlockingAsyncStager`, because
    DefaultStager cannot copy ShardedTensors (`_state_dict_stager.py` `_offload_tensor` calls
    `data_ptr()`, which ShardedTensor rejects); it caches only into pinned memory, i.e. on a GPU.
    GPU: page-locked host buffers kept between saves (the device-to-host copy is the stall).
    Shards held by a wrapper tensor subclass (fsdp.float8 with allGather: torchao's
    WeightWithDynamicFloat8CastTensor): `BlockingAsyncStager` too, because DefaultStager copies
    a tensor through its untyped storage, and a wrapper subclass has none (data_ptr() 0): it gets
    an uninitialized tensor of the same shape and the checkpoint holds garbage (seen with torch
    2.13 and torchao 0.18; tests/trainer/parallel/test_float8.py resumes such a run bit for bit).
    BlockingAsyncStager copies with `copy_` / `.to("cpu")`, which the subclass dispatches."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions
    from torch.distributed.fsdp import FullyShardedDataParallel

    if torch.cuda.is_available():
        return BlockingAsyncStager(cache_staged_state_dict=True)
    if isinstance(model, FullyShardedDataParallel) or _has_storageless_shards(model):
        return BlockingAsyncStager()
    return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=False))


def _has_storageless_shards(model: nn.Module) -> bool:
    """Whether a parameter's local shard is a wrapper tensor subclass without storage of its own."""
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if local.numel() > 0 and local.data_ptr() == 0:
            return True
    return False


def _rng_state(scaler: Any | None = None) -> dict[str, Any]:
    """Every random state that can influence the next step, of this rank: Python's, NumPy's, torch's
    CPU generator and the generator of this rank's accelerator (dropout draws from the latter on a
    GPU, from the CPU one on the CPU). Data order needs none: the sampler seeds itself with
    seed + epoch and every loader has its own generator (data/batching.py). Plus the fp16 gradient
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
    return plain_weights({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
