"""The DMS threshold rule: where a token's fate is decided.

KVzap follows the inference strategy of Dynamic Memory Sparsification (arXiv 2506.05345): every new pair is
scored as it enters the cache; the most recent ``sliding_window_size`` tokens are always kept; when a token
leaves that window its pair is evicted if its score is strictly below ``threshold``, and the decision is never
revisited. In prefill the whole prompt is scored at once and evicted after that forward's attention (dense
prefill); with ``decoding=True`` the scores of generated (and question) tokens wait in a buffer until they
leave the window. A chunked prefill also keeps each sequence's first tokens (``sink_size``, :data:`SINK_SIZE` by
default), which its later chunks need as attention sinks. Generated tokens are scored in batches of up to 16
(the scorer is a per-pair function, so this changes no score, only the number of calls): a batch is always scored
before its first token leaves the window.

Speculative decoding (``assistant_model=``, ``prompt_lookup_num_tokens=``) runs draft tokens and then crops the
rejected ones. A decision is only taken for tokens that no crop can remove: the tokens before a forward's drafts
(``generate`` says how many through ``logits_to_keep``; a decoding step of several tokens is otherwise taken to be
one token plus drafts). The decisions a forward deferred are taken before the next forward's attention, once the
crop is done, and a crop trims the buffered scores instead of discarding them. The window is thus never evicted.
NaN scores raise a ValueError where a batch is scored (no device sync per decoding step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kvzap.cache import PrunableLayer
from kvzap.presses.base import (
    BasePress,
    Scorer,
    as_bool,
    check_number,
    check_score_shape,
    check_scores,
    pad_columns,
)
from kvzap.presses.padding import pad_offsets

__all__ = ["DMSThresholdPress", "PREFILL_CHUNK_SIZE", "SINK_SIZE", "resolve_sink_size"]

#: Decoded tokens scored per scorer call (at most; fewer when a token must leave the window before).
_DECODE_SCORE_BATCH = 16


#: The chunk size to pass for a chunked prefill (``prefill_chunk_size``), the fastest measured: each chunk's pairs
#: are pruned before the next chunk attends to them, so the first token comes sooner (SmolLM2-135M-Instruct, fp32,
#: 2 CPU threads, ~74% evicted: 0.72x no press at 8k with chunks of 1024, 0.73x with 2048; Gemma 3 270M at 32k:
#: 0.14x; BENCHMARKS.md, "Time to first token"). It is not the default: on the 4k needle suite at threshold -2.5,
#: chunks of 1024 lose -5.9 [-9.8, -2.5] points against one forward on the same 200 samples, the first tokens kept as
#: sinks (``evaluation/results/smollm2-135m-4k-n40-chunked``).
PREFILL_CHUNK_SIZE = 1024

#: First tokens of a sequence a chunked prefill never evicts (``sink_size=None``). Later chunks attend to the kept
#: pairs only, and a layer whose heads evicted the first tokens loses the attention sink that its queries park their
#: weight on (StreamingLLM, arXiv 2309.17453): their representations drift and the question built on them fails.
#: Measured on SmolLM2-135M-Instruct at 4k tokens, threshold -2.5: the scorer evicts position 0 in all heads of
#: layers 0 and 1; without sinks chunks of 1024 lose -16.5 [-23.0, -10.2] needle points against one forward, and
#: keeping 4 first tokens recovers them (``research/chunked-prefill-sinks``). One forward needs none: every prompt
#: token attends to the whole prompt before anything is evicted.
SINK_SIZE = 4


def resolve_sink_size(sink_size: int | None, chunked: bool) -> int:
    """The first tokens a sequence keeps under ``sink_size``: itself when given; for None, :data:`SINK_SIZE` in a
    chunked prefill and 0 in one forward."""
    if sink_size is not None:
        return sink_size
    return SINK_SIZE if chunked else 0


@dataclass
class DMSThresholdPress(BasePress):
    """Evict KV pairs whose score is below a threshold once they leave a sliding window.

    Parameters
    ----------
    scorer : Scorer
        Gives each new pair a score (e.g. :class:`~kvzap.KVzapScorer`, a predicted log KVzip+ score).
    threshold : float
        Pairs with ``score < threshold`` are evicted. ``-inf`` evicts nothing (and skips scoring). Higher = more
        compression.
    sliding_window_size : int, default 128
        Number of most recent tokens that are always kept.
    decoding : bool, default False
        Also prune tokens processed after the prefill (questions, generated tokens).
    sink_size : int or None, default None
        Number of first tokens of each sequence (after its padding) that are never evicted. None: :data:`SINK_SIZE`
        when the prompt is prefilled in chunks (``prefill_chunk_size``, :meth:`prefilling`), where later chunks
        attend to the kept pairs and need the first tokens as attention sinks; 0 in one forward (the paper's
        setting).

    The compression ratio is an outcome, not an input: read :attr:`compression_ratio` (and the per-layer,
    per-head and per-sample ratios) after a forward pass.
    """

    scorer: Scorer = None  # type: ignore[assignment]
    threshold: float | None = None
    sliding_window_size: int = 128
    decoding: bool = False
    sink_size: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def _checked(self, name: str, value):
        # Setting a parameter after construction is checked as strictly as the constructor (also inside
        # `with press(model):`); numpy scalars become Python numbers (so that the repr identifies a run).
        if name == "scorer":
            if not isinstance(value, Scorer):
                raise TypeError(
                    f"scorer must be a kvzap Scorer (e.g. KVzapScorer(model_type='mlp')), got {type(value).__name__}."
                )
            if self.__dict__.get("decoding"):
                self._check_decoding(value)
        elif name == "threshold":
            # None only as the constructor's default, which validate() then refuses with how to fix it.
            value = check_number(
                "threshold", value, allow_none="threshold" not in self.__dict__, hint="Use -inf to evict nothing."
            )
        elif name == "sliding_window_size":
            value = check_number("sliding_window_size", value, integer=True, minimum=0)
        elif name == "sink_size":
            value = check_number("sink_size", value, integer=True, minimum=0, allow_none=True)
        elif name == "decoding":
            value = as_bool("decoding", value)
            if value and "scorer" in self.__dict__:
                self._check_decoding(self.scorer)
        return super()._checked(name, value)

    @staticmethod
    def _check_decoding(scorer: Scorer) -> None:
        if not scorer.supports_decoding:
            raise ValueError(
                f"{type(scorer).__name__} cannot score tokens one at a time, so it cannot prune during decoding: "
                "use decoding=False."
            )

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.scorer, Scorer):
            raise TypeError(
                f"scorer must be a kvzap Scorer (e.g. KVzapScorer(model_type='mlp')), got {type(self.scorer).__name__}."
            )
        if self.threshold is None:
            raise ValueError("threshold is required, e.g. DMSThresholdPress(KVzapScorer(), threshold=-4).")
        # Both are checked when assigned (_checked: a number, never NaN; a window >= 0), the constructor's too.
        if as_bool("decoding", self.decoding):
            self._check_decoding(self.scorer)

    @property
    def prunes_during_decoding(self) -> bool:
        return bool(self.decoding)

    @property
    def scores_needed(self) -> bool:
        return self.threshold != -math.inf  # no score is below -inf

    def setup(self, model) -> None:
        self.scorer.setup(model)

    def _buffer(self, layer: PrunableLayer, end: int) -> tuple[torch.Tensor | None, int, tuple, int, int] | None:
        """The layer's buffered state, trimmed to the tokens before ``end``; None when it does not reach ``end``.

        Returns ``(pending, start, unscored, n_pending, n_unscored)``: ``pending`` are the scores ``(B, H, p)`` of
        the tokens from ``start`` on, still inside the window; ``unscored`` the (hidden states, keys, values) of the
        tokens after them, not scored yet (a tuple: snapshots share it). A crop (draft tokens rejected) leaves the
        buffer past ``end``: the rejected tokens are cut off it, the others keep their scores.
        """
        state = layer.press_state
        pending, start = state.get("pending"), state.get("pending_start")
        if start is None:
            return None  # a new sequence (its layer state is empty)
        unscored = state.get("unscored", ())
        n_pending = 0 if pending is None else pending.shape[-1]
        n_unscored = state.get("n_unscored")  # kept beside ``unscored`` (counting it costs a loop every step)
        if n_unscored is None:
            n_unscored = sum(h.shape[1] for h, _, _ in unscored)
        if start + n_pending + n_unscored < end:
            return None  # tokens went by unscored (decoding was off): they stay kept
        if min(start, end) > max(end - self.sliding_window_size, 0):
            raise RuntimeError(
                f"The cache was cropped back to {end} tokens, but the press had already decided the fate of the "
                f"tokens up to position {start - 1}, some of which are now inside the sliding window "
                f"({self.sliding_window_size} tokens). With decoding=True only the draft tokens of the last forward "
                "(all its tokens but the first, as speculative decoding does) may be cropped; apply a press with "
                "decoding=False to an assistant model, or crop only draft tokens."
            )
        if start > end:
            return None  # a crop removed tokens already decided: everything before ``end`` is decided
        if start + n_pending + n_unscored == end:
            return pending, start, unscored, n_pending, n_unscored  # nothing cropped (every decoding step)
        keep = end - start
        if keep < n_pending:
            pending, unscored = pending[..., :keep], ()
        else:
            kept, left = [], keep - n_pending
            for h, k, v in unscored:
                if left <= 0:
                    break
                n = min(left, h.shape[1])
                kept.append((h[:, :n], k[:, :, :n], v[:, :, :n]) if n < h.shape[1] else (h, k, v))
                left -= n
            unscored = tuple(kept)
        n_pending = 0 if pending is None else pending.shape[-1]
        return pending, start, unscored, n_pending, keep - n_pending

    def before_layer(self, module: nn.Module, layer: PrunableLayer, prefill: bool) -> None:
        # Take the decisions the last forward deferred (its draft tokens could still be rejected then).
        if not self.decoding or prefill or not self.scores_needed or layer.seen == 0:
            return
        self._decide(module, layer, None, layer.seen, score_all=False)

    def process_layer(self, module: nn.Module, layer: PrunableLayer, hidden_states: torch.Tensor, prefill: bool):
        if not (prefill or self.decoding):
            return False  # decoding-time pruning is off: the window tokens of the prefill stay kept
        if not self.scores_needed:
            return True  # nothing to score, nothing evicted (the statistics are still recorded)
        q_len = hidden_states.shape[1]
        # Speculative decoding runs the last token plus draft tokens, then crops the rejected drafts: decide only
        # for the tokens before the drafts; the next forward's pre-hook catches up once the crop is done. How
        # many drafts a forward holds is known when `generate` runs it (also in its first forward, which holds
        # the prompt and the first drafts); otherwise a decoding step of several tokens is taken to be the last
        # token plus drafts, and a prefill to hold none.
        drafts = self._forward_drafts
        if drafts is None:
            drafts = 0 if prefill else q_len - 1
        committed = layer.seen - min(drafts, q_len - 1)
        self._decide(module, layer, (hidden_states, layer.last_keys, layer.last_values), committed, score_all=prefill)
        return True

    def _decide(
        self, module: nn.Module, layer: PrunableLayer, new: tuple | None, committed: int, score_all: bool
    ) -> None:
        """Buffer the new tokens, score what must be, and evict the tokens that left the window.

        Parameters
        ----------
        new : ``(hidden (B, q, D), keys (B, H, q, d), values)`` of the tokens the layer's last update appended, or
            None (catching up before a forward: nothing new).
        committed : tokens ``0 .. committed - 1`` can no longer be cropped; the window is counted back from there.
        score_all : score every buffered token now (a prefill: its tokens are scored in one call).
        """
        q_len = 0 if new is None else new[0].shape[1]
        first_new = layer.seen - q_len
        buffered = self._buffer(layer, first_new)
        if buffered is None:
            if new is None:
                return
            # A new sequence, or tokens went by unscored: the buffer restarts with this forward's tokens.
            buffered = (None, first_new, (), 0, 0)
            if first_new == 0:  # the sinks are those of how the sequence is prefilled, whatever comes later
                layer.press_state["sink_size"] = self.effective_sink_size
        pending, start, unscored, n_pending, n_unscored = buffered
        if new is not None:
            unscored += (new,)
            n_unscored += q_len
        n_leaving = committed - self.sliding_window_size - start  # tokens between start and the window
        if unscored and (score_all or n_unscored >= _DECODE_SCORE_BATCH or n_leaving > n_pending):
            # Decoded tokens are scored in batches (one scorer call for up to _DECODE_SCORE_BATCH of them, the
            # fixed cost of a call dominates a single token's); a token's score is needed only when it leaves the
            # window, and a batch is scored before that.
            scores = self._score(module, layer, unscored, first=start + n_pending)
            pending = scores if pending is None else torch.cat([pending, scores], dim=-1)  # (B, H, p + q)
            unscored, n_pending, n_unscored = (), pending.shape[-1], 0

        if n_leaving > 0:
            # These tokens leave the window now: decide their fate once and for all.
            evicted = pending[..., :n_leaving] < self.threshold
            sinks = self._sinks(layer, start, evicted)
            if sinks is not None:
                evicted &= ~sinks[:, None, :]
            layer.evict(start, evicted)
            pending, start = pending[..., n_leaving:], start + n_leaving
        state = layer.press_state
        state["pending"], state["pending_start"], state["unscored"] = pending, start, unscored
        state["n_unscored"] = n_unscored

    @property
    def effective_sink_size(self) -> int:
        """The first tokens a sequence starting now keeps (:func:`resolve_sink_size`; chunked inside
        :meth:`prefilling`)."""
        return resolve_sink_size(self.sink_size, chunked=self._prefilling)

    @staticmethod
    def _sinks(layer: PrunableLayer, first: int, evicted: torch.Tensor) -> torch.Tensor | None:
        """``(B, n)`` True where the columns ``first ..`` of ``evicted`` ``(B, H, n)`` are among a row's first real
        tokens (its sinks), on its device; None when none of them are."""
        sink = layer.press_state.get("sink_size", 0)
        if sink == 0:
            return None
        pads, pad_max = pad_offsets(layer)  # (B,) padding columns before each row's first token (or None), their max
        if first >= sink + pad_max:
            return None
        bsz, _, n = evicted.shape
        columns = torch.arange(first, first + n, device=evicted.device)[None, :]
        if pads is None:
            return (columns < sink).expand(bsz, n)
        pads = pads.to(evicted.device)[:, None]
        return (columns >= pads) & (columns < pads + sink)

    def _score(self, module: nn.Module, layer: PrunableLayer, unscored: tuple, first: int) -> torch.Tensor:
        """Scores ``(B, H, q)`` of the buffered new pairs, at absolute positions ``first ..``.

        Padding columns (already evicted by the base press) get a score of 0: their hidden states may be NaN (a
        padding query attends nothing), and their decisions are ignored anyway.
        """
        if len(unscored) == 1:
            hidden, keys, values = unscored[0]
        else:
            hidden = torch.cat([h for h, _, _ in unscored], dim=1)  # (B, q, D)
            keys = torch.cat([k for _, k, _ in unscored], dim=2)  # (B, H, q, d)
            values = torch.cat([v for _, _, v in unscored], dim=2)
        positions = torch.arange(first, first + hidden.shape[1], device=hidden.device)
        scores = self.scorer.score(module, hidden, keys, values, positions)
        # Checked before anything broadcasts them: (B, H, 1) scores would otherwise decide for every token.
        check_score_shape(scores, self.scorer, module, (keys.shape[0], keys.shape[1], hidden.shape[1]))
        pad = pad_columns(layer, first, hidden.shape[1])
        if pad is not None:
            scores = scores.masked_fill(pad[:, None, :].to(scores.device), 0.0)
        return check_scores(scores, self.scorer, module)
