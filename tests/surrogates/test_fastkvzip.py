"""Fast KVzip gates: formula, shapes and range, checkpoints, and use inside a press."""

import math

import pytest
import torch
from transformers import DynamicCache

from kvzap import DMSThresholdPress, FastKVzipGates, FastKVzipScorer, TopKPress
from kvzap._compat import cache_kwarg_name
from kvzap.surrogates.fastkvzip import FastKVzipGate
from tests.conftest import random_ids, tiny_model


@torch.no_grad()
def naive_gate(gate: FastKVzipGate, h: torch.Tensor) -> torch.Tensor:
    """The gate of one hidden state ``(D,)`` written out head by head, query by query."""
    r, H, G = gate.gate_dim, gate.n_kv_heads, gate.n_groups
    q_all, k_all = gate.q_proj(h), gate.k_proj(h)

    def rms(x, w):
        return x / torch.sqrt((x**2).mean() + 1e-6) * w

    out = torch.zeros(H)
    for k in range(H):
        key = rms(k_all[k * r : (k + 1) * r], gate.k_norm.weight)
        total = 0.0
        for g in range(G):
            start = (k * G + g) * r
            q = rms(q_all[start : start + r], gate.q_norm.weight)
            self_term = math.exp(float(q @ key) / math.sqrt(r) + float(gate.bias[k, g]))
            sinks = sum(math.exp(float(q @ s) / math.sqrt(r)) for s in gate.sinks[k])
            total += self_term / (self_term + sinks)
        out[k] = total / G
    return out


def test_gate_matches_the_formula_and_lies_in_zero_one():
    torch.manual_seed(0)
    gate = FastKVzipGate(input_dim=24, n_kv_heads=3, n_groups=2, gate_dim=4, n_sinks=5)
    with torch.no_grad():
        gate.bias.normal_()
        gate.q_norm.weight.uniform_(0.5, 1.5)
    h = torch.randn(2, 7, 24)
    values = gate(h)
    assert values.shape == (2, 7, 3)
    assert ((values > 0) & (values < 1)).all()
    torch.testing.assert_close(values[1, 4], naive_gate(gate, h[1, 4]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gate.log_gate(h), values.log())


def test_round_trip(tmp_path):
    torch.manual_seed(1)
    gates = FastKVzipGates(input_dim=16, n_kv_heads=2, n_groups=2, n_modules=3, gate_dim=4, n_sinks=3)
    gates.save_pretrained(tmp_path)
    loaded = FastKVzipGates.from_pretrained(tmp_path)
    assert loaded.config == gates.config
    h = torch.randn(5, 16)
    torch.testing.assert_close(loaded(h, 2), gates(h, 2))
    with pytest.raises(ValueError, match="positive"):
        FastKVzipGates(16, 2, 0, 3)


def tiny_gates():
    torch.manual_seed(2)
    return FastKVzipGates(input_dim=64, n_kv_heads=2, n_groups=2, n_modules=2)


def test_press_runs_with_the_gate_in_prefill_and_decoding(llama):
    press = DMSThresholdPress(FastKVzipScorer(tiny_gates()), threshold=math.log(0.05), sliding_window_size=4)
    press.decoding = True
    cache = DynamicCache(config=llama.config)
    kw = cache_kwarg_name(llama)
    ids = random_ids(2, 30)
    with press(llama):
        llama(ids[:, :24], **{kw: cache})
        for t in range(24, 30):
            llama(ids[:, t : t + 1], **{kw: cache})
    assert cache.layers[0].seen == 30 and 0 <= press.compression_ratio <= 1
    with TopKPress(FastKVzipScorer(tiny_gates()), target_compression=0.5)(llama):
        llama(ids)


def test_gates_for_another_model_are_refused(llama):
    wrong = FastKVzipGates(input_dim=64, n_kv_heads=2, n_groups=1, n_modules=2)
    with pytest.raises(ValueError, match="group size"), DMSThresholdPress(FastKVzipScorer(wrong), threshold=-3)(llama):
        pass


def test_nothing_bundled_for_a_tiny_model_is_a_clear_error():
    from kvzap.surrogates import SurrogateNotFoundError

    with pytest.raises(SurrogateNotFoundError, match="kvzap train"):
        with DMSThresholdPress(FastKVzipScorer(), threshold=-3)(tiny_model("qwen3")):
            pass
