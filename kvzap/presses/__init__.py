"""Scorers (how important is a KV pair) and presses (what to evict, applied with ``with press(model):``)."""

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
