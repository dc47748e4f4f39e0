"""Averaging surrogates into one checkpoint (`train.ensemble`, `python -m train ensemble`)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from kvzap.surrogates import KVzapSurrogate
from train.__main__ import main
from train.ensemble import average_surrogates, ensemble


def _random(hidden_dim: int | None, seed: int, n_modules: int = 3, prunable_layers=None) -> KVzapSurrogate:
    torch.manual_seed(seed)
    surrogate = KVzapSurrogate(16, 2, n_modules, hidden_dim=hidden_dim, prunable_layers=prunable_layers)
    for parameter in surrogate.parameters():  # default init leaves small outputs; make the members differ clearly
        torch.nn.init.normal_(parameter, std=0.5)
    return surrogate.eval()


def _predict(surrogate: KVzapSurrogate, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([surrogate.layers[i](x) for i in range(surrogate.n_modules)])


@pytest.mark.parametrize("hidden_dims", [(8, 8), (8, 4, 6), (None, None, None)])
def test_average_is_the_mean_of_the_members_predictions(hidden_dims):
    members = [_random(h, seed) for seed, h in enumerate(hidden_dims)]
    x = torch.randn(64, 16)
    merged = average_surrogates(members)
    expected = torch.stack([_predict(m, x) for m in members]).mean(0)
    torch.testing.assert_close(_predict(merged, x), expected, rtol=1e-5, atol=1e-5)
    assert merged.model_type == members[0].model_type
    assert merged.hidden_dim == (None if hidden_dims[0] is None else sum(hidden_dims))
    # not just one member: the mean differs from each of them
    assert all(not torch.allclose(_predict(m, x), expected, atol=1e-3) for m in members)


def test_weights_are_normalised():
    a, b = _random(8, 0), _random(8, 1)
    x = torch.randn(32, 16)
    merged = average_surrogates([a, b], weights=[3, 1])
    torch.testing.assert_close(_predict(merged, x), 0.75 * _predict(a, x) + 0.25 * _predict(b, x), rtol=1e-5, atol=1e-5)


def test_prunable_layers_are_kept():
    members = [_random(4, seed, n_modules=4, prunable_layers=[1, 3]) for seed in range(2)]
    assert average_surrogates(members).prunable_layers == (1, 3)


@pytest.mark.parametrize(
    "members, weights, message",
    [
        ([_random(8, 0)], None, "at least two"),
        ([_random(8, 0), _random(None, 1)], None, "model_type"),
        ([_random(8, 0), _random(8, 1, n_modules=4)], None, "n_modules"),
        ([_random(4, 0, n_modules=4, prunable_layers=[1]), _random(4, 1, n_modules=4)], None, "prunable_layers"),
        ([_random(8, 0), _random(8, 1)], [1.0], "one per surrogate"),
        ([_random(8, 0), _random(8, 1)], [1.0, 0.0], "positive"),
    ],
)
def test_bad_input_is_refused(members, weights, message):
    with pytest.raises(ValueError, match=message):
        average_surrogates(members, weights)


def test_saved_ensemble_loads_and_records_its_members(tmp_path):
    dirs = []
    for seed in range(2):
        dirs.append(_random(8, seed).save_pretrained(tmp_path / f"m{seed}"))
    record = ensemble(dirs, tmp_path / "avg")
    loaded = KVzapSurrogate.from_pretrained(tmp_path / "avg")
    x = torch.randn(16, 16)
    members = [KVzapSurrogate.from_pretrained(d) for d in dirs]
    expected = torch.stack([_predict(m, x) for m in members]).mean(0)
    torch.testing.assert_close(_predict(loaded, x), expected, rtol=1e-5, atol=1e-5)
    assert json.loads((tmp_path / "avg" / "ensemble.json").read_text()) == record
    assert [m["sha256"] for m in record["members"]] == [
        hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in dirs
    ]
    assert [m["weight"] for m in record["members"]] == [0.5, 0.5]
    assert sorted(p.name for p in (tmp_path / "avg").iterdir()) == ["config.json", "ensemble.json", "model.safetensors"]


def test_missing_member_is_refused_before_writing(tmp_path):
    first = _random(8, 0).save_pretrained(tmp_path / "m0")
    with pytest.raises(ValueError, match="No model.safetensors in .*nowhere"):
        ensemble([first, tmp_path / "nowhere"], tmp_path / "avg")
    assert not (tmp_path / "avg").exists()


def test_cli(tmp_path, capsys):
    dirs = [str(_random(None, seed).save_pretrained(tmp_path / f"m{seed}")) for seed in range(2)]
    assert main(["ensemble", *dirs, "--out", str(tmp_path / "avg"), "--weights", "1", "3"]) == 0
    assert "linear ensemble of 2 surrogates" in capsys.readouterr().out
    record = json.loads((tmp_path / "avg" / "ensemble.json").read_text())
    assert [m["weight"] for m in record["members"]] == [0.25, 0.75]
    assert KVzapSurrogate.from_pretrained(tmp_path / "avg").hidden_dim is None
