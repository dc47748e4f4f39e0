"""Scorers (how important is a KV pair) and presses (what to evict, applied with ``with press(model):``).

Which file holds what:

- ``scorer.py``: the :class:`Scorer` interface; ``checks.py``: the checks of numbers, flags and scores shared by
  presses, scorers and the pipeline;
- ``base.py``: :class:`BasePress`, the ``with press(model):`` lifecycle and its hooks; ``padding.py``: reading
  and evicting the padding of left-padded batches; ``stats.py``: compression ratios per layer, head and row;
- ``threshold.py``: :class:`DMSThresholdPress`, the DMS threshold rule and its sliding window;
  ``topk.py``: :class:`TopKPress`, evicting a fixed share of the prompt per KV head (baselines);
- ``surrogate_scorer.py``: what learned scorers share (weights, shape checks, placement); built on it,
  ``kvzap_scorer.py`` (:class:`KVzapScorer`) and ``fastkvzip_scorer.py`` (:class:`FastKVzipScorer`);
  ``kvzip_plus_scorer.py``: the KVzip+ oracle; ``baseline_scorers.py``: random, key norm, recency and constant
  scorers.
"""

from kvzap.presses.base import BasePress, Scorer
from kvzap.presses.baseline_scorers import ConstantScorer, KeyNormScorer, RandomScorer, RecencyScorer
from kvzap.presses.fastkvzip_scorer import FastKVzipScorer
from kvzap.presses.kvzap_scorer import KVzapScorer
from kvzap.presses.kvzip_plus_scorer import KVzipPlusScorer
from kvzap.presses.surrogate_scorer import SurrogateScorer
from kvzap.presses.threshold import DMSThresholdPress
from kvzap.presses.topk import TopKPress

__all__ = [
    "BasePress",
    "Scorer",
    "KVzapScorer",
    "FastKVzipScorer",
    "KVzipPlusScorer",
    "SurrogateScorer",
    "RandomScorer",
    "KeyNormScorer",
    "RecencyScorer",
    "ConstantScorer",
    "DMSThresholdPress",
    "TopKPress",
]
