"""Tests of the training scripts (train/); helpers shared by them: a tiny seeded Llama and an offline tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tiny_tokenizer():
    """A byte-level BPE tokenizer without merges (one token per byte) plus chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_llama(
    attn_implementation: str = "sdpa", seed: int = 0, vocab_size: int = 300, num_hidden_layers: int = 2
):
    """Tiny random Llama (hidden 64, 2 layers by default, 4 query heads, 2 KV heads); two builds with a seed are
    identical."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    return model


def write_word_corpus(path: Path, n_docs: int, n_words: int) -> Path:
    """A ``.jsonl`` corpus of ``n_docs`` documents of ``n_words`` colour words (seeded), in two subsets."""
    rng = random.Random(0)
    with Path(path).open("w") as f:
        for i in range(n_docs):
            text = " ".join(rng.choice(["red", "green", "blue"]) for _ in range(n_words))
            f.write(json.dumps({"text": text, "subset": f"s{i % 2}"}) + "\n")
    return Path(path)
