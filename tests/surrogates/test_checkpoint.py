"""Save/load of surrogates in the published nvidia/KVzap-* format, Hub resolution and bundled lookup.

The Hub is never contacted: hf_hub_download is either monkeypatched or called with local_files_only=True
on an empty cache.
"""

import json

import pytest
import torch
from huggingface_hub import errors as hf_errors
from safetensors.torch import load_file, save_file

from kvzap.surrogates import KVzapSurrogate, SurrogateNotFoundError, bundled, bundled_surrogate_dir, list_bundled
from kvzap.surrogates import checkpoint as ckpt

D, H, L, HIDDEN = 32, 2, 3, 8


def make_surrogate(hidden_dim: int | None, seed: int = 0) -> KVzapSurrogate:
    torch.manual_seed(seed)
    return KVzapSurrogate(D, H, L, hidden_dim)


def published_config(hidden_dim: int | None) -> dict:
    """config.json as transformers writes it for the published KVzapModel, extras included."""
    return {
        "architectures": ["KVzapModel"],
        "hidden_dim": hidden_dim,
        "input_dim": D,
        "model_type": "kvzap",
        "n_modules": L,
        "output_dim": H,
        "torch_dtype": "float32",
        "transformers_version": "4.57.1",
    }


def write_by_hand(directory, config: dict, tensors: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, directory / "model.safetensors")


def hub_error(cls: type[Exception], message: str = "boom") -> Exception:
    """An instance of a huggingface_hub error without the HTTP response some of them require."""
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    return error


# --- round trip -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden_dim", [None, HIDDEN])
def test_save_load_round_trip(tmp_path, hidden_dim):
    surrogate = make_surrogate(hidden_dim)
    assert surrogate.save_pretrained(tmp_path / "s") == tmp_path / "s"

    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config == {
        "model_type": "kvzap",
        "input_dim": D,
        "output_dim": H,
        "n_modules": L,
        "hidden_dim": hidden_dim,
        "architectures": ["KVzapModel"],
    }
    assert set(load_file(tmp_path / "s" / "model.safetensors")) == set(surrogate.state_dict())

    loaded = KVzapSurrogate.from_pretrained(tmp_path / "s")
    assert not loaded.training
    assert loaded.config == surrogate.config
    for name, tensor in surrogate.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    x = torch.randn(4, L, D)
    torch.testing.assert_close(loaded.forward_all(x), surrogate.forward_all(x), rtol=0, atol=0)


def test_load_keeps_file_dtype_unless_dtype_given(tmp_path):
    make_surrogate(HIDDEN).to(torch.bfloat16).save_pretrained(tmp_path)
    assert all(p.dtype == torch.bfloat16 for p in KVzapSurrogate.from_pretrained(tmp_path).parameters())
    loaded = KVzapSurrogate.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in loaded.parameters())


# --- the published format written by hand -----------------------------------------------------------------------


def test_published_mlp_checkpoint_loads_unchanged(tmp_path):
    torch.manual_seed(1)
    tensors = {}
    for i in range(L):
        tensors |= {
            f"layers.{i}.0.weight": torch.randn(HIDDEN, D),
            f"layers.{i}.0.bias": torch.randn(HIDDEN),
            f"layers.{i}.2.weight": torch.randn(H, HIDDEN),
            f"layers.{i}.2.bias": torch.randn(H),
        }
    write_by_hand(tmp_path, published_config(HIDDEN), tensors)

    surrogate = KVzapSurrogate.from_pretrained(tmp_path)
    assert surrogate.model_type == "mlp"
    x = torch.randn(5, L, D)
    expected = torch.stack(
        [
            torch.nn.functional.gelu(x[:, i] @ tensors[f"layers.{i}.0.weight"].T + tensors[f"layers.{i}.0.bias"])
            @ tensors[f"layers.{i}.2.weight"].T
            + tensors[f"layers.{i}.2.bias"]
            for i in range(L)
        ],
        dim=1,
    )
    torch.testing.assert_close(surrogate.forward_all(x), expected)


def test_published_linear_checkpoint_loads_unchanged(tmp_path):
    torch.manual_seed(2)
    tensors = {}
    for i in range(L):
        tensors |= {f"layers.{i}.weight": torch.randn(H, D), f"layers.{i}.bias": torch.randn(H)}
    write_by_hand(tmp_path, published_config(None), tensors)

    surrogate = KVzapSurrogate.from_pretrained(tmp_path)
    assert surrogate.model_type == "linear"
    x = torch.randn(2, 3, D)
    for i in range(L):
        torch.testing.assert_close(surrogate(x, i), x @ tensors[f"layers.{i}.weight"].T + tensors[f"layers.{i}.bias"])


# --- bad checkpoints --------------------------------------------------------------------------------------------


def test_wrong_model_type_names_the_file(tmp_path):
    make_surrogate(None).save_pretrained(tmp_path)
    write_by_hand(tmp_path, {**published_config(None), "model_type": "llama"}, make_surrogate(None).state_dict())
    with pytest.raises(ValueError, match=r"config\.json.*model_type 'llama', expected 'kvzap'"):
        KVzapSurrogate.from_pretrained(tmp_path)


def test_missing_field_names_the_file_and_field(tmp_path):
    config = published_config(None)
    del config["n_modules"]
    write_by_hand(tmp_path, config, make_surrogate(None).state_dict())
    with pytest.raises(ValueError, match=r"config\.json.*lacks the field\(s\) n_modules"):
        KVzapSurrogate.from_pretrained(tmp_path)


def test_invalid_field_value_names_the_file(tmp_path):
    write_by_hand(tmp_path, {**published_config(None), "output_dim": 0}, make_surrogate(None).state_dict())
    with pytest.raises(ValueError, match=r"config\.json.*is invalid: output_dim must be a positive integer"):
        KVzapSurrogate.from_pretrained(tmp_path)


def test_invalid_json_names_the_file(tmp_path):
    make_surrogate(None).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json' is not valid JSON"):
        KVzapSurrogate.from_pretrained(tmp_path)


def test_shape_mismatch_is_listed(tmp_path):
    tensors = dict(make_surrogate(None).state_dict())
    tensors["layers.1.weight"] = torch.zeros(H + 1, D)
    write_by_hand(tmp_path, published_config(None), tensors)
    with pytest.raises(ValueError, match=r"shape mismatches: layers\.1\.weight: \(3, 32\) in the file, \(2, 32\)"):
        KVzapSurrogate.from_pretrained(tmp_path)


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    # MLP weights under a linear config: every key is wrong both ways.
    write_by_hand(tmp_path, published_config(None), make_surrogate(HIDDEN).state_dict())
    with pytest.raises(ValueError) as info:
        KVzapSurrogate.from_pretrained(tmp_path)
    message = str(info.value)
    assert "model.safetensors" in message
    assert "missing keys: layers.0.weight, layers.0.bias" in message
    assert "unexpected keys: layers.0.0." in message and "layers.0.2.weight" in message


def test_extra_key_is_unexpected(tmp_path):
    tensors = {**make_surrogate(None).state_dict(), "layers.3.weight": torch.zeros(H, D)}
    write_by_hand(tmp_path, published_config(None), tensors)
    with pytest.raises(ValueError, match=r"unexpected keys: layers\.3\.weight"):
        KVzapSurrogate.from_pretrained(tmp_path)


def test_local_directory_without_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "hf_hub_download", _fail_if_called)
    (tmp_path / "config.json").write_text(json.dumps(published_config(None)))
    with pytest.raises(SurrogateNotFoundError, match=r"has no model\.safetensors.*kvzap train"):
        KVzapSurrogate.from_pretrained(tmp_path)


def test_missing_local_path_does_not_try_the_hub(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "hf_hub_download", _fail_if_called)
    with pytest.raises(SurrogateNotFoundError, match=r"does not exist.*local directory.*kvzap train"):
        KVzapSurrogate.from_pretrained(tmp_path / "nowhere")


# --- the Hub ------------------------------------------------------------------------------------------------------


def _fail_if_called(*args, **kwargs):
    raise AssertionError("hf_hub_download must not be called")


@pytest.mark.parametrize(
    ("error", "hint"),
    [
        (hf_errors.LocalEntryNotFoundError("not cached"), "could not be reached"),
        (hf_errors.OfflineModeIsEnabled("offline"), "could not be reached"),
        (ConnectionError("network down"), "could not be reached"),
        (hub_error(hf_errors.RepositoryNotFoundError), "does not exist on the Hub"),
        (hub_error(hf_errors.GatedRepoError), "gated"),
        (hub_error(hf_errors.RevisionNotFoundError), "revision does not exist"),
        (hf_errors.HFValidationError("bad id"), "not a valid Hub repo id"),
    ],
)
def test_hub_failures_raise_surrogate_not_found(monkeypatch, error, hint):
    def fake_download(*args, **kwargs):
        raise error

    monkeypatch.setattr(ckpt, "hf_hub_download", fake_download)
    with pytest.raises(SurrogateNotFoundError) as info:
        KVzapSurrogate.from_pretrained("nvidia/KVzap-mlp-Missing")
    message = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.__cause__ is error
    assert "'nvidia/KVzap-mlp-Missing'" in message and "config.json" in message
    assert hint in message
    assert "local directory" in message and "kvzap train" in message and "go online" in message


def test_other_errors_propagate(monkeypatch):
    def fake_download(*args, **kwargs):
        raise PermissionError("cache not writable")

    monkeypatch.setattr(ckpt, "hf_hub_download", fake_download)
    with pytest.raises(PermissionError):
        KVzapSurrogate.from_pretrained("nvidia/KVzap-mlp-Missing")


def test_real_hf_hub_download_offline_with_empty_cache(tmp_path):
    with pytest.raises(SurrogateNotFoundError, match=r"could not be reached.*LocalEntryNotFoundError"):
        KVzapSurrogate.from_pretrained("nvidia/KVzap-mlp-Qwen3-8B", cache_dir=tmp_path, local_files_only=True)


def test_hub_download_returning_local_files_loads(tmp_path, monkeypatch):
    surrogate = make_surrogate(HIDDEN)
    surrogate.save_pretrained(tmp_path / "snapshot")
    calls = []

    def fake_download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename, kwargs))
        return str(tmp_path / "snapshot" / filename)

    monkeypatch.setattr(ckpt, "hf_hub_download", fake_download)
    loaded = KVzapSurrogate.from_pretrained(
        "nvidia/KVzap-mlp-Tiny", revision="v1", cache_dir=tmp_path / "cache", token="t0ken"
    )
    assert [c[:2] for c in calls] == [
        ("nvidia/KVzap-mlp-Tiny", "config.json"),
        ("nvidia/KVzap-mlp-Tiny", "model.safetensors"),
    ]
    assert calls[0][2] == {
        "revision": "v1",
        "cache_dir": tmp_path / "cache",
        "local_files_only": False,
        "token": "t0ken",
    }
    x = torch.randn(3, D)
    torch.testing.assert_close(loaded(x, 2), surrogate(x, 2), rtol=0, atol=0)


# --- bundled surrogates -----------------------------------------------------------------------------------------


@pytest.fixture
def bundled_dir(tmp_path, monkeypatch):
    root = tmp_path / "bundled"
    make_surrogate(HIDDEN).save_pretrained(root / "SmolLM2-135M-Instruct" / "mlp")
    make_surrogate(None).save_pretrained(root / "SmolLM2-135M-Instruct" / "linear")
    (root / "Incomplete" / "mlp").mkdir(parents=True)  # no files: not listed, not found
    (root / "README.md").write_text("not a model")
    monkeypatch.setattr(bundled, "BUNDLED_DIR", root)
    return root


@pytest.mark.parametrize(
    "model_name",
    [
        "SmolLM2-135M-Instruct",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "/models/SmolLM2-135M-Instruct/",
        "smollm2-135m-instruct",
    ],
)
def test_bundled_lookup(bundled_dir, model_name):
    found = bundled_surrogate_dir(model_name, "mlp")
    assert found == bundled_dir / "SmolLM2-135M-Instruct" / "mlp"
    assert KVzapSurrogate.from_pretrained(found).model_type == "mlp"


def test_bundled_lookup_misses(bundled_dir):
    assert bundled_surrogate_dir("Qwen/Qwen3-8B", "mlp") is None
    assert bundled_surrogate_dir("SmolLM2-135M-Instruct", "fastkvzip") is None
    assert bundled_surrogate_dir("Incomplete", "mlp") is None
    with pytest.raises(ValueError, match="model_name must name a model"):
        bundled_surrogate_dir("", "mlp")
    with pytest.raises(ValueError, match="model_type must be"):
        bundled_surrogate_dir("SmolLM2-135M-Instruct", "")


def test_list_bundled(bundled_dir, tmp_path, monkeypatch):
    assert list_bundled() == {"SmolLM2-135M-Instruct": ["linear", "mlp"]}
    monkeypatch.setattr(bundled, "BUNDLED_DIR", tmp_path / "absent")
    assert list_bundled() == {}
    assert bundled_surrogate_dir("SmolLM2-135M-Instruct", "mlp") is None


def test_shipped_bundled_dir_exists():
    assert bundled.BUNDLED_DIR.is_dir()
    assert (bundled.BUNDLED_DIR / "README.md").is_file()
