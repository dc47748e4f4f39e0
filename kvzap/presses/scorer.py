"""The scorer interface: maps the new KV pairs of one attention layer to importance scores.

A scorer says how important each pair is; a press (:mod:`kvzap.presses.base`) decides what to evict from those
scores. Concrete scorers live one per file beside this one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import nn
from transformers import PreTrainedModel

from kvzap.cache import PrunableLayer

__all__ = ["Scorer"]


class Scorer(ABC):
    """Maps the new tokens of one attention layer to importance scores, higher = more important.

    Subclasses implement :meth:`score`; :meth:`setup` runs once when a press is applied to a model and must
    raise (``ValueError``/``TypeError``/``FileNotFoundError``) before anything is changed if the scorer
    cannot serve this model.
    """

    #: False for scorers that need the whole context at once (oracles): they cannot score decoded tokens.
    supports_decoding: ClassVar[bool] = True
    #: True for scorers that read the token ids of each sequence's prefill (oracles that rerun the context): the
    #: press then calls :meth:`begin_prefill` before the model runs the first forward of every sequence.
    reads_prefill_inputs: ClassVar[bool] = False
    #: False for scorers whose score of a pair depends on the other rows or on the padding of its row (an oracle
    #: rerunning the padded context): a left-padded batch is then refused before anything runs.
    supports_padding: ClassVar[bool] = True

    def setup(self, model: PreTrainedModel) -> None:
        """Prepare for ``model`` (load and place weights once). Default: nothing to do."""

    def begin_prefill(
        self,
        model: PreTrainedModel,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        chunked: bool,
    ) -> None:
        """See the inputs of a sequence's first forward before the model runs it (if :attr:`reads_prefill_inputs`).

        Called from a forward pre-hook of the decoder stack when the forward starts a sequence (its cache is
        empty, or the decoder will create one). Nothing of the sequence is in the cache yet, so an error raised
        here leaves no state behind. A forward this method runs itself on ``model`` (an oracle's extra forward,
        with ``use_cache=False``) is neither pruned nor recorded by the press, and does not call this again.

        Parameters
        ----------
        model : the model the press is applied to.
        input_ids : ``(B, n)`` token ids of the forward, or None when it was given ``inputs_embeds``.
        inputs_embeds : ``(B, n, D)`` input embeddings, or None.
        chunked : True when the forward runs inside :meth:`BasePress.prefilling` (a chunked prefill: later
            chunks continue the sequence without calling this again).
        """

    def release(self) -> None:
        """Drop per-sequence state; called when a press using this scorer is removed. Default: nothing."""

    @abstractmethod
    def score(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """Score the ``q`` new pairs of one layer.

        Parameters
        ----------
        module : the attention module (``module.layer_idx`` is its layer).
        hidden_states : ``(B, q, D)`` hidden states entering attention (after the input layernorm).
        keys, values : ``(B, H, q, d)`` the new pairs (keys after RoPE), H = KV heads.
        positions : ``(q,)`` absolute positions of the new tokens.

        Returns
        -------
        Tensor ``(B, H, q)``.
        """

    def score_new_pairs(self, module: nn.Module, layer: PrunableLayer, hidden_states: torch.Tensor) -> torch.Tensor:
        """:meth:`score` of the pairs a layer's last update appended, at their absolute positions: ``(B, H, q)``."""
        q_len = hidden_states.shape[1]
        positions = torch.arange(layer.seen - q_len, layer.seen, device=hidden_states.device)
        return self.score(module, hidden_states, layer.last_keys, layer.last_values, positions)
