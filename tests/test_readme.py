"""Every Python block of the README runs as written, in order, in one namespace, as in a fresh notebook.

Only what a test machine cannot have is replaced: ``load_model`` returns a tiny seeded model (named as the model
asked for) with a character tokenizer, the bundled surrogates are tiny ones for that model, and the Hub serves a
tiny published-format checkpoint from a local folder. Everything else is the library's own code path.
"""

import re
from pathlib import Path

import pytest
import torch

import kvzap.models
import kvzap.surrogates.bundled as bundled
import kvzap.surrogates.checkpoint as checkpoint
from kvzap import KVzapSurrogate
from tests.conftest import char_tokenizer, tiny_model

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
TINY = "tiny-llama"  # the name tiny_model gives the default model's stand-in


def _surrogate(seed: int) -> KVzapSurrogate:
    torch.manual_seed(seed)
    return KVzapSurrogate(64, 2, 2, hidden_dim=8)  # the tiny Llama: hidden 64, 2 KV heads, 2 layers


@pytest.fixture
def offline_world(tmp_path, monkeypatch):
    """Stand-ins for the default model, the bundled surrogates and the Hub; records what was asked of them."""
    asked = {"models": [], "hub": []}

    def load_model(name_or_path=None, *, dtype=torch.float32, attn_implementation="sdpa", device=None):
        asked["models"].append(name_or_path)
        model = tiny_model("llama", max_position_embeddings=16384)
        if name_or_path is not None:
            model.config._name_or_path = name_or_path
        return model, char_tokenizer()

    monkeypatch.setattr(kvzap.models, "load_model", load_model)

    bundled_dir = tmp_path / "bundled"
    for seed, kind in enumerate(("mlp", "linear", "mlp-average")):
        surrogate = _surrogate(seed) if kind != "linear" else KVzapSurrogate(64, 2, 2, hidden_dim=None)
        surrogate.save_pretrained(bundled_dir / TINY / kind)
    monkeypatch.setattr(bundled, "BUNDLED_DIR", bundled_dir)

    hub = tmp_path / "hub"
    _surrogate(7).save_pretrained(hub / "nvidia" / "KVzap-mlp-Qwen3-8B")

    def hf_hub_download(repo_id, filename, **kwargs):
        asked["hub"].append(repo_id)
        path = hub / repo_id / filename
        if not path.exists():
            raise FileNotFoundError(path)
        return str(path)

    monkeypatch.setattr(checkpoint, "hf_hub_download", hf_hub_download)
    return asked


def test_the_readme_has_the_blocks_a_user_follows():
    """Loading, the pipeline, generate, calibration, the bundled variants, a Hub model: six blocks in that order."""
    assert len(BLOCKS) == 6
    expected_calls = ("load_model()", "pipeline(", "model.generate(", "calibrate(", "variant=", "Qwen/Qwen3-8B")
    for block, expected in zip(BLOCKS, expected_calls, strict=True):
        assert expected in block


def test_every_python_block_runs_in_order(offline_world, capsys):
    namespace: dict = {}
    for n, block in enumerate(BLOCKS):  # load_model's stand-in takes the README's dtype and device and ignores them
        exec(compile(block, f"{README}:python block {n + 1}", "exec"), namespace)

    assert offline_world["models"] == [None, "Qwen/Qwen3-8B"]
    assert offline_world["hub"] and set(offline_world["hub"]) == {"nvidia/KVzap-mlp-Qwen3-8B"}
    assert isinstance(namespace["answer"], str)
    assert namespace["ids"].shape[1] > namespace["input_ids"].shape[1]
    assert isinstance(namespace["threshold"], float) and namespace["threshold"] == namespace["threshold"]
    assert 0 <= namespace["press"].compression_ratio <= 1
    assert namespace["average"].scorer.variant == "average"
    printed = capsys.readouterr().out
    assert printed.strip(), "the blocks print the answer and the compression ratio"
