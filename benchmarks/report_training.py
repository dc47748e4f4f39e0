"""The training tables of BENCHMARKS.md: the cost of the KVzip+ target collection (SmolLM2, Gemma 3) and of
fitting the surrogates (time, from the studies' ``r2.json`` in research/; memory, from ``bench_fit_memory.py``)."""

from __future__ import annotations

import json

from benchmarks.report_common import GIB, MB, Results, source


def _collect_lines(name: str, collect: dict) -> list[str]:
    sec, meta = collect["seconds"], collect["meta"]
    base = sec["plain_sdpa_last_logits"]
    scored = meta.get("scored_layers")
    lines = [
        source((name, meta)),
        "",
        f"One {meta['repeat_tokens']}-token repeat prompt, "
        f"{'layers ' + ', '.join(map(str, scored)) + ' scored' if scored else 'every layer scored'}, median of "
        f"{meta['runs']} runs.",
        "",
        "| forward | seconds | vs plain sdpa |",
        "|---|---|---|",
    ]
    lines += [f"| {forward} | {seconds:.2f} | {seconds / base:.2f}x |" for forward, seconds in sec.items()]
    ok = sec["kvzip_plus_collection"] <= 1.5 * base
    lines += ["", f"Goal: the collection <= 1.5x the plain forward: {'met' if ok else 'not met'}."]
    return lines


def gemma_collect_block(res: Results) -> list[str] | None:
    collect = res.load("gemma_collect.json")
    return _collect_lines("gemma_collect.json", collect) if collect else None


def collect_block(res: Results) -> list[str] | None:
    collect = res.load("collect.json")
    return _collect_lines("collect.json", collect) if collect else None


# The two KVzap-MLP fits of SmolLM2-135M-Instruct's 300-prompt collection that BENCHMARKS.md compares: (label,
# study folder under research/, commit and date of the run, command). Their r2.json files record no run metadata.
FIT_RUNS = (
    (
        "one skorch fit per layer",
        "smollm2-135m-300",
        "32b049f",
        "2026-11-30",
        "python -m train --threads 2 fit --collection outputs/collect300 --out outputs/fit300",
    ),
    (
        "all layers in one skorch fit (`fit_layers_mlp`)",
        "smollm2-135m-300-sweep/base",
        "9065093",
        "2026-12-01",
        "python -m train --threads 2 fit --collection outputs/collect300 --out outputs/fit300_base",
    ),
)


def fit_time_block(res: Results) -> list[str] | None:
    fits = []
    for label, study, commit, date, command in FIT_RUNS:
        path = res.research / study / "r2.json"
        if not path.exists():
            return None
        fits.append((label, study, commit, date, command, json.loads(path.read_text())["surrogates"]["mlp"]))
    base = fits[0][5]["fit_seconds"]
    lines = [
        "| fit | machine; run, commit | command | seconds | vs one fit per layer | held-out R^2 | raw |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, study, commit, date, command, mlp in fits:
        ratio = mlp["fit_seconds"] / base
        lines.append(
            f"| {label} | 2 CPU cores; run {date}, commit {commit} | `{command}` | {mlp['fit_seconds']:.0f} "
            f"| {'**' * (ratio != 1)}{ratio:.2f}x{'**' * (ratio != 1)} | {mlp['mean_r2']:.3f} "
            f"| [r2.json](research/{study}/r2.json) |"
        )
    return lines


def fit_memory_block(res: Results) -> list[str] | None:
    fit = res.load("fit_memory.json")
    if not fit:
        return None
    lines = [
        source(("fit_memory.json", fit["meta"])),
        "",
        "| fit | peak anonymous memory, median (range) | vs all layers | seconds | held-out R^2 |",
        "|---|---|---|---|---|",
    ]
    for r in fit["results"]:
        anon = [run["anon_mib"] * MB / GIB for run in r["runs"]]
        name = (
            "all layers at once (default)"
            if r["layers_at_once"] is None
            else f"`--layers-at-once {r['layers_at_once']}`"
        )
        ratio = f"{r['anon_ratio_to_all']:.2f}x"
        lines.append(
            f"| {name} | {r['peak_anon_mib'] * MB / GIB:.2f} GiB ({min(anon):.2f}-{max(anon):.2f}) "
            f"| {ratio if r['layers_at_once'] is None else f'**{ratio}**'} | {r['seconds']:.0f} "
            f"| {r['held_out_r2']:.4f} |"
        )
    return lines
