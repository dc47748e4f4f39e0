"""The KVzap surrogate: one small model per decoder layer mapping hidden states to KV-pair scores.

Each per-layer module maps the hidden state entering the attention layer (after the input layernorm,
dim ``D``) to one predicted log KVzip+ score per KV head (``H``):

- KVzap-Linear: ``Linear(D -> H)``;
- KVzap-MLP: ``Linear(D -> hidden_dim) -> GELU -> Linear(hidden_dim -> H)`` (``hidden_dim = D / 8``
  in the paper).

Parameter names follow the published ``nvidia/KVzap-*`` checkpoints (``layers.{i}.weight`` for linear,
``layers.{i}.0.*`` and ``layers.{i}.2.*`` for the MLP), so those load unchanged.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from kvzap.surrogates.checkpoint import (
    check_config_fields,
    check_finite,
    check_weights_header,
    load_state_dict_strict,
    load_weights,
    read_config,
    read_weights_header,
    resolve_checkpoint_files,
    write_checkpoint,
)

__all__ = ["KVzapSurrogate"]

_MODEL_TYPE = "kvzap"
_FIELDS = ("input_dim", "output_dim", "n_modules", "hidden_dim")


def _check_positive_int(name: str, value: object) -> int:
    # bool is an int subclass; True as a dimension is always a bug.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return value


def _check_prunable_layers(layers: object, n_modules: int) -> tuple[int, ...] | None:
    """``prunable_layers`` as a tuple, or None (every layer trained); a ValueError unless it lists distinct
    layers in ``[0, n_modules)`` in increasing order."""
    if layers is None:
        return None
    if not isinstance(layers, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ValueError(f"prunable_layers must be a list of layer indices, got {layers!r}.")
    if not layers or list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= n_modules:
        raise ValueError(
            f"prunable_layers must list distinct layers in [0, {n_modules}) in increasing order, got {list(layers)}."
        )
    return tuple(layers)


class KVzapSurrogate(nn.Module):
    """Per-layer surrogates predicting log KVzip+ scores from hidden states.

    Parameters
    ----------
    input_dim : int
        ``D``, the hidden size of the language model.
    output_dim : int
        ``H``, the number of KV heads per layer.
    n_modules : int
        ``L``, the number of decoder layers (one module each).
    hidden_dim : int, optional
        Width of the MLP hidden layer; ``None`` (default) builds KVzap-Linear.
    prunable_layers : sequence of int, optional
        The layers whose module was trained, when not all were: models with sliding-window layers, which
        presses leave alone by default (:mod:`kvzap.layers`). The checkpoint keeps one module per model layer
        (``n_modules = L``, weights ``layers.{i}.*`` as published); the others are untrained (zeros), and
        :meth:`forward` refuses them. Saved as the extra ``config.json`` field ``"prunable_layers"``; a
        checkpoint without it (every published one) has every layer trained.

    Raises
    ------
    ValueError
        If a dimension is not a positive integer, or ``prunable_layers`` is not a sorted list of distinct layers.
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        n_modules: int,
        hidden_dim: int | None = None,
        prunable_layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.input_dim = _check_positive_int("input_dim", input_dim)
        self.output_dim = _check_positive_int("output_dim", output_dim)
        self.n_modules = _check_positive_int("n_modules", n_modules)
        self.hidden_dim = None if hidden_dim is None else _check_positive_int("hidden_dim", hidden_dim)
        self.prunable_layers = _check_prunable_layers(prunable_layers, self.n_modules)
        self.layers = nn.ModuleList(self._build_module() for _ in range(self.n_modules))

    @property
    def trained_layers(self) -> tuple[int, ...]:
        """The layers whose module was trained (every layer when ``prunable_layers`` is None)."""
        return tuple(range(self.n_modules)) if self.prunable_layers is None else self.prunable_layers

    @staticmethod
    def _tensor_count(n_modules: int, hidden_dim: int | None) -> int:
        return n_modules * (2 if hidden_dim is None else 4)

    @staticmethod
    def _tensor_shapes(input_dim: int, output_dim: int, n_modules: int, hidden_dim: int | None) -> dict:
        """``name -> shape`` of every weight, computed from the config without building anything."""
        shapes = {}
        for i in range(n_modules):
            if hidden_dim is None:
                shapes[f"layers.{i}.weight"], shapes[f"layers.{i}.bias"] = (output_dim, input_dim), (output_dim,)
            else:
                shapes[f"layers.{i}.0.weight"], shapes[f"layers.{i}.0.bias"] = (hidden_dim, input_dim), (hidden_dim,)
                shapes[f"layers.{i}.2.weight"], shapes[f"layers.{i}.2.bias"] = (output_dim, hidden_dim), (output_dim,)
        return shapes

    def _build_module(self) -> nn.Module:
        if self.hidden_dim is None:
            return nn.Linear(self.input_dim, self.output_dim)
        # Indices 0 and 2 in the Sequential give the published key names layers.{i}.0.* / layers.{i}.2.*.
        return nn.Sequential(
            nn.Linear(self.input_dim, self.hidden_dim),
            nn.GELU(),
            nn.Linear(self.hidden_dim, self.output_dim),
        )

    @property
    def model_type(self) -> str:
        """``"linear"`` or ``"mlp"``."""
        return "linear" if self.hidden_dim is None else "mlp"

    @property
    def config(self) -> dict:
        """The fields of ``config.json`` in the published format (``hidden_dim`` is ``None`` for linear), plus
        ``prunable_layers`` when some layers were not trained."""
        config = {
            "model_type": _MODEL_TYPE,
            "input_dim": self.input_dim,
            "output_dim": self.output_dim,
            "n_modules": self.n_modules,
            "hidden_dim": self.hidden_dim,
        }
        if self.prunable_layers is not None:
            config["prunable_layers"] = list(self.prunable_layers)
        return config

    def extra_repr(self) -> str:
        return f"model_type={self.model_type!r}, " + ", ".join(f"{k}={getattr(self, k)}" for k in _FIELDS)

    def _check_last_dim(self, hidden_states: torch.Tensor) -> None:
        if hidden_states.ndim == 0 or hidden_states.shape[-1] != self.input_dim:
            raise ValueError(
                f"hidden_states must end with the hidden size {self.input_dim} of this surrogate, "
                f"got shape {tuple(hidden_states.shape)}."
            )

    def forward(self, hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Predict the log KVzip+ score of every KV head for the tokens of one layer.

        Parameters
        ----------
        hidden_states : torch.Tensor
            ``(..., D)``, e.g. ``(batch, tokens, D)``: the input of the layer's attention, after its
            input layernorm. Cast to the surrogate's dtype if it differs (a no-op otherwise).
        layer_idx : int
            The decoder layer, ``0 <= layer_idx < n_modules``.

        Returns
        -------
        torch.Tensor
            ``(..., H)`` scores in the surrogate's dtype.

        Raises
        ------
        IndexError
            If ``layer_idx`` is out of range.
        ValueError
            If the last dimension of ``hidden_states`` is not ``D``.
        """
        try:
            layer_idx = operator.index(layer_idx)
        except TypeError as error:
            raise TypeError(f"layer_idx must be an integer, got {type(layer_idx).__name__}.") from error
        if not 0 <= layer_idx < self.n_modules:
            raise IndexError(f"layer_idx must be in [0, {self.n_modules}) for this surrogate, got {layer_idx}.")
        if self.prunable_layers is not None and layer_idx not in self.prunable_layers:
            raise ValueError(
                f"This surrogate's module for layer {layer_idx} was not trained (only layers "
                f"{list(self.prunable_layers)} were: the others use a sliding window). Leave sliding-window layers "
                "alone (the press's default prune_sliding_layers=False), or train a surrogate on a collection made "
                "with prune_sliding_layers=True."
            )
        self._check_last_dim(hidden_states)
        module = self.layers[layer_idx]
        # The functional form of the module's layers (same parameters, same ops): on a few tokens (decoding) each
        # nested module call would cost about as much as its matmul.
        if isinstance(module, nn.Linear):
            return F.linear(hidden_states.to(module.weight.dtype), module.weight, module.bias)  # (..., H)
        first, last = module[0], module[2]
        # The model may run in bf16 while the surrogate is fp32: cast the (small) input, not the weights.
        hidden = F.gelu(F.linear(hidden_states.to(first.weight.dtype), first.weight, first.bias))
        return F.linear(hidden, last.weight, last.bias)  # (..., H)

    def forward_all(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Predict the scores of every layer at once (the layout of the published ``KVzapModel``).

        Parameters
        ----------
        hidden_states : torch.Tensor
            ``(N, L, D)``: for each of ``N`` tokens, the hidden state entering each of the ``L`` trained layers
            (:attr:`trained_layers`, in order: every layer, or those of ``prunable_layers``, as a collection
            stores them).

        Returns
        -------
        torch.Tensor
            ``(N, L, H)``.

        Raises
        ------
        ValueError
            If the shape is not ``(N, L, D)`` with this surrogate's ``L`` and ``D``.
        """
        layers = self.trained_layers
        if hidden_states.ndim != 3 or hidden_states.shape[1:] != (len(layers), self.input_dim):
            raise ValueError(
                f"hidden_states must have shape (N, {len(layers)}, {self.input_dim}) "
                f"(tokens, trained layers, hidden size), got {tuple(hidden_states.shape)}."
            )
        return torch.stack(
            [self(hidden_states[:, j], i) for j, i in enumerate(layers)],  # each (N, H)
            dim=1,
        )  # (N, L, H)

    def check_compatible(
        self, *, num_layers: int, hidden_size: int, num_kv_heads: int, model_name: str = "the model"
    ) -> None:
        """Check that this surrogate fits a language model.

        Parameters
        ----------
        num_layers, hidden_size, num_kv_heads : int
            The model's number of decoder layers, hidden size and number of KV heads.
        model_name : str, optional
            Used in the error message.

        Raises
        ------
        ValueError
            Naming both shapes and the fix, if any of the three differs.
        """
        expected = {"n_modules": num_layers, "input_dim": hidden_size, "output_dim": num_kv_heads}
        if all(getattr(self, name) == value for name, value in expected.items()):
            return
        raise ValueError(
            f"This KVzap surrogate was built for {self.n_modules} layers, hidden size {self.input_dim} and "
            f"{self.output_dim} KV heads, but {model_name} has {num_layers} layers, hidden size {hidden_size} and "
            f"{num_kv_heads} KV heads. Train a surrogate for this model with `kvzap train`, "
            f"or pass the surrogate that was trained for it."
        )

    def save_pretrained(self, path: str | os.PathLike[str]) -> Path:
        """Write ``config.json`` and ``model.safetensors`` in the published format.

        Parameters
        ----------
        path : str or os.PathLike
            The directory (created if needed).

        Returns
        -------
        Path
            The directory.
        """
        # "architectures" lets transformers-based tools (and the published loader) recognise the checkpoint.
        config = {**self.config, "architectures": ["KVzapModel"]}
        return write_checkpoint(path, config, self.state_dict())

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str | os.PathLike[str],
        *,
        revision: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        local_files_only: bool | None = None,
        token: str | bool | None = None,
        dtype: torch.dtype | None = None,
        expect: dict[str, int] | None = None,
    ) -> KVzapSurrogate:
        """Load a surrogate from a local directory or a Hugging Face Hub repo (e.g. ``nvidia/KVzap-mlp-Qwen3-8B``).

        Parameters
        ----------
        path_or_repo_id : str or os.PathLike
            A local directory if it exists, otherwise a Hub repo id.
        revision, cache_dir, local_files_only, token
            Passed to :func:`huggingface_hub.hf_hub_download` for a Hub repo.
        dtype : torch.dtype, optional
            Cast the weights to this dtype; by default they keep the dtype stored in the file.
        expect : dict, optional
            Config values the surrogate must have (e.g. ``{"n_modules": 32, "input_dim": 4096, "output_dim": 8}``
            for a known model), checked before anything is read beyond ``config.json``.

        Returns
        -------
        KVzapSurrogate
            On CPU, in eval mode.

        Raises
        ------
        SurrogateNotFoundError
            If the checkpoint can be found neither locally nor on the Hub.
        ValueError
            If ``config.json`` is not a KVzap config (or not the ``expect``-ed one), if the weights file is
            unreadable or does not match the config (names, shapes, float dtypes), or holds NaN/infinite values.
        """
        config_path, weights_path = resolve_checkpoint_files(
            path_or_repo_id,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            token=token,
        )
        config = read_config(config_path, _MODEL_TYPE, required=_FIELDS)
        fields = {name: config[name] for name in _FIELDS}
        try:
            for name in ("input_dim", "output_dim", "n_modules"):
                _check_positive_int(name, fields[name])
            if fields["hidden_dim"] is not None:
                _check_positive_int("hidden_dim", fields["hidden_dim"])
            prunable = _check_prunable_layers(config.get("prunable_layers"), fields["n_modules"])
        except (TypeError, ValueError) as error:
            raise ValueError(f"The surrogate config {str(config_path)!r} is invalid: {error}") from error
        check_config_fields(fields, config_path, expect)
        # The header is checked against the config before anything is allocated: a config describing huge
        # modules is refused in microseconds, whatever its numbers.
        check_weights_header(
            read_weights_header(weights_path),
            cls._tensor_count(fields["n_modules"], fields["hidden_dim"]),
            lambda: cls._tensor_shapes(**fields),
            str(weights_path),
            cls.__name__,
        )
        # The meta device skips the random init of weights that are about to be replaced
        # (about 200M parameters for the Qwen3-32B MLP surrogate).
        with torch.device("meta"):
            surrogate = cls(**fields, prunable_layers=prunable)
        state_dict = load_weights(weights_path)
        # assign=True keeps the tensors read from the file, hence their dtype.
        load_state_dict_strict(surrogate, state_dict, str(weights_path), assign=True)
        check_finite(surrogate, repr(str(weights_path)))
        if dtype is not None:
            surrogate = surrogate.to(dtype)
        return surrogate.eval()
