"""Cut an all-positions collection down to what ``collect --n-tokens N`` would have stored.

`collect` keeps, per prompt, ``train.collect.sample_positions(prompt_len, n_tokens, seed + prompt index)``
(a seeded random draw, stored sorted). A collection made with ``--n-tokens`` at least its ``--max-tokens``
stores every position of every prompt, so the rows of a smaller ``--n-tokens`` are that draw's rows of it:
this gives the 500-positions arm of the experiment from the all-positions collection, on the same prompts,
without a second collection.

    PYTHONPATH=. python train/results/smollm2-135m-ensemble/sample_positions.py outputs/pos30/train outputs/sub30 500
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from train.collect import sample_positions


def subsample(src: Path, dst: Path, n: int) -> int:
    """Write ``dst`` (a collection split) with the rows ``--n-tokens n`` would have kept of ``src``; return its rows."""
    manifest = json.loads((src / "manifest.json").read_text())
    settings = json.loads((src / "settings.json").read_text())
    if settings["n_tokens"] < settings["max_tokens"]:
        raise ValueError(f"{src} keeps {settings['n_tokens']} positions per prompt, not all of them.")
    dst.mkdir(parents=True, exist_ok=True)
    shards = []
    for shard in manifest["shards"]:
        with safe_open(src / shard["file"], "pt") as f:
            metadata = f.metadata()
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        prompt_index, position = tensors["prompt_index"], tensors["position"]
        keep = torch.zeros(len(prompt_index), dtype=torch.bool)
        for index in prompt_index.unique().tolist():
            rows = (prompt_index == index).nonzero().flatten()
            if not torch.equal(position[rows], torch.arange(len(rows))):
                raise ValueError(f"{src}: prompt {index} does not store every position in order.")
            keep[rows[sample_positions(len(rows), n, settings["seed"] + index)]] = True
        save_file({name: tensor[keep].contiguous() for name, tensor in tensors.items()}, dst / shard["file"], metadata)
        shards.append({**shard, "rows": int(keep.sum())})
    shutil.copy(src / "prompts.jsonl", dst / "prompts.jsonl")
    (dst / "settings.json").write_text(json.dumps({**settings, "n_tokens": n}, indent=2))
    manifest.update(n_tokens=n, n_rows=sum(shard["rows"] for shard in shards), shards=shards)
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest["n_rows"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="A collection split that stores every position.")
    parser.add_argument("dst", type=Path, help="Output folder.")
    parser.add_argument("n", type=int, help="--n-tokens to reproduce.")
    args = parser.parse_args()
    print(args.dst, subsample(args.src, args.dst, args.n), "rows")
