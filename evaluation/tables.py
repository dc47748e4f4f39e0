"""``python -m evaluation.tables``: the tables of docs/accuracy.md, printed from the committed run directories.

Every figure of docs/accuracy.md's tables is read from ``evaluation/results/``: a run's score, intervals and share
evicted from its ``metrics.json``, its settings from its ``config.json`` (:func:`evaluation.compare.read_config`),
and every paired difference recomputed from the runs' ``predictions.csv`` by :func:`evaluation.compare.compare_runs`
(a seeded bootstrap, so the same predictions always print the same interval). The document marks each table
between ``<!-- table: NAME -->`` and ``<!-- /table -->``; ``--check docs/accuracy.md`` says whether every marked
table equals what this module prints, ``--write docs/accuracy.md`` rewrites them after a new run.

    python -m evaluation.tables                      # every table
    python -m evaluation.tables smollm2-2k           # one table
    python -m evaluation.tables --check docs/accuracy.md

A table lists its runs by directory and hash (the ``__xxxxxxxx`` suffix the runner gives a run's directory), so
which run fills which row is written here once, and the figures come from the files.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .compare import compare_pooled, read_config

__all__ = ["TABLES", "RESULTS", "render", "marked_tables", "update", "main"]

#: The committed results, beside this module.
RESULTS = Path(__file__).resolve().parent / "results"
#: Where docs/accuracy.md's links to the results point.
LINK = "../evaluation/results"
#: The Gemma suite's "whole cache freed" (benchmarks.suite_memory on each task's first sample).
GEMMA_MEMORY = RESULTS.parent.parent / "benchmarks" / "results" / "gemma_suite_memory.json"

MACHINE = "2 CPU cores of an x86-64 VM, fp32, greedy decoding, a 128-token window, pruning after the prefill"
NEEDLES = "niah_single niah_single_text niah_multikey niah_multiquery niah_multiquery_text"
SHORT = {"niah_single": "single", "niah_single_text": "single_text", "niah_multikey": "multikey"}
SHORT |= {"niah_multiquery": "multiquery", "niah_multiquery_text": "multiquery_text"}


def run(results: Path, directory: str, digest: str) -> Path:
    """The run directory ``results/directory/.../<model>/<label>__digest``."""
    found = sorted((results / directory).rglob(f"*__{digest}"))
    if len(found) != 1:
        raise FileNotFoundError(f"{len(found)} run directories match {directory}/**/*__{digest} under {results}.")
    return found[0]


def metrics(path: Path) -> dict[str, Any]:
    return json.loads((path / "metrics.json").read_text(encoding="utf-8"))


def _interval(values: list[float] | None, signed: bool = False) -> str:
    if not values:
        return ""
    fmt = "+.1f" if signed else ".1f"
    return f"[{values[0]:{fmt}}, {values[1]:{fmt}}]"


def _paired(result: dict[str, Any]) -> str:
    """``-2.1 [-6.0, +1.5]``, in bold when the interval excludes 0 (a resolved difference)."""
    low, high = result["interval"]
    text = f"{result['difference']:+.1f} {_interval([low, high], signed=True)}"
    return f"**{text}**" if low > 0 or high < 0 else text


def _verdict(own: dict[str, Any], full: dict[str, Any]) -> str:
    """Where a run's score lies against the full cache's 95% interval, as ``evaluation plot`` writes it."""
    full_ci, own_ci = full["score_ci"], own["score_ci"]
    if full_ci[0] <= own["score"] <= full_ci[1]:
        return "inside"
    side = "below" if own["score"] < full_ci[0] else "above"
    disjoint = own_ci[1] < full_ci[0] or own_ci[0] > full_ci[1]
    return f"{side}, intervals {'disjoint' if disjoint else 'overlap'}"


def _parameter(path: Path) -> str:
    config = read_config(path) or {}
    return "-" if config.get("value") is None else f"tau {config['value']:g}"


def _task(value: float) -> str:
    return "100" if value == 100 else f"{value:.1f}"


def _score(m: dict[str, Any]) -> str:
    return f"**{m['score']:.1f}** {_interval(m.get('score_ci'))}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _source(results: Path, spec: Table) -> str:
    raw = ", ".join(f"[{d}/]({LINK}/{d}/)" for d in spec.raw)
    return f"*Machine: {spec.machine}. Run {spec.date}, commit {spec.commit}. Command: `{spec.command}`. Raw: {raw}.*"


@dataclass(frozen=True)
class Table:
    """One marked table: the provenance line above it and the function that prints its rows."""

    raw: tuple[str, ...]
    date: str
    commit: str
    command: str
    build: Callable[[Path, Table], str]
    rows: tuple = ()
    machine: str = MACHINE


def needle_runs(results: Path, spec: Table) -> str:
    """SmolLM2 on the five needle tasks: one row a run, the first being the full cache."""
    directory = spec.raw[0]
    full_path = run(results, directory, spec.rows[0][1])
    full = metrics(full_path)
    tasks = sorted(full["tasks"])
    header = ["press", "parameter", "evicted", "score [95% interval]", "vs full cache"]
    header += ["minus full cache, paired [95%]", *(SHORT[t] for t in tasks)]
    rows = []
    for label, digest in spec.rows:
        path = run(results, directory, digest)
        m = metrics(path)
        is_full = path == full_path
        rows.append(
            [
                label,
                _parameter(path),
                f"{100 * m['compression_ratio']:.1f}%" if not is_full else "0%",
                _score(m),
                "" if is_full else _verdict(m, full),
                "" if is_full else _paired(compare_pooled([(path, full_path)])),
                *(_task(m["tasks"][t]) for t in tasks),
            ]
        )
    return _table(header, rows)


def pairs(results: Path, spec: Table) -> str:
    """Paired differences of two runs (or of pairs of runs pooled over seeds) on the same samples."""
    header = ["A", "B", "A evicted", "B evicted", "A minus B, paired [95%]", "samples A / B higher"]
    header.append("task with the largest difference")
    rows = []
    for label_a, label_b, runs in spec.rows:
        result = compare_pooled([(run(results, *a), run(results, *b)) for a, b in runs])
        task, entry = max(result["tasks"].items(), key=lambda item: (abs(item[1]["difference"]), item[0]))
        rows.append(
            [
                label_a,
                label_b,
                f"{100 * result['compression_a']:.1f}%",
                f"{100 * result['compression_b']:.1f}%",
                _paired(result),
                f"{result['higher_a']} / {result['higher_b']}",
                f"{task} {_paired(entry)}",
            ]
        )
    return _table(header, rows)


def _freed(share: list[float]) -> str:
    low, high = (f"{100 * s:.0f}" for s in (min(share), max(share)))
    return f"{low}%" if low == high else f"{low}-{high}%"


def gemma_needles(results: Path, spec: Table) -> str:
    """Gemma 3 270M on niah_single and niah_multikey, with the share of the whole cache freed."""
    directory = spec.raw[0]
    memory = json.loads(GEMMA_MEMORY.read_text(encoding="utf-8"))["tasks"]
    full_path = run(results, directory, spec.rows[0][1])
    full = metrics(full_path)
    tasks = sorted(full["tasks"])
    header = ["press", "parameter", "evicted (full-attention pairs)", "whole cache freed", "score [95% interval]"]
    header += ["vs full cache", "minus full cache, paired [95%]", *tasks]
    rows = []
    for label, digest in spec.rows:
        path = run(results, directory, digest)
        m = metrics(path)
        is_full = path == full_path
        value = (read_config(path) or {}).get("value")
        freed = [r["freed_share"] for t in memory.values() for r in t["results"] if r["threshold"] == value]
        rows.append(
            [
                label,
                _parameter(path),
                "0%" if is_full else f"{100 * m['compression_ratio']:.1f}%",
                "0%" if is_full else _freed(freed),
                _score(m),
                "" if is_full else _verdict(m, full),
                "" if is_full else _paired(compare_pooled([(path, full_path)])),
                *(f"{m['tasks'][t]:.1f} {_interval(m['tasks_ci'][t])}" for t in tasks),
            ]
        )
    return _table(header, rows)


def gemma_tasks(results: Path, spec: Table) -> str:
    """Gemma 3 270M on fwe and niah_single_text: shares and paired differences per task."""
    directory = spec.raw[0]
    freed = json.loads((results / directory / "cache_freed.json").read_text(encoding="utf-8"))["freed_share"]
    full_path = run(results, directory, spec.rows[0][1])
    full = metrics(full_path)
    tasks = sorted(full["tasks"])
    names = " / ".join(tasks)
    header = ["press", "parameter", f"evicted (full-attention pairs): {names}", f"whole cache freed: {names}"]
    header += ["score [95%]", "minus full cache, paired [95%]", *tasks]
    rows = []
    for label, digest in spec.rows:
        path = run(results, directory, digest)
        m = metrics(path)
        if path == full_path:
            cells = ["0%", "0%", _score(m), ""]
            cells += [f"{m['tasks'][t]:.1f} {_interval(m['tasks_ci'][t])}" for t in tasks]
        else:
            result = compare_pooled([(path, full_path)])
            value = f"{(read_config(path) or {})['value']:g}"
            cells = [" / ".join(f"{100 * m['tasks_compression_ratio'][t]:.1f}%" for t in tasks)]
            cells.append(" / ".join(f"{100 * freed[value][t]:.1f}%" for t in tasks))
            cells += [_score(m), _paired(result)]
            for t in tasks:
                entry = result["tasks"][t]
                same = entry["higher_a"] == entry["higher_b"] == 0
                cells.append(f"{m['tasks'][t]:.1f}" + ("" if same else f"; {_paired(entry)}"))
        rows.append([label, _parameter(path), *cells])
    return _table(header, rows)


PRESS_NAMES = {
    "no_press": "full cache",
    "kvzap_mlp": "KVzap-MLP",
    "kvzap_linear": "KVzap-Linear",
    "fastkvzip": "Fast KVzip",
    "kvzip_plus": "KVzip+ oracle (top-k)",
    "random": "random (top-k)",
    "key_norm": "key norm (top-k)",
    "recency": "recency (top-k)",
}


def every_press(results: Path, spec: Table) -> str:
    """The sweep of every press at 2 samples per task and length, from the ``summary.md`` it wrote."""
    (length,) = spec.rows
    lines = (results / spec.raw[0] / "summary.md").read_text(encoding="utf-8").splitlines()
    header, *body = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("|")]
    body = [dict(zip(header, row, strict=True)) for row in body if not row[0].startswith("---")]
    tasks = header[header.index("score") + 1 :]
    chosen = [r for r in body if r["length"] == str(length)]
    chosen.sort(key=lambda r: (list(PRESS_NAMES).index(r["press"]), float(r["compression"])))
    out = []
    for r in chosen:
        evicted = "0%" if r["press"] == "no_press" else f"{100 * float(r['compression']):.1f}%"
        parameter = r["parameter"].replace("=", " ")
        out.append([PRESS_NAMES[r["press"]], parameter, evicted, f"**{float(r['score']):.1f}**"])
        out[-1] += [f"{float(r[t]):.0f}" for t in tasks]
    return _table(["press", "parameter", "evicted", "score", *(t.removeprefix("niah_") for t in tasks)], out)


SMOL2K = "smollm2-135m-2k-n40"
SMOL2K1 = "smollm2-135m-2k-n40-seed1"
SMOL4K = "smollm2-135m-4k-n40"
BUNDLED = "**KVzap-MLP, bundled** (300 prompts, 12 kinds)"
OLD = "KVzap-MLP, 200 prompts (not bundled)"
WD = "KVzap-MLP, weight decay 0.3 (not bundled)"
H = "KVzap-MLP, 1,920 prompts (H, not bundled)"
ORACLE = "KVzip+ oracle, DMS rule"
SMOL_COMMAND = (
    f"python -m evaluation --lengths 2048 --n-samples 40 --tasks {NEEDLES} --press kvzap_mlp --threshold -2"
    " --output-dir outputs/eval-2k-n40"
)
GEMMA = "gemma-3-270m"
GEMMA2 = "gemma-3-270m-4k-fwe-niah-single-text"


TABLES: dict[str, Table] = {
    "smollm2-2k": Table(
        raw=(SMOL2K,),
        date="2026-12-01 to 2026-12-03",
        commit="bcfece5 to 76fa5bc",
        command=SMOL_COMMAND,
        build=needle_runs,
        rows=(
            ("full cache", "73793b88"),
            *((BUNDLED, d) for d in ("51a892b4", "7ab5bd7c", "715cb588", "39a23dd3", "c3781577", "27f17048")),
            *((OLD, d) for d in ("a9fead7d", "ae23ce53", "078746c6", "7e3ccade")),
            *((WD, d) for d in ("e88400a6", "41cc85c0")),
            *((H, d) for d in ("ab707ce5", "2098be4e", "a1dfaa01")),
            *((ORACLE, d) for d in ("633075c0", "851dd6c7", "6a2a1f33")),
        ),
    ),
    "smollm2-2k-pairs": Table(
        raw=(SMOL2K, SMOL2K1),
        date="2026-12-01 to 2026-12-03",
        commit="bcfece5 to 76fa5bc",
        command="python -m evaluation compare RUN_A RUN_B [RUN_A RUN_B ...]",
        build=pairs,
        rows=tuple(
            (a, b, tuple(zip(runs_a, runs_b, strict=True)))
            for a, b, runs_a, runs_b in (
                ("bundled, tau -2.5", "oracle, tau -3.2", [(SMOL2K, "39a23dd3")], [(SMOL2K, "851dd6c7")]),
                ("bundled, tau -3", "oracle, tau -3.5", [(SMOL2K, "715cb588")], [(SMOL2K, "633075c0")]),
                ("bundled, tau -2", "oracle, tau -3", [(SMOL2K, "c3781577")], [(SMOL2K, "6a2a1f33")]),
                ("oracle, tau -3.2", "oracle, tau -3", [(SMOL2K, "851dd6c7")], [(SMOL2K, "6a2a1f33")]),
                ("oracle, tau -3.5", "oracle, tau -3.2", [(SMOL2K, "633075c0")], [(SMOL2K, "851dd6c7")]),
                ("bundled, tau -3", "200 prompts, tau -3", [(SMOL2K, "715cb588")], [(SMOL2K, "ae23ce53")]),
                ("weight decay 0.3, tau -2.5", "bundled, tau -2.5", [(SMOL2K, "e88400a6")], [(SMOL2K, "39a23dd3")]),
                ("weight decay 0.3, tau -2", "bundled, tau -2", [(SMOL2K, "41cc85c0")], [(SMOL2K, "c3781577")]),
                ("H, tau -3", "bundled, tau -3", [(SMOL2K, "ab707ce5")], [(SMOL2K, "715cb588")]),
                ("H, tau -2.5", "bundled, tau -2.5", [(SMOL2K, "2098be4e")], [(SMOL2K, "39a23dd3")]),
                ("H, tau -2", "bundled, tau -2", [(SMOL2K, "a1dfaa01")], [(SMOL2K, "c3781577")]),
                ("H, tau -3", "oracle, tau -3.5", [(SMOL2K, "ab707ce5")], [(SMOL2K, "633075c0")]),
                ("H, tau -3, seed 1", "bundled, tau -3, seed 1", [(SMOL2K1, "89bc07f1")], [(SMOL2K1, "d1797f02")]),
                (
                    "H, tau -3, seeds 0-1",
                    "bundled, tau -3, seeds 0-1",
                    [(SMOL2K, "ab707ce5"), (SMOL2K1, "89bc07f1")],
                    [(SMOL2K, "715cb588"), (SMOL2K1, "d1797f02")],
                ),
                ("H, tau -3.1", "bundled, tau -3", [(SMOL2K, "089fc992")], [(SMOL2K, "715cb588")]),
                ("H, tau -3.1, seed 1", "bundled, tau -3, seed 1", [(SMOL2K1, "612ceecf")], [(SMOL2K1, "d1797f02")]),
                (
                    "H, tau -3.1, seeds 0-1",
                    "bundled, tau -3, seeds 0-1",
                    [(SMOL2K, "089fc992"), (SMOL2K1, "612ceecf")],
                    [(SMOL2K, "715cb588"), (SMOL2K1, "d1797f02")],
                ),
            )
        ),
    ),
    "smollm2-4k": Table(
        raw=(SMOL4K,),
        date="2026-12-02 to 2026-12-07",
        commit="8efad08 to b46b2e2",
        command=SMOL_COMMAND.replace("2048", "4096").replace("2k", "4k") + " --max-new-tokens 64",
        build=needle_runs,
        rows=(
            ("full cache", "81eac6bf"),
            *((BUNDLED, d) for d in ("3af5285a", "d2c77be3", "93ff1abe", "bda9409c", "04fbfa41", "b5fe36f2")),
            (H, "7a6be2bc"),
            (ORACLE, "4bd4db6c"),
        ),
    ),
    "smollm2-4k-pairs": Table(
        raw=(SMOL4K,),
        date="2026-12-02 to 2026-12-03",
        commit="8efad08 to 1218c28",
        command="python -m evaluation compare RUN_A RUN_B",
        build=pairs,
        rows=tuple(
            (a, b, (((SMOL4K, run_a), (SMOL4K, run_b)),))
            for a, b, run_a, run_b in (
                ("bundled, tau -2", "bundled, tau -2.5", "04fbfa41", "bda9409c"),
                ("oracle, tau -3.2", "bundled, tau -2", "4bd4db6c", "04fbfa41"),
                ("oracle, tau -3.2", "bundled, tau -1.5", "4bd4db6c", "b5fe36f2"),
                ("oracle, tau -3.2", "bundled, tau -2.5", "4bd4db6c", "bda9409c"),
                ("H, tau -2.5", "bundled, tau -2.5", "7a6be2bc", "bda9409c"),
                ("H, tau -2.5", "bundled, tau -2", "7a6be2bc", "04fbfa41"),
            )
        ),
    ),
    "gemma-4k": Table(
        raw=(GEMMA,),
        date="2026-12-02",
        commit="92103ab",
        command=(
            "python -m evaluation --model gemma3-270m --press kvzap_mlp --threshold=-3.6 --tasks niah_single "
            "niah_multikey --lengths 4096 --n-samples 40 --max-new-tokens 24"
        ),
        build=gemma_needles,
        rows=(
            ("full cache", "efe8c21f"),
            *(("KVzap-MLP", d) for d in ("e6086d5b", "c406da9d", "333a39de", "b15007b0", "2658c16d")),
        ),
        machine="2 CPU cores of an x86-64 VM, fp32, greedy decoding, a 128-token window, sliding-window layers kept",
    ),
    "gemma-4k-pairs": Table(
        raw=(GEMMA,),
        date="2026-12-02",
        commit="92103ab",
        command="python -m evaluation compare RUN_A RUN_B",
        build=pairs,
        rows=(("tau -2.7", "tau -3.6", (((GEMMA, "b15007b0"), (GEMMA, "c406da9d")),)),),
        machine="2 CPU cores of an x86-64 VM, fp32, greedy decoding",
    ),
    "gemma-4k-fwe": Table(
        raw=(GEMMA2,),
        date="2026-12-05",
        commit="7069020",
        command=(
            "python -m evaluation --model gemma3-270m --press kvzap_mlp --threshold=-3 --tasks fwe niah_single_text "
            "--lengths 4096 --n-samples 40"
        ),
        build=gemma_tasks,
        rows=(
            ("full cache", "f8ce9e72"),
            ("KVzap-MLP", "447c9c18"),
            ("KVzap-MLP", "98b83051"),
            ("KVzap-MLP, exploratory (chosen after tau -3's eviction was seen)", "4e71d409"),
        ),
        machine="2 CPU cores of an x86-64 VM, fp32, greedy decoding, a 128-token window, sliding-window layers kept",
    ),
    "every-press-2k": Table(
        raw=("smollm2-135m-every-press-n2",),
        date="2026-11-30",
        commit="636ec22",
        command=(
            f"python -m evaluation --lengths 2048 4096 --n-samples 2 --tasks {NEEDLES} --press no_press kvzap_mlp "
            "kvzap_linear --threshold -5 -4 -3"
        ),
        build=every_press,
        rows=(2048,),
        machine="2 CPU cores of an x86-64 VM, fp32, greedy decoding",
    ),
}
TABLES["every-press-4k"] = Table(**{**TABLES["every-press-2k"].__dict__, "rows": (4096,)})


def render(name: str, results: Path | str = RESULTS) -> str:
    """The text between table ``name``'s markers: its provenance line, a blank line and the table."""
    results = Path(results)
    spec = TABLES[name]
    return f"{_source(results, spec)}\n\n{spec.build(results, spec)}"


# A table's body holds no comment marker, so an empty pair of markers never swallows the next table.
MARKED = re.compile(r"<!-- table: (?P<name>[\w-]+) -->\n(?P<body>(?:(?!<!-- ).)*?)\n?<!-- /table -->", re.DOTALL)


def marked_tables(markdown: str) -> dict[str, str]:
    """``name -> text`` of every table marked in ``markdown``."""
    return {m["name"]: m["body"] for m in MARKED.finditer(markdown)}


def update(markdown: str, results: Path | str = RESULTS) -> str:
    """``markdown`` with every marked table printed anew."""
    return MARKED.sub(lambda m: f"<!-- table: {m['name']} -->\n{render(m['name'], results)}\n<!-- /table -->", markdown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evaluation.tables", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", metavar="TABLE", help=f"tables to print (default all): {', '.join(TABLES)}")
    parser.add_argument("--results", default=str(RESULTS), help="the results directory (default: the committed one)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", metavar="MARKDOWN", help="exit 1 when a marked table differs from what is printed")
    group.add_argument("--write", metavar="MARKDOWN", help="rewrite the marked tables of MARKDOWN")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in TABLES]
    if unknown:
        parser.error(f"unknown table {', '.join(unknown)}; choose from {', '.join(TABLES)}")
    if args.check or args.write:
        path = Path(args.check or args.write)
        text = path.read_text(encoding="utf-8")
        new = update(text, args.results)
        if args.write:
            path.write_text(new, encoding="utf-8")
            return 0
        stale = [n for n, body in marked_tables(text).items() if body != marked_tables(new)[n]]
        for name in stale:
            print(f"{path}: table {name} differs from `python -m evaluation.tables {name}`", file=sys.stderr)
        return 1 if stale else 0
    for name in args.names or TABLES:
        print(f"<!-- table: {name} -->\n{render(name, args.results)}\n<!-- /table -->\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
