"""What every table of BENCHMARKS.md shares: the results directory, and the line naming a table's run (machine,
software, date, commit, command, raw file)."""

from __future__ import annotations

import json
from pathlib import Path

MB = 2**20
GIB = 2**30
# Where BENCHMARKS.md's links point: the results as committed (whatever --results the figures were read from).
RESULTS_LINK = "benchmarks/results"


class Results:
    """The results directory (``benchmarks/results``) and the research folder holding the training runs."""

    def __init__(self, directory: Path | str, research: Path | str | None = None):
        self.directory = Path(directory)
        # The surrogate-fitting studies: research/<study>/ of the checkout holding the results directory.
        self.research = Path(research) if research else self.directory.resolve().parent.parent / "research"

    def load(self, name: str) -> dict | None:
        path = self.directory / name
        return json.loads(path.read_text()) if path.exists() else None


def _short_machine(m: dict) -> str:
    if m.get("gpu"):
        return m["gpu"]
    cores = f"{m['cpus']} CPU cores" if m.get("cpus") else "CPU"
    host = m.get("machine", "").split("-with-")[0]
    return f"{cores} ({host})" if host else cores


def source(*files: tuple[str, dict]) -> str:
    """The line above a table: machine, software, date, commit, command(s) and raw file(s) of its run(s)."""
    parts, seen = [], set()
    for _, m in files:
        software = ", ".join(
            bit
            for bit in (
                f"{m['threads']} thread{'s' if m['threads'] != 1 else ''}" if "threads" in m else "",
                m.get("dtype", ""),
                f"torch {m['torch']}" if "torch" in m else "",
                f"transformers {m['transformers']}" if "transformers" in m else "",
            )
            if bit
        )
        if m.get("tool", "").startswith("kvpress"):
            software = f"{m['tool']}: {software}"
        run = f"{_short_machine(m)}, {software}" if software else _short_machine(m)
        run += f"; run {m.get('date', '?')}, commit {m.get('commit', '?')}"
        if run not in seen:
            seen.add(run)
            parts.append(run)
    commands = "; ".join(f"`{m['command']}`" for _, m in files if m.get("command"))
    raw = ", ".join(f"[{name}]({RESULTS_LINK}/{name})" for name, _ in files)
    return f"*Machine: {' | '.join(parts)}. Command: {commands or '-'}. Raw: {raw}.*"


def _ratio_runs(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def _paired(row: dict, mode: str, key: str) -> float:
    """``mode``'s ``key`` over no press's: the median of each run's ratio when the file has them (``sweep()``),
    else the ratio of the medians."""
    paired = row.get(f"{mode}_{key}_ratio")
    return paired if paired is not None else row[f"{mode}_{key}"] / row[f"none_{key}"]


def _runs_mb(entry: dict) -> str:
    return ", ".join(f"{v:.0f}" for v in entry["runs_mb"])
