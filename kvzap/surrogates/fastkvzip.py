"""Fast KVzip gates (arXiv 2601.17668): a per-layer "low-rank sink attention" predicting KV importance.

For the hidden state ``h`` of a token (input of the attention layer), per KV head ``k`` and query head ``g``
of its group, with ``r = gate_dim`` (16) dimensions per head::

    q = RMSNorm(W_q h + c)[k, g]          (H * G * r outputs)
    key = RMSNorm(W_k h)[k]               (H * r outputs)
    self_logit = q . key / sqrt(r) + b[k, g]
    sink_logit_j = q . sink[k, j] / sqrt(r)   for the S learned sink keys of head k
    gate[k] = mean_g  exp(self_logit) / (exp(self_logit) + sum_j exp(sink_logit_j))

so the gate is the attention a query would pay to the token itself against S learned "sinks": a number in
(0, 1) distilled from the token's KVzip score. Like KVzap it depends on the token's own hidden state only,
so it scores prefill and decoded tokens alike.

Checkpoints use the same directory format as KVzap surrogates (``config.json`` + ``model.safetensors``) with
``model_type: "fastkvzip"`` and weights ``layers.{i}.q_proj.weight|bias``, ``layers.{i}.k_proj.weight``,
``layers.{i}.q_norm.weight``, ``layers.{i}.k_norm.weight``, ``layers.{i}.sinks``, ``layers.{i}.bias``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn

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

__all__ = ["FastKVzipGate", "FastKVzipGates"]

_MODEL_TYPE = "fastkvzip"
_FIELDS = ("input_dim", "n_kv_heads", "n_groups", "n_modules", "gate_dim", "n_sinks")


class _RMSNorm(nn.Module):
    """RMS normalisation over the last dimension with a learned scale (as in Llama/Qwen3)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class FastKVzipGate(nn.Module):
    """The gate of one layer.

    Parameters
    ----------
    input_dim : hidden size ``D`` of the model.
    n_kv_heads : ``H``; n_groups : ``G`` query heads per KV head.
    gate_dim : ``r`` dimensions per head (16 in the paper); n_sinks : ``S`` learned sink keys (16).
    """

    def __init__(self, input_dim: int, n_kv_heads: int, n_groups: int, gate_dim: int = 16, n_sinks: int = 16):
        super().__init__()
        self.n_kv_heads, self.n_groups, self.gate_dim, self.n_sinks = n_kv_heads, n_groups, gate_dim, n_sinks
        self.q_proj = nn.Linear(input_dim, n_kv_heads * n_groups * gate_dim, bias=True)
        self.k_proj = nn.Linear(input_dim, n_kv_heads * gate_dim, bias=False)
        self.q_norm = _RMSNorm(gate_dim)
        self.k_norm = _RMSNorm(gate_dim)
        self.sinks = nn.Parameter(torch.randn(n_kv_heads, n_sinks, gate_dim) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_kv_heads, n_groups))

    def logits(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Self and sink logits: ``(..., H, G)`` and ``(..., H, G, S)`` for hidden states ``(..., D)``."""
        lead = hidden_states.shape[:-1]
        q = self.q_norm(self.q_proj(hidden_states).view(*lead, self.n_kv_heads, self.n_groups, self.gate_dim))
        k = self.k_norm(self.k_proj(hidden_states).view(*lead, self.n_kv_heads, self.gate_dim))
        scale = 1 / math.sqrt(self.gate_dim)
        self_logit = (q * k.unsqueeze(-2)).sum(-1) * scale + self.bias  # (..., H, G)
        sink_logit = torch.einsum("...hgr,hsr->...hgs", q, self.sinks) * scale  # (..., H, G, S)
        return self_logit, sink_logit

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Gate values in (0, 1): ``(..., D)`` -> ``(..., H)``, averaged over the G query heads of a group."""
        self_logit, sink_logit = self.logits(hidden_states)
        # exp(s) / (exp(s) + sum_j exp(s_j)) computed stably as a softmax entry over [s, s_1..s_S]
        all_logits = torch.cat([self_logit.unsqueeze(-1), sink_logit], dim=-1)  # (..., H, G, 1 + S)
        return torch.softmax(all_logits.float(), dim=-1)[..., 0].mean(-1)  # (..., H)

    def log_gate(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``log`` of the group-averaged gate, ``(..., H)``: the scale :class:`FastKVzipScorer` thresholds."""
        return self.forward(hidden_states).clamp_min(1e-30).log()


class FastKVzipGates(nn.Module):
    """One :class:`FastKVzipGate` per decoder layer, saved and loaded like KVzap surrogates."""

    def __init__(
        self,
        input_dim: int,
        n_kv_heads: int,
        n_groups: int,
        n_modules: int,
        gate_dim: int = 16,
        n_sinks: int = 16,
    ) -> None:
        super().__init__()
        for name, value in zip(_FIELDS, (input_dim, n_kv_heads, n_groups, n_modules, gate_dim, n_sinks), strict=True):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        self.input_dim, self.n_kv_heads, self.n_groups = input_dim, n_kv_heads, n_groups
        self.n_modules, self.gate_dim, self.n_sinks = n_modules, gate_dim, n_sinks
        self.layers = nn.ModuleList(
            FastKVzipGate(input_dim, n_kv_heads, n_groups, gate_dim, n_sinks) for _ in range(n_modules)
        )

    @property
    def model_type(self) -> str:
        return _MODEL_TYPE

    @property
    def config(self) -> dict:
        return {"model_type": _MODEL_TYPE, **{name: getattr(self, name) for name in _FIELDS}}

    def forward(self, hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Log gate of layer ``layer_idx``: ``(..., D)`` -> ``(..., H)``."""
        if not 0 <= layer_idx < self.n_modules:
            raise IndexError(f"layer_idx must be in [0, {self.n_modules}), got {layer_idx}.")
        if hidden_states.shape[-1] != self.input_dim:
            raise ValueError(f"hidden_states must end with {self.input_dim}, got shape {tuple(hidden_states.shape)}.")
        gate = self.layers[layer_idx]
        return gate.log_gate(hidden_states.to(gate.q_proj.weight.dtype))

    def check_compatible(
        self, *, num_layers: int, hidden_size: int, num_kv_heads: int, num_heads: int, model_name: str = "the model"
    ) -> None:
        """Raise ValueError naming both shapes if these gates were not trained for this model."""
        ours = (self.n_modules, self.input_dim, self.n_kv_heads, self.n_groups)
        theirs = (num_layers, hidden_size, num_kv_heads, num_heads // num_kv_heads)
        if ours != theirs:
            raise ValueError(
                f"These Fast KVzip gates were built for (layers, hidden size, KV heads, group size) = {ours}, but "
                f"{model_name} has {theirs}. Train gates for this model with `kvzap train gate`, "
                "or pass the gates trained for it."
            )

    def save_pretrained(self, path: str | os.PathLike) -> Path:
        return write_checkpoint(path, {**self.config, "architectures": ["FastKVzipGates"]}, self.state_dict())

    @staticmethod
    def _tensor_shapes(input_dim, n_kv_heads, n_groups, n_modules, gate_dim, n_sinks) -> dict:
        """``name -> shape`` of every weight, computed from the config without building anything."""
        shapes = {}
        for i in range(n_modules):
            shapes.update(
                {
                    f"layers.{i}.q_proj.weight": (n_kv_heads * n_groups * gate_dim, input_dim),
                    f"layers.{i}.q_proj.bias": (n_kv_heads * n_groups * gate_dim,),
                    f"layers.{i}.k_proj.weight": (n_kv_heads * gate_dim, input_dim),
                    f"layers.{i}.q_norm.weight": (gate_dim,),
                    f"layers.{i}.k_norm.weight": (gate_dim,),
                    f"layers.{i}.sinks": (n_kv_heads, n_sinks, gate_dim),
                    f"layers.{i}.bias": (n_kv_heads, n_groups),
                }
            )
        return shapes

    @classmethod
    def from_pretrained(
        cls, path_or_repo_id: str | os.PathLike, *, expect: dict[str, int] | None = None, **hub_kwargs
    ) -> FastKVzipGates:
        """Load gates from a local directory or a Hub repo in the format described in the module docstring.

        ``expect``: config values the gates must have (the model's shapes), checked before anything else is read.
        The weights file's header is checked against the config before anything is allocated, and weights
        holding NaN or infinity are refused (ValueError naming the file).
        """
        config_path, weights_path = resolve_checkpoint_files(path_or_repo_id, **hub_kwargs)
        config = read_config(config_path, _MODEL_TYPE, required=_FIELDS)
        fields = {name: config[name] for name in _FIELDS}
        for name, value in fields.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"The gates config {str(config_path)!r} is invalid: {name} must be a positive integer, "
                    f"got {value!r}."
                )
        check_config_fields(fields, config_path, expect)
        check_weights_header(
            read_weights_header(weights_path),
            7 * fields["n_modules"],
            lambda: cls._tensor_shapes(**fields),
            str(weights_path),
            cls.__name__,
        )
        with torch.device("meta"):  # skip the random init of weights about to be replaced
            gates = cls(**fields)
        load_state_dict_strict(gates, load_weights(weights_path), str(weights_path), assign=True)
        check_finite(gates, repr(str(weights_path)))
        return gates.eval()
