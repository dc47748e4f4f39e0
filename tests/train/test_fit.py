"""Surrogate fitting: ridge recovers a linear map, the MLP learns, checkpoints reload, R^2 is the paper's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvzap.surrogates import KVzapSurrogate
from tests.train import make_tiny_llama
from train.collect import collect, load_collection
from train.fit import (
    MLPConfig,
    evaluate_surrogate,
    fit_and_save,
    fit_layer_linear,
    fit_layer_mlp,
    fit_surrogate,
    pearson_r2,
    plot_r2,
)


def linear_data(n=2000, d=16, h=3, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)).astype(np.float32)
    W = rng.normal(size=(h, d)).astype(np.float32)
    b = rng.normal(size=h).astype(np.float32)
    y = X @ W.T + b + noise * rng.normal(size=(n, h)).astype(np.float32)
    return X, y, W, b


def test_ridge_recovers_linear_map():
    X, y, W, b = linear_data()
    linear = fit_layer_linear(X, y)
    # Ridge(alpha=1) on 2000 well-conditioned rows shrinks the coefficients by well under 1e-2.
    np.testing.assert_allclose(linear.weight.detach().numpy(), W, atol=1e-2)
    np.testing.assert_allclose(linear.bias.detach().numpy(), b, atol=1e-2)


def test_mlp_lowers_loss():
    X, y, _, _ = linear_data(n=1024, d=16, h=2, noise=0.1)
    y = np.tanh(0.25 * y).astype(np.float32)  # a smooth non-linear target
    config = MLPConfig(hidden_dim=8, batch_size=64, max_epochs=8, valid_fraction=0.1, seed=0)
    module, history = fit_layer_mlp(X, y, config)
    assert len(history["train_loss"]) == 8 and len(history["valid_loss"]) == 8
    assert history["train_loss"][-1] < 0.5 * history["train_loss"][0]
    assert [type(m).__name__ for m in module] == ["Linear", "GELU", "Linear"]


def test_mlp_without_validation_split():
    X, y, _, _ = linear_data(n=256, d=8, h=2)
    _, history = fit_layer_mlp(X, y, MLPConfig(hidden_dim=4, batch_size=64, max_epochs=2, valid_fraction=0))
    assert history["valid_loss"] == [] and len(history["train_loss"]) == 2
    with pytest.raises(ValueError, match="valid_fraction"):
        fit_layer_mlp(X, y, MLPConfig(valid_fraction=1.5))


def test_pearson_r2():
    x = torch.randn(500, 2, 3)
    assert torch.allclose(pearson_r2(2 * x + 1, x), torch.ones(2, 3, dtype=torch.float64))
    np.testing.assert_allclose(
        pearson_r2(x[:, 0, 0:1], x[:, 1, 0:1]).item(), np.corrcoef(x[:, 0, 0], x[:, 1, 0])[0, 1] ** 2
    )
    with pytest.raises(ValueError):
        pearson_r2(x, x[:, 0])


@pytest.mark.parametrize("model_type", ["linear", "mlp"])
def test_fit_surrogate_save_and_reload(tmp_path, model_type):
    n, layers, d, h = 600, 2, 16, 3
    rng = np.random.default_rng(1)
    X = torch.from_numpy(rng.normal(size=(n, layers, d)).astype(np.float32))
    W = torch.from_numpy(rng.normal(size=(layers, d, h)).astype(np.float32))
    y = torch.einsum("nld,ldh->nlh", X, W)  # (n, layers, h)
    config = MLPConfig(hidden_dim=16, batch_size=64, max_epochs=20, valid_fraction=0.05)
    surrogate, _ = fit_surrogate(X.half(), y, model_type, mlp_config=config)
    assert surrogate.model_type == model_type and surrogate.n_modules == layers
    surrogate.save_pretrained(tmp_path / model_type)
    loaded = KVzapSurrogate.from_pretrained(tmp_path / model_type)
    torch.testing.assert_close(loaded.forward_all(X), surrogate.forward_all(X))
    result = evaluate_surrogate(loaded, X, y)
    assert np.asarray(result["per_head"]).shape == (layers, h)
    assert result["mean_r2"] > (0.99 if model_type == "linear" else 0.8)
    with pytest.raises(ValueError, match="model_type"):
        fit_surrogate(X, y, "tree")


def test_plot_r2(tmp_path):
    result = {"mean_r2": 0.5, "per_head": [[0.4, 0.6], [0.5, 0.5]], "per_layer": [0.5, 0.5]}
    path = plot_r2({"linear": result}, tmp_path / "r2.png")
    assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"


def test_fit_and_save_end_to_end(tmp_path, tiny_tokenizer):
    model = make_tiny_llama()
    texts = ["one two three four five", "six seven eight nine", "ten eleven twelve", "thirteen fourteen"]
    prompts = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    collect(model, tiny_tokenizer, prompts[:3], tmp_path / "train", n_tokens=8, shard_size=2)
    collect(model, tiny_tokenizer, prompts[3:], tmp_path / "test", n_tokens=8, shard_size=2)
    collect(model, tiny_tokenizer, prompts[:2], tmp_path / "train2", n_tokens=8, shard_size=2, seed=5)
    config = MLPConfig(hidden_dim=8, batch_size=16, max_epochs=2)
    report = fit_and_save(
        [tmp_path / "train", tmp_path / "train2"], tmp_path / "out", test_dir=tmp_path / "test", mlp_config=config
    )
    assert set(report["surrogates"]) == {"linear", "mlp"}
    assert report["n_train_pairs"] == 8 * 5 and report["n_train_prompts"] == 5
    saved = json.loads((tmp_path / "out" / "r2.json").read_text())
    assert len(saved["surrogates"]["mlp"]["per_head"]) == 2 and (tmp_path / "out" / "r2.png").exists()
    for model_type in ("linear", "mlp"):
        loaded = KVzapSurrogate.from_pretrained(tmp_path / "out" / model_type)
        assert (loaded.n_modules, loaded.input_dim, loaded.output_dim) == (2, 64, 2)


def test_fitting_layers_together_is_fitting_each_alone():
    # One skorch fit of every layer (batched matrix products) against a loop of single-layer fits: the same
    # initialisation, batches, per-layer gradient clipping and AdamW steps, so the same weights up to the order of
    # floating-point sums; also on a subset of the rows, and with the top-weighted loss.
    from train.fit import fit_layers_mlp

    rng = np.random.default_rng(2)
    n, layers, d, h = 700, 3, 12, 2
    X = torch.from_numpy(rng.normal(size=(n, layers, d)).astype(np.float32))
    y = torch.tanh(X[..., :h] * torch.tensor([1.0, 2.0, 4.0]).view(1, layers, 1)) - 5.0  # layers of unlike scale
    rows = torch.arange(0, n, 2)
    for config, subset in (
        (MLPConfig(hidden_dim=6, batch_size=64, max_epochs=3, valid_fraction=0.1, grad_clip=0.05), None),
        (MLPConfig(hidden_dim=6, batch_size=32, max_epochs=2, valid_fraction=0, top_weight=2.0), rows),
    ):
        together, history = fit_layers_mlp(X.half(), y, config, rows=subset)
        assert len(together) == layers and len(history["final_train_loss"]) == layers
        picked = slice(None) if subset is None else subset
        for layer in range(layers):
            X_l, y_l = X.half()[picked, layer].float().numpy(), y[picked, layer].numpy()
            alone, alone_history = fit_layer_mlp(X_l, y_l, config)
            for a, b in zip(together[layer].state_dict().values(), alone.state_dict().values(), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
            with torch.no_grad():
                mse = float(((alone(torch.from_numpy(X_l)) - torch.from_numpy(y_l)) ** 2).mean())
            if config.valid_fraction == 0:  # every row trains: the final training MSE is over all of them
                assert history["final_train_loss"][layer] == pytest.approx(mse, rel=1e-4)
                assert history["final_valid_loss"][layer] is None and alone_history["valid_loss"] == []
    with pytest.raises(ValueError, match="matching N and L"):
        fit_layers_mlp(X, y[:, :2])


def test_fitting_a_few_layers_at_a_time_is_one_fit(tmp_path, tiny_tokenizer, monkeypatch):
    # layers_at_once reads and fits groups of layers, for collections larger than memory: the same surrogates,
    # histories and R^2 as one fit of all layers, with never more than the group's layers read at once.
    import train.collect

    model = make_tiny_llama(num_hidden_layers=5)
    texts = ["one two three four five", "six seven eight nine", "ten eleven twelve", "thirteen fourteen"]
    prompts = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    collect(model, tiny_tokenizer, prompts[:3], tmp_path / "train", n_tokens=8, shard_size=2)
    collect(model, tiny_tokenizer, prompts[3:], tmp_path / "test", n_tokens=8, shard_size=2)
    config = MLPConfig(hidden_dim=8, batch_size=16, max_epochs=3, valid_fraction=0.2)
    whole = fit_and_save(tmp_path / "train", tmp_path / "whole", test_dir=tmp_path / "test", mlp_config=config)
    # The default (one group of every layer) is fit_surrogate on the loaded collection.
    X, y, _ = load_collection(tmp_path / "train")
    for model_type in ("linear", "mlp"):
        reference = fit_surrogate(X, y, model_type, mlp_config=config)[0].state_dict()
        saved = KVzapSurrogate.from_pretrained(tmp_path / "whole" / model_type).state_dict()
        for name in reference:
            torch.testing.assert_close(saved[name], reference[name], rtol=1e-4, atol=1e-5)

    read = []
    original = train.collect.load_collections

    def spy(out_dirs, target="y", layers=None):
        X, y, manifests = original(out_dirs, target, layers)
        read.append((layers, X.shape[1]))
        return X, y, manifests

    monkeypatch.setattr(train.collect, "load_collections", spy)
    grouped = fit_and_save(
        tmp_path / "train", tmp_path / "grouped", test_dir=tmp_path / "test", mlp_config=config, layers_at_once=2
    )
    assert [n for layers, n in read if layers is not None] == [2, 2, 1]  # the training collection, by groups
    assert grouped["n_train_pairs"] == whole["n_train_pairs"] == 8 * 3 and grouped["layers_at_once"] == 2
    for model_type in ("linear", "mlp"):
        a = KVzapSurrogate.from_pretrained(tmp_path / "whole" / model_type).state_dict()
        b = KVzapSurrogate.from_pretrained(tmp_path / "grouped" / model_type).state_dict()
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)
        w, g = whole["surrogates"][model_type], grouped["surrogates"][model_type]
        for key in ("mean_r2", "train_r2"):
            assert g[key] == pytest.approx(w[key], abs=1e-4)
        assert g["per_layer"] == pytest.approx(w["per_layer"], abs=1e-4)
    w, g = whole["surrogates"]["mlp"], grouped["surrogates"]["mlp"]
    assert g["final_train_loss"] == pytest.approx(w["final_train_loss"], rel=1e-4)
    assert g["final_valid_loss"] == pytest.approx(w["final_valid_loss"], rel=1e-4)
    with pytest.raises(ValueError, match="group_size must be a positive number of layers"):
        fit_and_save(tmp_path / "train", tmp_path / "bad", mlp_config=config, layers_at_once=0)
