"""Unit tests for the KVzap surrogate module: construction, forward, compatibility checks."""

import pytest
import torch

from kvzap.surrogates import KVzapSurrogate

D, H, L, HIDDEN = 32, 2, 3, 8


def make_surrogate(hidden_dim: int | None, seed: int = 0) -> KVzapSurrogate:
    torch.manual_seed(seed)
    return KVzapSurrogate(D, H, L, hidden_dim)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_dim": 0, "output_dim": H, "n_modules": L}, "input_dim must be a positive integer"),
        ({"input_dim": D, "output_dim": -1, "n_modules": L}, "output_dim must be a positive integer"),
        ({"input_dim": D, "output_dim": H, "n_modules": 2.0}, "n_modules must be a positive integer"),
        ({"input_dim": D, "output_dim": H, "n_modules": True}, "n_modules must be a positive integer"),
        ({"input_dim": D, "output_dim": H, "n_modules": L, "hidden_dim": 0}, "hidden_dim must be a positive integer"),
        ({"input_dim": D, "output_dim": H, "n_modules": L, "hidden_dim": "8"}, "hidden_dim must be a positive"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVzapSurrogate(**kwargs)


def test_linear_keys_config_and_type():
    surrogate = make_surrogate(None)
    assert surrogate.model_type == "linear"
    assert surrogate.config == {
        "model_type": "kvzap",
        "input_dim": D,
        "output_dim": H,
        "n_modules": L,
        "hidden_dim": None,
    }
    expected = {f"layers.{i}.{p}": shape for i in range(L) for p, shape in [("weight", (H, D)), ("bias", (H,))]}
    assert {k: tuple(v.shape) for k, v in surrogate.state_dict().items()} == expected


def test_mlp_keys_config_and_type():
    surrogate = make_surrogate(HIDDEN)
    assert surrogate.model_type == "mlp"
    assert surrogate.config["hidden_dim"] == HIDDEN
    expected = {}
    for i in range(L):
        expected |= {
            f"layers.{i}.0.weight": (HIDDEN, D),
            f"layers.{i}.0.bias": (HIDDEN,),
            f"layers.{i}.2.weight": (H, HIDDEN),
            f"layers.{i}.2.bias": (H,),
        }
    assert {k: tuple(v.shape) for k, v in surrogate.state_dict().items()} == expected
    assert "model_type='mlp'" in repr(surrogate)


def test_seeded_builds_are_identical():
    a, b = make_surrogate(HIDDEN, seed=3), make_surrogate(HIDDEN, seed=3)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb
        torch.testing.assert_close(va, vb, rtol=0, atol=0)


@pytest.mark.parametrize("hidden_dim", [None, HIDDEN])
@pytest.mark.parametrize("shape", [(D,), (5, D), (2, 7, D)])
def test_forward_shapes(hidden_dim, shape):
    surrogate = make_surrogate(hidden_dim)
    out = surrogate(torch.randn(shape), 1)
    assert out.shape == (*shape[:-1], H)


def test_forward_computes_the_per_layer_formula():
    surrogate = make_surrogate(HIDDEN)
    x = torch.randn(4, D)
    sd = surrogate.state_dict()
    for i in range(L):
        hidden = torch.nn.functional.gelu(x @ sd[f"layers.{i}.0.weight"].T + sd[f"layers.{i}.0.bias"])
        expected = hidden @ sd[f"layers.{i}.2.weight"].T + sd[f"layers.{i}.2.bias"]
        torch.testing.assert_close(surrogate(x, i), expected)


def test_forward_casts_input_to_surrogate_dtype():
    surrogate = make_surrogate(None)
    x = torch.randn(3, D)
    out = surrogate(x.to(torch.bfloat16), 0)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, surrogate(x.to(torch.bfloat16).float(), 0))


@pytest.mark.parametrize("layer_idx", [L, -1, 100])
def test_forward_rejects_bad_layer_index(layer_idx):
    with pytest.raises(IndexError, match=rf"layer_idx must be in \[0, {L}\).*got {layer_idx}"):
        make_surrogate(None)(torch.randn(2, D), layer_idx)


def test_forward_rejects_non_integer_layer_index():
    with pytest.raises(TypeError, match="layer_idx must be an integer"):
        make_surrogate(None)(torch.randn(2, D), 1.0)


@pytest.mark.parametrize("shape", [(2, D + 1), ()])
def test_forward_rejects_wrong_hidden_size(shape):
    with pytest.raises(ValueError, match=f"must end with the hidden size {D}"):
        make_surrogate(HIDDEN)(torch.randn(shape), 0)


@pytest.mark.parametrize("hidden_dim", [None, HIDDEN])
def test_forward_all_matches_per_layer_forward(hidden_dim):
    surrogate = make_surrogate(hidden_dim)
    x = torch.randn(6, L, D)  # (N, L, D)
    out = surrogate.forward_all(x)
    assert out.shape == (6, L, H)
    for i in range(L):
        torch.testing.assert_close(out[:, i], surrogate(x[:, i], i))


@pytest.mark.parametrize("shape", [(6, L + 1, D), (6, L, D - 1), (L, D)])
def test_forward_all_rejects_bad_shape(shape):
    with pytest.raises(ValueError, match=rf"must have shape \(N, {L}, {D}\)"):
        make_surrogate(None).forward_all(torch.randn(shape))


def test_check_compatible_accepts_matching_model():
    make_surrogate(HIDDEN).check_compatible(num_layers=L, hidden_size=D, num_kv_heads=H)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": L + 1, "hidden_size": D, "num_kv_heads": H},
        {"num_layers": L, "hidden_size": 64, "num_kv_heads": H},
        {"num_layers": L, "hidden_size": D, "num_kv_heads": 4},
    ],
)
def test_check_compatible_names_both_shapes_and_the_fix(kwargs):
    with pytest.raises(ValueError) as info:
        make_surrogate(None).check_compatible(**kwargs, model_name="TinyLlama")
    message = str(info.value)
    assert f"built for {L} layers, hidden size {D} and {H} KV heads" in message
    assert (
        f"TinyLlama has {kwargs['num_layers']} layers, hidden size {kwargs['hidden_size']} "
        f"and {kwargs['num_kv_heads']} KV heads"
    ) in message
    assert "kvzap train" in message
