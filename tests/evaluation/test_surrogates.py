"""Which surrogate each press of a sweep reads, and the run key that records it (issues 13.6 and 14.5)."""

import json

import pytest
import torch

from evaluation.cli import main
from evaluation.presses import PRESSES
from evaluation.runner import RunSpec, load_config, run_dir
from kvzap.surrogates import KVzapSurrogate
from tests.conftest import char_tokenizer, tiny_model


def _run(press):
    knob = PRESSES[press].knob
    return RunSpec(press, knob, {"threshold": -4.0, "compression_ratio": 0.5, None: None}[knob], 400)


@pytest.mark.parametrize("press", [name for name, factory in PRESSES.items() if factory.surrogate_type])
def test_run_key_holds_the_surrogate_of_every_press_with_weights(press, tmp_path):
    # Two runs of the same press that differ only in --surrogate must not share a directory (the second would be
    # skipped as finished): this held for kvzap_* but not for fastkvzip.
    first = load_config(output_dir=str(tmp_path), presses=[press], surrogate=str(tmp_path / "a"))
    second = load_config(output_dir=str(tmp_path), presses=[press], surrogate=str(tmp_path / "b"))
    dirs = {run_dir(c, _run(press), "tiny") for c in (first, second)}
    assert len(dirs) == 2


def test_run_key_of_presses_without_weights_ignores_the_surrogate(tmp_path):
    for press in ("no_press", "random", "kvzip_plus_threshold"):
        first = load_config(output_dir=str(tmp_path), presses=[press], surrogate=str(tmp_path / "a"))
        second = load_config(output_dir=str(tmp_path), presses=[press])
        assert run_dir(first, _run(press), "tiny") == run_dir(second, _run(press), "tiny")


def test_surrogate_resolution(tmp_path):
    fit_out = tmp_path / "surrogates"  # what `kvzap train fit` writes: one sub-directory per type
    KVzapSurrogate(input_dim=64, output_dim=2, n_modules=2, hidden_dim=8).save_pretrained(fit_out / "mlp")
    KVzapSurrogate(input_dim=64, output_dim=2, n_modules=2).save_pretrained(fit_out / "linear")
    config = load_config(output_dir=str(tmp_path), surrogate=str(fit_out))
    assert config.surrogate_for("kvzap_mlp") == str(fit_out / "mlp")
    assert config.surrogate_for("kvzap_linear") == str(fit_out / "linear")
    assert config.surrogate_for("fastkvzip") == str(fit_out)  # no fastkvzip/ inside: the directory itself
    assert config.surrogate_for("no_press") is None
    # A type's own setting wins; a plain checkpoint directory is given as is.
    config = load_config(output_dir=str(tmp_path), surrogate=str(fit_out), surrogate_linear="other/linear")
    assert config.surrogate_for("kvzap_linear") == "other/linear"
    assert config.surrogate_for("kvzap_mlp") == str(fit_out / "mlp")
    config = load_config(output_dir=str(tmp_path), surrogate=str(fit_out / "mlp"))
    assert config.surrogate_for("kvzap_mlp") == str(fit_out / "mlp")
    # Unset: the bundled or published default, recorded as None (as before).
    assert load_config(output_dir=str(tmp_path)).surrogate_for("kvzap_mlp") is None


@pytest.mark.parametrize("flags", ["one directory", "one flag per type"])
def test_one_command_sweeps_mlp_and_linear_of_one_training_run(flags, tmp_path, monkeypatch, capsys):
    fit_out = tmp_path / "surrogates"
    KVzapSurrogate(input_dim=64, output_dim=2, n_modules=2, hidden_dim=8).save_pretrained(fit_out / "mlp")
    KVzapSurrogate(input_dim=64, output_dim=2, n_modules=2).save_pretrained(fit_out / "linear")
    monkeypatch.setattr("evaluation.runner._load_model", lambda config: (tiny_model("llama"), char_tokenizer()))
    argv = ["--press", "kvzap_mlp", "kvzap_linear", "--threshold", "100", "--sliding-window-size", "8"]
    argv += ["--tasks", "niah_single", "--lengths", "400", "--n-samples", "1", "--max-new-tokens", "2"]
    if flags == "one directory":
        argv += ["--surrogate", str(fit_out)]
    else:
        argv += ["--surrogate-mlp", str(fit_out / "mlp"), "--surrogate-linear", str(fit_out / "linear")]
    # A KVzap-linear checkpoint given to kvzap_mlp (or the reverse) is refused when loaded, so both runs
    # finishing shows each press read its own type.
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 0
    recorded = {}
    for path in (tmp_path / "out").rglob("config.json"):
        record = json.loads(path.read_text())
        recorded[record["press"]] = record["surrogate"]
    assert recorded == {"kvzap_mlp": str(fit_out / "mlp"), "kvzap_linear": str(fit_out / "linear")}


def test_a_surrogate_of_the_wrong_type_is_refused(tmp_path, monkeypatch, capsys):
    fit_out = tmp_path / "surrogates"
    KVzapSurrogate(input_dim=64, output_dim=2, n_modules=2).save_pretrained(fit_out / "linear")
    monkeypatch.setattr("evaluation.runner._load_model", lambda config: (tiny_model("llama"), char_tokenizer()))
    argv = ["--press", "kvzap_mlp", "--threshold", "100", "--tasks", "niah_single", "--lengths", "400"]
    argv += ["--n-samples", "1", "--max-new-tokens", "2", "--surrogate-mlp", str(fit_out / "linear")]
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 1
    assert "is a KVzap-linear model but model_type='mlp'" in capsys.readouterr().err


def test_short_model_names_share_the_default_models_results(tmp_path):
    from evaluation.runner import _model_name

    default = load_config(output_dir=str(tmp_path))
    short = load_config(output_dir=str(tmp_path), model="smollm2-135m")
    assert _model_name(default, None) == _model_name(short, None) == "SmolLM2-135M-Instruct"
    assert _model_name(load_config(output_dir=str(tmp_path), model="/m/foo.Q4.gguf"), None) == "foo.Q4"


def test_run_key_holds_the_weights_not_only_their_place(tmp_path, monkeypatch):
    # A surrogate retrained into the same directory, or a new bundled surrogate, must start new runs: a run key of
    # the path alone (or of None for the bundled default) reused the old weights' results as finished.
    import kvzap.surrogates.bundled as bundled
    from evaluation.runner import surrogate_weights

    def save(path, seed):
        torch.manual_seed(seed)
        KVzapSurrogate(input_dim=64, output_dim=2, n_modules=2, hidden_dim=8).save_pretrained(path)

    surrogate = tmp_path / "fit" / "mlp"
    save(surrogate, 0)
    config = load_config(output_dir=str(tmp_path / "out"), surrogate=str(surrogate))
    before = run_dir(config, _run("kvzap_mlp"), "tiny")
    assert run_dir(config, _run("kvzap_mlp"), "tiny") == before  # stable while the weights are
    fingerprint = surrogate_weights(config, "kvzap_mlp", "tiny")
    assert len(fingerprint) == 16
    save(surrogate, 1)
    assert surrogate_weights(config, "kvzap_mlp", "tiny") != fingerprint
    assert run_dir(config, _run("kvzap_mlp"), "tiny") != before

    # The bundled default (no --surrogate): the weights bundled for the model, looked up by its name.
    monkeypatch.setattr(bundled, "BUNDLED_DIR", tmp_path / "bundled")
    save(tmp_path / "bundled" / "tiny" / "mlp", 0)
    default = load_config(output_dir=str(tmp_path / "out"))
    first, key = surrogate_weights(default, "kvzap_mlp", "tiny"), run_dir(default, _run("kvzap_mlp"), "tiny")
    assert first is not None
    save(tmp_path / "bundled" / "tiny" / "mlp", 2)
    assert surrogate_weights(default, "kvzap_mlp", "tiny") != first
    assert run_dir(default, _run("kvzap_mlp"), "tiny") != key
    # No bundled surrogate and no directory (a Hub id names its weights), and presses without weights: None.
    assert surrogate_weights(default, "kvzap_mlp", "other-model") is None
    hub = load_config(output_dir=str(tmp_path / "out"), surrogate="nvidia/KVzap-mlp-Qwen3-8B")
    assert surrogate_weights(hub, "kvzap_mlp", "tiny") is None
    assert surrogate_weights(default, "no_press", "tiny") is None
