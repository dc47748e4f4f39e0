"""Scorers say how important each new KV pair is; presses decide what to evict and apply it to a model.

A press is applied with ``with press(model): ...``. Entering validates everything (model, press parameters,
scorer weights) before touching the model, then switches the model to kvzap's attention function and registers
one forward pre-hook and one forward hook per attention layer, and pre-hooks on the decoder stack (the pad counts
of a left-padded batch are read there from the 2-D attention mask; scorers that read the prefill's token ids get
them there).

Padded batches (left padding, as ``generate`` pads decoder-only models): each row's padding columns are evicted
right after the attention of the forward that appended them, before the press decides anything, so they are never
attended afterwards, never stored by the compact storage, and never counted in a statistic (they are taken off
both the evicted and the seen counts of their row). The press's own decisions on padding columns are ignored.

Exiting removes the hooks, restores the attention implementation and lets the scorers drop their per-sequence
state, even when the body raises, so the model is left exactly as it was found.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from transformers import Cache, PreTrainedModel

from kvzap import _compat
from kvzap.attention import ATTENTION_NAME, bind, ensure_registered, unbind
from kvzap.cache import PrunableLayer, own_window, prunable_layer_like
from kvzap.compact import compact_layer_like
from kvzap.layers import is_sliding_module

logger = logging.getLogger(__name__)

__all__ = ["Scorer", "BasePress", "STORAGES", "as_bool", "as_number", "check_scores"]

#: How evicted pairs are stored: "compact" frees them (per-head buffers, sliding-window layers stay masked);
#: "masked" keeps the dense cache and hides them (the reference for tests and benchmarks).
STORAGES = {"compact": compact_layer_like, "masked": prunable_layer_like}


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


def as_number(name: str, value: Any, *, integer: bool = False, allow_none: bool = False) -> Any:
    """``value`` as a Python int/float (numpy scalars included), or a TypeError naming ``name``.

    bool is refused (``True`` as a threshold or a window size is always a bug); ranges are checked by the caller.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be {'an int' if integer else 'a number'}, got a bool ({value!r}).")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if not integer and isinstance(value, (float, np.floating)):
        return float(value)
    raise TypeError(f"{name} must be {'an int' if integer else 'a number'}, got {type(value).__name__} ({value!r}).")


def as_bool(name: str, value: Any) -> bool:
    """``value`` as a Python bool (numpy bools included), or a TypeError naming ``name``."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__} ({value!r}).")


def check_scores(scores: torch.Tensor, scorer: Scorer, module: nn.Module) -> torch.Tensor:
    """Refuse NaN scores: ``score < threshold`` is False for NaN, so they would silently evict nothing.

    One device sync per scorer call; presses call it where they already score a batch (a prefill, or up to 16
    decoded tokens), not on every decoding step.

    Raises
    ------
    ValueError
        Naming the scorer and the layer.
    """
    if bool(torch.isnan(scores).any()):
        raise ValueError(
            f"{type(scorer).__name__} returned NaN scores for layer {_compat.layer_index(module)}: NaN cannot be "
            "compared with a threshold. Check the scorer's weights (a surrogate trained to NaN, or loaded in a dtype "
            "that overflows) and the model's hidden states."
        )
    return scores


@dataclass
class BasePress(ABC):
    """Applies a pruning policy to a model through ``with press(model):``.

    Subclasses implement :meth:`process_layer`, called after each attention layer's forward with the layer's
    prunable cache, and say what they do through :attr:`prunes_during_decoding` (read by the pipeline).

    ``storage`` (keyword only, every press): ``"compact"`` (default) physically frees evicted pairs;
    ``"masked"`` keeps them in a dense cache and hides them from attention (same logits).

    ``prune_sliding_layers`` (keyword only, every press): False (default) leaves the layers whose cache is
    bounded by a sliding window (see :mod:`kvzap.layers`) alone: they are not scored, not evicted, and not
    counted in the statistics, since evicting from them frees no memory. True prunes them like the others.
    """

    storage: str = field(default="compact", kw_only=True)
    prune_sliding_layers: bool = field(default=False, kw_only=True)

    #: False for presses whose decisions mix the rows' columns (a top-k over the prompt would rank padding):
    #: left-padded batches are then refused.
    supports_padding: ClassVar[bool] = True

    # Per-call state lives in thread-local storage (see ``_ThreadState``): one press may serve several models
    # from several threads at once, each thread seeing only its own forwards. Shared between threads: the map of
    # attention modules to the thread currently running their forward (a model runs one forward at a time).
    _local: threading.local = field(default_factory=lambda: _ThreadState(), init=False, repr=False, compare=False)
    _running: dict[nn.Module, tuple[int, int]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _lock: Any = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    # Locks and thread-local objects cannot be copied or pickled: a copy of a press starts with fresh ones.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_local", "_running", "_lock"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.update(_local=_ThreadState(), _running={}, _lock=threading.Lock())

    @property
    def _calls(self) -> dict[nn.Module, tuple[PrunableLayer, bool]]:
        """Attention modules whose forward the calling thread is running -> (their cache layer, prefill?)."""
        return self._local.calls

    @property
    def _stats(self) -> dict[int, tuple[torch.Tensor, torch.Tensor | int]]:
        """Statistics of the last forward the calling thread ran under this press, per layer."""
        return self._local.stats

    @property
    def _forward_drafts(self) -> int | None:
        """Trailing tokens of the calling thread's current forward that may be cropped after it (the drafts of
        speculative decoding), or None when unknown.

        ``generate`` asks the model for the logits of the drafts plus one (``logits_to_keep = drafts + 1``) in
        assisted and prompt-lookup decoding, and for one logit otherwise; a forward with all its logits (a hand
        written loop) says nothing.
        """
        return self._local.drafts

    @property
    def _prefilling(self) -> bool:
        return self._local.prefilling

    @_prefilling.setter
    def _prefilling(self, value: bool) -> None:
        self._local.prefilling = value

    # --- what a press states about itself ------------------------------------------------------------------
    @property
    def prunes_during_decoding(self) -> bool:
        """True if the press changes the cache after the prefill (generated or question tokens)."""
        return False

    @property
    def scores_needed(self) -> bool:
        """False when the press can evict nothing whatever the scores (a threshold of -inf): its scorers are then
        never called, and those reading the prefill's inputs (oracles) skip their extra forward."""
        return True

    def validate(self) -> None:
        """Raise ValueError/TypeError for invalid parameters. Called at construction and on entering.

        Subclasses extend it and call ``super().validate()``.
        """
        if not isinstance(self.storage, str) or self.storage not in STORAGES:
            raise ValueError(f"storage must be one of {', '.join(map(repr, STORAGES))}, got {self.storage!r}.")
        self.prune_sliding_layers = as_bool("prune_sliding_layers", self.prune_sliding_layers)

    def setup(self, model: PreTrainedModel) -> None:
        """Prepare for ``model`` before any hook is registered (e.g. load scorer weights)."""

    def scorers(self) -> tuple[Scorer, ...]:
        """The scorers this press uses: its ``scorer`` attribute when it has one (override to list others).

        The press calls their :meth:`Scorer.begin_prefill` (for those that read prefill inputs) and
        :meth:`Scorer.release`.
        """
        scorer = getattr(self, "scorer", None)
        return (scorer,) if isinstance(scorer, Scorer) else ()

    @abstractmethod
    def process_layer(self, module: nn.Module, layer: PrunableLayer, hidden_states: torch.Tensor, prefill: bool):
        """Decide evictions for one layer after its attention ran.

        ``prefill`` is True for the prompt: a sequence's first forward, and every chunk of a chunked prefill
        (forwards run inside :meth:`prefilling`). Return False when the press did nothing, so that the
        statistics of the last forward that acted are kept.
        """

    @contextlib.contextmanager
    def prefilling(self) -> Iterator[None]:
        """Treat the forwards run inside this block as prompt prefill (chunked prefill).

        Prefilling a long prompt in chunks, each evicted after its forward, keeps the cache near its pruned
        size during the prefill. Chunks after the first continue the sequence: the press prunes them as prompt
        tokens even when ``decoding=False``. Positions must be passed (or come from the cache) as usual.
        """
        previous, self._prefilling = self._prefilling, True
        try:
            yield
        finally:
            self._prefilling = previous

    # --- statistics -------------------------------------------------------------------------------------------
    def _leaves_alone(self, module: nn.Module, layer: Any) -> bool:
        """True when the press must not touch this attention layer: a sliding-window layer (see
        :mod:`kvzap.layers`) while ``prune_sliding_layers`` is False, whose cache layer is the bounded one
        transformers built (a cache built lazily without the config stores every pair: it is pruned)."""
        return (
            not self.prune_sliding_layers
            and isinstance(layer, _compat.DynamicSlidingWindowLayer)
            and not isinstance(layer, PrunableLayer)
            and is_sliding_module(module)
        )

    def _record(self, layer_idx: int, layer: PrunableLayer) -> None:
        """Keep the layer's ``(B, H)`` evicted counts and ``(B,)`` real tokens, padding taken off both (without
        padding, the tokens seen as an int: a decoding step records every layer, and the tensor is built only when
        the statistics are read)."""
        pads = layer.press_state.get(_PADS)
        if pads is None:
            self._stats[layer_idx] = (layer.n_evicted, layer.seen)
            return
        n_evicted = layer.n_evicted - layer.press_state[_PAD_EVICTED]
        real = torch.full((n_evicted.shape[0],), float(layer.seen), device=pads.device) - pads
        self._stats[layer_idx] = (n_evicted, real)

    def _require_stats(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not self._stats:
            raise RuntimeError(
                "No compression statistics yet in this thread: run a forward pass (or the pipeline) under "
                "`with press(model):` first. Statistics are kept per thread: read them in the thread that ran "
                "the forward. A press with prune_sliding_layers=False prunes nothing in a model whose layers all "
                "use a sliding window (their memory is bounded already): pass prune_sliding_layers=True to prune "
                "them."
            )
        stats = []
        for i in sorted(self._stats):
            n_evicted, real = self._stats[i]
            if not isinstance(real, torch.Tensor):
                real = torch.full((n_evicted.shape[0],), float(real))
            stats.append((n_evicted, real))
        return stats

    @property
    def layer_compression_ratios(self) -> torch.Tensor:
        """``(n_layers,)`` evicted share of the real pairs seen, per layer (over all rows and KV heads; padding
        is not counted)."""
        return torch.tensor([float(n.sum()) / (n.shape[1] * float(real.sum())) for n, real in self._require_stats()])

    @property
    def head_compression_ratios(self) -> torch.Tensor:
        """``(n_layers, kv_heads)`` evicted share of the real pairs per layer and KV head (over all rows)."""
        return torch.stack([n.float().sum(0).cpu() / float(real.sum()) for n, real in self._require_stats()])

    @property
    def sample_compression_ratios(self) -> torch.Tensor:
        """``(batch,)`` evicted share of each row's real pairs (averaged over layers and KV heads)."""
        return torch.stack([n.float().mean(1).cpu() / real.cpu() for n, real in self._require_stats()]).mean(0)

    @property
    def compression_ratio(self) -> float:
        """Share of KV pairs evicted in the last sequence, averaged over layers (read-only).

        "The last sequence" is the one of the last forward pass the calling thread ran under this press (on any
        model): a press shared by several threads reports, in each thread, that thread's own sequence.
        """
        return float(self.layer_compression_ratios.mean())

    # --- applying the press ------------------------------------------------------------------------------------
    def before_layer(self, module: nn.Module, layer: PrunableLayer, prefill: bool) -> None:
        """Called before an attention layer's forward, once its cache layer is known. Default: nothing.

        The cache may have been cropped since the last forward (speculative decoding rejects draft tokens
        between forwards): a press that deferred decisions takes them here, once no crop can undo them.
        """

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        cache = _compat.cache_from_kwargs(kwargs)
        if cache is None:  # use_cache=False: nothing to prune
            unbind([module])
            return None
        idx = _compat.layer_index(module)
        layers = cache.layers
        if idx == 0:
            _check_cache(cache, keep_sliding=not self.prune_sliding_layers)
        if self._leaves_alone(module, layers[idx] if idx < len(layers) else None):
            # Bounded by its window already: transformers' sdpa reads the untouched layer (no binding), and the
            # post-hook finds no call, so the press neither scores, evicts nor records it.
            if idx == 0 and layers[idx].get_seq_length() == 0:
                self._stats.clear()  # a new sequence starts (layer 0 cannot tell it through ``seen`` here)
            unbind([module])
            return None
        if len(layers) <= idx:
            # Lazily built cache (DynamicCache() without a config): create this layer ourselves.
            new_layer = STORAGES[self.storage]
            layers.extend(new_layer(_compat.DynamicLayer()) for _ in range(idx + 1 - len(layers)))
        layer = layers[idx]
        if not isinstance(layer, PrunableLayer):
            layer = layers[idx] = STORAGES[self.storage](layer)
        new_sequence = layer.seen == 0
        if new_sequence and idx == 0:
            self._stats.clear()
        if new_sequence:
            pads = self._local.pads
            for key in (_PADS, _PAD_MAX, _PAD_EVICTED):
                layer.press_state.pop(key, None)
            if pads is not None:
                layer.press_state[_PADS] = pads[0]
                layer.press_state[_PAD_MAX] = pads[1]
                layer.press_state[_PAD_EVICTED] = torch.zeros_like(pads[0])[:, None]
        prefill = new_sequence or self._prefilling
        self.before_layer(module, layer, prefill)
        bind(module, layer)
        self._calls[module] = (layer, prefill)
        return None

    def _claim(self, decoder: nn.Module) -> None:
        """Mark the model's decoder as running a forward in this thread; refuse a second thread meanwhile.

        The attention function finds its cache layer through a binding per attention module, so two concurrent
        forwards of one model would read each other's caches. Nested forwards of one thread (an oracle's extra
        forward) are counted.
        """
        me = threading.get_ident()
        with self._lock:
            owner, depth = self._running.get(decoder, (me, 0))
            if owner != me:
                raise RuntimeError(
                    "This model is already running a forward under the press in another thread: a model under a "
                    "kvzap press runs one forward at a time. Use one model per thread (a press may be shared), "
                    "or a lock around the forwards."
                )
            self._running[decoder] = (me, depth + 1)

    def _unclaim(self, decoder: nn.Module, *_: Any) -> None:
        """End of a forward of the decoder (also when it raised)."""
        me = threading.get_ident()
        with self._lock:
            owner, depth = self._running.get(decoder, (None, 0))
            if owner == me:
                if depth > 1:
                    self._running[decoder] = (me, depth - 1)
                else:
                    del self._running[decoder]

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        call = self._calls.pop(module, None)
        if call is None:
            # A layer left alone keeps transformers' own storage, which holds the whole prompt after a prefill
            # (a slice of it is the window): give the window its own storage, so that the layer is bounded by it.
            layers = getattr(_compat.cache_from_kwargs(kwargs), "layers", ())
            idx = _compat.layer_index(module)
            if idx < len(layers) and self._leaves_alone(module, layers[idx]):
                own_window(layers[idx])
            return None
        layer, prefill = call
        hidden_states = kwargs.get("hidden_states", args[0] if args else None)
        try:
            _evict_padding(layer, hidden_states.shape[1])
            if self.process_layer(module, layer, hidden_states, prefill) is not False:
                self._record(_compat.layer_index(module), layer)
        finally:
            layer.end_forward()  # the forward's dense pairs go now, even if the press failed
        return None

    def _model_start_hook(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """Start of a forward of the whole model: note how many of its tokens are drafts (see _forward_drafts)."""
        keep = kwargs.get("logits_to_keep")
        self._local.next_drafts = (
            keep - 1 if isinstance(keep, int) and not isinstance(keep, bool) and keep > 0 else None
        )

    def _forward_start_hook(self, modules: list[nn.Module], decoder: nn.Module, args: tuple, kwargs: dict) -> None:
        """Start of a forward of the decoder stack: drop what an earlier forward of this thread left behind when
        it raised (its layers never reached their post-hook), then refuse inputs the press cannot serve."""
        # What the model's own forward said about drafts; None when the decoder is called directly.
        self._local.drafts, self._local.next_drafts = self._local.next_drafts, None
        if self._running.get(decoder, (None, 0))[0] != threading.get_ident():
            # Not nested in a forward of this thread: nothing of an earlier forward may linger.
            for module in modules:
                self._calls.pop(module, None)
        cache = _compat.cache_from_kwargs(kwargs)
        if cache is not None:  # before the mask: transformers 5.2 gives a static cache a 4-D mask
            _check_cache(cache, keep_sliding=not self.prune_sliding_layers)
        past = 0 if cache is None else cache.get_seq_length()
        starts = past == 0
        inputs = kwargs.get("input_ids", args[0] if args else None)
        if inputs is None:
            inputs = kwargs.get("inputs_embeds")
        # Only a sequence's first forward says where its padding is (later masks of `generate` append ones), so
        # decoding steps read nothing from the mask: no host sync per step.
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            pads = _left_padding_4d(mask, read=starts, inputs=inputs, past=past, modules=modules)
        else:
            pads = _left_padding(mask, read=starts)
        if pads is not None and starts:
            refusing = [type(s).__name__ for s in self.scorers() if not s.supports_padding and self.scores_needed]
            if not self.supports_padding:
                refusing.insert(0, type(self).__name__)
            if refusing:
                raise ValueError(
                    f"{' and '.join(refusing)} cannot prune a padded batch (the attention mask contains zeros): "
                    "run sequences of equal length together, or one at a time."
                )
        self._local.pads = pads
        if isinstance(inputs, torch.Tensor) and inputs.dim() >= 2 and inputs.shape[1] == 0:
            raise ValueError(
                f"The input holds no token (shape {tuple(inputs.shape)}): pass at least one token per sequence."
            )
        output_attentions = kwargs.get("output_attentions")
        if output_attentions is None:
            output_attentions = getattr(decoder.config, "output_attentions", False)
        if output_attentions:
            raise ValueError(
                "output_attentions=True is not supported under a kvzap press: its attention function computes no "
                "attention weights. Drop output_attentions, or run without the press (eager attention) to get them."
            )
        self._claim(decoder)

    def _prefill_inputs_hook(
        self, model: PreTrainedModel, scorers: tuple[Scorer, ...], decoder: nn.Module, args: tuple, kwargs: dict
    ) -> None:
        """Hand the token ids of a sequence's first forward to the scorers that read them."""
        cache = _compat.cache_from_kwargs(kwargs)
        if cache is None:
            use_cache = kwargs.get("use_cache")
            if not (decoder.config.use_cache if use_cache is None else use_cache):
                return None  # no cache: nothing will be pruned (this is also an oracle's own forward)
        elif cache.get_seq_length() > 0:
            return None  # continues a sequence (decoding, a question, a later prefill chunk)
        # The decoder's own argument names (stable across transformers 5.x): ids first, or embeddings.
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        for scorer in scorers:
            scorer.begin_prefill(model, input_ids, kwargs.get("inputs_embeds"), chunked=self._prefilling)
        return None

    def _generate_prefill(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """``generate``'s prefill step under the press: a chunked one (``prefill_chunk_size``) runs inside
        :meth:`prefilling`, so every chunk is pruned as prompt, whatever ``decoding`` says."""
        config = _compat.generation_config_of_prefill(args, kwargs)
        chunked = getattr(config, "prefill_chunk_size", None) is not None
        with self.prefilling() if chunked else contextlib.nullcontext():
            return original(*args, **kwargs)

    @contextlib.contextmanager
    def __call__(self, model: PreTrainedModel) -> Iterator[PreTrainedModel]:
        """Apply the press to ``model`` for the duration of the ``with`` block."""
        # Everything that can fail on bad input happens before the model is touched.
        _compat.check_supported_model(model)
        self.validate()
        if model.config._attn_implementation == ATTENTION_NAME:
            raise RuntimeError("A kvzap press is already applied to this model; presses cannot be nested.")
        modules = _compat.attention_modules(model)
        decoder = _compat.decoder_model(model)
        self.setup(model)
        scorers = self.scorers()
        try:
            ensure_registered()
            readers = tuple(s for s in scorers if s.reads_prefill_inputs) if self.scores_needed else ()
            original_attn = model.config._attn_implementation
            handles = []
            # Methods of the model shadowed for the block (instance attributes, removed on exit). Continuous
            # batching runs its own scheduler and paged cache: refused by name before it changes anything
            # (transformers' own error names kvzap's attention and advises switching it, unpruned). generate's
            # chunked prefill runs as one prompt (as in `prefilling()`), not as a prompt chunk then "decoding".
            shadows = {n: functools.partial(_refuse_continuous_batching, n) for n in _compat.CONTINUOUS_BATCHING}
            original = getattr(model, _compat.GENERATE_PREFILL, None)
            if original is not None:
                shadows[_compat.GENERATE_PREFILL] = functools.partial(self._generate_prefill, original)
            shadowed = [n for n in shadows if hasattr(model, n) and n not in vars(model)]
            try:
                for name in shadowed:
                    vars(model)[name] = shadows[name]
                model.set_attn_implementation(ATTENTION_NAME)
                handles.append(model.register_forward_pre_hook(self._model_start_hook, with_kwargs=True))
                start = functools.partial(self._forward_start_hook, modules)
                handles.append(decoder.register_forward_pre_hook(start, with_kwargs=True))
                handles.append(decoder.register_forward_hook(self._unclaim, always_call=True))
                if readers:  # after the padding check: a padded batch is refused before any oracle forward
                    hook = functools.partial(self._prefill_inputs_hook, model, readers)
                    handles.append(decoder.register_forward_pre_hook(hook, with_kwargs=True))
                for module in modules:
                    handles.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
                    handles.append(module.register_forward_hook(self._post_hook, with_kwargs=True))
                yield model
            finally:
                for name in shadowed:
                    vars(model).pop(name, None)
                for handle in handles:
                    handle.remove()
                unbind(modules)
                with self._lock:
                    self._running.pop(decoder, None)
                for module in modules:
                    self._calls.pop(module, None)
                if model.config._attn_implementation != original_attn:
                    model.set_attn_implementation(original_attn)
        finally:
            # Also when something failed after the scorers were set up: they count the models they serve.
            for scorer in scorers:
                scorer.release()


def _left_padding(attention_mask: Any, read: bool = True) -> tuple[torch.Tensor, int] | None:
    """The pad counts of a left-padded batch: ``((B,) long, their max)``, or None without padding (or when
    ``read`` is False: the mask's type and shape are checked, its values not read).

    A 2-D mask ``(B, n)`` marks padding with zeros, which must all come before the row's first one (left padding,
    as ``generate`` pads decoder-only models). A 4-D mask ``(B, 1, q, kv)`` is a custom pattern (packed
    sequences, prefix-LM) that eviction cannot honour, since evicted pairs are hidden by kvzap's own masks: it is
    refused whatever it holds. Reads the mask on the host once per forward.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"kvzap presses take attention_mask as a tensor (batch, tokens) or None, got "
            f"{type(attention_mask).__name__}."
        )
    if attention_mask.dim() != 2:
        raise ValueError(
            f"kvzap presses take a 2-D attention_mask (batch, tokens), the 4-D causal mask of a left-padded batch, "
            f"or none at all, got a {attention_mask.dim()}-D mask of shape {tuple(attention_mask.shape)}. Pass the "
            "2-D mask (batch, tokens) of a left-padded batch, or none."
        )
    if not read or not _compat.padded_rows(attention_mask):
        return None
    ones = attention_mask != 0
    if bool((ones[:, :-1] & ~ones[:, 1:]).any()):
        raise ValueError(
            "kvzap presses support left-padded batches only (zeros before each row's first token, as `generate` "
            "pads decoder-only models), but this attention mask has a zero after a one (right padding, or a hole): "
            "pad on the left (tokenizer.padding_side = 'left')."
        )
    pads = (~ones).sum(-1)  # (B,) zeros before the first one
    pad_max = int(pads.max())
    if pad_max == attention_mask.shape[-1]:
        raise ValueError(
            "A row of the attention mask holds only zeros: a sequence without tokens, or a first prefill chunk "
            "shorter than a row's padding. Drop empty sequences; in a chunked prefill, make the first chunk hold "
            "all the padding (the pipeline does)."
        )
    return pads, pad_max


def _left_padding_4d(
    mask: torch.Tensor, read: bool, inputs: Any, past: int, modules: list[nn.Module]
) -> tuple[torch.Tensor, int] | None:
    """The pad counts of a 4-D mask that is the causal mask of a left-padded batch, as :func:`_left_padding`.

    Such a mask ``(B, 1, q, past + q)`` (bool, True = may attend, or additive float: 0 or a large negative value)
    lets the query of absolute position ``p`` of row ``b`` attend to the keys ``pads[b] <= j <= p``: what
    transformers builds itself from the 2-D mask of a left-padded batch. kvzap honours exactly that pattern (a
    padding query may attend to nothing or to everything: its output is never used), and refuses any other one (packed
    sequences, prefix-LM, a sliding window drawn into the mask) before anything changes, since the pairs it
    evicts are hidden by its own masks, and a model with sliding-window layers, to which transformers would hand
    the same mask as to its full-attention layers. Only a sequence's first forward reads the mask's values; later
    ones check its shape.
    """
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"A 4-D attention_mask must be bool (True = may attend) or an additive float mask, got {mask.dtype}. "
            "Pass the 2-D mask (batch, tokens) of a left-padded batch instead."
        )
    sliding = [_compat.layer_index(m) for m in modules if is_sliding_module(m)]
    if sliding:
        raise ValueError(
            f"A 4-D attention_mask is used as-is by every layer, but layers {sliding} of this model attend through "
            "a sliding window that such a mask does not draw. Pass the 2-D mask (batch, tokens) of a left-padded "
            "batch, from which transformers builds each layer's own mask."
        )
    known = isinstance(inputs, torch.Tensor) and inputs.dim() >= 2
    batch, q_len = (int(inputs.shape[0]), int(inputs.shape[1])) if known else (mask.shape[0], mask.shape[2])
    if mask.shape[0] not in (1, batch) or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (q_len, past + q_len):
        raise ValueError(
            f"A 4-D attention_mask must have shape (batch, 1, new tokens, cached + new tokens) = ({batch}, 1, "
            f"{q_len}, {past + q_len}) for this forward, got {tuple(mask.shape)}. Pass the 2-D mask (batch, "
            "tokens) of a left-padded batch instead."
        )
    rows, keys = q_len, past + q_len
    if not read:
        return None
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    allowed = allowed[:, 0]  # (B, q, kv)
    last = allowed[:, -1]  # (B, kv): the last token of each row is a real one
    if not bool(last.any(dim=-1).all()):
        raise ValueError(
            "A row of the 4-D attention_mask lets its last token attend to nothing: a sequence without tokens. "
            "Drop empty sequences."
        )
    pads = last.to(torch.uint8).argmax(dim=-1)  # (B,) first key the last token may attend to
    positions = past + torch.arange(rows, device=mask.device)  # (q,) absolute positions of the queries
    columns = torch.arange(keys, device=mask.device)
    expected = (columns[None, None, :] >= pads[:, None, None]) & (columns[None, None, :] <= positions[None, :, None])
    real = positions[None, :] >= pads[:, None]  # (B, q) queries of real tokens
    # A padding query attends to nothing (transformers' own masks), or to everything (the legacy masks that
    # unmask fully masked rows for sdpa); anything else is a pattern of its own (e.g. a first packed document).
    padding_rows_ok = ~allowed.any(dim=-1) | allowed.all(dim=-1)  # (B, q)
    if not bool((allowed == expected)[real].all()) or not bool(padding_rows_ok[~real].all()):
        raise ValueError(
            "This 4-D attention_mask is not the causal mask of a left-padded batch (each token attending to every "
            "earlier real token and itself): custom patterns (packed sequences, prefix-LM, windows) cannot be "
            "combined with eviction, since kvzap hides evicted pairs with its own masks. Pass the 2-D mask "
            "(batch, tokens) of a left-padded batch, or none."
        )
    pads = pads.long().expand(batch)  # a mask of batch 1 serves every row
    pad_max = int(pads.max())
    if pad_max == 0:
        return None
    return pads, pad_max


def _evict_padding(layer: PrunableLayer, q_len: int) -> None:
    """Evict the padding columns among the ``q_len`` pairs the layer's last update appended.

    Called before the press decides anything, so that the compact storage never stores them; the pairs this
    evicts are added to the layer's ``_PAD_EVICTED`` counts (a sliding-window layer may no longer store some).
    """
    state = layer.press_state
    pad_max = state.get(_PAD_MAX, 0)
    first = layer.seen - q_len
    if pad_max <= first:
        return
    pads = state[_PADS]
    n = min(pad_max, layer.seen) - first
    columns = torch.arange(first, first + n, device=pads.device)
    mask = (columns[None, :] < pads[:, None])[:, None, :].expand(-1, layer.n_evicted.shape[1], -1)  # (B, H, n)
    before = layer.n_evicted
    layer.evict(first, mask)
    state[_PAD_EVICTED] = state[_PAD_EVICTED] + (layer.n_evicted - before).to(pads.device)


def pad_columns(layer: PrunableLayer, first: int, n: int) -> torch.Tensor | None:
    """``(B, n)`` True where columns ``first .. first + n - 1`` of the layer are padding; None without padding."""
    pads = layer.press_state.get(_PADS)
    if pads is None or layer.press_state[_PAD_MAX] <= first:
        return None
    return torch.arange(first, first + n, device=pads.device)[None, :] < pads[:, None]


# Keys of a layer's press_state that the base press owns (a sequence's padding), whatever press subclass runs.
_PADS, _PAD_MAX, _PAD_EVICTED = "pads", "pad_max", "pad_evicted"


def _refuse_continuous_batching(name: str, *args: Any, **kwargs: Any) -> None:
    raise NotImplementedError(
        f"`{name}` (transformers' continuous batching) cannot run under a kvzap press: it keeps the KV pairs in its "
        "own paged cache, which the press cannot prune. Under the press, call `model.generate` on a left-padded "
        "batch, or the `kv-press-text-generation` pipeline with a list of contexts and `batch_size=`; or leave the "
        "`with press(model):` block to batch continuously without pruning."
    )


def _check_cache(cache: Any, keep_sliding: bool = False) -> None:
    """Refuse caches the press cannot prune (offloaded, static, quantized, or filled without the press).

    ``keep_sliding``: the press leaves sliding-window layers alone (``prune_sliding_layers=False``), so those
    layers hold tokens without ever being wrapped: they are not "filled without the press".
    """
    if not isinstance(cache, Cache):
        raise TypeError(
            f"kvzap presses prune a `transformers.DynamicCache`, got a {type(cache).__name__} (continuous batching's "
            "paged cache, a legacy tuple, or another object). Pass no cache (one is created) or a `DynamicCache`."
        )
    if getattr(cache, "offloading", False):
        raise TypeError(
            "kvzap presses cannot prune an offloaded cache (layers moved between devices by the cache): "
            "pass no cache (one is created) or a `transformers.DynamicCache` without offloading."
        )
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, PrunableLayer):
            continue
        prunable_layer_like(layer)  # raises TypeError for layers we cannot prune
        if keep_sliding and isinstance(layer, _compat.DynamicSlidingWindowLayer):
            continue
        if layer.get_seq_length() > 0:
            raise ValueError(
                "The cache already holds tokens that were processed without the press. Apply the press before "
                "the first forward of the sequence (prefill under `with press(model):`), or pass a fresh cache."
            )


class _ThreadState(threading.local):
    """The per-call state of a press, one instance per thread."""

    def __init__(self) -> None:
        self.calls: dict[nn.Module, tuple[PrunableLayer, bool]] = {}
        self.stats: dict[int, tuple[torch.Tensor, int]] = {}
        self.prefilling = False
        self.drafts: int | None = None
        self.next_drafts: int | None = None
        # Pad counts ((B,) tensor, max) of the decoder forward that starts a sequence, read by its layers.
        self.pads: tuple[torch.Tensor, int] | None = None
