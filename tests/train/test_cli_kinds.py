"""`python -m train fit --leave-kinds-out` and `python -m train evaluate-surrogates` on a tiny model, in process."""

from __future__ import annotations

import json
import random

from tests.train import make_tiny_llama
from train.__main__ import build_parser, main


def test_leave_kinds_out_and_evaluate_surrogates(tmp_path, tiny_tokenizer, capsys):
    make_tiny_llama().save_pretrained(tmp_path / "tiny")
    tiny_tokenizer.save_pretrained(tmp_path / "tiny")
    rng = random.Random(0)
    with (tmp_path / "data.jsonl").open("w") as f:
        for i in range(8):
            subset = ["c-headers", "chat-en"][i % 2]
            text = " ".join(rng.choice(["int", "x", "hello", "you"]) for _ in range(25))
            f.write(json.dumps({"text": text, "subset": subset}) + "\n")
    data = ["--model", str(tmp_path / "tiny"), "--data", str(tmp_path / "data.jsonl"), "--train-per-subset", "2"]
    data += ["--test-per-subset", "1", "--min-tokens", "30", "--max-tokens", "60", "--n-tokens", "12"]
    fit = ["--epochs", "2", "--batch-size", "8", "--hidden-dim", "4"]
    assert main(["--threads", "1", "all", "--out", str(tmp_path / "run"), *data, *fit, "--top-weight", "2"]) == 0
    report = json.loads((tmp_path / "run" / "surrogates" / "r2.json").read_text())
    assert set(report["surrogates"]["mlp"]["per_kind"]) == {"code-c", "dialogue"}
    assert report["mlp_config"]["top_weight"] == 2.0 and (tmp_path / "run" / "surrogates" / "kinds.png").exists()
    capsys.readouterr()

    collection = str(tmp_path / "run" / "collect")
    args = ["fit", "--collection", collection, "--out", str(tmp_path / "lko"), "--types", "linear", *fit]
    assert main([*args, "--leave-kinds-out"]) == 0
    out = capsys.readouterr().out
    assert "code-c held out, linear: R^2" in out and "dialogue held out, linear: R^2" in out
    held_out = json.loads((tmp_path / "lko" / "leave_kinds_out.json").read_text())
    assert held_out["kinds"]["dialogue"]["n_test_prompts"] == 3  # 2 training + 1 held-out prompt
    assert main([*args, "--leave-kinds-out", "dialogue"]) == 0
    capsys.readouterr()
    assert list(json.loads((tmp_path / "lko" / "leave_kinds_out.json").read_text())["kinds"]) == ["dialogue"]

    mlp = tmp_path / "run" / "surrogates" / "mlp"
    evaluate = ["evaluate-surrogates", "--surrogate", f"mine={mlp}", str(tmp_path / "run" / "surrogates" / "linear")]
    assert main([*evaluate, "--collection", f"{collection}/test", "--out", str(tmp_path / "eval")]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    assert [line[:3] for line in lines if line[1:2] in (["code-c:"], ["dialogue:"])] == [
        ["mine", "code-c:", "R^2"],
        ["mine", "dialogue:", "R^2"],
        ["linear", "code-c:", "R^2"],
        ["linear", "dialogue:", "R^2"],
    ]
    # One line per surrogate over all held-out prompts, with the oracle's top pairs kept at 80% and 90% eviction.
    assert [line[:2] for line in lines if line[1:2] == ["all:"]] == [["mine", "all:"], ["linear", "all:"]]
    assert out.count("oracle's top 1% / 5% kept (DMS-like)") == 2
    assert set(json.loads((tmp_path / "eval" / "eval.json").read_text())["surrogates"]) == {"mine", "linear"}
    assert "evaluate-surrogates" in build_parser().format_help()
