"""The layers of evaluation/: reading run directories below running and reports, the command line on top."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "evaluation"
#: The modules that run a sweep or parse its command line: what a module reading run directories never needs.
RUNNING = {"config", "plan", "runner", "cli", "__main__"}
REPORTS = ("compare", "errors", "collect", "summary", "plots", "tables")


def _imported(module: str) -> set[str]:
    """The modules of evaluation/ that ``module`` imports, anywhere in its code (inside functions too)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module} if node.module else {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("evaluation."):
            found.add(node.module.split(".")[1])
    return found


@pytest.mark.parametrize("module", ["rundirs", *REPORTS])
def test_reading_and_reports_never_import_the_runner(module):
    assert not _imported(module) & RUNNING


def test_run_directories_are_read_by_one_module_that_needs_only_the_intervals():
    assert _imported("rundirs") == {"intervals"}


def test_only_the_command_line_imports_the_command_line():
    users = [p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("cli", "__main__", "__init__")]
    assert not [module for module in users if "cli" in _imported(module)]


def test_the_reading_functions_stay_importable_where_they_were():
    from evaluation import compare, plots, rundirs, runner

    for name in ("read_config", "read_sample_fingerprints", "read_predictions", "read_run", "sample_settings"):
        assert getattr(compare, name) is getattr(rundirs, name)
    assert plots.task_compression is rundirs.task_compression
    assert runner.sample_fingerprints is rundirs.sample_fingerprints and runner.PARTIAL == rundirs.PARTIAL
