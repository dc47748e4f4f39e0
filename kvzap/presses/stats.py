"""Compression accounting of a press: which share of the real KV pairs it evicted, per layer, KV head and row.

:class:`CompressionStats` is mixed into :class:`~kvzap.presses.base.BasePress`. The press records each layer's
counts after its decisions (:meth:`CompressionStats._record`); the ratios are computed only when read. Padding
columns of a left-padded batch are taken off both the evicted and the seen counts of their row.
"""

from __future__ import annotations

import torch

from kvzap.cache import PrunableLayer
from kvzap.presses.padding import _PAD_EVICTED, _PADS

__all__ = ["CompressionStats"]


class CompressionStats:
    """The compression statistics of the last forward the calling thread ran under a press.

    Needs ``self._local`` (the press's thread-local state, with a ``stats`` dict).
    """

    @property
    def _stats(self) -> dict[int, tuple[torch.Tensor, torch.Tensor | int]]:
        """Statistics of the last forward the calling thread ran under this press, per layer."""
        return self._local.stats

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
