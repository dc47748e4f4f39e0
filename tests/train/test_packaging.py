"""The tools install as kvzap.train / kvzap.evaluation behind `kvzap train` and `kvzap evaluate` (issue 14 part 5).

The wheel itself is built, installed and run from another directory by `.ci/run` (through `.ci/smoke_tools.py`);
these tests check what a checkout can: the package list, the relative imports, and the subcommands.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

from kvzap.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _setuptools_config() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]


def test_every_package_is_installed_under_kvzap():
    config = _setuptools_config()
    mapping = config["package-dir"]
    assert mapping == {"kvzap.train": "train", "kvzap.evaluation": "evaluation"}
    expected = {"kvzap.train", "kvzap.evaluation"}
    for init in (ROOT / "kvzap").rglob("__init__.py"):  # every regular sub-package of kvzap must be listed
        expected.add(".".join(init.parent.relative_to(ROOT).parts))
    assert set(config["packages"]) == expected
    assert all(name == "kvzap" or name.startswith("kvzap.") for name in config["packages"])  # no generic names


@pytest.mark.parametrize("package", ["train", "evaluation"])
def test_tools_import_each_other_relatively(package):
    # `from train.x import` would work from a checkout only; installed, the package is kvzap.train.
    for path in (ROOT / package).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                assert node.module.split(".")[0] != package, f"{path.name} imports {node.module} absolutely"
            if isinstance(node, ast.Import):
                assert all(alias.name.split(".")[0] != package for alias in node.names), path.name


@pytest.mark.parametrize("command, package", [("train", "train"), ("evaluate", "evaluation")])
def test_kvzap_subcommands(command, package, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvzap {command}")
    # The tool is imported under kvzap's name (installed, or read from the checkout by the same name).
    assert f"kvzap.{package}" in sys.modules
    assert Path(sys.modules[f"kvzap.{package}"].__file__).resolve().parent == ROOT / package


def test_kvzap_evaluate_runs_a_sweep_from_another_directory(tmp_path, monkeypatch, capsys):
    # Issue 12 item 9: `kvzap evaluate` failed outside the repository root with "No module named 'evaluation'".
    from tests.conftest import char_tokenizer, tiny_model

    monkeypatch.chdir(tmp_path)
    argv = ["evaluate", "--press", "no_press", "--tasks", "niah_single", "--lengths", "400", "--n-samples", "1"]
    argv += ["--max-new-tokens", "2", "--output-dir", str(tmp_path / "out")]
    from kvzap.cli import _import_tool

    _import_tool("evaluation")
    runner = importlib.import_module("kvzap.evaluation.runner")
    monkeypatch.setattr(runner, "_load_model", lambda config: (tiny_model("llama"), char_tokenizer()))
    assert main(argv) == 0
    assert "no_press__len400" in capsys.readouterr().out
    assert len(list((tmp_path / "out").rglob("metrics.json"))) == 1
