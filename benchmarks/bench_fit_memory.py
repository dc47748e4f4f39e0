"""Peak memory of ``python -m train fit``, all layers at once against ``--layers-at-once K``, measured from outside.

A synthetic collection with SmolLM2-135M-Instruct's shapes (30 layers, hidden size 576, 3 KV heads; float16 hidden
states, targets a noisy function of them) is written to a temporary folder, then each way of fitting runs in a
fresh process while this one samples the child's ``RssAnon`` (anonymous memory: what the fit allocates; file
pages of the memory-mapped shards are reclaimable and reported apart) from ``/proc`` every 0.1 s::

    python -m benchmarks.bench_fit_memory --rows 100000 --groups 5 --runs 3 --json benchmarks/results/fit_memory.json

Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import meta, write_results

SHAPES = {"n_layers": 30, "hidden_size": 576, "kv_heads": 3}


def write_synthetic_collection(
    out: Path, train_rows: int, test_rows: int = 10000, rows_per_shard: int = 10000, seed: int = 0
) -> None:
    """``out/train`` and ``out/test`` in the collection format of ``train.collect``."""
    from train.collect import _write_manifest, _write_shard, shard_path

    generator = torch.Generator().manual_seed(seed)
    layers, dim, heads = SHAPES["n_layers"], SHAPES["hidden_size"], SHAPES["kv_heads"]
    weights = torch.randn(layers, dim, heads, generator=generator) / dim**0.5
    for split, rows in (("train", train_rows), ("test", test_rows)):
        folder = out / split
        folder.mkdir(parents=True, exist_ok=True)
        n_shards = -(-rows // rows_per_shard)
        for shard in range(n_shards):
            n = min(rows_per_shard, rows - shard * rows_per_shard)
            X = torch.randn(n, layers, dim, generator=generator)
            noise = torch.randn(n, layers, heads, generator=generator)
            y = torch.einsum("nld,ldh->nlh", X, weights).tanh() - 5 + 0.1 * noise
            prompt = torch.arange(n) // 500 + shard * rows_per_shard // 500  # 500 pairs a prompt, as collected
            _write_shard(shard_path(folder, shard), [{"X": X.half(), "y": y, "prompt_index": prompt}], {})
        _write_manifest(folder, {"model": "synthetic", **SHAPES, "n_prompts": -(-rows // 500)}, n_shards)


def sample_peak(command: list[str]) -> dict:
    """Run ``command``; peaks of its ``RssAnon`` and ``RssFile`` (MiB) sampled from ``/proc`` every 0.1 s."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = {"RssAnon": 0, "RssFile": 0}
    start = time.perf_counter()
    while process.poll() is None:
        try:
            with open(f"/proc/{process.pid}/status") as status:
                for line in status:
                    key, _, value = line.partition(":")
                    if key in peak:
                        peak[key] = max(peak[key], int(value.split()[0]))
        except FileNotFoundError:
            break
        time.sleep(0.1)
    output = process.stdout.read()
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output[-3000:]}")
    return {
        "anon_mib": peak["RssAnon"] / 1024,
        "file_mib": peak["RssFile"] / 1024,
        "seconds": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100000, help="training rows (500 a prompt, as collected)")
    parser.add_argument("--groups", type=int, nargs="+", default=[5], help="--layers-at-once values to measure")
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per way; medians are reported")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        collection = Path(tmp) / "collection"
        write_synthetic_collection(collection, args.rows)
        hidden_gib = args.rows * SHAPES["n_layers"] * SHAPES["hidden_size"] * 2 / 2**30
        for group in [None, *args.groups]:
            runs, r2 = [], None
            for run in range(args.runs):
                out = Path(tmp) / f"fit-{group}-{run}"
                command = [sys.executable, "-m", "train", "--threads", "1", "fit", "--collection", str(collection)]
                command += ["--out", str(out), "--types", "mlp", "--epochs", str(args.epochs)]
                command += [] if group is None else ["--layers-at-once", str(group)]
                runs.append(sample_peak(command))
                r2 = json.loads((out / "r2.json").read_text())["surrogates"]["mlp"]["mean_r2"]
            row = {
                "layers_at_once": group,
                "train_rows": args.rows,
                "hidden_states_gib": round(hidden_gib, 2),
                "peak_anon_mib": statistics.median(r["anon_mib"] for r in runs),
                "peak_file_mib": statistics.median(r["file_mib"] for r in runs),
                "seconds": statistics.median(r["seconds"] for r in runs),
                "runs": runs,
                "held_out_r2": r2,
            }
            results.append(row)
            print(
                f"layers at once {group or 'all'}: peak anonymous {row['peak_anon_mib'] / 1024:.2f} GiB "
                f"(file pages {row['peak_file_mib'] / 1024:.2f} GiB), {row['seconds']:.0f} s, held-out R^2 {r2:.4f}",
                flush=True,
            )
    base = results[0]["peak_anon_mib"]
    for row in results:
        row["anon_ratio_to_all"] = row["peak_anon_mib"] / base
    write_results(args.json, meta(tool="kvzap bench_fit_memory", runs=args.runs), results)
    return results


if __name__ == "__main__":
    main()
