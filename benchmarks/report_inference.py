"""The inference tables of BENCHMARKS.md: KV memory, decoding and prefill speed, ragged batches, scorers, Gemma 3.

Each ``*_block`` reads its results files and returns its lines (the run's line, the table, a verdict), or None
when a file is missing.
"""

from __future__ import annotations

import statistics

from benchmarks.report_common import MB, Results, _paired, _ratio_runs, _runs_mb, source

# --- KV memory, measured from outside -------------------------------------------------------------------------


def memory_block(res: Results) -> list[str] | None:
    memory = res.load("memory.json")
    if not memory or not memory["results"]:
        return None
    m = memory["meta"]
    n_layers = m["num_layers"]
    lines = [
        source(("memory.json", m)),
        "",
        f"| context | storage | evicted | held after prefill / full | dense-prefill peak / full (goal: kept + "
        f"1/{n_layers} + 0.05) | held after {m['decode_tokens']} tokens / full |",
        "|---|---|---|---|---|---|",
    ]
    for r in memory["results"]:
        full, kept = r["full_bytes_prefill"], 1 - r["evicted_after_prefill"]
        held = f"{r['held_after_prefill'] / full:.3f}"
        goal = ""
        if r["mode"] == "compact":
            held += f" (kept {kept:.3f}; {r['held_after_prefill'] / MB:.0f} of {full / MB:.0f} MiB)"
            goal = f" ({kept + 1 / n_layers + 0.05:.3f})"
        lines.append(
            f"| {r['prefill_tokens']} | {'no press' if r['mode'] == 'none' else r['mode']} "
            f"| {r['evicted_after_prefill']:.1%} | {held} | {r['prefill_peak_extra'] / full:.3f}{goal} "
            f"| {r['held_after_decode'] / r['full_bytes_decode']:.3f} |"
        )
    return lines


def _rss_goal(rss: dict, m: dict) -> tuple[float, float, float]:
    """(MB saved by kvzap compact against no press, evicted share, goal in MB: 0.8 x evicted x full KV)."""
    evicted = statistics.mean(rss["compact"]["evicted_share"])
    # The difference of the medians as the table rounds them, so that a reader's subtraction gives the same.
    saved = round(rss["none"]["median_mb"]) - round(rss["compact"]["median_mb"])
    return saved, evicted, 0.8 * evicted * m["rss_full_bytes"] / MB


def rss_block(res: Results) -> list[str] | None:
    memory = res.load("memory.json")
    rss = (memory or {}).get("peak_rss", {})
    if "none" not in rss or "compact" not in rss:
        return None
    m = memory["meta"]
    n = len(rss["none"]["runs_mb"])
    lines = [
        source(("memory.json", m)),
        "",
        f"| {m['rss_prompt']}-token prefill + {m['rss_decode']} decoded tokens | evicted | peak RSS, median of {n} "
        "fresh processes (MB) | each process (MB) |",
        "|---|---|---|---|",
    ]
    for mode, name in (("none", "no press"), ("compact", "kvzap compact")):
        entry = rss[mode]
        lines.append(
            f"| {name} | {statistics.mean(entry['evicted_share']):.1%} | **{entry['median_mb']:.0f}** "
            f"| {_runs_mb(entry)} |"
        )
    saved, evicted, goal = _rss_goal(rss, m)
    lines += [
        "",
        f"kvzap peaks **{abs(saved):.0f} MB {'lower' if saved >= 0 else 'higher'}** (goal: lower by >= 0.8 x evicted "
        f"x full KV = 0.8 x {evicted:.3f} x {m['rss_full_bytes'] / MB:.0f} MiB = {goal:.0f} MB: "
        f"{'met' if saved >= goal else 'not met'}).",
    ]
    return lines


RSS_WAYS = {
    "none": "no press",
    "compact": "kvzap compact (default release)",
    "compact_trim_only": "kvzap compact, heap trims only",
    "compact_trim_every_layer": "kvzap compact, a trim after every layer",
    "compact_no_heap_release": "kvzap compact, no release",
}


def decode_block(res: Results) -> list[str] | None:
    kvzap, kvpress = res.load("decode.json"), res.load("decode_kvpress.json")
    if not kvzap:
        return None
    files = [("decode.json", kvzap["meta"])] + ([("decode_kvpress.json", kvpress["meta"])] if kvpress else [])
    by_context = {r["prefill_tokens"]: r for r in kvpress["results"]} if kvpress else {}
    lines = [
        source(*files),
        "",
        "| context | evicted | KV after prefill / full | decode tok/s: no press, kvzap, kvpress "
        "| kvzap / no press (each run) | kvpress / no press |",
        "|---|---|---|---|---|---|",
    ]
    for r in kvzap["results"]:
        t = by_context.get(r["prefill_tokens"])
        runs = r.get("compact_decode_tok_s_ratio_runs")
        speeds = f"{r['none_decode_tok_s']:.2f}, {r['compact_decode_tok_s']:.2f}, "
        speeds += f"{t['kvpress_decode_tok_s']:.2f}" if t else "-"
        theirs = f"{_paired(t, 'kvpress', 'decode_tok_s'):.2f}x" if t else "-"
        lines.append(
            f"| {r['prefill_tokens']} | {r['compact_evicted_share']:.1%} "
            f"| {r['compact_kv_bytes_after_prefill'] / r['full_kv_bytes']:.2f} | {speeds} "
            f"| **{_paired(r, 'compact', 'decode_tok_s'):.2f}x**{f' ({_ratio_runs(runs)})' if runs else ''} "
            f"| {theirs} |"
        )
    return lines


def no_eviction_block(res: Results) -> list[str] | None:
    inf = res.load("decode_no_eviction.json")
    if not inf:
        return None
    lines = [
        source(("decode_no_eviction.json", inf["meta"])),
        "",
        "| context | decode tok/s: no press, kvzap | kvzap / no press (each run) | prefill kvzap / no press |",
        "|---|---|---|---|",
    ]
    for r in inf["results"]:
        runs = r.get("compact_decode_tok_s_ratio_runs")
        lines.append(
            f"| {r['prefill_tokens']} | {r['none_decode_tok_s']:.2f}, {r['compact_decode_tok_s']:.2f} "
            f"| **{_paired(r, 'compact', 'decode_tok_s'):.2f}x**{f' ({_ratio_runs(runs)})' if runs else ''} "
            f"| {_paired(r, 'compact', 'prefill_s'):.2f}x |"
        )
    return lines


def fixed_cost_block(res: Results) -> list[str] | None:
    """The fixed cost of a decoding step: a context short enough that reading the cache costs next to nothing."""
    decoding, prompt_only = res.load("decode_fixed_cost.json"), res.load("decode_fixed_cost_prompt_only.json")
    if not decoding or not prompt_only:
        return None
    r, p = decoding["results"][0], prompt_only["results"][0]
    none_ms, kvzap_ms = 1e3 / r["none_decode_tok_s"], 1e3 / r["compact_decode_tok_s"]
    po_ms = 1e3 / p["compact_decode_tok_s"]
    return [
        source(
            ("decode_fixed_cost.json", decoding["meta"]), ("decode_fixed_cost_prompt_only.json", prompt_only["meta"])
        ),
        "",
        "| context | ms per step: no press | kvzap | kvzap, prompt pruned only | kvzap's fixed cost | of which storage "
        "and paged attention | of which decisions while decoding |",
        "|---|---|---|---|---|---|---|",
        f"| {r['prefill_tokens']} | {none_ms:.1f} | {kvzap_ms:.1f} | {po_ms:.1f} | **+{kvzap_ms - none_ms:.1f}** "
        f"| +{po_ms - 1e3 / p['none_decode_tok_s']:.1f} | +{kvzap_ms - po_ms:.1f} |",
    ]


# --- Prefill time -----------------------------------------------------------------------------------------------


BATCH_GOALS = (("batched_none", 1.2, "batched without a press"), ("one_at_a_time", 2.5, "kvzap one prompt at a time"))
BATCH_WAYS = {
    "one_at_a_time": "kvzap (compact), one prompt at a time",
    "batched_none": "one left-padded batch, no press",
    "batched_kvzap": "one left-padded batch, kvzap (compact)",
}


def batch_block(res: Results) -> list[str] | None:
    """``bench_batch.py``: a row per way, then the goals, each met or not."""
    batch = res.load("batch.json")
    if not batch:
        return None
    m, rows = batch["meta"], {r["way"]: r for r in batch["results"]}
    lengths, full = m["lengths"], m["full_kv_bytes"]
    lines = [
        source(("batch.json", m)),
        "",
        f"{len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens ({sum(lengths)} in all), {m['decode_tokens']} "
        f"greedy tokens each, threshold {m['threshold']}, window {m['window']}, median of {m['runs']} runs. Full "
        f"cache of the prompts' own tokens after decoding: {full / MB:.0f} MB (left padded to the longest: "
        f"{m['full_kv_bytes_padded'] / MB:.0f} MB).",
        "",
        "| way | evicted | prefill s | decode tok/s | vs batched no press | vs kvzap one at a time "
        "| KV after prefill (MB) | KV after decoding (MB, / full) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for way, r in rows.items():
        ratios = [f"{r[f'decode_vs_{base}']:.2f}x" if f"decode_vs_{base}" in r else "-" for base, _, _ in BATCH_GOALS]
        lines.append(
            f"| {BATCH_WAYS.get(way, way)} | {r['evicted_share']:.1%} | {r['prefill_s']:.2f} "
            f"| {r['decode_tok_s']:.2f} | {ratios[0]} | {ratios[1]} | {r['kv_bytes_after_prefill'] / MB:.0f} "
            f"| {r['kv_bytes_after_decode'] / MB:.0f} ({r['kv_bytes_after_decode'] / full:.2f}) |"
        )
    kvzap = rows.get("batched_kvzap")
    if kvzap:
        lines.append("")
        for base, goal, name in BATCH_GOALS:
            key = f"decode_vs_{base}"
            if key in kvzap:
                verdict = "met" if kvzap[key] >= goal else "not met"
                lines.append(f"- Batched kvzap decode vs {name}: **{kvzap[key]:.2f}x** (goal >= {goal}x: {verdict}).")
        if "same_tokens_as_one_at_a_time" in kvzap:
            lines.append(
                f"- Rows whose {m['decode_tokens']} greedy tokens equal those of the prompt decoded alone under the "
                f"same press: {kvzap['same_tokens_as_one_at_a_time']} of {len(lengths)}."
            )
    return lines


# --- Learned scorers --------------------------------------------------------------------------------------------


def scorers_block(res: Results) -> list[str] | None:
    scorers = res.load("scorers.json")
    if not scorers:
        return None
    m = scorers["meta"]
    lines = [
        source(("scorers.json", m)),
        "",
        f"{m['prefill_tokens']}-token prefill: the model's own forward takes {m['model_prefill_ms']:.0f} ms; one "
        f"decoded token: {m['model_decode_step_ms']:.1f} ms; median of {m['runs']} runs.",
        "",
        "| scorer | parameters (per layer) | prefill scoring ms (share of the forward) | decode scoring ms (share) |",
        "|---|---|---|---|",
    ]
    for r in scorers["results"]:
        lines.append(
            f"| {r['scorer']} | {r['parameters']:,} ({r['parameters_per_layer']:,}) | "
            f"{r['prefill_scoring_ms']:.1f} ({r['prefill_scoring_share']:.1%}) | "
            f"{r['decode_scoring_ms']:.2f} ({r['decode_scoring_share']:.1%}) |"
        )
    return lines


# --- Gemma 3 270M -----------------------------------------------------------------------------------------------


def _gemma_rows(res: Results) -> list[tuple[dict, str, dict]]:
    """(row, file name, meta) of every ``gemma_decode*.json``, sorted by context."""
    runs = [(p.name, res.load(p.name)) for p in sorted(res.directory.glob("gemma_decode*.json"))]
    rows = [(r, name, d["meta"]) for name, d in runs if d for r in d["results"]]
    return sorted(rows, key=lambda x: x[0]["prefill_tokens"])


def gemma_decode_block(res: Results) -> list[str] | None:
    rows = _gemma_rows(res)
    if not rows:
        return None
    files = list({name: meta for _, name, meta in rows}.items())
    m = rows[0][2]
    lines = [
        source(*files),
        "",
        "| context | runs | evicted (full-attention layers) | KV after prefill (MB): no press, kvzap "
        f"| KV after {m['decode_tokens']} tokens (MB): no press, kvzap (kvzap / no press) "
        "| decode tok/s: no press, kvzap | kvzap / no press | prefill s: no press, kvzap |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r, _, meta in rows:
        after = r["compact_kv_bytes_after_decode"] / r["none_kv_bytes_after_decode"]
        lines.append(
            f"| {r['prefill_tokens']} | {meta['runs']} | {r['compact_evicted_share']:.1%} "
            f"| {r['none_kv_bytes_after_prefill'] / MB:.1f}, {r['compact_kv_bytes_after_prefill'] / MB:.1f} "
            f"| {r['none_kv_bytes_after_decode'] / MB:.1f}, {r['compact_kv_bytes_after_decode'] / MB:.1f} "
            f"(**{after:.2f}**) "
            f"| {r['none_decode_tok_s']:.2f}, {r['compact_decode_tok_s']:.2f} "
            f"| **{r['compact_decode_tok_s'] / r['none_decode_tok_s']:.2f}x** "
            f"| {r['none_prefill_s']:.1f}, {r['compact_prefill_s']:.1f} |"
        )
    return lines


def gemma_suite_memory_block(res: Results) -> list[str] | None:
    """``suite_memory.py``: the whole cache freed on the needle suite's own prompts, per threshold and task."""
    suite = res.load("gemma_suite_memory.json")
    if not suite:
        return None
    tasks = suite["tasks"]
    header = " | ".join(
        f"{task} ({', '.join(map(str, t['prompt_tokens']))} context tokens; no press {t['no_press_mb']:.1f} MB): "
        "prunable pairs evicted, cache MB, whole cache freed"
        for task, t in tasks.items()
    )
    lines = [source(("gemma_suite_memory.json", suite["meta"])), "", f"| threshold | {header} |"]
    lines.append("|---" * (len(tasks) + 1) + "|")
    thresholds = [r["threshold"] for r in next(iter(tasks.values()))["results"]]
    for i, threshold in enumerate(thresholds):
        cells = [
            f"{r['evicted_share']:.1%}, {r['cache_mb']:.1f}, {r['freed_share']:.1%}"
            for r in (t["results"][i] for t in tasks.values())
        ]
        lines.append(f"| {threshold:g} | {' | '.join(cells)} |")
    return lines
