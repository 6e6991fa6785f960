"""The success report's `performance`: what `llamaft sweep` compares across sizes must be over the
steps that measure the size (the first step of an attempt pays one-time costs) and exact arithmetic
of what the loop recorded."""

from __future__ import annotations

import json

import pytest
from llamaft_trainer.process.termination import RunRecord, fit, succeeded


def test_the_first_step_of_an_attempt_is_left_out() -> None:
    record = RunRecord(tokens=1000 + 3 * 600, train_seconds=2.0 + 3 * 0.5, steady_steps=3, steady_tokens=1800,
                       steady_seconds=1.5, world_size=2, flops_per_token=1e9, peak_flops=1e12, peak_memory_bytes=123)
    assert record.performance() == {
        "steps": 3, "worldSize": 2, "tokensPerSecond": 1200.0, "tokensPerSecondPerDevice": 600.0,
        "stepSeconds": 0.5, "mfu": pytest.approx(0.6), "peakMemoryBytes": 123,
    }


def test_one_step_is_its_own_figure_and_no_peak_means_no_mfu() -> None:
    record = RunRecord(tokens=500, train_seconds=0.25, world_size=1)
    assert record.performance() == {"steps": 1, "worldSize": 1, "tokensPerSecond": 2000.0,
                                     "tokensPerSecondPerDevice": 2000.0, "stepSeconds": 0.25, "mfu": None,
                                     "peakMemoryBytes": None}


def test_no_step_timed_reports_no_figures() -> None:
    assert RunRecord(world_size=2).performance() is None  # a resumed run that had nothing left to train
    assert succeeded(RunRecord(step=5, total_steps=5))["performance"] is None


def test_the_report_with_figures_fits_the_termination_message() -> None:
    record = RunRecord(step=10, total_steps=10, loss=1.0, tokens=10, train_seconds=1.0, steady_steps=9, steady_tokens=9,
                       steady_seconds=0.9, world_size=4096, flops_per_token=1.0, peak_flops=2.0, peak_memory_bytes=2**40,
                       export_path="/x" * 500)
    doc = succeeded(record)
    assert json.loads(fit(doc)) == doc


def test_a_dpo_report_carries_the_reward_figures_and_an_sft_one_no_dpo_key() -> None:
    dpo = succeeded(RunRecord(step=8, total_steps=8, loss=0.4, eval_loss=0.5, reward_accuracy=0.875, reward_margin=0.9,
                              eval_reward_accuracy=0.75, eval_reward_margin=0.6))
    assert {k: dpo[k] for k in ("rewardAccuracy", "rewardMargin", "evalRewardAccuracy", "evalRewardMargin")} == {
        "rewardAccuracy": 0.875, "rewardMargin": 0.9, "evalRewardAccuracy": 0.75, "evalRewardMargin": 0.6}
    assert json.loads(fit(dpo)) == dpo
    sft = succeeded(RunRecord(step=8, total_steps=8, loss=1.2))
    assert not {"rewardAccuracy", "rewardMargin", "evalRewardAccuracy", "evalRewardMargin"} & set(sft)
