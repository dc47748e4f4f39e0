"""Parameters and scoring cost of the learned scorers (KVzap-MLP, KVzap-Linear, Fast KVzip) on one model.

For each scorer, the time to score every layer's new pairs (the hidden states entering attention, all layers)
for a prefill of ``--prefill`` tokens and for one decoded token, against the model's own forward of the same
tokens measured in the same run (median of ``--runs``). The hidden states are captured from one real forward
of the benchmark text, so the scorers see what they see under a press.

    python -m benchmarks.bench_scorers --model ~/.cache/kvzap/models/SmolLM2-135M-Instruct --threads 2 \
        --json benchmarks/results/scorers.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from benchmarks.common import cache_kwarg, load, meta, prompt_ids, write_results
from kvzap import _compat
from kvzap.presses import FastKVzipScorer, KVzapScorer


def _median_time(fn, runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="local model directory (e.g. the default model's cache)")
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model)
    ids = prompt_ids(tokenizer, args.prefill, model.config.vocab_size)
    modules = _compat.attention_modules(model)

    # The hidden states entering each attention layer (after its input layernorm), from one real forward.
    captured: dict[int, torch.Tensor] = {}
    handles = [
        m.register_forward_pre_hook(
            lambda mod, a, kw: captured.__setitem__(_compat.layer_index(mod), kw["hidden_states"]), with_kwargs=True
        )
        for m in modules
    ]
    model(ids, logits_to_keep=1)
    for h in handles:
        h.remove()

    kw = cache_kwarg(model)

    def prefill():
        model(ids, logits_to_keep=1, **{kw: DynamicCache(config=model.config)})

    cache = DynamicCache(config=model.config)
    model(ids, logits_to_keep=1, **{kw: cache})
    token = ids[:, -1:]

    def decode_step():
        model(token, **{kw: cache})
        cache.crop(-1)  # forget it again (a negative count: the same meaning on every transformers 5.x)

    model_prefill = _median_time(prefill, args.runs)
    model_step = _median_time(decode_step, args.runs * 4)
    rows = []
    for name, scorer in (
        ("kvzap_mlp", KVzapScorer("mlp")),
        ("kvzap_linear", KVzapScorer("linear")),
        ("fastkvzip", FastKVzipScorer()),
    ):
        scorer.setup(model)
        params = sum(p.numel() for p in scorer._loaded.parameters())

        def score_all(last_only: bool, scorer=scorer):
            for module in modules:
                h = captured[_compat.layer_index(module)]
                scorer.score(module, h[:, -1:] if last_only else h, None, None, None)

        t_prefill = _median_time(lambda: score_all(False), args.runs)
        t_step = _median_time(lambda: score_all(True), args.runs * 4)
        row = {
            "scorer": name,
            "parameters": params,
            "parameters_per_layer": params // len(modules),
            "prefill_scoring_ms": 1000 * t_prefill,
            "prefill_scoring_share": t_prefill / model_prefill,
            "decode_scoring_ms": 1000 * t_step,
            "decode_scoring_share": t_step / model_step,
        }
        rows.append(row)
        print(row, flush=True)
    setup = meta(
        tool="kvzap scorers",
        model=args.model,
        prefill_tokens=args.prefill,
        model_prefill_ms=1000 * model_prefill,
        model_decode_step_ms=1000 * model_step,
        runs=args.runs,
    )
    write_results(args.json, setup, rows)


if __name__ == "__main__":
    main()
