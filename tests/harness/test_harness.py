"""The kvzap model of lm-evaluation-harness on the tiny model: splitting, pruning, generation, CLI errors, tasks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from kvzap.harness import TASKS_DIR, KVzapLM, check_model_args  # noqa: E402
from kvzap.harness.cli import main as harness_main  # noqa: E402
from kvzap.harness.data import write_data  # noqa: E402
from kvzap.surrogates import KVzapSurrogate  # noqa: E402
from tests.conftest import char_tokenizer, tiny_model  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog. " * 8
REQUESTS = [
    Instance("loglikelihood", {}, (TEXT, " and runs away"), 0),
    Instance("loglikelihood", {}, (TEXT, " yes"), 1),  # same context: one shared prefill
    Instance("loglikelihood", {}, ("Hello", " world"), 2),
]


def _kvzap(model, tokenizer, threshold, **extra):
    return KVzapLM(
        pretrained=model,
        tokenizer=tokenizer,
        device="cpu",
        press="kvzap_linear",
        threshold=threshold,
        surrogate=KVzapSurrogate(64, 2, 2),
        window=16,
        **extra,
    )


@pytest.fixture(scope="module")
def setup():
    return tiny_model("llama"), char_tokenizer()


@pytest.mark.parametrize("storage", ["compact", "masked"])
def test_threshold_minus_inf_equals_lm_eval_hf_model(setup, storage):
    model, tokenizer = setup
    reference = HFLM(pretrained=model, tokenizer=tokenizer, device="cpu", batch_size=2).loglikelihood(REQUESTS)
    ours = _kvzap(model, tokenizer, float("-inf"), storage=storage).loglikelihood(REQUESTS)
    for (ref, ref_greedy), (got, greedy) in zip(reference, ours, strict=True):
        assert got == pytest.approx(ref, abs=1e-4)
        assert greedy == ref_greedy


def test_pruning_changes_the_continuation_loglikelihoods(setup):
    model, tokenizer = setup
    full = _kvzap(model, tokenizer, float("-inf")).loglikelihood(REQUESTS)
    lm = _kvzap(model, tokenizer, 0.0)
    pruned = lm.loglikelihood(REQUESTS)
    assert abs(pruned[0][0] - full[0][0]) > 1e-3 and abs(pruned[1][0] - full[1][0]) > 1e-3
    assert pruned[2][0] == pytest.approx(full[2][0], abs=1e-5)  # a 4-token prefix, inside the window: kept
    info = lm.get_model_info()["kvzap"]
    assert info["press"] == "kvzap_linear" and info["value"] == 0.0 and info["window"] == 16
    assert info["requests"] == 3 and 0 < info["compression_ratio"] < 1


def test_rolling_is_read_in_chunks_under_the_press(setup):
    model, tokenizer = setup
    requests = [Instance("loglikelihood_rolling", {}, (TEXT * 2,), 0)]
    reference = HFLM(pretrained=model, tokenizer=tokenizer, device="cpu", max_length=1000).loglikelihood_rolling(
        requests
    )
    full = _kvzap(model, tokenizer, float("-inf"), rolling_chunk=64, max_length=1000).loglikelihood_rolling(requests)
    pruned = _kvzap(model, tokenizer, 0.0, rolling_chunk=64, max_length=1000).loglikelihood_rolling(requests)
    assert full[0] == pytest.approx(reference[0], rel=1e-5)
    assert abs(pruned[0] - full[0]) > 1e-3


def test_generation_tasks_run_offline(setup, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    model, tokenizer = setup
    write_data("ruler_offline", tmp_path, tokenizer, tasks=["niah_single"], length=400, n_samples=2)
    manager = TaskManager(include_path=str(TASKS_DIR), metadata={"data_dir": str(tmp_path)})
    lm = _kvzap(model, tokenizer, 0.0)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["kvzap_ruler_offline_niah_single"], task_manager=manager, log_samples=True
    )
    task = results["results"]["kvzap_ruler_offline_niah_single"]
    assert task["sample_len"] == 2 and 0 <= task["score,none"] <= 100
    answers = [s["resps"][0][0] for s in results["samples"]["kvzap_ruler_offline_niah_single"]]
    # The kvzap documents are answered by the pipeline, as `kvzap evaluate` answers them.
    from transformers import pipeline

    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    docs = [s["doc"] for s in results["samples"]["kvzap_ruler_offline_niah_single"]]
    expected = [
        pipe(
            d["context"], question=d["question"], answer_prefix=d["answer_prefix"], press=lm.press, max_new_tokens=128
        )["answer"]
        for d in docs
    ]
    assert answers == expected
    assert results["config"]["kvzap"]["by_request_type"]["generate_until"]["requests"] == 2


def test_generic_generation_runs_under_the_press(setup):
    model, tokenizer = setup
    lm = _kvzap(model, tokenizer, 0.0, batch_size=2)
    requests = [
        Instance("generate_until", {}, (TEXT, {"until": ["\n"], "max_gen_toks": 5, "do_sample": False}), 0),
        Instance("generate_until", {}, (TEXT[:50], {"until": ["\n"], "max_gen_toks": 5, "do_sample": False}), 1),
    ]
    out = lm.generate_until(requests)
    assert len(out) == 2 and all(isinstance(t, str) for t in out)
    ratios = lm.compression_summary()["by_request_type"]["generate_until"]
    assert ratios["requests"] == 2 and ratios["compression_ratio"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        ({"press": "kvzap_nope", "threshold": -3}, "Unknown press"),
        ({"press": "kvzap_mlp", "treshold": -3}, "Unknown model argument"),
        ({"press": "kvzap_mlp", "threshold": "abc"}, "must be a number"),
        ({"press": "kvzap_mlp"}, "needs a threshold"),
        ({"press": "kvzap_mlp", "threshold": -3, "model_type": "linear"}, "contradicts"),
        ({"press": "key_norm", "threshold": -3}, "compression_ratio"),
        ({"press": "kvzap_mlp", "threshold": -3, "variant": "nope"}, "variant"),
        ({"press": "kvzap_mlp", "threshold": -3, "storage": "paged"}, "storage"),
        ({"press": "kvzap_mlp", "threshold": -3, "window": -1}, "window"),
        ({"press": "kvzap_mlp", "threshold": -3, "sink_size": -1}, "sink_size"),
        ({"press": "key_norm", "compression_ratio": 0.5, "sink_size": 4}, "sink_size"),
    ],
)
def test_bad_model_arguments_are_refused_before_loading(args, message):
    with pytest.raises(ValueError, match=message):
        check_model_args(args)


def test_sink_size_reaches_the_press_and_the_record():
    from kvzap.harness.args import parse_press_settings

    settings = parse_press_settings({"press": "kvzap_mlp", "threshold": -3, "sink_size": "2"})
    assert settings.build().sink_size == 2 and settings.record()["sink_size"] == 2
    assert parse_press_settings({"press": "kvzap_mlp", "threshold": -3}).build().sink_size is None


def test_a_surrogate_that_does_not_fit_is_refused_before_loading(tmp_path, setup):
    model, tokenizer = setup
    model.save_pretrained(tmp_path / "model")
    KVzapSurrogate(32, 2, 3).save_pretrained(tmp_path / "surrogate")  # hidden 32, 3 layers: not the model's
    with pytest.raises(ValueError, match="does not fit"):
        check_model_args(
            {"pretrained": str(tmp_path / "model"), "press": "kvzap_linear", "threshold": -3,
             "surrogate": str(tmp_path / "surrogate")}
        )  # fmt: skip


def test_cli_errors(monkeypatch, tmp_path, capsys):
    assert harness_main(["--model_args", "press=kvzap_mlp,threshold=abc", "--tasks", "x"]) == 2
    assert "must be a number" in capsys.readouterr().err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    assert harness_main(["--model_args", "press=no_press", "--tasks", "kvzap_ruler_offline",
                         "--metadata", json.dumps({"data_dir": str(tmp_path)})]) == 2  # fmt: skip
    assert "kvzap harness data" in capsys.readouterr().err


def test_cli_network_error_names_the_task(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    assert harness_main(["--model_args", "press=no_press", "--tasks", "hellaswag"]) == 2
    err = capsys.readouterr().err
    assert "hellaswag" in err and "network" in err


def test_task_configs_load_offline():
    from lm_eval.tasks import TaskManager

    from kvzap.harness.tasks._write_configs import configs

    assert {p.name: p.read_text(encoding="utf-8") for p in TASKS_DIR.glob("kvzap_*.yaml")} == configs()
    manager = TaskManager(include_path=str(TASKS_DIR))
    for group in ("kvzap_ruler_offline", "kvzap_ruler", "kvzap_longbench"):
        assert group in manager.all_groups
    assert "kvzap_aime25_aime25" in manager.all_subtasks


def test_kvzap_subcommand_help():
    out = subprocess.run(
        [sys.executable, "-m", "kvzap.cli", "harness", "data", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--dataset" in out and "--out" in out


@pytest.mark.slow
def test_two_processes_give_the_results_of_one(tmp_path, setup):
    """`accelerate launch --num_processes 2 -m kvzap.harness ...` on CPU: the same per-sample results as one."""
    pytest.importorskip("accelerate")
    model, tokenizer = setup
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    KVzapSurrogate(64, 2, 2).save_pretrained(tmp_path / "surrogate")
    write_data("ruler_offline", tmp_path / "data", tokenizer, tasks=["niah_single"], length=400, n_samples=4)
    common = [
        "--model_args",
        f"pretrained={tmp_path / 'model'},press=kvzap_linear,threshold=0,surrogate={tmp_path / 'surrogate'},window=16",
        "--tasks", "kvzap_ruler_offline_niah_single", "--metadata", json.dumps({"data_dir": str(tmp_path / "data")}),
        "--log_samples", "--device", "cpu",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run([sys.executable, "-m", "kvzap.harness", *common, "--output_path", str(one)], env=env, check=True)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--cpu"]
    subprocess.run([*launch, "-m", "kvzap.harness", *common, "--output_path", str(two)], env=env, check=True)

    def samples(root: Path) -> list:
        (file,) = root.rglob("samples_*.jsonl")
        rows = [json.loads(line) for line in file.read_text().splitlines()]
        return sorted((r["doc_id"], r["resps"], r["score"]) for r in rows)

    assert samples(one) == samples(two)
    assert not math.isnan(samples(one)[0][2])
