"""The planner under training.globalBatchSize (issue 39): memory per rank from perDeviceBatchSize
and the derived micro-steps, exactly as the same micro-batch with that accumulation; time per step
and steps per epoch from the global batch, whatever the world size; fixes that keep it."""

from __future__ import annotations

from llamaft.planner import build_plan, resolve_shape
from llamaft.planner.plan import apply_changes, suggest_fixes

from tests.planner.conftest import make_spec

SHAPE = "meta-llama/Llama-2-7b-hf"


def test_memory_is_the_micro_batchs_and_time_the_global_batchs() -> None:
    shape = resolve_shape(SHAPE)
    # 2 workers x 8 = 16 ranks, micro-batch 2: 64 sequences a step are 2 micro-steps per rank
    global_batch = build_plan(make_spec(**{"cluster.workers": 2, "training.perDeviceBatchSize": 2,
                                           "training.globalBatchSize": 64}), shape)
    accumulated = build_plan(make_spec(**{"cluster.workers": 2, "training.perDeviceBatchSize": 2,
                                          "training.gradientAccumulationSteps": 2}), shape)
    assert global_batch.memory.peak_bytes == accumulated.memory.peak_bytes
    assert global_batch.throughput.tokens_per_step == accumulated.throughput.tokens_per_step == 64 * 4096
    # on one worker the same spec keeps its 64 sequences a step: twice the time per step, same tokens
    one = build_plan(make_spec(**{"training.perDeviceBatchSize": 2, "training.globalBatchSize": 64}), shape)
    assert one.throughput.tokens_per_step == 64 * 4096
    assert one.throughput.step_seconds is not None and global_batch.throughput.step_seconds is not None
    assert one.throughput.step_seconds == 2 * global_batch.throughput.step_seconds
    # an uneven split (50 over 16 ranks of 2: 2 micro-steps, some short) still counts 50 sequences
    uneven = build_plan(make_spec(**{"cluster.workers": 2, "training.perDeviceBatchSize": 2,
                                     "training.globalBatchSize": 50}), shape)
    assert uneven.memory.peak_bytes == accumulated.memory.peak_bytes
    assert uneven.throughput.tokens_per_step == 50 * 4096


def test_epochs_count_global_steps() -> None:
    spec = make_spec(**{"training.maxSteps": None, "training.epochs": 2, "dataset.packing": False,
                        "dataset.validationSplit": 0.0, "training.globalBatchSize": 64})
    # samsum's 14,732 training records, 64 a step on any world size, the tail short of a step left out
    assert build_plan(spec, resolve_shape(SHAPE)).throughput.total_steps == 2 * (14732 // 64)


def test_the_fixes_keep_the_global_batch_valid() -> None:
    spec = make_spec(**{"training.perDeviceBatchSize": 8, "training.globalBatchSize": 8,
                        "fsdp.activationCheckpointing.mode": "none"})
    plan = build_plan(spec, resolve_shape(SHAPE))
    fixes = suggest_fixes(spec, resolve_shape(SHAPE), plan.memory, 1)
    assert fixes
    for fix in fixes:
        assert "training.gradientAccumulationSteps" not in fix.changes
        assert "cluster.workers" not in fix.changes  # 16 ranks cannot carry 8 sequences
        changed = apply_changes(spec, fix.changes)
        assert changed.training.global_batch_size == 8
