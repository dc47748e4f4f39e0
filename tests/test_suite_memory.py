"""``benchmarks/suite_memory.py``: the whole cache's memory freed on the suite's prompts, on a tiny saved Gemma 3."""

from __future__ import annotations

import torch

from benchmarks.suite_memory import main
from kvzap import KVzapSurrogate
from tests.conftest import char_tokenizer, tiny_model


def table_rows(out: str) -> dict[float, tuple[float, float, float]]:
    """threshold -> (prunable pairs evicted %, cache MB, share freed %) from the printed table."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].endswith("%"):
            rows[float(cells[0])] = (float(cells[1][:-1]), float(cells[2]), float(cells[3][:-1]))
    return rows


def test_rows_follow_the_threshold_and_freed_memory_stays_below_the_prunable_share(tmp_path, capsys):
    model_dir, surrogate_dir = tmp_path / "tiny-gemma3", tmp_path / "surrogate"
    model = tiny_model("gemma3_text")  # layer 0: sliding window of 24 tokens, layer 1: full attention
    model.save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    torch.manual_seed(0)
    KVzapSurrogate(64, 2, 2, hidden_dim=8).save_pretrained(surrogate_dir)

    args = ["--model", str(model_dir), "--surrogate", str(surrogate_dir), "--length", "400", "--window", "8"]
    main([*args, "--thresholds", "-1000000000", "0", "1000000000"])
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert set(rows) == {-1e9, 0.0, 1e9}
    evicted = [rows[t][0] for t in (-1e9, 0.0, 1e9)]
    freed = [rows[t][2] for t in (-1e9, 0.0, 1e9)]
    assert evicted[0] == 0.0 and evicted[2] > 90.0  # everything but the window and the first pairs goes
    assert evicted == sorted(evicted) and freed == sorted(freed)
    # Nothing evicted costs the compact storage its overhead (a negative share). With the full-attention layer
    # nearly emptied, less of the whole cache is freed than of the prunable pairs: the sliding layer keeps its
    # window and the block pool its overhead.
    assert freed[0] <= 0.0
    assert 0.0 < freed[2] < evicted[2]
