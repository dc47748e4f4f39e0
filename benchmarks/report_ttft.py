"""The time-to-first-token tables of BENCHMARKS.md (``bench_ttft.py``): no press against kvzap's prefills, and where
the time of a prefill chunk and of a decoding step goes."""

from __future__ import annotations

from benchmarks.report_common import Results, _ratio_runs, source

__all__ = ["QUIET_ONE_FORWARD", "ttft_block", "ttft_breakdown_block"]

MODE_LABELS = {"none": "no press", "dense": "kvzap, one forward", "auto": "kvzap, the pipeline's default"}
PARTS = ("weights_s", "attention_s", "scoring_s", "bookkeeping_s", "python_and_other_ops_s")


def _label(mode: str) -> str:
    kind, _, size = mode.partition(":")
    return MODE_LABELS.get(mode) or f"{'no press' if kind == 'plain' else 'kvzap'}, chunks of {size}"


#: SmolLM2-135M's one forward against no press, timed again alone on a quiet host (the glance quotes it too).
QUIET_ONE_FORWARD = "ttft_one_forward.json"
#: The results files of the table: SmolLM2-135M's, its quiet-host one forward, then Gemma 3 270M's (rows after the
#: first file's name what sets them apart).
TTFT_FILES = (("ttft.json", ""), (QUIET_ONE_FORWARD, ", quiet host"), ("gemma_ttft.json", ", Gemma 3 270M"))
#: The steps the breakdown shows of each file's profiled run (Gemma 3's has none): the quiet host's run times the
#: prefill, so its decoding step stays in its raw file.
BREAKDOWN_STEPS = {"ttft.json": ("prefill_chunk", "decode_step"), QUIET_ONE_FORWARD: ("prefill_chunk",)}
STEP_LABELS = {"prefill_chunk": "last prefill chunk", "decode_step": "a decoding step"}


def ttft_block(res: Results) -> list[str] | None:
    """Time to the first answer token through the pipeline, each mode's median and each run's ratio to no press:
    SmolLM2-135M (``ttft.json``) and, when its file is there, Gemma 3 270M (``gemma_ttft.json``)."""
    benches = [(name, suffix, res.load(name)) for name, suffix in TTFT_FILES]
    benches = [(name, suffix, bench) for name, suffix, bench in benches if bench]
    if not benches or benches[0][0] != "ttft.json":
        return None
    lines = [
        source(*((name, bench["meta"]) for name, _, bench in benches)),
        "",
        "| context | prefill | first token, s | / no press: median (each run) | evicted |",
        "|---|---|---|---|---|",
    ]
    for _, suffix, bench in benches:
        for row in bench["results"]:
            modes = [m for m in row if m not in ("prefill_tokens", "breakdown")]
            for mode in modes:
                r = row[mode]
                ratio = "" if mode == "none" else f"**{r['ratio_to_none']:.2f}x** ({_ratio_runs(r['ratio_runs'])})"
                evicted = "" if mode == "none" or mode.startswith("plain:") else f"{r['evicted_share']:.0%}"
                context = f"{row['prefill_tokens']}{suffix}"
                lines.append(f"| {context} | {_label(mode)} | {r['ttft_s']:.2f} | {ratio} | {evicted} |")
    return lines


def ttft_breakdown_block(res: Results) -> list[str] | None:
    """Where the time goes: the last prefill chunk and one decoding step, no press against kvzap (one profiled run
    a file, its longest context)."""
    found = []
    for name, suffix in TTFT_FILES:
        steps = BREAKDOWN_STEPS.get(name)
        bench = res.load(name) if steps else None
        rows = [r for r in (bench or {}).get("results", []) if "breakdown" in r]
        if rows:  # the longest context: the others are in the raw file
            found.append((name, suffix, steps, bench, max(rows, key=lambda r: r["prefill_tokens"])))
    if not found or found[0][0] != "ttft.json":
        return None
    lines = [
        source(*((name, bench["meta"]) for name, _, _, bench, _ in found)),
        "",
        "| context | step | mode | wall ms | weights | attention | scoring | bookkeeping | Python, other ops |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for _, suffix, steps, _, row in found:
        for step in steps:
            label = STEP_LABELS[step]
            digits = 0 if step == "prefill_chunk" else 1  # ms: a chunk takes seconds, a step tens of ms
            for mode, parts in row["breakdown"].items():
                p = parts[step]
                what = f"{label} ({p['tokens']} tokens)" if "tokens" in p else label
                wall, *cells = (f"{1000 * p[k]:.{digits}f}" for k in ("wall_s", *PARTS))
                context = f"{row['prefill_tokens']}{suffix}"
                lines.append(f"| {context} | {what} | {_label(mode)} | {wall} | {' | '.join(cells)} |")
    return lines
