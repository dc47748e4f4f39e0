"""Decoding reads nothing back from the device per layer and step: at most one read per 16 steps per layer.

On an accelerator, every ``.item()``, ``.tolist()``, ``.cpu()``, ``bool(tensor)`` ... waits for the device. The
test counts such calls on CPU (where they are cheap, but the same calls) during ``model.generate``'s decoding
steps, keeping those whose Python stack passes through kvzap's files: transformers' own reads are not ours.
"""

from __future__ import annotations

import math
import os
import sys
from collections import Counter

import pytest
import torch
from transformers import DynamicCache

import kvzap
from kvzap import _compat
from kvzap.presses.baseline_scorers import RandomScorer
from kvzap.presses.threshold import DMSThresholdPress
from tests.conftest import random_ids, tiny_model

_KVZAP_DIR = os.path.dirname(kvzap.__file__) + os.sep
# Tensor methods that copy device data to the host (or need it to decide a Python value). ``numpy()`` is left out:
# it only accepts host tensors, so on an accelerator it always follows a ``cpu()``, which is counted.
_READS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero")


def _kvzap_caller() -> str | None:
    """``file:function`` of the innermost kvzap frame on the stack, or None when no kvzap code is calling."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_KVZAP_DIR):
            return f"{path[len(_KVZAP_DIR) :]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return None


class _ReadCounter:
    """Counts host reads of tensors made from kvzap code while ``active``."""

    def __init__(self, monkeypatch):
        self.active = False
        self.reads: Counter[str] = Counter()
        for name in _READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(original))
        monkeypatch.setattr(torch, "nonzero", self._wrap(torch.nonzero))

    def _wrap(self, original):
        def counted(*args, **kwargs):
            if self.active:
                caller = _kvzap_caller()
                if caller is not None:
                    self.reads[caller] += 1
            return original(*args, **kwargs)

        return counted


@pytest.mark.parametrize("storage", ["compact", "masked"])
def test_decoding_reads_the_device_at_most_once_per_16_steps_per_layer(storage, monkeypatch):
    model = tiny_model("llama")
    n_layers, n_new = model.config.num_hidden_layers, 64
    press = DMSThresholdPress(
        RandomScorer(seed=0), threshold=0.3, sliding_window_size=8, decoding=True, storage=storage
    )
    counter = _ReadCounter(monkeypatch)
    decoder = _compat.decoder_model(model)

    def mark_decoding(module, args, kwargs):  # the prefill (an empty cache) is not counted
        cache = _compat.cache_from_kwargs(kwargs)
        counter.active = cache is not None and cache.get_seq_length() > 0

    handle = decoder.register_forward_pre_hook(mark_decoding, with_kwargs=True)
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad(), press(model):
            kw = {_compat.cache_kwarg_name(model): cache}
            model.generate(random_ids(1, 40), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, **kw)
    finally:
        handle.remove()
        counter.active = False
    steps = n_new - 1  # forwards after the prefill
    assert 0.2 < press.compression_ratio < 0.8  # decoding evicted pairs
    # The decoder's padding check reads the 2-D attention mask once per step (not per layer): left to the
    # press's own hook, counted apart.
    padding = sum(n for caller, n in counter.reads.items() if caller.endswith(":padded_rows"))
    assert padding <= steps
    # The press refuses NaN scores with one read per scorer call (presses/checks.py check_scores): decoded tokens are
    # scored in batches of up to 16, here of up to 8 (a batch is scored before its first token leaves the window).
    checks = sum(n for caller, n in counter.reads.items() if caller.endswith(":check_scores"))
    assert checks <= n_layers * (math.ceil(steps / 8) + 1)
    others = (":padded_rows", ":check_scores")
    per_layer = {caller: n for caller, n in counter.reads.items() if not caller.endswith(others)}
    # The storage: at most one read per 16 steps per layer.
    assert sum(per_layer.values()) <= n_layers * math.ceil(steps / 16), per_layer
    if storage == "compact":  # the catch-ups of the host table happened, and nothing else read the device
        assert set(per_layer) == {"compact.py:_sync"}, per_layer
    else:  # the masked storage never needs the host
        assert per_layer == {}, per_layer
