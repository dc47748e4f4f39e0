"""The press lifecycle: ``with press(model):`` and the hooks it registers on the model.

A press is applied with ``with press(model): ...``. Entering validates everything (model, press parameters,
scorer weights) before touching the model, then switches the model to kvzap's attention function and registers
one forward pre-hook and one forward hook per attention layer, and pre-hooks on the decoder stack (the pad counts
of a left-padded batch are read there from the 2-D attention mask; scorers that read the prefill's token ids get
them there).

Exiting removes the hooks, restores the attention implementation and lets the scorers drop their per-sequence
state, even when the body raises, so the model is left exactly as it was found.

Beside this module: the scorer interface (:mod:`kvzap.presses.scorer`), the argument and score checks
(:mod:`kvzap.presses.checks`), left padding (:mod:`kvzap.presses.padding`) and the compression statistics
(:mod:`kvzap.presses.stats`). Their public names are importable from here too.
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

import torch
from torch import nn
from transformers import Cache, PreTrainedModel

from kvzap import _compat
from kvzap.attention import ATTENTION_NAME, bind, ensure_registered, unbind
from kvzap.cache import PrunableLayer, own_window, prunable_layer_like
from kvzap.compact import compact_layer_like
from kvzap.layers import is_sliding_module
from kvzap.presses.checks import (
    as_bool,
    as_number,
    check_number,
    check_press_kv_bits,
    check_score_shape,
    check_scores,
)
from kvzap.presses.padding import (
    _PAD_EVICTED,
    _PAD_MAX,
    _PADS,
    _evict_padding,
    _left_padding,
    _left_padding_4d,
    pad_columns,
)
from kvzap.presses.scorer import Scorer
from kvzap.presses.stats import CompressionStats

logger = logging.getLogger(__name__)

__all__ = [
    "Scorer",
    "BasePress",
    "STORAGES",
    "as_bool",
    "as_number",
    "check_number",
    "check_score_shape",
    "check_scores",
    "pad_columns",
]


#: How evicted pairs are stored: "compact" frees them (per-head buffers, sliding-window layers stay masked);
#: "masked" keeps the dense cache and hides them (the reference for tests and benchmarks).
STORAGES = {"compact": compact_layer_like, "masked": prunable_layer_like}


@dataclass
class BasePress(CompressionStats, ABC):
    """Applies a pruning policy to a model through ``with press(model):``.

    Subclasses implement :meth:`process_layer`, called after each attention layer's forward with the layer's
    prunable cache, and say what they do through :attr:`prunes_during_decoding` (read by the pipeline).

    ``storage`` (keyword only, every press): ``"compact"`` (default) physically frees evicted pairs;
    ``"masked"`` keeps them in a dense cache and hides them from attention (same logits).

    ``kv_bits`` (keyword only, every press): None (default) stores the kept pairs in the model's dtype; 8 stores
    them as 8-bit codes, with float16 scales per slot and group of channels (compact storage only; see
    :mod:`kvzap.paged.quant`). Sliding-window layers left in the masked storage keep the model's dtype. 4 is
    refused with the measurement that shows its loss (the storage itself can hold 4-bit codes, for studies).

    ``prune_sliding_layers`` (keyword only, every press): False (default) leaves the layers whose cache is
    bounded by a sliding window (see :mod:`kvzap.layers`) alone: they are not scored, not evicted, and not
    counted in the statistics, since evicting from them frees no memory. True prunes them like the others.
    """

    storage: str = field(default="compact", kw_only=True)
    prune_sliding_layers: bool = field(default=False, kw_only=True)
    kv_bits: int | None = field(default=None, kw_only=True)

    #: False for presses whose decisions mix the rows' columns (a top-k over the prompt would rank padding):
    #: left-padded batches are then refused.
    supports_padding: ClassVar[bool] = True

    # Per-call state lives in thread-local storage (see ``_ThreadState``): one press may serve several models
    # from several threads at once, each thread seeing only its own forwards. Shared between threads: the map of
    # attention modules to the thread currently running their forward (a model runs one forward at a time).
    _local: threading.local = field(default_factory=lambda: _ThreadState(), init=False, repr=False, compare=False)
    _running: dict[nn.Module, tuple[int, int]] = field(default_factory=dict, init=False, repr=False, compare=False)
    _lock: Any = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        # A parameter set after construction (also inside `with press(model):`, where nothing validates again) is
        # checked as strictly as the constructor checks it.
        super().__setattr__(name, self._checked(name, value))

    def _checked(self, name: str, value: Any) -> Any:
        """``value`` checked for the parameter ``name`` (subclasses extend it); other names pass unchanged."""
        if name == "storage" and not (isinstance(value, str) and value in STORAGES):
            raise ValueError(f"storage must be one of {', '.join(map(repr, STORAGES))}, got {value!r}.")
        if name == "prune_sliding_layers":
            return as_bool("prune_sliding_layers", value)
        if name == "kv_bits":
            return check_press_kv_bits(value)
        return value

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
        self.kv_bits = check_press_kv_bits(self.kv_bits)
        if self.kv_bits is not None and self.storage != "compact":
            raise ValueError(
                f"kv_bits={self.kv_bits} quantizes the compact storage's pairs, but storage={self.storage!r} keeps a "
                "dense cache in the model's dtype: use storage='compact' or kv_bits=None."
            )

    @property
    def default_prefill_chunk_size(self) -> int | None:
        """Tokens per forward of the prompt prefill when the pipeline is not told (its ``prefill_chunk_size``):
        None, one forward, for every press kvzap ships. Top-k presses decide over the whole prompt at once, and a
        threshold press in chunks brings the first token sooner but loses needles at 4k tokens (see
        :data:`kvzap.presses.threshold.PREFILL_CHUNK_SIZE`), so the pipeline chunks only when asked."""
        return None

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

    def _storage_layer(self, layer: Any) -> PrunableLayer:
        """The prunable layer of the press's storage (and ``kv_bits``) standing in for transformers' ``layer``."""
        if self.kv_bits is not None:
            return compact_layer_like(layer, kv_bits=self.kv_bits)
        return STORAGES[self.storage](layer)

    # --- which layers the press touches -------------------------------------------------------------------------
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
            layers.extend(self._storage_layer(_compat.DynamicLayer()) for _ in range(idx + 1 - len(layers)))
        layer = layers[idx]
        if not isinstance(layer, PrunableLayer):
            layer = layers[idx] = self._storage_layer(layer)
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
