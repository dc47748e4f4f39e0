"""Cost of one KVzip+ target collection forward vs. a plain sdpa forward of the same repeat prompt.

The collection runs the repeat prompt (``prompt`` + "Repeat the previous context exactly." + ``prompt``) once
with kvzap's scoring attention; the baseline is the same forward with transformers' sdpa (``logits_to_keep=1``,
as the collection uses, and with all logits). Modes alternate within each run; medians of ``--runs`` runs.

    python -m benchmarks.bench_collect --prompt-tokens 1200 --runs 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (kvzap.models.load_model)")
    parser.add_argument("--prompt-tokens", type=int, default=1200)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--prune-sliding-layers", action="store_true", help="also score the sliding-window layers (collect's option)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from kvzap.layers import prunable_layers
    from kvzap.models import load_model
    from train.collect import build_repeat_prompt, kvzip_plus_scores

    model, tokenizer = load_model(args.model)
    # The layers `train collect` scores: a sliding-window layer runs plain attention (nothing is collected there).
    layers = prunable_layers(model, args.prune_sliding_layers)
    text = Path(sys.modules["argparse"].__file__).read_text()  # real Python source, present everywhere
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.prompt_tokens]
    repeat = build_repeat_prompt(tokenizer, ids)
    x = repeat.input_ids[None]

    @torch.no_grad()
    def plain(keep: int) -> None:
        model(input_ids=x, use_cache=False, logits_to_keep=keep)

    modes = {
        "plain_sdpa_last_logits": lambda: plain(1),
        "plain_sdpa_all_logits": lambda: plain(0),
        "kvzip_plus_collection": lambda: kvzip_plus_scores(
            model, tokenizer, repeat, return_hidden_states=True, layers=layers
        ),
    }
    plain(1)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.runs):
        for name, fn in modes.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    result = {name: statistics.median(t) for name, t in times.items()}
    base = result["plain_sdpa_last_logits"]
    print(
        f"repeat prompt: {x.shape[1]} tokens (prompt {len(ids)}), "
        f"{len(layers)} of {model.config.num_hidden_layers} layers scored"
    )
    for name, seconds in result.items():
        print(f"{name:<24} {seconds:7.2f} s   {seconds / base:.2f}x")
    if args.json:
        payload = {
            "meta": meta(
                tool="kvzap",
                model=args.model or "SmolLM2-135M-Instruct",
                runs=args.runs,
                repeat_tokens=x.shape[1],
                scored_layers=list(layers),
            ),
            "seconds": result,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
