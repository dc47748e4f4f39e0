"""The SmolLM2 MLP variant bundled as ``SmolLM2-135M-Instruct/mlp-average`` (``KVzapScorer(variant="average")``).

It is the average of three MLPs kept in ``research/`` (its ``ensemble.json`` names them and their sha256). The
shipped file is checked from outside the code that wrote it: each member is loaded on its own, their predictions
are averaged here, and the shipped surrogate must predict that mean in every layer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from kvzap import KVzapScorer, KVzapSurrogate
from kvzap.surrogates.bundled import BUNDLED_DIR, bundled_surrogate_dir, list_bundled

ROOT = Path(__file__).resolve().parents[2]
NAME = "SmolLM2-135M-Instruct"
SMOLLM2 = {"n_modules": 30, "input_dim": 576, "output_dim": 3}
VARIANT = BUNDLED_DIR / NAME / "mlp-average"


def test_listed_beside_the_default():
    assert list_bundled()[NAME] == ["fastkvzip", "linear", "mlp", "mlp-average"]
    assert bundled_surrogate_dir(NAME, "mlp-average") == VARIANT
    assert bundled_surrogate_dir(f"HuggingFaceTB/{NAME}", "mlp") == BUNDLED_DIR / NAME / "mlp"


def test_the_variant_predicts_the_mean_of_its_members():
    record = json.loads((VARIANT / "ensemble.json").read_text())
    assert record["model_type"] == "mlp" and len(record["members"]) == 3
    shipped = KVzapSurrogate.from_pretrained(VARIANT, expect=SMOLLM2)
    assert shipped.model_type == "mlp" and shipped.hidden_dim == record["hidden_dim"] == 216
    members = []
    for member in record["members"]:
        weights = ROOT / member["path"] / "model.safetensors"
        assert hashlib.sha256(weights.read_bytes()).hexdigest() == member["sha256"], member["path"]
        assert member["weight"] == pytest.approx(1 / 3)
        members.append(KVzapSurrogate.from_pretrained(ROOT / member["path"], expect=SMOLLM2))
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 576) * 3
    with torch.no_grad():
        for layer in range(30):
            mean = sum(m(hidden, layer) for m in members) / 3
            torch.testing.assert_close(shipped(hidden, layer), mean, rtol=1e-6, atol=1e-5)  # float32 rounding
            # and it is not simply one of them (or the default MLP)
            assert (shipped(hidden, layer) - members[0](hidden, layer)).abs().max() > 1e-2


def test_its_accuracy_runs_read_these_very_weights():
    """The accuracy figures quoted for the variant (its model card, its study) are the shipped file's."""
    from evaluation.presses import weights_fingerprint

    runs = sorted((ROOT / "research/smollm2-135m-ensemble/second_suite").glob("HGpref_*/config.json"))
    assert len(runs) == 6
    shipped = weights_fingerprint(VARIANT)
    for run in runs:
        assert json.loads(run.read_text())["surrogate_weights"] == shipped, run.parent.name


def test_the_scorer_reads_it_only_when_asked():
    scorer = KVzapScorer("mlp", variant="average")
    assert scorer.bundled_type == "mlp-average" and scorer.surrogate is None
    assert KVzapScorer("mlp").bundled_type == "mlp"
