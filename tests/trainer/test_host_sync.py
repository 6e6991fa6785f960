"""No host synchronisation inside a step except on logging steps (issue 42): the real loop,
in-process on CPU (gloo, world size 1), under a torch function mode that counts the loop's reads of
device tensors back to the host.

On CPU every tensor lives in the same memory, so the mode tells the device's tensors apart the way a
GPU run would: the CPU batches the data yields are host tensors, and so is whatever is computed from
host tensors alone; a batch moved with `.to(device)` becomes a device tensor (a copy, as on a GPU),
and so is everything else (parameters, gradients, losses, `torch.tensor(..., device=device)`).
A read is `.item()`, `.tolist()`, `float()`, `int()`, `bool()`, `.cpu()` or `.numpy()` of a device
tensor, made by the trainer's own code (torch's internals reading its CPU-side state, e.g. AdamW's
step counter, are not the loop's doing). Each read is charged to the optimizer step that the loop is
in (from the start of `Trainer._step` to the next one).
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from llamaft.api.spec import TrainingJobConfig
from llamaft_trainer import train
from llamaft_trainer.main import setup
from llamaft_trainer.process.local_etcd import free_port
from llamaft_trainer.process.preemption import StopSignal
from llamaft_trainer.process.runtime import init_runtime
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from tests.trainer.conftest import base_config

TRAINER_CODE = str(Path(train.__file__).parent)
READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__,
         torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}
STEPS, LOG_INTERVAL = 8, 3
LOGGING_STEPS = {3, 6, 8}  # every LOG_INTERVAL-th step and the last


def _is_host(t: torch.Tensor) -> bool:
    return bool(getattr(t, "_llamaft_host", False))


def _mark_host(value: Any) -> None:
    for t in tree_flatten(value)[0]:
        if isinstance(t, torch.Tensor):
            t._llamaft_host = True  # type: ignore[attr-defined]


def _caller() -> Any:
    """The frame that made the read (the first one outside this file)."""
    frame = inspect.currentframe()
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return frame


def _moves(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """`.to(device)` / `.cuda()`: a copy to the device (on a GPU)."""
    if func is torch.Tensor.cuda:
        return True
    return func is torch.Tensor.to and (
        "device" in kwargs or any(isinstance(a, torch.device | str) for a in args[1:]))


class DeviceReads(TorchFunctionMode):
    """Counts reads of device tensors by the trainer's code, per optimizer step (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.reads: Counter[int] = Counter()
        self.where: dict[int, list[str]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func in READS and tensors and not _is_host(tensors[0]):
            caller = _caller()
            if caller is not None and caller.f_code.co_filename.startswith(TRAINER_CODE):
                self.reads[self.step] += 1
                self.where.setdefault(self.step, []).append(
                    f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno} {getattr(func, '__name__', func)}")
        out = func(*args, **kwargs)
        if _moves(func, args, kwargs):
            # A host tensor moved to the device is a device tensor (a copy, as on a GPU).
            return out.clone() if out is args[0] else out
        if all(_is_host(t) for t in tensors) and (tensors or kwargs.get("device") is None):
            _mark_host(out)  # computed from host tensors alone, or made on the host
        return out


@pytest.fixture(scope="module")
def gloo() -> Iterator[None]:
    """A world of one: the loop's collectives run in this process."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _run(tiny_model: Path, tmp: Path, stop: StopSignal | None = None, stop_at: int | None = None,
         **training: Any) -> tuple[DeviceReads, train.LoopResult]:
    """STEPS steps (2 micro-steps each) of the real loop, logging every LOG_INTERVAL steps; `stop`
    is signalled during step `stop_at`."""
    cfg = TrainingJobConfig.model_validate(base_config(
        tiny_model, tmp / "ck",
        training={"maxSteps": STEPS, "logInterval": LOG_INTERVAL, "gradientAccumulationSteps": 2, **training}))
    rt = init_runtime()
    session = setup(cfg, rt)
    trainer = train.Trainer(session, stop=stop)
    batches = session.data.batches

    def host_batches(*args: Any, **kwargs: Any) -> Iterator[dict[str, torch.Tensor]]:
        for batch in batches(*args, **kwargs):
            _mark_host(batch)
            yield batch

    session.data.batches = host_batches  # type: ignore[method-assign]
    mode = DeviceReads()
    step = trainer._step

    def counted_step(group: list[dict[str, torch.Tensor]]) -> Any:
        mode.step = trainer.state.step + 1
        if stop is not None and mode.step == stop_at:
            stop._handle(15, None)
        return step(group)

    trainer._step = counted_step  # type: ignore[method-assign]
    with mode:
        result = trainer.train()
    return mode, result


def test_only_logging_steps_read_the_device(gloo: None, tiny_model: Path, tmp_path: Path) -> None:
    mode, result = _run(tiny_model, tmp_path)
    assert result.state.step == STEPS and len(result.losses) == len(result.grad_norms) == STEPS
    quiet = {s: mode.where[s] for s in range(1, STEPS + 1) if s not in LOGGING_STEPS and mode.reads[s]}
    assert not quiet, f"device reads outside logging steps: {quiet}"
    assert all(mode.reads[s] > 0 for s in LOGGING_STEPS), mode.reads  # the mode does see reads


def test_a_stop_is_agreed_on_at_a_read_and_no_step_between_reads_syncs(
        gloo: None, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a stop signal, the ranks agree on it where the loop reads anyway: the logging steps,
    and every STOP_CHECK_SECONDS of training (here never, so only the first step and the logging
    steps): a signal during step 4 stops the loop after step 6, every rank together."""
    monkeypatch.setattr(train, "STOP_CHECK_SECONDS", 1e9)
    stop = StopSignal(budget_s=30)
    mode, result = _run(tiny_model, tmp_path, stop=stop, stop_at=4)
    assert result.stopped is not None and result.stopped.step == 6 and result.stopped.signalled
    assert result.state.step == 6 and len(result.losses) == 6
    reads = {s for s in range(1, 7) if mode.reads[s]}
    assert reads == {1, 3, 6}, mode.where
