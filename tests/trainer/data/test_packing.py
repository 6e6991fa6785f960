"""Packing without cross-talk (`dataset.packingStrategy: bfd`, packing.py and data.PackedExamples):
best-fit decreasing places every example whole and fills blocks as TRL's bfd does; the layout is
built once with the token store and keyed by it; a packed example has exactly the loss and
gradients it has alone (in-process: plain, lossChunks, LoRA, DoRA, chat, activation checkpointing;
under torchrun: 2 ranks, FSDP2 with activation checkpointing, lossChunks, LoRA); evaluation packed
equals evaluation padded for a trained model; a resumed epoch gives the same batches.

The reference packer. TRL is not installed in any venv here, so the fill comparison uses two
references written in this file: `naive_bfd`, best-fit decreasing as TRL documents `bfd`
(longest first, each into the fullest block that still holds it) by scanning every block, and
`fewest_blocks`, the optimum by exhaustive search for small inputs.

`LLAMAFT_TEST_PACKING_STRATEGY=concatenate` runs the equality tests with concatenation instead:
they must fail (cross-talk, examples cut at block edges, the dropped tail).
"""

from __future__ import annotations

import itertools
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from llamaft.api.spec import CheckpointingMode, DatasetSpec
from llamaft_trainer.data import batching, encoding, prepare, streaming
from llamaft_trainer.data.packing import bfd_layout, fill_ratio, flatten_layout
from llamaft_trainer.model import attention as attention_module
from llamaft_trainer.model.attention import DOCUMENT_SDPA
from llamaft_trainer.process.runtime import Runtime
from llamaft_trainer.report.logline import read_events
from llamaft_trainer.train import token_loss_sum
from transformers import AutoTokenizer, LlamaForCausalLM

from tests.trainer.conftest import DATASET, REPO, base_config, torchrun_cmd, trainer_env

STRATEGY = os.environ.get("LLAMAFT_TEST_PACKING_STRATEGY", "bfd")
CHAT_DATASET = REPO / "examples" / "data" / "chat-tiny.jsonl"
WORKER = Path(__file__).parent.parent / "packing_worker.py"
CPU = torch.device("cpu")



def dspec(**kw: Any) -> DatasetSpec:
    return DatasetSpec.model_validate({"format": "samsum", "source": str(DATASET), "maxSeqLength": 256, "packing": True,
                                       "packingStrategy": STRATEGY, "validationSplit": 0.1, **kw})


def head(source: Path, n: int, out: Path) -> Path:
    out.write_text("".join(source.read_text().splitlines(keepends=True)[:n]))
    return out


# ------------------------------------------------------------------------------ the layout
def naive_bfd(lengths: list[int], capacity: int) -> list[int]:
    """Best-fit decreasing by scanning every block: the room left in each block."""
    rooms: list[int] = []
    for size in sorted((n for n in lengths if n), reverse=True):
        fits = [k for k, room in enumerate(rooms) if room >= size]
        if fits:
            best = min(fits, key=lambda k: rooms[k])
            rooms[best] -= size
        else:
            rooms.append(capacity - size)
    return rooms


def fewest_blocks(lengths: list[int], capacity: int) -> int:
    """The optimum, by trying every assignment (small inputs only)."""
    items = sorted((n for n in lengths if n), reverse=True)
    for blocks in range(1, len(items) + 1):
        for assignment in itertools.product(range(blocks), repeat=len(items)):
            loads = [0] * blocks
            for size, block in zip(items, assignment, strict=True):
                loads[block] += size
            if max(loads) <= capacity:
                return blocks
    return 0


def test_bfd_places_longest_first_into_the_fullest_block_that_holds_it() -> None:
    # sorted: 8 (#5), 7 (#1), 5 (#2), 5 (#3), 3 (#0), 2 (#4); 3 fits the 7's block exactly, 2 the 8's
    assert bfd_layout([3, 7, 5, 5, 2, 8], 10) == [[5, 4], [1, 0], [2, 3]]
    assert bfd_layout([4, 4, 4], 4) == [[0], [1], [2]], "equal lengths keep their order"
    assert bfd_layout([], 8) == [] and bfd_layout([0, 3, 0], 8) == [[1]], "empty examples are left out"
    examples, offsets = flatten_layout([[5, 4], [1, 0], [2, 3]])
    assert examples.tolist() == [5, 4, 1, 0, 2, 3] and offsets.tolist() == [0, 2, 4, 6]


def test_bfd_refuses_an_example_longer_than_a_block() -> None:
    with pytest.raises(ValueError, match="example 1 has 9 tokens, more than a block's 8"):
        bfd_layout([3, 9], 8)


def test_bfd_places_every_example_whole_and_fills_as_trl_does() -> None:
    rng = random.Random(0)
    for trial in range(300):
        capacity = rng.randint(4, 16)
        lengths = [rng.choice([0, *range(1, capacity + 1)]) for _ in range(rng.randint(1, 7))]
        blocks = bfd_layout(lengths, capacity)
        placed = sorted(i for b in blocks for i in b)
        assert placed == [i for i, n in enumerate(lengths) if n], (trial, lengths)
        assert all(sum(lengths[i] for i in b) <= capacity for b in blocks), (trial, lengths, blocks)
        rooms = naive_bfd(lengths, capacity)
        assert sorted(capacity - sum(lengths[i] for i in b) for b in blocks) == sorted(rooms), (trial, lengths)
        assert fill_ratio(lengths, len(blocks), capacity) >= fill_ratio(lengths, len(rooms), capacity)
        optimum = fewest_blocks(lengths, capacity)
        assert optimum <= len(blocks) <= 11 * optimum / 9 + 1, (trial, lengths)  # BFD's worst case (Johnson 1973)


def test_bfd_on_samsum_lengths_matches_the_reference(tok: Any, tmp_path: Path) -> None:
    store = prepare.build_store(dspec(validationSplit=0.0), tok, 0, tmp_path)
    lengths = store.train.lengths.tolist()
    blocks = bfd_layout(lengths, 256)
    assert len(blocks) == len(naive_bfd(lengths, 256))
    assert fill_ratio(lengths, len(blocks), 256) > 0.85


# ------------------------------------------------------------------------------ the store
def test_the_layout_is_built_with_the_store_and_is_part_of_its_key(tok: Any, tmp_path: Path) -> None:
    bfd = prepare.build_store(dspec(packingStrategy="bfd"), tok, 0, tmp_path)
    assert bfd.train.layout is not None and bfd.validation.layout is not None
    examples, offsets = bfd.train.layout
    assert [examples[offsets[b]:offsets[b + 1]].tolist() for b in range(len(offsets) - 1)] == \
        bfd_layout(bfd.train.lengths, 256)
    again = prepare.build_store(dspec(packingStrategy="bfd"), tok, 0, tmp_path)
    assert again.path == bfd.path and (bfd.path / "train" / "blocks.bin").read_bytes() == \
        (again.path / "train" / "blocks.bin").read_bytes()
    concatenated = prepare.build_store(dspec(packingStrategy="concatenate"), tok, 0, tmp_path)
    assert concatenated.path != bfd.path
    assert concatenated.train.layout is None and concatenated.validation.layout is not None, \
        "evaluation packs by bfd whatever the strategy"
    shorter = prepare.build_store(dspec(maxSeqLength=128), tok, 0, tmp_path)
    assert shorter.path != bfd.path and shorter.train.layout is not None
    assert len(shorter.train.layout[1]) > len(bfd.train.layout[1])
    assert prepare.build_store(dspec(packing=False), tok, 0, tmp_path).train.layout is None


def test_the_data_event_reports_blocks_and_fill(tok: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = prepare.build_store(dspec(packingStrategy="bfd"), tok, 0, tmp_path)
    event = read_events(capsys.readouterr().out, "data")[-1]
    blocks = len(store.train.layout[1]) - 1  # type: ignore[index]
    assert event["packing_strategy"] == "bfd" and event["train_blocks"] == blocks
    assert event["train_fill"] == round(store.train.total_tokens / (blocks * 256), 4)
    assert event["validation_blocks"] == len(store.validation.layout[1]) - 1  # type: ignore[index]


def test_packed_items_isolate_their_examples(tok: Any, tmp_path: Path) -> None:
    store = prepare.build_store(dspec(packingStrategy="bfd"), tok, 0, tmp_path)
    blocks = batching.packed_dataset(store.train, dspec(packingStrategy="bfd"), validation=False)
    assert isinstance(blocks, batching.PackedExamples)
    seen = []
    for b in range(len(blocks)):
        item, members = blocks[b], blocks.block(b)
        seen += members
        at = 0
        for e in members:
            tokens, loss = store.train.example(e)
            n = len(tokens)
            assert item["input_ids"][at:at + n].tolist() == tokens.tolist()
            assert item["position_ids"][at:at + n].tolist() == list(range(n))
            expected = [t if f else encoding.IGNORE_INDEX for t, f in zip(tokens.tolist(), loss.tolist(), strict=True)]
            assert item["labels"][at:at + n].tolist() == [encoding.IGNORE_INDEX, *expected[1:]], "no label crosses a boundary"
            at += n
        assert at == len(item["input_ids"]) <= 256
    assert sorted(seen) == list(range(len(store.train))), "every example in exactly one block"
    batch = batching.Collate(int(tok.pad_token_id))([blocks[0], blocks[len(blocks) - 1]])
    n = len(blocks[len(blocks) - 1]["input_ids"])
    assert batch["position_ids"][1, n:].tolist() == list(range(batch["input_ids"].shape[1] - n)), \
        "padding is a sequence of its own"
    assert int(batch["attention_mask"].sum()) == len(blocks[0]["input_ids"]) + n, "real tokens only"


# -------------------------------------------------------------------- the model's maths
def segments(batch: dict[str, torch.Tensor]) -> list[tuple[int, int, int]]:
    """(row, start, end) of each example in a packed batch (from its position ids; the whole row
    when there are none), padding left out."""
    out = []
    for row in range(batch["input_ids"].shape[0]):
        real = int(batch["attention_mask"][row].sum())
        positions = batch["position_ids"][row].tolist() if "position_ids" in batch else [1] * real
        starts = [k for k in range(real) if positions[k] == 0] or [0]
        if starts[0] != 0:
            starts.insert(0, 0)
        out += [(row, a, b) for a, b in zip(starts, [*starts[1:], real], strict=True)]
    return out


def example_losses(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[tuple[int, ...], torch.Tensor]:
    """Each example's summed next-token loss, keyed by its tokens."""
    out = {}
    for row, a, b in segments(batch):
        key = tuple(batch["input_ids"][row, a:b].tolist())
        out[key] = F.cross_entropy(logits[row, a:b - 1].float(), batch["labels"][row, a + 1:b], ignore_index=encoding.IGNORE_INDEX,
                                   reduction="sum")
    return out


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    for name, g in want.items():
        scale = float(g.abs().max()) or 1.0
        assert float((got[name] - g).abs().max()) <= 1e-5 * scale, name


def with_lora(model: torch.nn.Module, dora: bool) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                               use_dora=dora, task_type="CAUSAL_LM"))
    with torch.no_grad():  # peft's B starts at 0: move it so the adapters change the logits
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return adapted


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llamaft_trainer.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("chat") / "tiny-llama3", DATASET, hidden_size=64, layers=2,
                            vocab_size=512, chat_template="llama3")


per_example = attention_module._per_example
VARIANTS = ["plain", "loss-chunks", "lora", "dora", "chat", "activation-checkpointing", "transformers-sdpa"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_examples_have_the_losses_and_gradients_they_have_alone(
    variant: str, tiny_model: Path, chat_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fp32, every training example of a small set: packed batches (2 blocks a batch, so a batch
    pads its shorter block) against each example alone; per-example losses 1e-5 relative, the
    summed gradient 1e-5 of each tensor's largest element, and in `plain` each packed example's
    own gradient (backward of its loss alone) against its gradient alone. The model runs the
    trainer's attention (model.attention_function: per example on CPU) but in
    `transformers-sdpa`, transformers' SDPA with its block-diagonal mask."""
    source = head(CHAT_DATASET if variant == "chat" else DATASET, 14, tmp_path / "data.jsonl")
    extra = {"format": "chat", "trainOn": "all"} if variant == "chat" else {}  # all: a first token carries loss
    spec = dspec(source=str(source), validationSplit=0.0, maxSeqLength=384 if variant == "chat" else 256, **extra)
    path = chat_model if variant == "chat" else tiny_model
    tokenizer = AutoTokenizer.from_pretrained(path)
    part = prepare.build_store(spec, tokenizer, 0, tmp_path / "store").train
    torch.manual_seed(0)
    attention = "sdpa" if variant == "transformers-sdpa" else DOCUMENT_SDPA
    split = []
    monkeypatch.setattr(attention_module, "_per_example", lambda *a: split.append(1) or per_example(*a))
    model: torch.nn.Module = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
    if variant in ("lora", "dora"):
        model = with_lora(model, dora=variant == "dora")
    if variant == "activation-checkpointing":
        from llamaft_trainer.parallel.parallelize import apply_activation_checkpointing, decoder_layers

        assert apply_activation_checkpointing(decoder_layers(model), CheckpointingMode.FULL, 1) == 2 * 2
    model.train()
    chunks = 3 if variant == "loss-chunks" else 1
    collate = batching.Collate(int(tokenizer.pad_token_id))
    blocks = batching.packed_dataset(part, spec, validation=False)
    batches = [collate([blocks[i] for i in range(s, min(s + 2, len(blocks)))]) for s in range(0, len(blocks), 2)]
    assert any(len(s) > 1 for s in (segments(b) for b in batches)), "some block holds several examples"

    model.zero_grad(set_to_none=True)
    packed_total, packed_targets, packed_each = 0.0, 0, {}
    for batch in batches:
        loss, n = token_loss_sum(model, batch, CPU, chunks)
        loss.backward()
        packed_total, packed_targets = packed_total + float(loss.detach()), packed_targets + n
        if chunks == 1:
            with torch.no_grad():
                logits = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"),
                               use_cache=False).logits
            packed_each.update({k: float(v) for k, v in example_losses(logits, batch).items()})
    packed_grads = grads(model)

    model.zero_grad(set_to_none=True)
    alone_total, alone_targets, alone_each = 0.0, 0, {}
    for e in range(len(part)):
        batch = collate([batching.training_item(*part.example(e))])
        loss, n = token_loss_sum(model, batch, CPU, 1)
        loss.backward()
        alone_total, alone_targets = alone_total + float(loss.detach()), alone_targets + n
        alone_each[tuple(batch["input_ids"][0].tolist())] = float(loss)
    assert packed_targets == alone_targets, "every target once, none across an example boundary"
    assert bool(split) == (attention == DOCUMENT_SDPA), "packed CPU batches attend per example"
    assert packed_total == pytest.approx(alone_total, rel=1e-5)
    if chunks == 1:
        assert packed_each.keys() == alone_each.keys(), "every example whole, in one block"
        for key, want in alone_each.items():
            assert packed_each[key] == pytest.approx(want, rel=1e-5)
    assert_grads_close(packed_grads, grads(model))

    if variant == "plain":  # each example's own gradient, from inside its packed batch
        batch = batches[0]
        by_tokens = {tuple(part.example(e)[0].tolist()): e for e in range(len(part))}
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        for key, loss in list(example_losses(logits, batch).items())[:3]:
            model.zero_grad(set_to_none=True)
            loss.backward(retain_graph=True)
            packed_one = grads(model)
            model.zero_grad(set_to_none=True)
            token_loss_sum(model, collate([batching.training_item(*part.example(by_tokens[key]))]), CPU)[0].backward()
            assert_grads_close(packed_one, grads(model))


# --------------------------------------------------------------------------------- resume
def test_a_resumed_bfd_epoch_gives_the_same_batches(tok: Any, tmp_path: Path) -> None:
    spec = dspec(packingStrategy="bfd", validationSplit=0.0, maxSeqLength=128)
    store = prepare.build_store(spec, tok, 0, tmp_path)
    data = batching.loaders(store, spec, int(tok.pad_token_id), 2, 3, rank=1, world=2)
    whole = list(data.batches(epoch=1, skip=0))
    assert len(whole) > 8
    for skip in (1, 5, len(whole) - 1):
        resumed = list(data.batches(epoch=1, skip=skip))
        assert len(resumed) == len(whole) - skip
        for a, b in zip(resumed, whole[skip:], strict=True):
            assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "labels", "position_ids")), skip


def test_a_resumed_streamed_bfd_epoch_gives_the_same_batches(tok: Any, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streaming, "WINDOW", 50)
    spec = dspec(packingStrategy="bfd", streaming=True, maxSeqLength=128)
    index = tmp_path / "windows.json"

    def run(r: int, skip: int, idx: Path | None) -> list[dict[str, torch.Tensor]]:
        rt = Runtime(rank=r, local_rank=r, world_size=2, local_world_size=2, device=CPU)
        return list(streaming.BatchStream(spec, tok, 2, 5, rt, idx).batches(epoch=2, skip=skip))

    leader = run(0, 0, index)  # writes the window index (blocks per window)
    whole = run(1, 0, index)
    assert len(whole) == len(leader) > 6 and "position_ids" in whole[0]
    for skip in (1, 4, len(whole) - 1):
        for idx in (index, None):  # by the index, and tokenized forward without it
            resumed = run(1, skip, idx)
            assert len(resumed) == len(whole) - skip
            assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(resumed, whole[skip:], strict=True))


# ----------------------------------------------------------------------------- torchrun
def test_two_ranks_fsdp_packed_equals_alone_and_eval_packed_equals_padded(tiny_model: Path, tmp_path: Path) -> None:
    """One launch, 2 ranks: FSDP2 (a) activation checkpointing full + lossChunks 3, (b) selective-op
    + LoRA; (c) FSDP1 with full activation checkpointing. Packed blocks against their examples alone (losses, target counts, every full gradient),
    then 3 training steps and the validation loss packed against padded (fp32, 1e-5 relative)."""
    dataset = {"maxSeqLength": 256, "packingStrategy": STRATEGY, "validationSplit": 0.15}
    cases = [
        {"name": "fsdp2-full-chunks", "steps": 3, "config": base_config(
            tiny_model, tmp_path / "a", dataset=dataset, training={"lossChunks": 3},
            fsdp={"activationCheckpointing": {"mode": "full"}})},
        {"name": "fsdp2-selective-op-lora", "steps": 3, "config": base_config(
            tiny_model, tmp_path / "b", dataset=dataset,
            training={"lora": {"r": 4, "alpha": 8, "dropout": 0.0, "targetModules": ["q_proj", "v_proj"]}},
            fsdp={"activationCheckpointing": {"mode": "selective-op"}})},
        {"name": "fsdp1-full", "steps": 2, "config": base_config(
            tiny_model, tmp_path / "c", dataset=dataset,
            fsdp={"implementation": "fsdp1", "activationCheckpointing": {"mode": "full"}})},
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    import subprocess

    proc = subprocess.run(torchrun_cmd(2, str(WORKER), str(tmp_path / "cases.json"), str(tmp_path / "out.json")),
                          env=trainer_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "out.json").read_text())
    for name, r in results.items():
        assert r["wrapper"] != "LlamaForCausalLM" or "lora" not in name
        assert r["blocks_with_several_examples"] > 0, name
        assert r["packed_targets"] == r["alone_targets"], name
        assert r["packed_loss"] == pytest.approx(r["alone_loss"], rel=1e-5), name
        assert r["grads"] > 0 and r["grad_rel_diff"] <= 1e-5, (name, r["grad_rel_diff"])
        assert r["validation_items"] < r["validation_examples"], "validation packed several examples a block"
        assert r["packed_eval"] == pytest.approx(r["padded_eval"], rel=1e-5), name
