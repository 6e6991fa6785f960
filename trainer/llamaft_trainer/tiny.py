"""Build a tiny Llama and its tokenizer from scratch: the local default and the test asset.

Nothing can come from a model hub here, so the "pretrained" model is a LlamaConfig with random
weights saved with `save_pretrained`, and its BPE tokenizer is trained on the shipped dataset. The
trainer then loads both through the same code path it uses for a real checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]


def _texts(dataset: Path) -> Iterator[str]:
    with dataset.open(encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            yield from (str(v) for v in record.values())


def build_tokenizer(dataset: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the dataset's text."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_texts(dataset), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def build_tiny_llama(
    out_dir: Path,
    dataset: Path,
    *,
    hidden_size: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 512,
    vocab_size: int = 1024,
    seed: int = 0,
) -> Path:
    """Write a random-init LlamaForCausalLM + tokenizer to `out_dir`; returns `out_dir`."""
    tokenizer = build_tokenizer(dataset, vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
