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
CHAT_SPECIAL_TOKENS: dict[str, list[str]] = {
    # Llama 3's control tokens, added as special tokens so that each is one id, as in Meta's tokenizer.
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    # Llama 2 chat writes <s> / </s> (already special here) and plain-text [INST] / <<SYS>> markers.
    "llama2": [],
}
"""Special tokens each built-in chat template (llamaft_trainer.data.chat.BUILTIN_TEMPLATES) needs."""
CHAT_BOS_EOS = {"llama3": ("<|begin_of_text|>", "<|eot_id|>"), "llama2": ("<s>", "</s>")}
"""bos/eos per template, as Meta's chat tokenizers set them: Llama 3 Instruct's eos is <|eot_id|>,
so generation stops at the end of the assistant's turn."""


def _texts(dataset: Path) -> Iterator[str]:
    with dataset.open(encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            yield from (str(v) for v in record.values())


def build_tokenizer(dataset: Path, vocab_size: int, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the dataset's text.

    `chat_template` (a built-in name, `llama3` or `llama2`) makes it a chat tokenizer: that
    template becomes its `chat_template` (saved with it, so apply_chat_template works after
    from_pretrained) and the template's control tokens are special tokens of their own. Without
    it the tokenizer is exactly the plain one other tests depend on.
    """
    from llamaft_trainer.data.chat import BUILTIN_TEMPLATES

    if chat_template is not None and chat_template not in BUILTIN_TEMPLATES:
        raise ValueError(f"chat_template must be one of {sorted(BUILTIN_TEMPLATES)}, not {chat_template!r}")
    extra = CHAT_SPECIAL_TOKENS[chat_template] if chat_template else []
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + extra,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_texts(dataset), trainer=trainer)
    if chat_template is None:
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
        )
    bos, eos = CHAT_BOS_EOS[chat_template]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token="<unk>", pad_token="<pad>",
        additional_special_tokens=[t for t in extra if t not in (bos, eos)],
    )
    fast.chat_template = BUILTIN_TEMPLATES[chat_template]
    return fast


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
    chat_template: str | None = None,
) -> Path:
    """Write a random-init LlamaForCausalLM + tokenizer to `out_dir`; returns `out_dir`.

    `chat_template` (`llama3` or `llama2`): a chat tokenizer, see build_tokenizer."""
    tokenizer = build_tokenizer(dataset, vocab_size, chat_template)
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
