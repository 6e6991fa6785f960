"""The learning-rate schedule (train.build_scheduler) is transformers' schedule, step for step, for
every `training.scheduler`: a run compared with HF Trainer (bench/peers.py) has the same rates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llamaft.api.spec import SchedulerType, TrainingJobConfig
from llamaft_trainer.train import build_scheduler
from transformers import get_scheduler

from tests.trainer.conftest import base_config


def job_config(**training: object) -> TrainingJobConfig:
    return TrainingJobConfig.model_validate(base_config(Path("/m"), Path("/c"), training=training))


HF_NAMES = {SchedulerType.COSINE: "cosine", SchedulerType.LINEAR: "linear", SchedulerType.CONSTANT: "constant_with_warmup"}


def rates(scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    out = []
    for _ in range(steps + 3):  # past the end: both floor at 0 (or hold, constant)
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("kind", list(SchedulerType))
@pytest.mark.parametrize("warmup", [0, 1, 7])
def test_the_schedule_is_transformers_schedule(kind: SchedulerType, warmup: int) -> None:
    cfg = job_config(scheduler=kind.value, warmupSteps=warmup, maxSteps=23)
    ours_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    theirs_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    ours = rates(build_scheduler(ours_opt, cfg, 23), ours_opt, 23)
    theirs = rates(get_scheduler(HF_NAMES[kind], theirs_opt, num_warmup_steps=warmup, num_training_steps=23), theirs_opt, 23)
    assert ours == theirs
    assert len(set(ours)) > 1 or (kind is SchedulerType.CONSTANT and warmup == 0)


def test_the_schedule_resumes_from_its_state_dict() -> None:
    cfg = job_config(scheduler="cosine", warmupSteps=3, maxSteps=20)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    first = build_scheduler(opt, cfg, 20)
    for _ in range(9):
        opt.step()
        first.step()
    state = first.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    second = build_scheduler(opt2, cfg, 20)
    second.load_state_dict(state)
    opt2.param_groups[0]["lr"] = second.get_last_lr()[0]
    assert second.get_last_lr() == first.get_last_lr() and second.last_epoch == 9
