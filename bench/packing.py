"""Packing throughput (CPU): real training tokens per second of best-fit-decreasing packing
(`packingStrategy: bfd`) against concatenation (`concatenate`) and against padding (`packing: false`),
measured in one run, so the ratios hold on whatever the machine is doing.

    .venv/bin/python bench/packing.py [--max-seq-length 512] [--batch-size 4] [--steps 10] [--rounds 3] [--data samsum-like]

Each mode trains the same tiny Llama (llamaft make-tiny-model's defaults, fp32, one thread, the
attention the trainer runs for `sdpa`) on dialogues with samsum's spread of lengths
(bench/_samsum_like.py; `--data samsum-tiny`: the examples' own short dialogues) through the trainer's own data path (token store, loaders,
collate) and loss (train.token_loss_sum): forward, backward and an AdamW step per micro-batch of
`--batch-size` sequences of at most `--max-seq-length` tokens. The modes take turns, `--rounds`
times, each round `--steps` micro-batches (the first round of each is a warm-up and not counted).
Tokens are real tokens only (padding excluded), as the trainer's tokens/s counts them. Targets
(issue #37): bfd >= 0.9x concatenation, >= 1.3x padding. `--smoke`: a few tiny steps (tests).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer")]

import _samsum_like as samsum_like  # noqa: E402
import torch  # noqa: E402
from llamaft.api.spec import DatasetSpec  # noqa: E402
from llamaft_trainer.data import batching, prepare  # noqa: E402
from llamaft_trainer.model.attention import DOCUMENT_SDPA  # noqa: E402
from llamaft_trainer.tiny import build_tiny_llama  # noqa: E402
from llamaft_trainer.train import token_loss_sum  # noqa: E402
from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: E402

DATASET = REPO / "examples" / "data" / "samsum-tiny.jsonl"
MODES = {"bfd": {"packing": True, "packingStrategy": "bfd"},
         "concatenate": {"packing": True, "packingStrategy": "concatenate"},
         "padding": {"packing": False}}


def batches(mode: str, source: Path, tok: Any, root: Path, max_len: int, batch_size: int, steps: int) -> tuple[list[dict[str, torch.Tensor]], dict[str, Any]]:
    spec = DatasetSpec.model_validate({"format": "samsum", "source": str(source), "maxSeqLength": max_len,
                                       "validationSplit": 0.0, **MODES[mode]})
    store = prepare.build_store(spec, tok, 0, root)
    data = batching.loaders(store, spec, int(tok.pad_token_id), batch_size, 0, rank=0, world=1)
    out = []
    for batch in data.batches(epoch=0, skip=0):
        out.append(batch)
        if len(out) == steps:
            break
    computed = sum(int(b["input_ids"].numel()) for b in out)
    info = {"sequences": data.info["train_sequences"], **prepare.block_report(store, spec),
            "computed_fill": sum(int(b["attention_mask"].sum()) for b in out) / max(computed, 1),
            "tokens_per_batch": computed / max(len(out), 1)}
    return out, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-seq-length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", choices=("samsum-like", "samsum-tiny"), default="samsum-like",
                        help="samsum-like: samsum's spread of dialogue lengths (bench/_samsum_like.py); "
                             "samsum-tiny: the examples' 64-80-token dialogues")
    parser.add_argument("--smoke", action="store_true", help="tiny model, 2 steps, 2 rounds (tests)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        size = {"hidden_size": 32, "layers": 1, "vocab_size": 512} if args.smoke else {}
        steps, rounds = (2, 2) if args.smoke else (args.steps, args.rounds)
        model_dir = build_tiny_llama(root / "tiny-llama", DATASET, **size)  # type: ignore[arg-type]
        tok = AutoTokenizer.from_pretrained(model_dir)
        # The attention the trainer runs for `attnImplementation: sdpa` (model.attention_function).
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=DOCUMENT_SDPA)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        source = DATASET if args.data == "samsum-tiny" else samsum_like.write(root / "samsum-like.jsonl")
        data, infos = {}, {}
        for mode in MODES:
            data[mode], infos[mode] = batches(mode, source, tok, root / "data", args.max_seq_length, args.batch_size, steps)
        tokens = dict.fromkeys(MODES, 0)
        seconds = dict.fromkeys(MODES, 0.0)
        for r in range(rounds):
            for mode in MODES:
                started = time.perf_counter()
                real = 0
                for batch in data[mode]:
                    loss, _ = token_loss_sum(model, batch, torch.device("cpu"))
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    real += int(batch["attention_mask"].sum())
                if r > 0:  # round 0 warms every mode up
                    tokens[mode] += real
                    seconds[mode] += time.perf_counter() - started
    rate = {m: tokens[m] / max(seconds[m], 1e-9) for m in MODES}
    print(f"{args.data}, maxSeqLength {args.max_seq_length}, perDeviceBatchSize {args.batch_size}, {steps} micro-batches x "
          f"{rounds - 1} counted rounds per mode")
    print("| mode | training sequences | block fill | real / computed tokens | computed tokens per micro-batch | real tokens/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode in MODES:
        info, fill = infos[mode], infos[mode].get("train_fill")
        print(f"| {mode} | {info['sequences']} | {'-' if fill is None else f'{fill:.3f}'} | {info['computed_fill']:.3f} | "
              f"{info['tokens_per_batch']:,.0f} | {rate[mode]:,.0f} |")
    vs_concat, vs_padding = rate["bfd"] / rate["concatenate"], rate["bfd"] / rate["padding"]
    print(f"bfd / concatenate: {vs_concat:.2f}x (target >= 0.9x); bfd / padding: {vs_padding:.2f}x (target >= 1.3x)")
    print(json.dumps({"event": "packing_bench", "tokens_per_second": {m: round(v, 1) for m, v in rate.items()},
                      "bfd_over_concatenate": round(vs_concat, 3), "bfd_over_padding": round(vs_padding, 3),
                      "fill": {m: infos[m].get("train_fill") for m in MODES}}))


if __name__ == "__main__":
    main()
