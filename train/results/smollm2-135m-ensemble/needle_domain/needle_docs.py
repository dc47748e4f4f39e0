"""The needle suite's contexts as a `collect` corpus: do surrogates predict KVzip+ on the text they are judged on?

Writes the contexts of `python -m evaluation`'s offline needle samples (2,048 tokens, SmolLM2's tokenizer, one
seed) as a jsonl that `python -m train collect --data` reads, one document per sample: `subset` is the task (so
`evaluate-surrogates` reports R^2 per task), `source` the sample id, `split` test.

    PYTHONPATH=. python train/results/smollm2-135m-ensemble/needle_domain/needle_docs.py --seed 2 --n-samples 10 \
        --out outputs/needle_docs/needles.jsonl
"""

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

from evaluation.ruler import generate_samples
from kvzap.models import resolve_model

TASKS = ["niah_single", "niah_single_text", "niah_multikey", "niah_multiquery", "niah_multiquery_text"]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-samples", type=int, default=10, help="samples per task")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    samples = generate_samples(tokenizer, TASKS, args.length, args.n_samples, seed=args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as handle:
        for sample in samples:
            row = {"text": sample["context"], "subset": sample["task"], "source": sample["id"], "split": "test"}
            handle.write(json.dumps(row) + "\n")
    print(f"{len(samples)} contexts -> {args.out}")
