"""Every table of BENCHMARKS.md, printed from the committed results files.

Each table is a *block*: a line saying which run it comes from (machine, date, commit, command, raw results file:
what a reader needs to reproduce it), the table, and sometimes a line or two that judge it against its goal. A
block is printed between two marker comments, ``<!-- report: NAME -->`` and ``<!-- /report -->``; BENCHMARKS.md
carries the same markers around the same text, and ``tests/test_benchmarks_doc.py`` checks that every table of
the document sits in a block equal to what this script prints, so that no figure is copied by hand::

    python -m benchmarks.report [--results benchmarks/results]   # every block, in the document's order
    python -m benchmarks.report --table decode                    # one block by name (--list names them)
    python -m benchmarks.report --update BENCHMARKS.md            # rewrite the document's blocks in place

A block whose results files are missing is left out (``run_all.sh`` prints the blocks of the files it wrote).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

from benchmarks.report_alternatives import alternatives_block
from benchmarks.report_common import MB, Results, _paired
from benchmarks.report_inference import (
    BATCH_GOALS,
    _gemma_rows,
    _rss_goal,
    batch_block,
    decode_block,
    fixed_cost_block,
    gemma_decode_block,
    gemma_suite_memory_block,
    memory_block,
    no_eviction_block,
    rss_block,
    scorers_block,
)
from benchmarks.report_training import FIT_RUNS, collect_block, fit_memory_block, fit_time_block, gemma_collect_block
from benchmarks.report_ttft import QUIET_ONE_FORWARD, ttft_block, ttft_breakdown_block
from kvzap.presses.threshold import _DECODE_SCORE_BATCH as DECODE_SCORE_BATCH
from kvzap.presses.threshold import PREFILL_CHUNK_SIZE

BEGIN, END = "<!-- report: {} -->", "<!-- /report -->"
BLOCK = re.compile(r"<!-- report: ([\w-]+) -->\n(.*?)\n<!-- /report -->", re.S)


# --- At a glance ------------------------------------------------------------------------------------------------


def _glance_rows(res: Results) -> list[tuple[str, str, str, str]]:
    """(what, measured, against, section) from the same files as the sections' tables; a row whose files are
    missing is left out."""
    rows = []
    memory = res.load("memory.json")
    if memory and memory["results"]:
        compact = {r["prefill_tokens"]: r for r in memory["results"] if r["mode"] == "compact"}
        (short, s), (long, lo) = min(compact.items()), max(compact.items())

        def after(r):
            return r["held_after_decode"] / r["full_bytes_decode"]

        def peak(r):
            return r["prefill_peak_extra"] / r["full_bytes_prefill"]

        rows.append(
            (
                f"KV memory, SmolLM2-135M, ~{lo['evicted_after_prefill']:.0%} of pairs evicted, after "
                f"{memory['meta']['decode_tokens']} decoded tokens",
                f"**{after(s):.2f}** of the full cache at {short // 1024}k, **{after(lo):.2f}** at {long // 1024}k "
                f"({lo['held_after_prefill'] / MB:.0f} of {lo['full_bytes_prefill'] / MB:.0f} MiB after the "
                f"{long // 1024}k prefill)",
                "no press, same tokens",
                "[KV memory](#kv-memory-measured-from-outside)",
            )
        )
        goal = max(1 - r["evicted_after_prefill"] for r in compact.values()) + 1 / memory["meta"]["num_layers"] + 0.05
        rows.append(
            (
                "Peak memory of a dense prefill (outside measure, at every layer's exit)",
                f"{peak(s):.2f} of the full cache at {short // 1024}k, {peak(lo):.2f} at {long // 1024}k",
                f"goal: kept share + 1/{memory['meta']['num_layers']} + 0.05 = {goal:.2f}",
                "[KV memory](#kv-memory-measured-from-outside)",
            )
        )
        rss = memory.get("peak_rss", {})
        if "none" in rss and "compact" in rss:
            saved, _, goal_mb = _rss_goal(rss, memory["meta"])
            m = memory["meta"]
            rows.append(
                (
                    f"Peak RSS, {m['rss_prompt'] // 1024}k prefill + {m['rss_decode']} tokens",
                    f"{rss['compact']['median_mb']:.0f} MB against {rss['none']['median_mb']:.0f} MB: "
                    f"**{saved:.0f} MB lower**",
                    f"goal: >= {goal_mb:.0f} MB lower",
                    "[KV memory](#kv-memory-measured-from-outside)",
                )
            )
    decode, kvpress = res.load("decode.json"), res.load("decode_kvpress.json")
    if decode:
        r = decode["results"]
        ctx = " / ".join(f"{x['prefill_tokens'] // 1024}k" for x in r)
        ratios = " / ".join(f"{_paired(x, 'compact', 'decode_tok_s'):.2f}x" for x in r)
        theirs = ""
        if kvpress:
            k = [_paired(x, "kvpress", "decode_tok_s") for x in kvpress["results"]]
            theirs = f"; {kvpress['meta'].get('tool', 'kvpress')} {min(k):.2f}-{max(k):.2f}x"
        rows.append(
            (
                "Decode speed, SmolLM2-135M",
                f"**{ratios}** no press at {ctx}{theirs}",
                "no press, same run",
                "[Decoding speed](#decoding-speed)",
            )
        )
    ttft = res.load("ttft.json")
    if ttft:
        longest = max(ttft["results"], key=lambda row: row["prefill_tokens"])
        chunks = [m for m in longest if m.startswith("chunk:")]
        default = f"chunk:{PREFILL_CHUNK_SIZE}" if f"chunk:{PREFILL_CHUNK_SIZE}" in chunks else None
        if default and "dense" in longest:
            gemma = _gemma_ttft(res.load("gemma_ttft.json"), default)
            dense = f"{longest['dense']['ratio_to_none']:.2f}x"
            quiet = [
                r
                for r in (res.load(QUIET_ONE_FORWARD) or {}).get("results", [])
                if r["prefill_tokens"] == longest["prefill_tokens"] and "dense" in r
            ]
            if quiet:  # timed again alone: the figure the goal is judged on
                dense = f"**{quiet[0]['dense']['ratio_to_none']:.2f}x** on a quiet host ({dense} on a shared one)"
            rows.append(
                (
                    f"Time to the first answer token, {longest['prefill_tokens'] // 1024}k context, through the "
                    "pipeline",
                    f"**{longest[default]['ratio_to_none']:.2f}x** no press in chunks of {PREFILL_CHUNK_SIZE} "
                    f"(opt-in: they lose needles at 4k); one dense forward, the default, {dense}"
                    f"{gemma}",
                    "goals: <= 0.75x and <= 1.05x",
                    "[Time to first token](#time-to-first-token-and-prefill)",
                )
            )
    batch = res.load("batch.json")
    if batch:
        ways = {x["way"]: x for x in batch["results"]}
        k, lengths = ways["batched_kvzap"], batch["meta"]["lengths"]
        rows.append(
            (
                f"Ragged batch, {len(lengths)} prompts of {min(lengths) // 1024}k-{max(lengths) // 1024}k tokens",
                f"decode **{k['decode_vs_batched_none']:.2f}x** the batch without a press, "
                f"**{k['decode_vs_one_at_a_time']:.2f}x** kvzap one prompt at a time; KV "
                f"{k['kv_bytes_after_decode'] / batch['meta']['full_kv_bytes']:.2f} of the full cache",
                f"goals: {BATCH_GOALS[0][1]}x and {BATCH_GOALS[1][1]}x",
                "[Ragged batches](#ragged-batches)",
            )
        )
    scorers = res.load("scorers.json")
    if scorers:
        mlp = next(x for x in scorers["results"] if x["scorer"] == "kvzap_mlp")
        rows.append(
            (
                "Scoring cost, KVzap-MLP",
                f"{mlp['prefill_scoring_share']:.1%} of a {scorers['meta']['prefill_tokens'] // 1024}k prefill's "
                f"forward; decoded tokens scored {DECODE_SCORE_BATCH} at a time",
                "the model's forward",
                "[Learned scorers](#learned-scorers)",
            )
        )
    gemma = _gemma_rows(res)
    if gemma:
        evicted = [r["compact_evicted_share"] for r, _, _ in gemma]
        ctx = " / ".join(f"{r['prefill_tokens'] // 1024}k" for r, _, _ in gemma)
        kv = " / ".join(
            f"{r['compact_kv_bytes_after_decode'] / r['none_kv_bytes_after_decode']:.2f}" for r, _, _ in gemma
        )
        speed = " / ".join(f"{r['compact_decode_tok_s'] / r['none_decode_tok_s']:.2f}x" for r, _, _ in gemma)
        rows.append(
            (
                f"Gemma 3 270M, ~{min(evicted) * 100:.0f}-{max(evicted):.0%} of full-attention pairs evicted, after "
                f"{gemma[0][2]['decode_tokens']} tokens",
                f"**{kv}** of the no-press cache at {ctx}; decode {speed}",
                "no press, same run",
                "[Gemma 3 270M](#gemma-3-270m-second-model)",
            )
        )
    collect, gemma_collect = res.load("collect.json"), res.load("gemma_collect.json")
    if collect:

        def cost(c):
            return c["seconds"]["kvzip_plus_collection"] / c["seconds"]["plain_sdpa_last_logits"]

        rows.append(
            (
                "KVzip+ target collection",
                f"{cost(collect):.2f}x a plain forward (SmolLM2)"
                + (f", {cost(gemma_collect):.2f}x (Gemma 3)" if gemma_collect else ""),
                "goal: <= 1.5x",
                "[Collection](#kvzip-target-collection-training)",
            )
        )
    fit, fit_memory = fit_time_block(res), res.load("fit_memory.json")
    if fit and fit_memory:
        batched = json.loads((res.research / FIT_RUNS[1][1] / "r2.json").read_text())["surrogates"]["mlp"]
        loop = json.loads((res.research / FIT_RUNS[0][1] / "r2.json").read_text())["surrogates"]["mlp"]
        grouped = next(r for r in fit_memory["results"] if r["layers_at_once"] is not None)
        rows.append(
            (
                "Fitting KVzap-MLP, 30 layers",
                f"{batched['fit_seconds']:.0f} s in one batched fit "
                f"({batched['fit_seconds'] / loop['fit_seconds']:.2f}x "
                f"the per-layer loop); {grouped['anon_ratio_to_all']:.2f}x the memory with `--layers-at-once "
                f"{grouped['layers_at_once']}`",
                "per-layer loop; all layers at once",
                "[Fitting](#surrogate-fitting-training)",
            )
        )
    return rows


def glance_block(res: Results) -> list[str] | None:
    rows = _glance_rows(res)
    if not rows:
        return None
    return ["| what | measured | against | section |", "|---|---|---|---|"] + [f"| {' | '.join(row)} |" for row in rows]


def _gemma_ttft(bench: dict | None, default: str) -> str:
    """The glance's Gemma 3 clause: its longest context's chunked prefill (``default``: the chunk mode SmolLM2's
    clause reports) against no press, and chunking
    alone (``plain:N``, no press) when it was timed; empty without the file."""
    rows = [r for r in (bench or {}).get("results", []) if default in r]
    if not rows:
        return ""
    row = max(rows, key=lambda r: r["prefill_tokens"])
    plain = row.get(default.replace("chunk:", "plain:"))
    alone = f" (chunks without a press: {plain['ratio_to_none']:.2f}x)" if plain else ""
    return f"; Gemma 3 270M, {row['prefill_tokens'] // 1024}k: **{row[default]['ratio_to_none']:.2f}x**{alone}"


# Every block of BENCHMARKS.md, in the document's order.
BLOCKS: dict[str, Callable[[Results], list[str] | None]] = {
    "glance": glance_block,
    "memory": memory_block,
    "memory-rss": rss_block,
    "decode": decode_block,
    "decode-no-eviction": no_eviction_block,
    "decode-fixed-cost": fixed_cost_block,
    "ttft": ttft_block,
    "ttft-breakdown": ttft_breakdown_block,
    "alternatives": alternatives_block,
    "batch": batch_block,
    "scorers": scorers_block,
    "gemma-decode": gemma_decode_block,
    "gemma-suite-memory": gemma_suite_memory_block,
    "gemma-collect": gemma_collect_block,
    "collect": collect_block,
    "fit-time": fit_time_block,
    "fit-memory": fit_memory_block,
}


def blocks(directory: Path | str, research: Path | str | None = None, names: list[str] | None = None) -> dict[str, str]:
    """Every block whose results files are there (or only ``names``): name -> its text (without the markers)."""
    unknown = sorted(set(names or ()) - set(BLOCKS))
    if unknown:
        raise ValueError(f"No table named {', '.join(unknown)}; the tables are: {', '.join(BLOCKS)}.")
    res = Results(directory, research)
    out = {}
    for name, build in BLOCKS.items():
        if names and name not in names:
            continue
        lines = build(res)
        if lines:
            out[name] = "\n".join(lines)
    return out


def report(directory: Path | str, research: Path | str | None = None, names: list[str] | None = None) -> str:
    """Every block (or only ``names``), each between its markers, as BENCHMARKS.md carries them."""
    printed = blocks(directory, research, names)
    return "\n\n".join(f"{BEGIN.format(name)}\n{text}\n{END}" for name, text in printed.items())


def update(document: Path, directory: Path | str, research: Path | str | None = None) -> list[str]:
    """Rewrite every block of ``document`` with what the results print now; returns the names of the blocks that
    changed. A block of the document that the results cannot print is left as it is."""
    printed = blocks(directory, research)
    changed = []

    def replace(match: re.Match) -> str:
        name, text = match.group(1), match.group(2)
        if name in printed and printed[name] != text:
            changed.append(name)
            text = printed[name]
        return f"{BEGIN.format(name)}\n{text}\n{END}"

    document.write_text(BLOCK.sub(replace, document.read_text()))
    return changed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default=None, help="the results directory (same as --results)")
    parser.add_argument("--results", default=None, help="the results directory (default: benchmarks/results)")
    parser.add_argument("--research", default=None, help="the training studies' folder (default: research/)")
    parser.add_argument("--update", type=Path, default=None, help="rewrite this document's blocks in place")
    parser.add_argument(
        "--table", action="append", default=None, choices=list(BLOCKS), metavar="NAME", help="print this table only"
    )
    parser.add_argument("--list", action="store_true", help="print the tables' names, in the document's order")
    args = parser.parse_args(argv)
    directory = args.results or args.directory or "benchmarks/results"
    if args.list:
        print("\n".join(BLOCKS))
    elif args.update:
        changed = update(args.update, directory, args.research)
        print(f"{args.update}: {', '.join(changed) if changed else 'no block'} changed")
    else:
        printed = report(directory, args.research, args.table)
        if args.table and not printed:
            parser.error(f"the results in {directory} cannot print {', '.join(args.table)}: its files are missing")
        print(printed)


if __name__ == "__main__":
    main()
