"""Markdown tables for BENCHMARKS.md from the JSON files written by ``run_all.sh``."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

MB = 2**20


def _load(directory: Path, name: str) -> dict | None:
    path = directory / name
    return json.loads(path.read_text()) if path.exists() else None


def _runs(entry: dict) -> str:
    return f"{entry['median_mb']:.0f} MB ({', '.join(f'{v:.0f}' for v in entry['runs_mb'])})"


def _rss_lines(memory: dict) -> list[str]:
    """Peak RSS paragraphs of ``memory.json``: the default allocator, then glibc with a fixed mmap threshold."""
    m, lines = memory["meta"], []
    for key, allocator in (
        ("peak_rss", "glibc's default allocator"),
        ("peak_rss_mmap", "`MALLOC_MMAP_THRESHOLD_=65536` (every tensor of 64 KiB or more unmapped when freed)"),
    ):
        rss = memory.get(key)
        if not rss or "none" not in rss or "compact" not in rss:
            continue
        evicted = statistics.mean(rss["compact"]["evicted_share"])
        saved = rss["none"]["median_mb"] - rss["compact"]["median_mb"]
        goal = 0.8 * evicted * m["rss_full_bytes"] / MB
        text = (
            f"Peak RSS of {m['rss_prompt']}-token prefill + {m['rss_decode']} decoded tokens, {allocator}, median of "
            f"{len(rss['none']['runs_mb'])} fresh processes per mode: no press {_runs(rss['none'])}, kvzap compact "
            f"{_runs(rss['compact'])}, {evicted:.1%} evicted: **{abs(saved):.0f} MB "
            f"{'lower' if saved >= 0 else 'higher'}** (goal: lower by >= 0.8 x evicted x full KV = {goal:.0f} MB: "
            f"{'met' if saved >= goal else 'not met'})."
        )
        if "compact_trim_only" in rss:
            text += (
                " kvzap compact giving freed memory back by heap trims only "
                f"(`kvzap.heap.set_heap_release(pages=False)`): {_runs(rss['compact_trim_only'])}."
            )
        if "compact_no_heap_release" in rss:
            text += (
                " kvzap compact without giving freed memory back to the system "
                f"(`kvzap.heap.set_heap_release(None, pages=False)`): {_runs(rss['compact_no_heap_release'])}."
            )
        lines += ["", text]
    return lines


def _prefill_release_lines(bench: dict | None) -> list[str]:
    """Prefill time of kvzap's ways of giving freed memory back against no press (``prefill_release.json``)."""
    if not bench:
        return []
    names = {
        "pages": "kvzap (default: pages + RSS-triggered trims)",
        "trim": "trims only",
        "trim_every_layer": "a trim after every layer",
        "off": "no release",
    }
    paired = all("ratio_runs" in row for row in bench["results"])
    how = "the median of each run's ratio to no press" if paired else "ratio to no press in the same run"
    lines = [
        "",
        f"Prefill only (`benchmarks/bench_prefill_release.py`, `logits_to_keep=1` as `generate` prefills), median of "
        f"{bench['meta']['runs']} runs, {how} (goal for kvzap: <= 1.05x):",
        "",
    ]
    for row in bench["results"]:
        ratios = row["ratio_to_none"]
        parts = [f"no press {row['median_s']['none']:.2f} s"] + [
            f"{names.get(mode, mode)} {ratio:.3f}x" for mode, ratio in ratios.items() if mode != "none"
        ]
        lines.append(f"- {row['prefill_tokens']} tokens: " + ", ".join(parts))
    return lines


def _paired(row: dict, mode: str, key: str) -> float:
    """``mode``'s ``key`` over no press's: the median of each run's ratio when the run recorded them (sweep()),
    else the ratio of the medians (files of earlier runs)."""
    paired = row.get(f"{mode}_{key}_ratio")
    return paired if paired is not None else row[f"{mode}_{key}"] / row[f"none_{key}"]


def report(directory: Path) -> str:
    kvzap, kvpress = _load(directory, "kvzap.json"), _load(directory, "kvpress.json")
    lines = []
    if kvzap:
        m = kvzap["meta"]
        lines += [
            f"Model: `{Path(m['model']).name}`, {m['dtype']}, {m['threads']} threads, threshold {m['threshold']}, "
            f"window {m['window']}, decoding-time pruning {'on' if m['decoding_pruning'] else 'off'}, "
            f"{m['decode_tokens']} decoded tokens, median of {m['runs']} runs"
            + (
                " (ratios: the median of each run's ratio, the modes alternating inside a run)"
                if "compact_decode_tok_s_ratio" in kvzap["results"][0]
                else ""
            )
            + f"; torch {m['torch']}, "
            f"transformers {m['transformers']}"
            + (f" (kvpress: transformers {kvpress['meta']['transformers']})" if kvpress else "")
            + ".",
            "",
            "| context | evicted | KV after prefill / full: kvzap compact, masked, kvpress "
            "| decode tok/s: none, kvzap, kvpress | kvzap / none | kvpress / none "
            "| prefill s: none, kvzap | kvzap / none |",
            "|---|---|---|---|---|---|---|---|",
        ]
        theirs = {r["prefill_tokens"]: r for r in kvpress["results"]} if kvpress else {}
        for r in kvzap["results"]:
            t = theirs.get(r["prefill_tokens"])
            full = r["full_kv_bytes"]
            kvp_mem = f"{t['kvpress_kv_bytes_after_prefill'] / full:.2f}" if t else "-"
            kvp_tok = f"{t['kvpress_decode_tok_s']:.2f}" if t else "-"
            kvp_ratio = f"{_paired(t, 'kvpress', 'decode_tok_s'):.2f}x" if t else "-"
            lines.append(
                f"| {r['prefill_tokens']} | {r['compact_evicted_share']:.1%} "
                f"| {r['compact_kv_bytes_after_prefill'] / full:.2f} ({r['compact_kv_bytes_after_prefill'] / MB:.0f} "
                f"of {full / MB:.0f} MB), {r['masked_kv_bytes_after_prefill'] / full:.2f}, {kvp_mem} "
                f"| {r['none_decode_tok_s']:.2f}, {r['compact_decode_tok_s']:.2f}, {kvp_tok} "
                f"| **{_paired(r, 'compact', 'decode_tok_s'):.2f}x** | {kvp_ratio} "
                f"| {r['none_prefill_s']:.2f}, {r['compact_prefill_s']:.2f} "
                f"| {_paired(r, 'compact', 'prefill_s'):.2f}x |"
            )
    inf = _load(directory, "kvzap_no_eviction.json")
    if inf:
        lines += [
            "",
            "Threshold -inf (nothing can be evicted: nothing is scored; compact layers still read their blocks):",
            "",
        ]
        for r in inf["results"]:
            lines.append(
                f"- {r['prefill_tokens']} tokens: decode {r['compact_decode_tok_s']:.2f} vs "
                f"{r['none_decode_tok_s']:.2f} tok/s (**{_paired(r, 'compact', 'decode_tok_s'):.2f}x**), prefill "
                f"{_paired(r, 'compact', 'prefill_s'):.2f}x"
            )
    lines += _overhead_lines(_load(directory, "overhead.json"), _load(directory, "overhead_prompt_only.json"))
    lines += _prefill_release_lines(_load(directory, "prefill_release.json"))
    peaks = {mode: _load(directory, f"peak_{mode}.json") for mode in ("none", "compact", "compact_chunked", "kvpress")}
    if any(peaks.values()):
        rows = {mode: peak["results"][0] for mode, peak in peaks.items() if peak}
        lines += [
            "",
            "Peak process memory (max RSS), 8k-token prefill + 256 decoded tokens, one fresh process each (KV measured "
            "from outside):",
            "",
            "| run | peak RSS (MB) | KV after decoding (MB) |",
            "|---|---|---|",
        ]
        chunk = peaks["compact_chunked"]["meta"].get("prefill_chunk") if peaks["compact_chunked"] else None
        names = {
            "none": "no press",
            "compact": "kvzap (compact)",
            "compact_chunked": f"kvzap (compact), prefill in chunks of {chunk}",
            "kvpress": "kvpress 0.5.5",
        }
        for mode, row in rows.items():
            lines.append(f"| {names[mode]} | {row['peak_rss_mb']:.0f} | {row['kv_bytes_after_decode'] / MB:.0f} |")
    memory = _load(directory, "memory.json")
    if memory:
        m = memory["meta"]
        n_layers = m["num_layers"]
        lines += [
            "",
            f"KV memory measured from outside (`bench_memory.py`: tensor storages reachable from the cache; live "
            f"tensors at every layer's exit during the prefill, minus the same forward without a cache), threshold "
            f"{m['threshold']}, {m['decode_tokens']} decoded tokens; goals: held <= kept share + 0.05, prefill peak "
            f"<= kept share + 1/{n_layers} + 0.05 (compact):",
            "",
            "| context | storage | evicted | held after prefill / full | prefill peak / full (goal) "
            "| held after decoding / full |",
            "|---|---|---|---|---|---|",
        ]
        for r in memory["results"]:
            full, kept = r["full_bytes_prefill"], 1 - r["evicted_after_prefill"]
            goal = f" ({kept + 1 / n_layers + 0.05:.3f})" if r["mode"] == "compact" else ""
            lines.append(
                f"| {r['prefill_tokens']} | {r['mode']} | {r['evicted_after_prefill']:.1%} "
                f"| {r['held_after_prefill'] / full:.3f} ({r['held_after_prefill'] / MB:.0f} of {full / MB:.0f} MB) "
                f"| {r['prefill_peak_extra'] / full:.3f}{goal} "
                f"| {r['held_after_decode'] / r['full_bytes_decode']:.3f} |"
            )
        lines += _rss_lines(memory)
    scorers = _load(directory, "scorers.json")
    if scorers:
        m = scorers["meta"]
        lines += [
            "",
            f"Learned scorers: parameters and the time to score every layer's new pairs ({m['prefill_tokens']}-token "
            f"prefill: the model's own forward takes {m['model_prefill_ms']:.0f} ms; one decoded token: "
            f"{m['model_decode_step_ms']:.1f} ms; median of {m['runs']} runs):",
            "",
            "| scorer | parameters (per layer) | prefill scoring ms (share of the forward) "
            "| decode scoring ms (share) |",
            "|---|---|---|---|",
        ]
        for r in scorers["results"]:
            lines.append(
                f"| {r['scorer']} | {r['parameters']:,} ({r['parameters_per_layer']:,}) | "
                f"{r['prefill_scoring_ms']:.1f} ({r['prefill_scoring_share']:.1%}) | "
                f"{r['decode_scoring_ms']:.2f} ({r['decode_scoring_share']:.1%}) |"
            )
    collect = _load(directory, "collect.json")
    if collect:
        sec = collect["seconds"]
        base = sec["plain_sdpa_last_logits"]
        lines += [
            "",
            f"KVzip+ target collection, one {collect['meta']['repeat_tokens']}-token repeat prompt "
            f"(median of {collect['meta']['runs']} runs):",
            "",
            "| forward | seconds | vs plain sdpa |",
            "|---|---|---|",
        ]
        for name, seconds in sec.items():
            lines.append(f"| {name} | {seconds:.2f} | {seconds / base:.2f}x |")
    lines += _batch_lines(_load(directory, "batch.json"))
    lines += _second_model_lines(directory)
    return "\n".join(lines)


def _second_model_lines(directory: Path) -> list[str]:
    """Gemma 3 270M: decode speed and outside-measured KV (``gemma_decode*.json``), collection cost
    (``gemma_collect.json``)."""
    runs = [_load(directory, p.name) for p in sorted(Path(directory).glob("gemma_decode*.json"))]
    rows = sorted(((r, d["meta"]) for d in runs if d for r in d["results"]), key=lambda x: x[0]["prefill_tokens"])
    lines = []
    if rows:
        m = rows[0][1]
        lines += [
            "",
            f"Gemma 3 270M (`{Path(m['model']).name}`), {m['dtype']}, {m['threads']} threads, threshold "
            f"{m['threshold']}, window {m['window']}, {m['decode_tokens']} decoded tokens; KV measured from outside "
            "(every tensor storage reachable from the cache; no press: transformers' cache, whose sliding layers "
            "hold their window):",
            "",
            "| context | runs | evicted (full-attention layers) | KV after prefill (MB): no press, kvzap "
            f"| KV after {m['decode_tokens']} tokens (MB): no press, kvzap (kvzap / no press) "
            "| decode tok/s: no press, kvzap | kvzap / no press | prefill s: no press, kvzap |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r, meta in rows:
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
    collect = _load(directory, "gemma_collect.json")
    if collect:
        sec, meta = collect["seconds"], collect["meta"]
        base = sec["plain_sdpa_last_logits"]
        scored = meta.get("scored_layers")
        ok = sec["kvzip_plus_collection"] <= 1.5 * base
        lines += [
            "",
            f"KVzip+ target collection on Gemma 3 270M, one {meta['repeat_tokens']}-token repeat prompt, "
            f"{'layers ' + ', '.join(map(str, scored)) + ' scored' if scored else 'every layer scored'} (median of "
            f"{meta['runs']} runs): "
            + ", ".join(f"{name} {seconds:.2f} s ({seconds / base:.2f}x)" for name, seconds in sec.items())
            + f" (goal: collection <= 1.5x the plain forward: {'met' if ok else 'not met'}).",
        ]
    return lines


# The goals for the ragged batch: batched kvzap decode against batched no press and kvzap one at a time.
BATCH_GOALS = (("batched_none", 1.2, "batched without a press"), ("one_at_a_time", 2.5, "kvzap one prompt at a time"))
BATCH_WAYS = {
    "one_at_a_time": "kvzap (compact), one prompt at a time",
    "batched_none": "one left-padded batch, no press",
    "batched_kvzap": "one left-padded batch, kvzap (compact)",
}


def _overhead_lines(decoding: dict | None, prompt_only: dict | None) -> list[str]:
    """The fixed cost of a decoding step: a context short enough that reading the cache costs next to nothing."""
    if not decoding:
        return []
    r = decoding["results"][0]
    none_ms, kvzap_ms = 1e3 / r["none_decode_tok_s"], 1e3 / r["compact_decode_tok_s"]
    lines = [
        "",
        f"Fixed cost of a decoding step ({r['prefill_tokens']}-token context, where reading the cache costs next to "
        f"nothing; median step of {decoding['meta']['runs']} runs): no press {none_ms:.1f} ms, kvzap (compact, "
        f"decoding-time pruning) {kvzap_ms:.1f} ms, **+{kvzap_ms - none_ms:.1f} ms** per step",
    ]
    if prompt_only:
        p = prompt_only["results"][0]
        po_ms = 1e3 / p["compact_decode_tok_s"]
        lines[-1] += (
            f"; with the prompt pruned only (no decision per step) {po_ms:.1f} ms: storage and paged attention "
            f"+{po_ms - 1e3 / p['none_decode_tok_s']:.1f} ms, decisions while decoding +{kvzap_ms - po_ms:.1f} ms"
        )
    lines[-1] += "."
    return lines


def _batch_lines(batch: dict | None) -> list[str]:
    """The "Ragged batches" section from ``bench_batch.py``'s JSON (nothing without it): a table per way, then
    the goals, each met or not."""
    if not batch:
        return []
    m, rows = batch["meta"], {r["way"]: r for r in batch["results"]}
    lengths, full, padded = m["lengths"], m["full_kv_bytes"], m["full_kv_bytes_padded"]
    lines = [
        "",
        f"Ragged batches (`bench_batch.py`): {len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens "
        f"({sum(lengths)} in all, consecutive segments of one text), {m['decode_tokens']} greedy tokens each; "
        f"`{Path(m['model']).name}`, {m['dtype']}, {m['threads']} threads, threshold {m['threshold']}, window "
        f"{m['window']}, decoding-time pruning on, median of {m['runs']} runs (the ways alternate inside each run; "
        f"speedups are medians of each run's ratio). Decode tok/s: every row's decoded tokens over the decode wall "
        f"time. KV: tensor storages reachable from the cache(s), measured from outside, against the full cache of "
        f"the prompts' own tokens ({full / MB:.0f} MB after decoding; left padded to the longest: "
        f"{padded / MB:.0f} MB):",
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


if __name__ == "__main__":
    print(report(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")))
