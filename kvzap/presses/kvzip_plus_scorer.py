"""The KVzip+ oracle as a scorer: the exact KVzip+ scores of a prefill, from one extra forward of the context.

KVzap surrogates are trained to predict these scores from the hidden states; this scorer computes them exactly
(:func:`kvzap.kvzip.kvzip_plus_scores`), which makes it the upper bound of the surrogates in evaluations.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvzap import _compat
from kvzap.kvzip import _template_ids, build_prefill_repeat_prompt, kvzip_plus_scores
from kvzap.presses.base import Scorer, as_number

logger = logging.getLogger(__name__)

__all__ = ["KVzipPlusScorer"]


class KVzipPlusScorer(Scorer):
    """Exact log KVzip+ scores of the prefilled context: the oracle that KVzap surrogates approximate.

    When a sequence starts (the first forward of a sequence under the press: the pipeline's context prefill,
    or the prompt of ``generate``), the scorer runs one extra forward, without a cache and before the
    prefill itself, of the repeat prompt built from the prefill's own token ids
    (:func:`~kvzap.kvzip.build_prefill_repeat_prompt`: the prefill, the repeat instruction, then the prefill
    again without its chat-template prefix). That forward yields the log KVzip+ score of every pair of the
    prefill in every layer and KV head; the press then reads them layer by layer, like any scorer's. The extra
    forward is neither pruned nor recorded by the press, and leaves the press's attention implementation in
    place. It costs about one forward of twice the prefill's length (three prefills in all), plus the scoring
    of the repeated rows.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase, optional
        The model's tokenizer (its chat template frames the repeat prompt, and it encodes the repeat
        instruction). None: loaded from the model's ``config._name_or_path`` when the press is applied, from
        local files only (a Hub model loaded with ``from_pretrained`` has its tokenizer cached next to it).
    chunk_size : int, default 64
        Query rows scored at once by the extra forward (memory against speed), see
        :func:`~kvzap.kvzip.kvzip_plus_scores`.

    Notes
    -----
    KVzip defines a score only for the pairs of the context that is repeated, so:

    - Only the pairs of a sequence's first forward are scored. Pairs added later (questions after the context,
      generated tokens) have no score and are never evicted: :attr:`supports_decoding` is False, so
      ``DMSThresholdPress(..., decoding=True)`` is refused, and ``TopKPress`` prunes the prefill only. Asking
      for the score of a later pair raises a ValueError.
    - A chunked prefill (``press.prefilling()``, the ``prefill_chunk_size`` of the pipeline or of ``generate``) is
      refused when its first chunk starts: the oracle needs the whole context in one forward.
    - Batches work, each row scored by its own extra forward. Left-padded batches are refused: the repeat
      prompt of a padded row would hold its padding.
      A prefill given as ``inputs_embeds`` is refused: the repeat prompt is made of token ids.
    """

    supports_decoding = False
    reads_prefill_inputs = True
    supports_padding = False

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None, *, chunk_size: int = 64) -> None:
        if tokenizer is not None and not isinstance(tokenizer, PreTrainedTokenizerBase):
            raise TypeError(
                f"tokenizer must be a transformers tokenizer (AutoTokenizer.from_pretrained(...)) or None, "
                f"got {type(tokenizer).__name__}."
            )
        self.tokenizer = tokenizer
        self.chunk_size = chunk_size
        self._resolved: PreTrainedTokenizerBase | None = tokenizer
        self._resolved_for: str | None = None
        self._scores: torch.Tensor | None = None  # (n_layers, B, H, n) log KVzip+ of the current prefill
        self._running = False
        self._users = 0  # presses currently applied with this scorer (their `with` blocks are open)
        self._lock = threading.Lock()

    def __setattr__(self, name: str, value) -> None:
        # Checked at construction and when set later alike.
        if name == "chunk_size":
            value = as_number("chunk_size", value, integer=True)
            if value < 1:
                raise ValueError(f"chunk_size must be a positive int, got {value!r}.")
        super().__setattr__(name, value)

    def __repr__(self) -> str:
        tokenizer = "None" if self.tokenizer is None else type(self.tokenizer).__name__
        return f"{type(self).__name__}(tokenizer={tokenizer}, chunk_size={self.chunk_size})"

    # --- applying ------------------------------------------------------------------------------------------------
    def _tokenizer_for(self, model: PreTrainedModel) -> PreTrainedTokenizerBase:
        if self.tokenizer is not None:
            return self.tokenizer
        name = str(getattr(model.config, "_name_or_path", "") or "")
        if self._resolved is not None and self._resolved_for == name:
            return self._resolved
        fix = "Pass it: KVzipPlusScorer(tokenizer=AutoTokenizer.from_pretrained(...))."
        if not name:
            raise ValueError(
                f"KVzipPlusScorer needs the model's tokenizer, and the model has no name to load it by. {fix}"
            )
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError, TypeError, KeyError) as error:
            where = "directory" if Path(name).is_dir() else "local Hub cache"
            raise ValueError(
                f"KVzipPlusScorer needs the model's tokenizer; none could be loaded for {name!r} from its {where} "
                f"({type(error).__name__}: {error}). {fix}"
            ) from error
        self._resolved, self._resolved_for = tokenizer, name
        logger.info("KVzipPlusScorer loaded the tokenizer of %s", name)
        return tokenizer

    def setup(self, model: PreTrainedModel) -> None:
        tokenizer = self._tokenizer_for(model)
        for module in _compat.attention_modules(model):
            if not isinstance(getattr(module, "o_proj", None), nn.Linear):
                raise TypeError(
                    f"KVzip+ scores need each attention layer's output projection `o_proj` (Llama-style layers); "
                    f"layer {_compat.layer_index(module)} of {type(model).__name__} has none."
                )
        _template_ids(tokenizer)  # a chat template that cannot frame the repeat prompt fails here, not mid-forward
        with self._lock:
            if self._users:
                # The scores of the current sequence live in the scorer: a second model (or thread) would replace
                # them under the first one's feet.
                raise RuntimeError(
                    "This KVzipPlusScorer is already in use by an applied press: it holds the scores of one "
                    "sequence at a time. Give each model (and thread) its own scorer and press."
                )
            self._users += 1

    def begin_prefill(
        self,
        model: PreTrainedModel,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        chunked: bool,
    ) -> None:
        if self._running:  # the extra forward itself (runs without a cache, so the press does not call this)
            return
        self._scores = None  # a new sequence: the previous one's scores must never be served for it
        if chunked:
            raise ValueError(
                "KVzipPlusScorer scores a context from one forward of the whole context, so it cannot serve a "
                "chunked prefill (press.prefilling(), the prefill_chunk_size of the pipeline or of generate): prefill "
                "in one forward."
            )
        if input_ids is None:
            raise ValueError(
                "KVzipPlusScorer builds its repeat prompt from the prefill's token ids, but the model was called "
                "with inputs_embeds: call it with input_ids."
            )
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"Expected (batch, tokens) input_ids for the prefill, got shape {tuple(input_ids.shape)}.")
        tokenizer = self._tokenizer_for(model)
        self._running = True
        try:
            rows = [
                kvzip_plus_scores(
                    model, tokenizer, build_prefill_repeat_prompt(tokenizer, ids), chunk_size=self.chunk_size
                ).log_scores
                for ids in input_ids
            ]  # B x (n_layers, H, n)
        finally:
            self._running = False
        self._scores = torch.stack(rows, dim=1)  # (n_layers, B, H, n)

    def release(self) -> None:
        with self._lock:
            self._users = max(self._users - 1, 0)
            if not self._users:
                self._scores = None

    # --- scoring -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, module: nn.Module, hidden_states, keys, values, positions) -> torch.Tensor:
        scores = self._scores
        if scores is None:
            raise RuntimeError(
                "KVzipPlusScorer has no scores for this forward: they are computed when a sequence starts under "
                "`with press(model):` (the first forward of the sequence, with input_ids)."
            )
        _, batch, heads, n = scores.shape  # (n_layers, B, H, n)
        if keys.shape[0] != batch or keys.shape[1] != heads:
            raise ValueError(
                f"The KVzip+ scores were computed for {batch} sequence(s) x {heads} KV heads, got pairs of shape "
                f"{tuple(keys.shape)}: the forward does not continue the prefill the scores belong to."
            )
        if positions.numel() and int(positions.max()) >= n:
            raise ValueError(
                f"KVzip+ scores exist only for the {n} pairs of the sequence's first forward (the context); "
                f"got pairs at positions {int(positions.min())}..{int(positions.max())}. Pairs added later (a later "
                "prefill chunk, questions, generated tokens) have no KVzip score: prefill the context in one forward "
                "and do not prune during decoding."
            )
        layer_scores = scores[_compat.layer_index(module)]  # (B, H, n)
        return layer_scores[..., positions.to(layer_scores.device)].to(keys.device)  # (B, H, q)
