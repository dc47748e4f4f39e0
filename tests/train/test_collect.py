"""KVzip+ collection: the fast scoring attention against a direct computation from eager attention weights."""

from __future__ import annotations

import json

import pytest
import torch

from tests.train import make_tiny_llama
from train.collect import (
    ATTENTION_NAME,
    RepeatPrompt,
    build_repeat_prompt,
    collect,
    kvzip_plus_scores,
    load_collection,
    load_collections,
    sample_positions,
)


@torch.no_grad()
def naive_kvzip_plus(model, repeat_prompt: RepeatPrompt) -> torch.Tensor:
    """log s+ straight from the formula, with eager attention weights: (n_layers, kv_heads, prompt_len)."""
    config = model.config
    q_heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // q_heads
    group = q_heads // kv_heads
    eager = make_tiny_llama("eager")
    eager.load_state_dict(model.state_dict())
    out = eager(repeat_prompt.input_ids[None], output_attentions=True, output_hidden_states=True)
    p, r = repeat_prompt.prompt, repeat_prompt.repeat
    layers = []
    for layer_idx, layer in enumerate(eager.model.layers):
        attn = out.attentions[layer_idx][0]  # (q_heads, T, T)
        h = layer.input_layernorm(out.hidden_states[layer_idx][0])  # (T, D) attention input
        v = layer.self_attn.v_proj(h).view(-1, kv_heads, head_dim)  # (T, kv_heads, head_dim)
        w_o = layer.self_attn.o_proj.weight
        per_kv = torch.full((kv_heads, p.stop - p.start), -torch.inf)
        for head in range(q_heads):
            kv = head // group
            w_slice = w_o[:, head * head_dim : (head + 1) * head_dim]  # (D, head_dim)
            for i in range(p.start, p.stop):
                v_norm = (w_slice @ v[i, kv]).norm()
                s = max(float(attn[head, j, i] * v_norm / h[j].norm()) for j in range(r.start, r.stop))
                per_kv[kv, i - p.start] = max(per_kv[kv, i - p.start], s)
        layers.append(per_kv.log())
    return torch.stack(layers)


@pytest.mark.parametrize("chunk_size", [3, 256])
def test_scores_match_naive_formula(tiny_llama, tiny_tokenizer, chunk_size):
    prompt = tiny_tokenizer("The cat sat on the mat.", add_special_tokens=False)["input_ids"]
    result = kvzip_plus_scores(tiny_llama, tiny_tokenizer, prompt, return_hidden_states=True, chunk_size=chunk_size)
    expected = naive_kvzip_plus(tiny_llama, result.repeat_prompt)
    assert result.log_scores.shape == (2, 2, len(prompt))
    torch.testing.assert_close(result.log_scores, expected, rtol=1e-5, atol=1e-5)
    assert result.hidden_states.shape == (2, len(prompt), 64)


def test_model_restored_after_scoring(tiny_llama, tiny_tokenizer):
    ids = tiny_tokenizer("abc def", add_special_tokens=False)["input_ids"]
    before = {name: len(m._forward_pre_hooks) for name, m in tiny_llama.named_modules()}
    x = torch.tensor([ids])
    with torch.no_grad():
        reference = tiny_llama(x).logits
    kvzip_plus_scores(tiny_llama, tiny_tokenizer, ids)
    assert tiny_llama.config._attn_implementation == "sdpa"
    assert before == {name: len(m._forward_pre_hooks) for name, m in tiny_llama.named_modules()}
    with torch.no_grad():
        torch.testing.assert_close(tiny_llama(x).logits, reference)


def test_model_restored_on_error(tiny_llama, tiny_tokenizer):
    ids = tiny_tokenizer("abc", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="chunk_size"):
        kvzip_plus_scores(tiny_llama, tiny_tokenizer, ids, chunk_size=0)
    bad = RepeatPrompt(torch.tensor(ids * 2 + [5000]), prompt=slice(0, 3), repeat=slice(3, 7))  # id out of vocab
    with pytest.raises(IndexError):
        kvzip_plus_scores(tiny_llama, tiny_tokenizer, bad)
    assert tiny_llama.config._attn_implementation == "sdpa"
    assert all(not m._forward_pre_hooks for m in tiny_llama.modules())
    assert ATTENTION_NAME != tiny_llama.config._attn_implementation


def test_scoring_output_equals_sdpa(tiny_llama, tiny_tokenizer):
    """The registered attention returns the normal sdpa output, so the forward itself is unchanged."""
    from train import collect as collect_module

    ids = tiny_tokenizer("hello world", add_special_tokens=False)["input_ids"]
    rp = build_repeat_prompt(tiny_tokenizer, ids)
    with torch.no_grad():
        reference = tiny_llama(rp.input_ids[None]).logits[:, -1]
    state = collect_module._ScoringState(prompt=rp.prompt, repeat=rp.repeat, chunk_size=4)
    with collect_module._scoring_context(tiny_llama, state), torch.no_grad():
        logits = tiny_llama(rp.input_ids[None]).logits[:, -1]
    torch.testing.assert_close(logits, reference)


def test_repeat_prompt_spans(tiny_tokenizer):
    ids = tiny_tokenizer("some text", add_special_tokens=False)["input_ids"]
    rp = build_repeat_prompt(tiny_tokenizer, ids)
    assert rp.input_ids[rp.prompt].tolist() == ids
    assert rp.input_ids[rp.repeat].tolist() == ids
    assert rp.repeat.stop == rp.input_ids.numel()
    text = tiny_tokenizer.decode(rp.input_ids)
    assert "Repeat the previous context exactly." in text and "<|im_start|>assistant" in text
    with pytest.raises(ValueError, match="non-empty"):
        build_repeat_prompt(tiny_tokenizer, [])


def test_sample_positions_deterministic():
    a = sample_positions(100, 10, seed=3)
    assert a.tolist() == sample_positions(100, 10, seed=3).tolist()
    assert a.tolist() == sorted(set(a.tolist())) and len(a) == 10
    assert sample_positions(5, 10, seed=0).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        sample_positions(5, 0, seed=0)


def test_collect_shards_resume(tiny_llama, tiny_tokenizer, tmp_path):
    texts = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota", "kappa"]
    prompts = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    manifest = collect(tiny_llama, tiny_tokenizer, prompts, tmp_path, n_tokens=6, shard_size=3, seed=1)
    assert [s["file"] for s in manifest["shards"]] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    X, y, info = load_collection(tmp_path)
    n_rows = sum(min(6, len(p)) for p in prompts)
    assert X.shape == (n_rows, 2, 64) and X.dtype == torch.float16
    assert y.shape == (n_rows, 2, 2) and torch.isfinite(y).all()
    assert info["prompt_index"].tolist()[:6] == [0] * 6

    # The collected rows are the full scores at the sampled positions.
    full = kvzip_plus_scores(tiny_llama, tiny_tokenizer, prompts[1], return_hidden_states=True)
    pos = sample_positions(len(prompts[1]), 6, seed=1 + 1)
    rows = info["prompt_index"] == 1
    torch.testing.assert_close(y[rows], full.log_scores[:, :, pos].permute(2, 0, 1))
    torch.testing.assert_close(X[rows].float(), full.hidden_states[:, pos].transpose(0, 1).half().float())

    # Resume: a finished shard is not recomputed.
    first = tmp_path / "shard-00000.safetensors"
    mtime = first.stat().st_mtime_ns
    (tmp_path / "shard-00001.safetensors").unlink()
    collect(tiny_llama, tiny_tokenizer, prompts, tmp_path, n_tokens=6, shard_size=3, seed=1)
    assert first.stat().st_mtime_ns == mtime
    assert json.loads((tmp_path / "manifest.json").read_text())["n_rows"] == n_rows

    with pytest.raises(ValueError, match="other settings"):
        collect(tiny_llama, tiny_tokenizer, prompts, tmp_path, n_tokens=5, shard_size=3, seed=1)


def test_load_collections_reads_several_into_one_copy(tiny_llama, tiny_tokenizer, tmp_path):
    """Several collections read into one X/y equal their separate loads concatenated; each keeps its prompt numbers."""
    texts = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota", "kappa"]
    prompts = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    collect(tiny_llama, tiny_tokenizer, prompts, tmp_path / "a", n_tokens=6, shard_size=3, seed=1)
    collect(tiny_llama, tiny_tokenizer, prompts[:3], tmp_path / "b", n_tokens=5, shard_size=2, seed=2)
    a, b = load_collection(tmp_path / "a"), load_collection(tmp_path / "b")
    X, y, manifests = load_collections([tmp_path / "a", tmp_path / "b"])
    assert X.dtype == a[0].dtype and y.dtype == a[1].dtype
    torch.testing.assert_close(X, torch.cat([a[0], b[0]]), rtol=0, atol=0)
    torch.testing.assert_close(y, torch.cat([a[1], b[1]]), rtol=0, atol=0)
    assert manifests[1]["prompt_index"].tolist() == b[2]["prompt_index"].tolist()
    assert [m["n_prompts"] for m in manifests] == [4, 3]
    # Some layers only: read from the files as a slice, the same values.
    X1, y1, _ = load_collections([tmp_path / "a", tmp_path / "b"], layers=slice(1, 2))
    assert X1.shape == (X.shape[0], 1, X.shape[2]) and y1.shape == (y.shape[0], 1, y.shape[2])
    torch.testing.assert_close(X1, X[:, 1:2], rtol=0, atol=0)
    torch.testing.assert_close(y1, y[:, 1:2], rtol=0, atol=0)
    with pytest.raises(ValueError, match="layers must be a slice of consecutive collected layers"):
        load_collections([tmp_path / "a"], layers=[0, 1])

    # A shard whose rows disagree with its manifest, another model's collection, or a missing one is refused.
    manifest_file = tmp_path / "b" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["shards"][0]["rows"] += 1
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="shard-00000.safetensors holds .* rows where its manifest says"):
        load_collections([tmp_path / "a", tmp_path / "b"])
    manifest_file.write_text(json.dumps({**manifest, "model": "another/model"}))
    with pytest.raises(ValueError, match="come from different models"):  # before any shard is read
        load_collections([tmp_path / "a", tmp_path / "b"])
    with pytest.raises(FileNotFoundError, match="missing or unfinished"):
        load_collections([tmp_path / "a", tmp_path / "nothing"])


@pytest.mark.slow
def test_data_parallel_collection_matches_single_process(tmp_path, tiny_tokenizer):
    """`accelerate launch` with 2 CPU processes writes the same pairs as one process (about 30 s)."""
    import os
    import random
    import subprocess
    import sys
    from pathlib import Path

    model = make_tiny_llama()
    model.save_pretrained(tmp_path / "tiny")
    tiny_tokenizer.save_pretrained(tmp_path / "tiny")
    rng = random.Random(0)
    with (tmp_path / "data.jsonl").open("w") as f:
        for i in range(10):
            text = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(30))
            f.write(json.dumps({"text": text, "subset": f"s{i % 2}"}) + "\n")
    common = ["--threads", "1", "collect", "--model", str(tmp_path / "tiny"), "--data", str(tmp_path / "data.jsonl")]
    common += [
        "--train-per-subset",
        "3",
        "--test-per-subset",
        "1",
        "--min-tokens",
        "40",
        "--max-tokens",
        "80",
        "--n-tokens",
        "10",
    ]
    common += ["--shard-size", "1"]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launcher += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "train"]
    subprocess.run([*launcher, *common, "--out", str(tmp_path / "dp")], check=True, env=env, cwd=root, timeout=300)
    subprocess.run(
        [sys.executable, "-m", "train", *common, "--out", str(tmp_path / "single")],
        check=True,
        env=env,
        cwd=root,
        timeout=300,
    )
    for split in ("train", "test"):
        X_dp, y_dp, _ = load_collection(tmp_path / "dp" / split)
        X_one, y_one, _ = load_collection(tmp_path / "single" / split)
        assert torch.equal(X_dp, X_one) and torch.equal(y_dp, y_one)
    from safetensors import safe_open

    processes = set()
    for path in (tmp_path / "dp" / "train").glob("shard-*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            processes.add(f.metadata()["process"])
    assert processes == {"0", "1"}  # both processes did part of the work


def test_explicit_masks_match_implicit_causal():
    """The bool and additive masks transformers may pass give the same scores as the built-in causal mask."""
    from torch import nn

    from train.collect import _kvzip_plus_log_scores, _ScoringState

    torch.manual_seed(0)
    seq, q_heads, kv_heads, head_dim, hidden = 12, 4, 2, 8, 16
    query, hid = torch.randn(1, q_heads, seq, head_dim), torch.randn(1, seq, hidden)
    key, value = torch.randn(1, kv_heads, seq, head_dim), torch.randn(1, kv_heads, seq, head_dim)
    module = nn.Module()
    module.o_proj = nn.Linear(q_heads * head_dim, hidden, bias=False)
    state = _ScoringState(prompt=slice(1, 5), repeat=slice(7, 12), chunk_size=2)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]  # (1, 1, seq, seq)
    additive = torch.zeros(1, 1, seq, seq).masked_fill(~causal, torch.finfo(torch.float32).min)
    per_head = causal.expand(1, q_heads, seq, seq)
    expected = _kvzip_plus_log_scores(module, query, key, value, None, hid, 0.3, state)
    for mask in (causal, additive, per_head):
        got = _kvzip_plus_log_scores(module, query, key, value, mask, hid, 0.3, state)
        torch.testing.assert_close(got, expected)
