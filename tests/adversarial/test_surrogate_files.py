"""Surrogate checkpoints on disk: every field of config.json, broken or hostile weight files, NaN weights, paths.

A bad checkpoint is refused with a ValueError/TypeError/FileNotFoundError naming the file, before anything large
is allocated, before the model is touched, and without ever unpickling anything."""

from __future__ import annotations

import json
import pickle
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from kvzap import DMSThresholdPress, FastKVzipScorer, KVzapScorer, KVzapSurrogate
from kvzap.surrogates import FastKVzipGates
from tests.adversarial._probe import refused
from tests.conftest import random_ids, tiny_model

D, H, L, HIDDEN = 64, 2, 2, 8  # the tiny llama: hidden size, KV heads, layers
CLEAR = (ValueError, TypeError, FileNotFoundError)


def write(directory, config, tensors):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


def good(hidden=HIDDEN):
    torch.manual_seed(0)
    surrogate = KVzapSurrogate(D, H, L, hidden_dim=hidden)
    return surrogate.config, surrogate.state_dict()


JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    st.lists(st.integers(0, 9), max_size=2),
    st.sampled_from([0, -1, 1, 10**6, 10**12, 2**63, 64.0, "64", True]),
)


@settings(max_examples=80, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["input_dim", "output_dim", "n_modules", "hidden_dim", "model_type"]), value=JSON_VALUES)
def test_every_config_field_is_checked_before_anything_is_built(tmp_path_factory, field, value):
    directory = tmp_path_factory.mktemp("ckpt")
    config, tensors = good()
    write(directory, {**config, field: value}, tensors)
    start = time.perf_counter()
    try:
        loaded = KVzapSurrogate.from_pretrained(directory)
    except CLEAR as error:
        assert "config.json" in str(error) or "model.safetensors" in str(error)
    else:
        # Accepted only when the value is the one the weights were saved with.
        assert loaded.config[field] == config[field] and type(loaded.config[field]) is type(config[field])
    assert time.perf_counter() - start < 1.0  # nothing huge was built


@pytest.mark.parametrize("n_modules", [10**5, 10**12])
def test_huge_n_modules_is_refused_in_milliseconds(tmp_path, n_modules):
    """Issue 12 item 6: 1e5 took 52 s and 1.8 GB, 1e12 never returned."""
    config, tensors = good()
    write(tmp_path, {**config, "n_modules": n_modules}, tensors)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="model.safetensors.*hold 8 tensors"):
        KVzapSurrogate.from_pretrained(tmp_path)
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("field", ["input_dim", "hidden_dim", "output_dim"])
def test_huge_dims_are_refused_from_the_header(tmp_path, field):
    config, tensors = good()
    write(tmp_path, {**config, field: 10**12}, tensors)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="shape mismatches"):
        KVzapSurrogate.from_pretrained(tmp_path)
    assert time.perf_counter() - start < 0.5


def test_a_checkpoint_for_another_model_is_refused_before_its_weights_are_read(tmp_path, monkeypatch):
    config, tensors = good()
    write(tmp_path, {**config, "n_modules": 10**12}, tensors)
    model = tiny_model("llama")
    import kvzap.surrogates.checkpoint as ckpt

    monkeypatch.setattr(ckpt, "safe_open", lambda *a, **k: pytest.fail("the weights file was opened"))
    press = DMSThresholdPress(KVzapScorer("mlp", surrogate=tmp_path), threshold=0.0)
    with refused(model, ValueError, r"config\.json.*does not fit the model: n_modules is 1000000000000"):
        with press(model):
            pass


@pytest.mark.parametrize(
    "content",
    [b"", b"\x00" * 7, b"garbage that is no safetensors", b"\xff" * 8 + b"{}", "truncated"],
    ids=["empty", "short", "garbage", "huge_header_length", "truncated"],
)
def test_broken_weight_files_are_refused_naming_the_file(tmp_path, content):
    config, tensors = good()
    write(tmp_path, config, tensors)
    weights = tmp_path / "model.safetensors"
    if content == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    else:
        weights.write_bytes(content)
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        KVzapSurrogate.from_pretrained(tmp_path)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool, torch.uint8])
def test_non_float_weights_are_refused(tmp_path, dtype):
    config, tensors = good()
    write(tmp_path, config, {k: v.to(dtype) for k, v in tensors.items()})
    with pytest.raises(ValueError, match=r"model\.safetensors.*floating-point"):
        KVzapSurrogate.from_pretrained(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes_load_and_keep_their_dtype(tmp_path, dtype):
    config, tensors = good()
    write(tmp_path, config, {k: v.to(dtype) for k, v in tensors.items()})
    assert KVzapSurrogate.from_pretrained(tmp_path).layers[0][0].weight.dtype == dtype


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_in_a_file_are_refused(tmp_path, bad):
    config, tensors = good()
    tensors["layers.1.2.bias"][0] = bad
    write(tmp_path, config, tensors)
    with pytest.raises(ValueError, match=r"model\.safetensors.*NaN or infinite.*layers\.1\.2\.bias"):
        KVzapSurrogate.from_pretrained(tmp_path)


def test_non_finite_weights_in_a_module_passed_by_the_user_are_refused():
    model = tiny_model("llama")
    torch.manual_seed(0)
    surrogate = KVzapSurrogate(D, H, L, hidden_dim=HIDDEN)
    with torch.no_grad():
        surrogate.layers[0][2].weight[0, 0] = float("nan")
    press = DMSThresholdPress(KVzapScorer("mlp", surrogate=surrogate), threshold=0.0)
    with refused(model, ValueError, "NaN or infinite"), press(model):
        pass


def test_nan_scores_at_run_time_raise(monkeypatch):
    """Issue 12 item 7: NaN scores used to evict nothing silently, even at threshold +inf."""
    model = tiny_model("llama")
    torch.manual_seed(0)
    surrogate = KVzapSurrogate(D, H, L, hidden_dim=HIDDEN)
    press = DMSThresholdPress(KVzapScorer("mlp", surrogate=surrogate), threshold=float("inf"), sliding_window_size=2)
    with press(model):
        with torch.no_grad():  # weights broken after they were checked (e.g. by the caller's own code)
            surrogate.layers[1][0].bias.fill_(float("nan"))
        with pytest.raises(ValueError, match="NaN scores for layer 1"):
            model(random_ids(1, 10))


def test_fastkvzip_gates_get_the_same_checks(tmp_path):
    torch.manual_seed(0)
    gates = FastKVzipGates(D, H, 2, L)
    gates.save_pretrained(tmp_path / "ok")
    assert FastKVzipGates.from_pretrained(tmp_path / "ok").n_modules == L
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    write(tmp_path / "huge", {**config, "n_modules": 10**12}, gates.state_dict())
    with pytest.raises(ValueError, match="hold 14 tensors"):
        FastKVzipGates.from_pretrained(tmp_path / "huge")
    state = gates.state_dict()
    state["layers.0.sinks"][0, 0, 0] = float("nan")
    write(tmp_path / "nan", config, state)
    with pytest.raises(ValueError, match="NaN or infinite"):
        FastKVzipGates.from_pretrained(tmp_path / "nan")
    model = tiny_model("llama")
    press = DMSThresholdPress(FastKVzipScorer(surrogate=tmp_path / "huge"), threshold=0.0)
    with refused(model, ValueError, "does not fit the model"), press(model):
        pass


def test_pickles_are_never_unpickled(tmp_path, monkeypatch):
    """A directory holding only pickled weights (pytorch_model.bin) is refused without reading them."""
    config, tensors = good()
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    (tmp_path / "model.pkl").write_bytes(pickle.dumps(tensors))

    def forbidden(*args, **kwargs):
        pytest.fail("something was unpickled")

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        KVzapSurrogate.from_pretrained(tmp_path)
    # A pickle renamed model.safetensors is not a safetensors file: refused, never unpickled.
    (tmp_path / "model.safetensors").write_bytes((tmp_path / "model.pkl").read_bytes())
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        KVzapSurrogate.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "config_text",
    ["", "{", "[]", "null", "\udcff", '{"model_type": "kvzap"}', "[" * 100000 + "]" * 100000],
    ids=["empty", "truncated", "list", "null", "not_utf8", "missing_fields", "deeply_nested"],
)
def test_broken_configs_are_refused_naming_the_file(tmp_path, config_text):
    config, tensors = good()
    write(tmp_path, config, tensors)
    if config_text == "\udcff":
        (tmp_path / "config.json").write_bytes(b"\xff\xfe{")
    else:
        (tmp_path / "config.json").write_text(config_text)
    with pytest.raises(ValueError, match=r"config\.json"):
        KVzapSurrogate.from_pretrained(tmp_path)


@pytest.mark.parametrize("path", ["", ".", "/nonexistent/dir", "./missing", "a/b/c", "~/none", "x" * 5000])
def test_bad_paths_are_refused_clearly(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CLEAR) as info:
        KVzapSurrogate.from_pretrained(path, local_files_only=True)
    assert "surrogate" in str(info.value).lower() or "checkpoint" in str(info.value).lower()


def test_a_file_instead_of_a_directory(tmp_path):
    config, tensors = good()
    write(tmp_path, config, tensors)
    with pytest.raises(FileNotFoundError, match="is a file"):
        KVzapSurrogate.from_pretrained(tmp_path / "model.safetensors")
