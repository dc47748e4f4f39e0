"""Plain KVzip targets and Fast KVzip gate distillation."""

from __future__ import annotations

import pytest
import torch

from kvzap import FastKVzipGates
from tests.train import make_tiny_llama
from train.collect import collect, kvzip_plus_scores, load_collection
from train.gate import GateConfig, evaluate_gates, fit_gates, fit_gates_and_save


@torch.no_grad()
def naive_kvzip(model, repeat_prompt) -> torch.Tensor:
    """log of max over repeated rows and the GQA group of the attention weight, with eager attention."""
    eager = make_tiny_llama("eager")
    eager.load_state_dict(model.state_dict())
    out = eager(repeat_prompt.input_ids[None], output_attentions=True)
    p, r = repeat_prompt.prompt, repeat_prompt.repeat
    kv_heads = model.config.num_key_value_heads
    group = model.config.num_attention_heads // kv_heads
    layers = []
    for attn in out.attentions:
        a = attn[0][:, r, p]  # (q_heads, repeat_len, prompt_len)
        a = a.amax(dim=1).view(kv_heads, group, -1).amax(dim=1)  # (kv_heads, prompt_len)
        layers.append(a.log())
    return torch.stack(layers)


def test_plain_kvzip_scores_match_the_formula(tiny_llama, tiny_tokenizer):
    prompt = tiny_tokenizer("The cat sat on the mat.", add_special_tokens=False)["input_ids"]
    result = kvzip_plus_scores(tiny_llama, tiny_tokenizer, prompt, chunk_size=4, return_kvzip=True)
    torch.testing.assert_close(result.log_kvzip, naive_kvzip(tiny_llama, result.repeat_prompt), atol=1e-5, rtol=1e-5)
    assert kvzip_plus_scores(tiny_llama, tiny_tokenizer, prompt).log_kvzip is None


def test_gate_training_lowers_the_loss_and_round_trips(tmp_path):
    torch.manual_seed(0)
    n, layers, dim, heads = 512, 2, 16, 2
    X = torch.randn(n, layers, dim)
    # targets that depend on the hidden state: a gate can learn them
    w = torch.randn(layers, dim, heads)
    log_target = torch.nn.functional.logsigmoid(torch.einsum("nld,ldh->nlh", X, w))
    config = GateConfig(steps=300, batch_size=128, lr=0.2, gate_dim=4, n_sinks=4)
    untrained = FastKVzipGates(dim, heads, 2, layers, gate_dim=4, n_sinks=4)
    before = evaluate_gates(untrained, X, log_target)["mean_bce"]
    gates, curves = fit_gates(X, log_target, n_groups=2, config=config)
    after = evaluate_gates(gates, X, log_target)
    assert after["mean_bce"] < before and curves[0][-1] < curves[0][0]
    assert after["mean_r2"] > 0.3
    with pytest.raises(ValueError, match="positive"):
        GateConfig(steps=0)


def test_collect_with_kvzip_then_gate_cli_path(tiny_llama, tiny_tokenizer, tmp_path):
    prompts = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("one two three four", "five six")]
    collect(tiny_llama, tiny_tokenizer, prompts, tmp_path / "c" / "train", n_tokens=3, with_kvzip=True)
    X, y_kvzip, _ = load_collection(tmp_path / "c" / "train", target="y_kvzip")
    assert y_kvzip.shape == (X.shape[0], 2, 2) and (y_kvzip <= 0).all()
    report = fit_gates_and_save(
        [tmp_path / "c" / "train"], tmp_path / "gates", n_groups=2, config=GateConfig(steps=5, batch_size=4)
    )
    assert FastKVzipGates.from_pretrained(tmp_path / "gates").n_modules == 2
    assert "train" in report and (tmp_path / "gates" / "report.json").exists()
    collect(tiny_llama, tiny_tokenizer, prompts, tmp_path / "plain", n_tokens=3)
    with pytest.raises(ValueError, match="with-kvzip"):
        load_collection(tmp_path / "plain", target="y_kvzip")
