"""``kvzap demo/calibrate/info`` run as subprocesses with bad arguments: a one-line message naming the argument,
a non-zero exit status, no traceback, and nothing loaded before the arguments are checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvzap.cli import main

ROOT = Path(__file__).resolve().parents[2]

BAD = [
    (["demo", "--window", "-1"], "--window"),
    (["demo", "--window", "ten"], "--window"),
    (["demo", "--threshold", "nan"], "--threshold"),
    (["demo", "--threshold", "low"], "--threshold"),
    (["demo", "--context-tokens", "0"], "--context-tokens"),
    (["demo", "--max-new-tokens", "-3"], "--max-new-tokens"),
    (["demo", "--model-type", "quadratic"], "--model-type"),
    (["demo", "--model", "/nonexistent/model"], "--model"),
    (["demo", "--surrogate", "./no/such/surrogate"], "--surrogate"),
    (["calibrate", "--target", "1.5"], "--target"),
    (["calibrate", "--target", "nan"], "--target"),
    (["calibrate", "--target"], "--target"),
    (["calibrate", "--max-tokens", "0"], "--max-tokens"),
    (["calibrate", "--texts", "/nonexistent/text.txt"], "--texts"),
    (["demo", "--variant", "avg"], "variant='avg' is not a bundled"),
    (["calibrate", "--model-type", "linear", "--variant", "average"], "variant='average' is not a bundled"),
    (["calibrate", "--model-type", "fastkvzip", "--variant", "average"], "--variant"),
    (["demo", "--variant", "average", "--surrogate", "someone/weights"], "pass only one of them"),
    (["info", "extra"], "unrecognized arguments"),
    (["nosuch"], "invalid choice"),
    ([], "required"),
]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # `-m kvzap.cli` from the repository root runs this checkout's kvzap, whatever is installed.
    return subprocess.run(
        [sys.executable, "-m", "kvzap.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


IDS = [" ".join(a) or "no_args" for a, _ in BAD]


@pytest.mark.parametrize(("args", "names"), BAD, ids=IDS)
def test_bad_arguments_give_a_clear_message_and_a_non_zero_exit(args, names, capsys):
    """In process (fast): argparse exits with status 2, kvzap's own checks return 1; one message, no traceback."""
    try:
        status = main(list(args))
    except SystemExit as exit_:
        status = exit_.code
    err = capsys.readouterr().err
    assert status not in (0, None)
    assert "Traceback" not in err
    assert names in err and "error" in err


# A few as real subprocesses by default (the interpreter start costs seconds each); all of them with -m slow.
SUBPROCESS_DEFAULT = {"calibrate --texts /nonexistent/text.txt"}


@pytest.mark.parametrize(
    ("args", "names"),
    [
        pytest.param(a, n, id=i, marks=() if i in SUBPROCESS_DEFAULT else pytest.mark.slow)
        for (a, n), i in zip(BAD, IDS, strict=True)
    ],
)
def test_bad_arguments_as_a_subprocess(args, names):
    result = run_cli(*args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert names in result.stderr and "error" in result.stderr


def test_info_works(capsys):
    assert main(["info"]) == 0
    assert capsys.readouterr().out.startswith("kvzap ")
