"""The per-rank memory model against hand-computed cases."""

from __future__ import annotations

import dataclasses

import pytest
from llamaft.api.spec import AttentionImplementation, CheckpointingMode, MixedPrecision, ShardingStrategy
from llamaft.planner.memory import (
    TRAINER_SYNCS_EVERY_MICRO_STEP,
    Setup,
    compute_bytes,
    dora_temporary_bytes,
    layer_activation_bytes_per_token,
    master_bytes,
    op_sac_recomputed_fraction,
    op_sac_saved_bytes,
    reduce_bytes,
    setup_from_spec,
    units,
)
from llamaft.planner.replay import estimate_memory
from llamaft.planner.shapes import shape_from_config

from tests.conftest import REPO
from tests.planner.conftest import make_spec

# 4 layers, hidden 256, 8 heads of 32, 4 KV heads, MLP 688, vocab 2048: 3,950,848 parameters
SMALL = shape_from_config({"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
                           "num_attention_heads": 8, "num_key_value_heads": 4}, "small")
LAYER = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 688 + 2 * 256  # q, o 256x256; k, v 128x256; MLP; norms
N = 4 * LAYER + 2 * 2048 * 256 + 256


def setup(**kw: object) -> Setup:
    base: dict[str, object] = {"strategy": ShardingStrategy.FULL_SHARD, "world_size": 1, "shard_size": 1,
                               "precision": MixedPrecision.BF16, "batch": 2, "seq": 256, "device": "cpu"}
    base.update(kw)
    return Setup(**base)  # type: ignore[arg-type]


def test_dtypes() -> None:
    assert [compute_bytes(p) for p in MixedPrecision] == [2, 2, 4, 2]
    assert [master_bytes(p) for p in MixedPrecision] == [4, 4, 4, 2]
    assert [reduce_bytes(p) for p in MixedPrecision] == [4, 4, 4, 2]


def test_shapes_of_the_small_model() -> None:
    assert LAYER == 725_504 and SMALL.layer_parameters == LAYER
    assert N == SMALL.parameters == 3_950_848


def test_layer_activations_by_hand() -> None:
    h, q, kv, i, heads = 256, 256, 128, 688, 8
    # bf16, full fine-tuning, sdpa, packing, CPU kernel (o_proj input is a separate copy):
    # RMSNorm x2: fp32 upcast 4h + normalised 2h + output 2h; q, k, v after RoPE; sdpa output +
    # log-sum-exp; o_proj input; SwiGLU: gate, silu, up, product
    full = 2 * (4 * h + 2 * h + 2 * h) + 2 * (q + 2 * kv) + 2 * q + 4 * heads + 2 * q + 4 * 2 * i
    assert full == 11_680
    assert layer_activation_bytes_per_token(SMALL, setup()) == full
    # on CUDA the sdpa output already has o_proj's layout: no copy
    assert layer_activation_bytes_per_token(SMALL, setup(device="cuda")) == full - 2 * q
    # padding mask: sdpa gets k and v repeated to every head
    assert layer_activation_bytes_per_token(SMALL, setup(packing=False)) == full + 2 * 2 * (q - kv)
    # eager: q and repeated k, v; the softmax in fp32 and its bf16 cast per key position; no sdpa output
    eager = layer_activation_bytes_per_token(SMALL, setup(attention=AttentionImplementation.EAGER, device="cuda"))
    assert eager == full - 2 * (q + 2 * kv) - 2 * q - 4 * heads - 2 * q + 3 * 2 * q + (4 + 2) * heads * 256 + 2 * q
    # LoRA r8 on q, v with dropout: frozen base and norms save less; each adapted projection keeps
    # a dropout mask (1 byte) and the dropped input (2 bytes) per input feature, and r values
    lora = setup(lora_rank=8, lora_targets=("q_proj", "v_proj"), lora_dropout=0.05)
    by_hand = (4 * h) + 2 * (3 * h + 2 * 8) + 2 * (q + 2 * kv) + 2 * q + 4 * heads + (4 * h) + 3 * 2 * i
    assert by_hand == 9_312
    assert layer_activation_bytes_per_token(SMALL, lora) == by_hand


def test_peak_by_hand_one_rank_bf16() -> None:
    """The whole step, one rank, bf16, no AC, micro-batch 2 x 256: the peak is cross-entropy's
    backward (what the CPU bench measures too)."""
    est = estimate_memory(SMALL, setup())
    tokens = 2 * 256
    params = 4 * N  # fp32 master copy, not sharded (one rank)
    adam = 2 * 4 * N
    last_layer = 2 * LAYER  # the last decoder layer stays gathered after forward (bf16)
    activations = 4 * 11_680 * tokens + (24 + 2 * 2 * 32) * tokens + (4 * 256 + 2 * 2 * 256) * tokens
    logits = 3 * 4 * 2048 * tokens  # saved log-softmax + two fp32 gradients
    assert est.peak_event == "loss:cross-entropy backward"
    assert est.components["parameters"] == params and est.components["optimizer"] == adam
    assert est.components["gathered_parameters"] == last_layer
    assert est.components["logits"] == logits
    assert est.peak_bytes == params + adam + last_layer + activations + logits == 86_491_136


def test_sharding_pads_each_tensor_to_the_group() -> None:
    odd = dataclasses.replace(SMALL, vocab_size=2050)
    layer, root, wrapped = units(odd, setup(world_size=4, shard_size=4))
    assert wrapped == 4 and layer.padded == layer.numel  # every layer dim divides by 4
    assert root.numel == 2 * 2050 * 256 + 256
    assert root.padded == 2 * 2052 * 256 + 256  # 2050 rows -> 4 x 513
    est = estimate_memory(odd, setup(world_size=4, shard_size=4))
    assert est.components["parameters"] == 4 * (4 * LAYER + root.padded) // 4


def test_accumulation_keeps_unsharded_gradients() -> None:
    """train.py reduce-scatters on every micro-step (issue 10; HSDP skips only the replica
    all-reduce), so the planner assumes sharded gradients. The model of a trainer that turned
    gradient sync off between micro-steps stays checked: FSDP2 would keep every trainable
    parameter's gradient unsharded, in the reduce dtype (fp32 for bf16), until the last micro-step."""
    text = (REPO / "trainer" / "llamaft_trainer" / "train.py").read_text()
    assert "with micro_step_sync(self.model, index == accum - 1, self.s.plan)" in text and TRAINER_SYNCS_EVERY_MICRO_STEP
    one = estimate_memory(SMALL, setup(world_size=8, shard_size=8))
    two = estimate_memory(SMALL, setup(world_size=8, shard_size=8, accumulation=2))
    assert one.components["accumulated_gradients"] == 0
    assert two.components["accumulated_gradients"] == 4 * N
    assert two.peak_bytes == one.peak_bytes + 4 * N
    pure = estimate_memory(SMALL, setup(accumulation=3, precision=MixedPrecision.PURE_BF16))
    assert pure.components["accumulated_gradients"] == 2 * N
    # a trainer that reduce-scatters every micro-step would hold sharded gradients instead
    synced = estimate_memory(SMALL, setup(world_size=8, shard_size=8, accumulation=2, sync_between_micro_steps=True))
    assert synced.components["accumulated_gradients"] == 0 and synced.peak_bytes < two.peak_bytes


def test_strategies_and_offload() -> None:
    fs = estimate_memory(SMALL, setup(world_size=4, shard_size=4))
    assert fs.components["parameters"] == 4 * N // 4
    sgo = estimate_memory(SMALL, setup(world_size=4, shard_size=4, strategy=ShardingStrategy.SHARD_GRAD_OP))
    # SHARD_GRAD_OP keeps every unit (and the root) gathered from forward into backward
    assert sgo.components["gathered_parameters"] == 2 * N
    assert sgo.peak_bytes - fs.peak_bytes == 2 * N - 2 * LAYER
    no = estimate_memory(SMALL, setup(world_size=4, shard_size=1, strategy=ShardingStrategy.NO_SHARD))
    assert no.components["parameters"] == 4 * N and no.components["optimizer"] == 8 * N
    off = estimate_memory(SMALL, setup(world_size=4, shard_size=4, cpu_offload=True))
    assert off.components["parameters"] == off.components["optimizer"] == off.components["gradients"] == 0
    assert off.host_offloaded_bytes == (4 + 4 + 8) * N // 4
    assert off.peak_bytes < fs.peak_bytes


def test_activation_checkpointing() -> None:
    none = estimate_memory(SMALL, setup(batch=8))
    full = estimate_memory(SMALL, setup(batch=8, ac_mode=CheckpointingMode.FULL))
    half = estimate_memory(SMALL, setup(batch=8, ac_mode=CheckpointingMode.SELECTIVE, ac_every=2))
    assert full.peak_bytes < half.peak_bytes < none.peak_bytes
    tokens = 8 * 256
    shared = (24 + 2 * 2 * 32) * tokens
    final_norm = (4 * 256 + 2 * 2 * 256) * tokens
    assert full.components["activations"] == 4 * 2 * 256 * tokens + shared + final_norm  # only layer inputs
    assert half.components["activations"] == (2 * 2 * 256 + 2 * 11_680) * tokens + shared + final_norm


def test_selective_op_keeps_the_odd_matmuls_and_attention() -> None:
    """selective-op (torchtitan's op policy): a layer keeps its input, the outputs of its 1st, 3rd,
    5th and 7th matmul (q, v, gate, down) and sdpa's output and log-sum-exp; bf16 by hand."""
    h, q, kv, i, heads = 256, 256, 128, 688, 8
    tokens = 8 * 256
    op = setup(batch=8, ac_mode=CheckpointingMode.SELECTIVE_OP)
    per_token = 2 * (h + q + kv + i + h) + 2 * q + 4 * heads
    assert per_token == 3_712
    assert op_sac_saved_bytes(SMALL, op, tokens) == per_token * tokens
    none, full, sac = (estimate_memory(SMALL, s) for s in (setup(batch=8), setup(batch=8, ac_mode=CheckpointingMode.FULL), op))
    shared = (24 + 2 * 2 * 32) * tokens
    final_norm = (4 * 256 + 2 * 2 * 256) * tokens
    assert sac.components["activations"] == 4 * per_token * tokens + shared + final_norm
    assert full.peak_bytes < sac.peak_bytes < none.peak_bytes
    # eager attention is recomputed (no kernel output kept)
    eager = setup(batch=8, ac_mode=CheckpointingMode.SELECTIVE_OP, attention=AttentionImplementation.EAGER)
    assert op_sac_saved_bytes(SMALL, eager, tokens) == 2 * (h + q + kv + i + h) * tokens
    # recomputed: k, o and up of q, k, v, o, gate, up, down
    assert op_sac_recomputed_fraction(SMALL, op) == pytest.approx((128 * 256 + 256 * 256 + 688 * 256) / LAYER_MATMUL)
    # LoRA on q and v: q, q.A, q.B, k, v, v.A, v.B, o, gate, up, down: keep q, q.B, v, v.B, gate, down
    lora = setup(batch=8, ac_mode=CheckpointingMode.SELECTIVE_OP, lora_rank=8, lora_targets=("q_proj", "v_proj"))
    assert op_sac_saved_bytes(SMALL, lora, tokens) == (2 * (h + q + q + kv + kv + i + h) + 2 * q + 4 * heads) * tokens
    # DoRA adds the dense adapters lora_B(lora_A(eye)) (in x out), kept once per layer
    dora = dataclasses.replace(lora, lora_dora=True)
    assert op_sac_saved_bytes(SMALL, dora, tokens) == op_sac_saved_bytes(SMALL, lora, tokens) + 2 * (256 * 256 + 256 * 128)
    assert any(n.startswith("selective-op with useDora") for n in estimate_memory(SMALL, dora).notes)


LAYER_MATMUL = LAYER - 2 * 256  # the layer's parameters without its two norms


def test_loss_chunks_divide_the_logits() -> None:
    """lossChunks N: the logits, their fp32 copy, log-softmax and its gradients exist for one slice
    of ceil(seq / N) positions; nothing vocabulary-wide is kept from forward to backward."""
    vocab, tokens = 2048, 2 * 256
    one = estimate_memory(SMALL, setup())
    four = estimate_memory(SMALL, setup(loss_chunks=4))
    three = estimate_memory(SMALL, setup(loss_chunks=3))  # 256 = 86 + 85 + 85: the largest counts
    # bf16: at the cross-entropy backward, the saved log-softmax and two fp32 gradients
    assert one.phase_peaks["loss"] - four.phase_peaks["loss"] == 12 * vocab * (tokens - tokens // 4)
    assert one.phase_peaks["loss"] - three.phase_peaks["loss"] == 12 * vocab * (tokens - 2 * 86)
    assert four.peak_bytes < one.peak_bytes
    assert setup_from_spec(make_spec(**{"training.lossChunks": 4})).loss_chunks == 4


def test_a_note_suggests_loss_chunks_when_the_logits_dominate() -> None:
    big_vocab = dataclasses.replace(SMALL, vocab_size=128_256)
    est = estimate_memory(big_vocab, setup(batch=1, seq=4096))
    note = [n for n in est.notes if n.startswith("logits and cross-entropy are")]
    assert note and "training.lossChunks" in note[0] and "128,256" in note[0]
    assert est.components["logits"] >= 0.25 * est.peak_bytes
    chunked = estimate_memory(big_vocab, setup(batch=1, seq=4096, loss_chunks=8))
    assert not any(n.startswith("logits and cross-entropy are") for n in chunked.notes)
    assert chunked.components["logits"] < est.components["logits"] / 4
    assert not any(n.startswith("logits and cross-entropy are") for n in estimate_memory(SMALL, setup()).notes)


def test_lora_trains_adapters_only() -> None:
    est = estimate_memory(SMALL, setup(lora_rank=8, lora_targets=("q_proj", "v_proj"), lora_dropout=0.05))
    adapters = SMALL.lora_parameters(8, ["q_proj", "v_proj"])
    assert est.trainable_parameters == adapters == 4 * 8 * (256 + 256 + 256 + 128)
    assert est.parameters == N + adapters
    assert est.components["optimizer"] == 8 * adapters


def test_dora_adds_magnitudes_their_activations_and_a_weight_sized_temporary() -> None:
    lora = {"lora_rank": 8, "lora_targets": ("q_proj", "v_proj"), "lora_dropout": 0.05}
    plain, dora = setup(**lora), setup(**lora, lora_dora=True)
    # one trainable magnitude per output row (q 256, v 128), with its gradient and AdamW moments
    adapters = SMALL.lora_parameters(8, ["q_proj", "v_proj"], dora=True)
    assert adapters == SMALL.lora_parameters(8, ["q_proj", "v_proj"]) + 4 * (256 + 128)
    est, base = estimate_memory(SMALL, dora), estimate_memory(SMALL, plain)
    assert est.trainable_parameters == adapters and est.components["optimizer"] == 8 * adapters
    # per token: the base and adapter outputs the magnitude multiplies, bf16 (2 bytes)
    assert layer_activation_bytes_per_token(SMALL, dora) == 9_312 + 2 * 2 * (256 + 128)
    # per forward: eye(256), its rank-8 product, then BA, s*BA and W + s*BA of q_proj (256 x 256)
    assert dora_temporary_bytes(SMALL, dora) == 2 * (256 * 256 + 256 * 8 + 3 * 256 * 256)
    assert dora_temporary_bytes(SMALL, plain) == 0
    assert est.peak_bytes > base.peak_bytes
    assert any(n.startswith("useDora: ") for n in est.notes) and not any(n.startswith("useDora") for n in base.notes)
    # checkpointed layers build it again in backward's recompute
    ac = {**lora, "ac_mode": CheckpointingMode.FULL}
    with_dora, without = (estimate_memory(SMALL, setup(**ac, lora_dora=d)).phase_peaks["backward"] for d in (True, False))
    assert with_dora >= without + dora_temporary_bytes(SMALL, dora)


def test_setup_from_spec_reads_use_dora() -> None:
    assert setup_from_spec(make_spec(**{"training.lora": {"useDora": True}})).lora_dora
    assert not setup_from_spec(make_spec(**{"training.lora": {}})).lora_dora


@pytest.mark.parametrize("strategy", list(ShardingStrategy))
def test_setup_from_spec_follows_build_mesh(strategy: ShardingStrategy) -> None:
    extra = {"fsdp.hybridShard": {"shardGroupSize": 4, "replicaGroupSize": 4}} if strategy is ShardingStrategy.HYBRID_SHARD else {}
    spec = make_spec(**{"cluster.workers": 2, "fsdp.shardingStrategy": strategy.value, **extra})
    s = setup_from_spec(spec)
    expected = {"FULL_SHARD": 16, "SHARD_GRAD_OP": 16, "HYBRID_SHARD": 4, "NO_SHARD": 1}[strategy.value]
    assert (s.world_size, s.shard_size) == (16, expected)
    default_hybrid = setup_from_spec(make_spec(**{"cluster.workers": 2, "fsdp.shardingStrategy": "HYBRID_SHARD"}))
    assert default_hybrid.shard_size == 8  # the GPUs of one worker
