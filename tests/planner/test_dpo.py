"""`llamaft plan` and the capacity verdict for training.method dpo: two sequences per pair in one
forward, DPO's logits, the reference (precomputed pass, LoRA's adapter-disabled forward, `live`'s
frozen copy and its forward per micro-batch), what the trainer refuses in its words."""

from __future__ import annotations

from typing import Any

import pytest
from llamaft.api.spec import (
    MixedPrecision,
    ShardingStrategy,
)
from llamaft.planner import (
    FITS,
    admission,
    build_plan,
    estimate_memory,
    resolve_shape,
    setup_from_spec,
)
from llamaft.planner.memory import Setup
from llamaft.planner.plan_text import render_plan

from tests.planner.conftest import make_spec
from tests.planner.test_memory import SMALL

DPO = {"training.method": "dpo", "dataset.format": "preference", "dataset.source": "trl-lib/tldr-preference",
       "dataset.packing": False, "dataset.maxSeqLength": 2048, "training.perDeviceBatchSize": 2}


def dpo_spec(**overrides: Any) -> Any:
    return make_spec(**{**DPO, **overrides})


def setup(**kw: object) -> Setup:
    base: dict[str, object] = {"strategy": ShardingStrategy.FULL_SHARD, "world_size": 1, "shard_size": 1,
                               "precision": MixedPrecision.BF16, "batch": 4, "seq": 256, "device": "cpu", "packing": False}
    base.update(kw)
    return Setup(**base)  # type: ignore[arg-type]


def test_a_pair_is_two_sequences_in_one_forward() -> None:
    s = setup_from_spec(dpo_spec())
    assert (s.dpo, s.batch, s.seq, s.packing) == (True, 4, 2048, False)
    sft = setup_from_spec(make_spec(**{"training.perDeviceBatchSize": 2, "dataset.packing": False}))
    assert (sft.dpo, sft.batch) == (False, 2)
    # up to the LM head, DPO's forward over 2 pairs is SFT's over 4 sequences
    dpo, four = estimate_memory(SMALL, setup(dpo=True)), estimate_memory(SMALL, setup())
    assert dpo.phase_peaks["forward"] == four.phase_peaks["forward"]
    assert dpo.notes[0].startswith("DPO: perDeviceBatchSize 2 pairs is a micro-batch of 4 sequences")


def test_dpo_logits_by_hand() -> None:
    """dpo.sequence_logps under autograd, bf16, one slice: at log-softmax's backward the saved fp32
    output, the logits' bf16 gradient, two fp32 gradients and the bf16 cast: 2c more per element
    than SFT's cross-entropy (12 bytes)."""
    vocab, tokens, c = 2048, 4 * 256, 2
    dpo, sft = estimate_memory(SMALL, setup(dpo=True)), estimate_memory(SMALL, setup())
    assert dpo.phase_peaks["loss"] - sft.phase_peaks["loss"] == 2 * c * vocab * tokens
    # lossChunks slices only log-softmax's fp32 input and gradients (a quarter each: 12 -> 3 bytes
    # and the bf16 cast 2 -> 0.5), while each slice's gradient is padded to the logits' full size
    # (+2) and the whole fp32 log-softmax stays saved: DPO gains less from it than SFT, whose LM
    # head runs per slice
    dpo4, sft4 = estimate_memory(SMALL, setup(dpo=True, loss_chunks=4)), estimate_memory(SMALL, setup(loss_chunks=4))
    assert dpo.phase_peaks["loss"] - dpo4.phase_peaks["loss"] == 5.5 * vocab * tokens
    assert sft.phase_peaks["loss"] - sft4.phase_peaks["loss"] > dpo.phase_peaks["loss"] - dpo4.phase_peaks["loss"]
    assert dpo4.phase_peaks["loss"] - sft4.phase_peaks["loss"] >= 4 * vocab * tokens


def test_the_precomputed_reference_is_a_pass_before_training_and_no_memory() -> None:
    spec = dpo_spec(**{"training.maxSteps": 100})
    shape = resolve_shape(spec.model.source)
    plan = build_plan(spec, shape, dataset_records=10_000)
    tp = plan.throughput
    fpt = tp.flops_per_token
    assert tp.reference_seconds == pytest.approx(10_000 * 2 * 2048 * fpt / 3 / (0.4 * 312e12 * 8))
    assert tp.total_seconds == pytest.approx(100 * tp.step_seconds + tp.reference_seconds)
    assert "before the first step" in tp.reference_note and "no second copy" in tp.reference_note
    # no second model: the same memory as with LoRA's reference would be for full fine-tuning
    assert plan.memory.parameters == build_plan(make_spec(), shape).memory.parameters
    unknown = build_plan(spec, shape).throughput
    assert unknown.reference_seconds is None and "--dataset-records" in unknown.reference_note
    text = render_plan("dpo", plan, admission(spec))
    assert "(2 DPO pairs: chosen + rejected)" in text and "the DPO reference pass before training" in text


def test_loras_reference_is_a_forward_per_micro_batch() -> None:
    lora = {"training.lora.enabled": True, "training.lora.r": 16, "training.lora.targetModules": ["q_proj", "v_proj"]}
    spec = dpo_spec(**lora)
    plan = build_plan(spec, resolve_shape(spec.model.source), dataset_records=10_000)
    sft = build_plan(make_spec(**lora), resolve_shape(spec.model.source))
    assert plan.throughput.recompute_factor == pytest.approx(sft.throughput.recompute_factor + 2 / 6)
    assert plan.throughput.reference_seconds is None and "adapters disabled" in plan.throughput.reference_note
    # no copy: the base model's shards are the reference, so the memory is LoRA SFT's but the pairs'
    assert plan.memory.components.get("reference", 0) == 0
    assert plan.memory.persistent_bytes == sft.memory.persistent_bytes
    # `live` means nothing under LoRA: the base model is the reference
    live = dpo_spec(**lora, **{"training.dpo.reference": "live"})
    assert admission(live).reason == FITS
    assert build_plan(live, resolve_shape(spec.model.source)).memory.components.get("reference", 0) == 0


def test_the_live_reference_is_a_second_sharded_copy_and_a_forward_per_micro_batch() -> None:
    """`reference: live`: the frozen copy's shards in the compute dtype (bf16: half the fp32 master
    copy) held all the time, its no-grad forward per micro-batch in the time (+2/6)."""
    base = {"training.maxSteps": 100, "training.gradientAccumulationSteps": 2, "cluster.workers": 2}
    shape = resolve_shape(dpo_spec().model.source)
    pre = build_plan(dpo_spec(**base), shape, dataset_records=10_000)
    live = build_plan(dpo_spec(**base, **{"training.dpo.reference": "live"}), shape, dataset_records=10_000)
    assert live.setup.dpo_live_reference and not pre.setup.dpo_live_reference
    reference = live.memory.components["reference"]
    assert reference == live.memory.components["parameters"] // 2 > 0  # c = 2 bytes, the master 4
    assert "reference" not in pre.memory.components or pre.memory.components["reference"] == 0
    assert live.memory.peak_bytes >= pre.memory.peak_bytes + reference
    assert live.memory.persistent_bytes == pre.memory.persistent_bytes + reference
    assert live.memory.phase_peaks["reference"] > 0
    # fp32: the copy is as large as the master copy
    fp32 = build_plan(dpo_spec(**base, **{"training.dpo.reference": "live", "fsdp.mixedPrecision": "fp32"}), shape)
    assert fp32.memory.components["reference"] == fp32.memory.components["parameters"]
    # time: a no-grad forward per micro-batch, nothing before training
    assert live.throughput.recompute_factor == pytest.approx(pre.throughput.recompute_factor + 2 / 6)
    assert live.throughput.reference_seconds is None and "live reference" in live.throughput.reference_note
    assert live.throughput.step_seconds > pre.throughput.step_seconds
    assert "DPO live reference (frozen sharded copy)" in render_plan("live", live, admission(dpo_spec(**base)))


def test_the_capacity_verdict_counts_the_live_reference() -> None:
    """Llama 2 7B on 8 A100 40GB (p4d), 8 pairs of 2048 tokens per micro-batch: about 39 of 40 GiB
    with the precomputed reference; the live copy's bf16 shard (6.7e9 x 2 bytes / 8 ranks, 1.6 GiB)
    beside it does not fit, and the verdict says so."""
    tight = {"cluster.instanceType": "p4d.24xlarge", "training.perDeviceBatchSize": 8, "dataset.maxSeqLength": 2048}
    pre = admission(dpo_spec(**tight))
    live = admission(dpo_spec(**tight, **{"training.dpo.reference": "live"}))
    assert pre.plan is not None and live.plan is not None
    copy = live.plan.memory.components["reference"]
    assert copy == 2 * live.plan.memory.parameters // 8 == pytest.approx(1.57 * 2**30, rel=0.01)
    assert live.plan.required_bytes - pre.plan.required_bytes >= copy
    assert pre.reason == FITS and live.reason != FITS and not live.fits, (pre.message, live.message)


def test_streamed_pairs_are_planned_and_trained_as_stored_ones() -> None:
    """dataset.streaming with format preference (preference_stream.py) is valid: the verdict fits it,
    its plan is the token store's (the same micro-batches, the same reference pass before training:
    the stream is scored in one pass of the initial model)."""
    base = {"training.maxSteps": 100, "cluster.workers": 2}
    shape = resolve_shape(dpo_spec().model.source)
    stored = build_plan(dpo_spec(**base), shape, dataset_records=10_000)
    streamed = build_plan(dpo_spec(**base, **{"dataset.streaming": True}), shape, dataset_records=10_000)
    assert admission(dpo_spec(**{"dataset.streaming": True})).reason == FITS
    assert streamed.memory.peak_bytes == stored.memory.peak_bytes
    assert streamed.throughput.reference_seconds == stored.throughput.reference_seconds > 0


def test_the_llama3_8b_dpo_example_is_lora_and_fits_on_p5() -> None:
    from llamaft.manifests import load_finetune

    from tests.conftest import REPO

    _, spec = load_finetune(REPO / "examples" / "llama3-8b-dpo.yaml")
    result = admission(spec)
    assert result.reason == FITS and result.plan is not None and result.plan.setup.dpo
    assert spec.training.lora is not None and not result.plan.setup.dpo_live_reference  # the base is the reference
    assert result.plan.memory.components.get("reference", 0) == 0
    assert result.plan.setup.batch == 2 * spec.training.per_device_batch_size
    assert result.plan.memory.peak_event == "loss:DPO log-softmax backward"
