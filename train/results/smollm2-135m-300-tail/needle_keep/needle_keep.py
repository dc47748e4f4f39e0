"""Which tokens of the niah_multikey needles a surrogate keeps in the prefill (session 27, issue 14).

Runs the needle samples of `python -m evaluation` (2,048 tokens, 40 samples, one seed) through SmolLM2-135M-Instruct
under DMSThresholdPress(KVzapScorer) at one threshold, records every layer's surrogate scores of the context (the
dense prefill's scores do not depend on earlier layers' evictions) and writes, per sample and needle, the share
of (layer, KV head) pairs scored at or above the threshold, i.e. kept, for the needle's key words, its number and
the rest of its sentence, overall and per layer. The needles are outside the 128-token window in these samples.

    PYTHONPATH=. python train/results/smollm2-135m-300-tail/needle_keep/needle_keep.py --seed 0 --threshold -3 \
        [--surrogate DIR] --out keep.json
    PYTHONPATH=. python train/results/smollm2-135m-300-tail/needle_keep/needle_keep.py report A.json B.json \
        [--runs RUN_A RUN_B]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch


def _tokens(starts: list[int], pieces: list[str], a: int, b: int) -> list[int]:
    """The tokens overlapping characters [a, b) of the decoded prompt."""
    return [i for i, s in enumerate(starts) if s < b and s + len(pieces[i]) > a]


def _kept(scores: torch.Tensor, threshold: float, idx: list[int]) -> float:
    return (scores[:, :, idx] >= threshold).float().mean().item()


def _per_layer(scores: torch.Tensor, threshold: float, idx: list[int]) -> list[float]:
    return (scores[:, :, idx] >= threshold).float().mean(dim=(1, 2)).tolist()


def collect(seed: int, threshold: float, surrogate: str | None, out: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    import kvzap  # noqa: F401  (registers the pipeline task)
    from evaluation import ruler
    from evaluation.presses import make_press
    from kvzap.models import resolve_model
    from kvzap.presses.surrogate_scorer import SurrogateScorer

    path = resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok)
    captured: dict[int, torch.Tensor] = {}
    original = SurrogateScorer.score

    def score(self, module, hidden, keys, values, positions):
        scores = original(self, module, hidden, keys, values, positions)
        captured[module.layer_idx] = scores[0].float().clone()  # (H, T) of the prefill
        return scores

    SurrogateScorer.score = score
    rows = []
    for sample in ruler.generate_task("niah_multikey", tok, 2048, 40, seed):
        inputs = pipe.preprocess(sample["context"], [sample["question"]], sample["answer_prefix"], None, False)
        ids = inputs["context_ids"]
        press = make_press("kvzap_mlp", threshold, surrogate=surrogate)
        captured.clear()
        with torch.no_grad(), press(model):
            model(ids)
        scores = torch.stack([captured[i] for i in sorted(captured)])  # (L, H, T)
        pieces = [tok.decode([t]) for t in ids[0].tolist()]
        starts = [0, *itertools.accumulate(len(p) for p in pieces)][:-1]  # each token's first character
        text = "".join(pieces)

        needles = []
        for match in ruler.NEEDLE_PATTERN.finditer(text):
            key, value = _tokens(starts, pieces, *match.span(1)), _tokens(starts, pieces, *match.span(2))
            frame = [i for i in _tokens(starts, pieces, *match.span()) if i not in key and i not in value]
            needles.append(
                {
                    "key": match.group(1),
                    "value": match.group(2),
                    "asked": match.group(1) in sample["question"],
                    "kept_key": _kept(scores, threshold, key),
                    "kept_value": _kept(scores, threshold, value),
                    "kept_frame": _kept(scores, threshold, frame),
                    "layers_key": _per_layer(scores, threshold, key),
                    "layers_value": _per_layer(scores, threshold, value),
                }
            )
        outside = scores[:, :, : scores.shape[-1] - 128]
        rows.append({"id": sample["id"], "needles": needles, "kept_all": (outside >= threshold).float().mean().item()})
        print(sample["id"], [(round(n["kept_key"], 3), round(n["kept_value"], 3), n["asked"]) for n in needles])
    with open(out, "w", encoding="utf-8") as handle:
        json.dump({"seed": seed, "threshold": threshold, "surrogate": surrogate, "samples": rows}, handle)


def report(files: list[str], runs: list[str] | None) -> None:
    data = [json.load(open(f, encoding="utf-8")) for f in files]
    names = [f"{d['surrogate'] or 'bundled'} tau {d['threshold']}" for d in data]
    print(
        "kept outside the window:",
        ", ".join(
            f"{n} {statistics.mean(s['kept_all'] for s in d['samples']):.3f}" for n, d in zip(names, data, strict=True)
        ),
    )
    for which, select in (("asked", True), ("distractor", False)):
        for part in ("key", "value", "frame"):
            means = [
                statistics.mean(n[f"kept_{part}"] for s in d["samples"] for n in s["needles"] if n["asked"] == select)
                for d in data
            ]
            print(f"{which:>10} {part:>5}: " + ", ".join(f"{n} {m:.3f}" for n, m in zip(names, means, strict=True)))
    if runs:  # the samples one run found and the other did not
        from evaluation.compare import read_run

        found = [{r["id"]: r["score"] for r in read_run(run)[0] if r["task"] == "niah_multikey"} for run in runs]
        only_a = [i for i in found[0] if found[0][i] > found[1][i]]
        only_b = [i for i in found[0] if found[0][i] < found[1][i]]
        print(f"found by run A only: {len(only_a)} {only_a}; by run B only: {len(only_b)} {only_b}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", nargs="?", default="collect", choices=["collect", "report"])
    parser.add_argument("files", nargs="*")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threshold", type=float, default=-3.0)
    parser.add_argument("--surrogate")
    parser.add_argument("--out")
    parser.add_argument("--runs", nargs=2)
    args = parser.parse_args()
    if args.command == "report":
        report(args.files, args.runs)
    else:
        torch.set_num_threads(1)
        collect(args.seed, args.threshold, args.surrogate, args.out)


if __name__ == "__main__":
    main()
