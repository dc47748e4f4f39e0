"""The interface every kvzap cache layer gives presses, and the snapshot rules every layer follows.

A press decides *which* pairs to evict; a cache layer decides *how* eviction is stored and how attention reads
what is left. Presses only talk to the small interface of :class:`PrunableLayer`:

- ``seen``: number of tokens ever appended to the layer (absolute positions ``0 .. seen - 1``);
- ``last_keys`` / ``last_values``: the new pairs of the current forward, ``(batch, kv_heads, q_len, head_dim)``,
  for scorers that look at keys or values; they live from the layer's ``update`` to :meth:`end_forward` (the
  end of the press's post-hook), never longer, so no dense copy of a prompt outlives the forward that made it;
- ``evict(start, mask)``: evict the pairs at absolute positions ``start .. start + n - 1`` where
  ``mask`` ``(batch, kv_heads, n)`` is True; an evicted pair is never attended again by any head;
- ``n_evicted``: ``(batch, kv_heads)`` number of pairs evicted so far;
- ``press_state``: a dict that the press owns (per sequence state, e.g. scores of the tokens still inside the
  sliding window); it travels with the cache, so one press object serves any number of sequences;
- ``attend(module, query, key, value, attention_mask, scaling, dropout)``: attention over the kept pairs,
  called by the attention function registered in :mod:`kvzap.attention`;
- ``snapshot()`` / ``restore(state)``: cheap checkpoints used by the pipeline to answer several questions
  against the same compressed context. A snapshot is a :class:`LayerState` that holds only what a restore
  needs: every attribute of a layer is declared either shared (replaced, never written in place), copied, or
  transient (alive within one forward, or derived); a layer with an undeclared attribute refuses to snapshot,
  so a new field is never shared by accident;
- ``begin_forward()`` / ``end_forward()``: the press binds the layer for one forward (its pre-hook, through
  :func:`kvzap.attention.bind`) and ends it at the end of its post-hook. A layer that a press has pruned
  refuses ``update`` outside a press (its evictions would be lost, or its compact storage unread).

The storages are :mod:`kvzap.cache` (masked: dense pairs and a keep mask) and :mod:`kvzap.compact` (compact:
evicted pairs freed).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = ["PrunableLayer", "LayerState", "check_evict_mask"]

# Attributes of transformers' dynamic layers (every 5.x release we support). Their ``update``/``crop``/batch
# operations replace these tensors instead of writing into them, so a snapshot shares them by reference.
_PARENT_FIELDS = frozenset(
    {
        "keys",
        "values",
        "is_initialized",
        "device",
        "dtype",
        "sliding_window",
        "cumulative_length",
        "_sliding_window_tensor",
        "record_past",
    }
)


@dataclass(frozen=True)
class LayerState:
    """A checkpoint of one prunable layer: the attributes a restore needs, by name.

    Attributes
    ----------
    layer_type : the class of the layer it was taken from (a restore into another class is refused).
    fields : attribute name -> value; shared values are the layer's own objects, copied ones are copies made
        by the layer's snapshot rules (see :meth:`PrunableLayer.snapshot`).
    """

    layer_type: type
    fields: dict[str, Any]


def _rows_of(value: Any, rows: torch.Tensor) -> Any:
    """``value``'s batch rows ``rows`` (tensors: along dim 0; tuples and lists: each item), other values as is."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value.index_select(0, rows.to(value.device))
    if isinstance(value, (tuple, list)):
        return type(value)(_rows_of(v, rows) for v in value)
    return value


def _trimmed(value: Any) -> Any:
    """``value``, or a copy of it when it is a tensor view holding more than twice its own bytes alive (e.g. the
    scores of the window's tokens, sliced out of the whole prompt's scores). Values are replaced, never
    written: snapshots may share them."""
    if isinstance(value, torch.Tensor) and value._base is not None:
        own = value.numel() * value.element_size()
        if value.untyped_storage().nbytes() > 2 * own + 64:
            return value.clone()
    return value


class PrunableLayer:
    """Mixin giving a transformers cache layer the eviction interface presses use (see the module docstring).

    Snapshot rules: every attribute of a layer is in exactly one of ``_SHARED_FIELDS`` (shared by reference with
    a snapshot: the layer only ever replaces it), ``_COPIED_FIELDS`` (copied by :meth:`_copy_field`) and
    ``_TRANSIENT_FIELDS`` (alive within one forward, or derived: not part of a snapshot, reset by a restore).
    """

    seen: int
    n_evicted: torch.Tensor | None
    press_state: dict[str, Any]
    last_keys: torch.Tensor | None
    last_values: torch.Tensor | None

    _SHARED_FIELDS: ClassVar[frozenset[str]] = _PARENT_FIELDS | {"seen", "n_evicted"}
    # press_state: a shallow copy (presses replace its values, never write into them).
    _COPIED_FIELDS: ClassVar[frozenset[str]] = frozenset({"press_state"})
    _TRANSIENT_FIELDS: ClassVar[frozenset[str]] = frozenset({"last_keys", "last_values", "_bound"})

    def _init_prunable(self) -> None:
        self.seen = 0
        self.n_evicted = None
        self.press_state = {}
        self.last_keys = None
        self.last_values = None
        # None: never driven by a press (a standalone layer); True: inside a press's forward; False: a press
        # drove it and its forward ended (an update now happens outside the press).
        self._bound: bool | None = None

    # The interface -------------------------------------------------------------------------------------------
    def evict(self, start: int, mask: torch.Tensor) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def attend(self, module: nn.Module, query, key, value, attention_mask, scaling, dropout):  # pragma: no cover
        raise NotImplementedError

    def kept_counts(self) -> torch.Tensor:  # pragma: no cover - abstract
        """``(batch, kv_heads)`` number of pairs physically held for attention."""
        raise NotImplementedError

    def keep_mask(self) -> torch.Tensor:  # pragma: no cover - abstract
        """``(batch, kv_heads, stored)`` True for kept pairs, over the last ``stored`` positions still covered by
        the layer (all positions seen, except for sliding-window layers)."""
        raise NotImplementedError

    def held_objects(self) -> list[Any]:
        """Every tensor and array this layer holds (for :func:`kvzap.cache.kv_bytes`): storage, bookkeeping, press
        state."""
        return [self.n_evicted, self.press_state, self.last_keys, self.last_values]

    def _select_press_state(self, rows: torch.Tensor) -> None:
        """Keep the press state's rows ``rows`` (a batch operation: select, repeat, reorder).

        Every tensor a press keeps per sequence has the batch first (scores ``(B, H, p)``, buffered hidden states
        ``(B, q, D)``, pad counts ``(B,)``), in the state's values or in tuples of them; other values (positions,
        counts) are the same for every row and stay.
        """
        self.press_state = {name: _rows_of(value, rows) for name, value in self.press_state.items()}

    # Forwards ------------------------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """Called by the press before the attention module's forward (through :func:`kvzap.attention.bind`)."""
        self._bound = True

    def end_forward(self) -> None:
        """Called at the end of the press's post-hook (also when the press failed): drop the new pairs of this
        forward (see ``last_keys``), leave the storage complete, and make sure the press's state keeps no large
        tensor alive through a small view of it (its values only: nested tuples are the press's buffers of new
        pairs, which are their own tensors)."""
        self.last_keys = self.last_values = None
        if self._bound:
            self._bound = False
        self.press_state = {name: _trimmed(value) for name, value in self.press_state.items()}

    def _check_bound(self) -> None:
        """Refuse an update outside the press once a press pruned this layer (nothing changed yet)."""
        if self._bound is False and self._needs_press():
            raise RuntimeError(
                f"This cache was pruned by a kvzap press ({type(self).__name__}) and is being used outside "
                "`with press(model):`: only the press's attention reads its kept pairs correctly. Use the cache "
                "inside `with press(model):`, or start a new cache."
            )

    def _needs_press(self) -> bool:
        """True when a forward without the press would read this layer wrongly."""
        return True

    # Snapshots -------------------------------------------------------------------------------------------------
    def _settle(self) -> None:
        """Bring the storage to a complete state (deferred writes done); nothing to do by default."""

    def _copy_field(self, name: str, value: Any) -> Any:
        if name == "press_state":
            return dict(value)
        raise NotImplementedError(name)  # pragma: no cover - every copied field has a rule

    def _restore_field(self, name: str, value: Any) -> Any:
        return self._copy_field(name, value)

    def _reset_transient(self) -> None:
        self.last_keys = self.last_values = None

    def unclassified_fields(self) -> set[str]:
        """Attributes covered by no snapshot rule (always empty for a correct layer class)."""
        return set(vars(self)) - self._SHARED_FIELDS - self._COPIED_FIELDS - self._TRANSIENT_FIELDS

    def snapshot(self) -> LayerState:
        """A checkpoint holding only what :meth:`restore` needs (see the class docstring)."""
        self._settle()
        unknown = self.unclassified_fields()
        if unknown:
            raise RuntimeError(
                f"{type(self).__name__} has attributes {sorted(unknown)} that no snapshot rule covers: add them to "
                "_SHARED_FIELDS, _COPIED_FIELDS or _TRANSIENT_FIELDS (a kvzap bug, or an unsupported transformers "
                "version)."
            )
        fields = {
            name: self._copy_field(name, value) if name in self._COPIED_FIELDS else value
            for name, value in vars(self).items()
            if name not in self._TRANSIENT_FIELDS
        }
        return LayerState(type(self), fields)

    def restore(self, state: LayerState) -> None:
        """Bring the layer back to ``state`` (which stays valid for later restores)."""
        if not isinstance(state, LayerState) or state.layer_type is not type(self):
            raise TypeError(
                f"Cannot restore a {type(self).__name__} from {state!r}: pass a state this layer's snapshot() made."
            )
        for name in [n for n in vars(self) if n not in self._TRANSIENT_FIELDS and n not in state.fields]:
            delattr(self, name)
        for name, value in state.fields.items():
            setattr(self, name, self._restore_field(name, value) if name in self._COPIED_FIELDS else value)
        self._reset_transient()

    @property
    def has_evictions(self) -> bool:
        """True when a pair was evicted (reads ``n_evicted``: on an accelerator, this waits for the device)."""
        return self.n_evicted is not None and bool(self.n_evicted.any())

    @property
    def reads_own_storage(self) -> bool:
        """True when attention must go through :meth:`attend` (what ``update`` returned is not the whole cache,
        or evicted pairs must be hidden); otherwise transformers' own sdpa reads ``update``'s output."""
        return self.has_evictions


def check_evict_mask(mask: Any, rows_heads: tuple[int, int], start: Any, seen: int) -> None:
    """Refuse an eviction mask that is not a bool ``(batch, kv_heads, n)`` tensor of this layer, or that covers
    positions the layer has not seen: it would otherwise broadcast over the rows or heads it does not name."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        what = f"a {mask.dtype} tensor" if isinstance(mask, torch.Tensor) else f"a {type(mask).__name__}"
        raise TypeError(f"evict expects a bool mask (True = evict), got {what}: compare scores with a threshold.")
    if mask.dim() != 3 or tuple(mask.shape[:2]) != tuple(rows_heads):
        raise ValueError(
            f"evict expects a mask of shape (batch={rows_heads[0]}, kv_heads={rows_heads[1]}, n), "
            f"got {tuple(mask.shape)}."
        )
    if isinstance(start, bool) or not isinstance(start, numbers.Integral):
        raise TypeError(f"evict expects an int start position, got {type(start).__name__}.")
    n_pos = mask.shape[-1]
    if n_pos and (start < 0 or start + n_pos > seen):
        raise ValueError(
            f"evict covers positions {start}..{start + n_pos - 1}, but this layer has seen positions "
            f"0..{seen - 1} only."
        )
