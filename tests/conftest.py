"""Tiny, seeded random models of every supported family, built from configs (no download)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

# torch's default generator starts from a random seed: a test that draws weights without seeding (a random
# surrogate in a fixture) would otherwise see different weights in every run.
torch.manual_seed(0)

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Mistral and Gemma3 get a short sliding window so that tests cross it and exercise sliding cache layers.
FAMILIES = {
    "llama": (LlamaConfig, {}),
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {"head_dim": 16}),
    "mistral": (MistralConfig, {"sliding_window": 24}),
    "phi3": (Phi3Config, {}),
    "gemma3_text": (
        Gemma3TextConfig,
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}


def tiny_model(family: str = "llama", seed: int = 0, **overrides):
    """A deterministic tiny random model: two builds with the same arguments are identical."""
    config_class, extra = FAMILIES[family]
    config = config_class(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.config._name_or_path = f"tiny-{family}"
    return model


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture
def llama():
    return tiny_model("llama")


def random_ids(batch: int, length: int, seed: int = 0, vocab: int = 128) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def char_tokenizer(chat_template: bool = True):
    """A character-level tokenizer over a 128-token vocabulary, built offline (special tokens first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    assert len(vocab) <= 128
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.add_special_tokens({"additional_special_tokens": specials[4:]})
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture
def tokenizer():
    return char_tokenizer()
