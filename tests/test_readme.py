"""The README quickstart runs as written on a tiny model."""

import re
from pathlib import Path

import torch

import kvzap.surrogates.bundled as bundled
from kvzap import KVzapSurrogate
from tests.conftest import char_tokenizer, random_ids, tiny_model

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quickstart_runs_as_written(tmp_path, monkeypatch):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    model = tiny_model("llama", max_position_embeddings=4096)
    # "bundle" a surrogate for the tiny model, as the package does for its default model
    monkeypatch.setattr(bundled, "BUNDLED_DIR", tmp_path)
    torch.manual_seed(0)
    KVzapSurrogate(64, 2, 2, hidden_dim=8).save_pretrained(tmp_path / "tiny-llama" / "mlp")
    namespace = {
        "model": model,
        "tokenizer": char_tokenizer(),
        "context": "Lorem ipsum dolor sit amet. " * 20,
        "question": "What is this?",
        "input_ids": random_ids(1, 300),
    }
    exec(compile(code, str(README), "exec"), namespace)
    assert isinstance(namespace["answer"], str)
    assert namespace["ids"].shape[1] > 300
    assert 0 <= namespace["press"].compression_ratio <= 1
