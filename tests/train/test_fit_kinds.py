"""Per-kind evaluation: kept-set overlaps and top recalls with hand-computed values, R^2 per kind, kinds read from
prompts.jsonl, leave-kinds-out fits, evaluation of saved surrogates, and the top-weighted loss."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from kvzap.surrogates import KVzapSurrogate
from tests.train import make_tiny_llama
from train.collect import collect
from train.fit import (
    EVICTIONS,
    MLPConfig,
    TopWeightedMSELoss,
    collection_kinds,
    evaluate_saved,
    evaluate_surrogate,
    fit_and_save,
    fit_layer_mlp,
    fit_surrogate,
    kept_overlap,
    leave_kinds_out,
    top_recall,
)
from train.plots import _bar_styles


def test_kept_overlap_one_prompt_one_head():
    target = torch.tensor([4.0, 3.0, 2.0, 1.0]).view(4, 1, 1)
    prediction = torch.tensor([4.0, 2.0, 3.0, 1.0]).view(4, 1, 1)
    result = kept_overlap(prediction, target)
    # 50% evicted keeps 2 of 4: the oracle keeps rows {0, 1}, the surrogate {0, 2}. 67% and 80% keep row 0 only.
    assert result["per_head"]["0.5"] == {"mean": 0.5, "per_layer": [0.5]}
    assert result["per_head"]["0.67"]["mean"] == 1.0 and result["per_head"]["0.8"]["mean"] == 1.0
    assert result["dms"] == result["per_head"]  # one head, one prompt: both rules rank the same scores


def test_kept_overlap_per_head_against_one_threshold_per_layer():
    # Two prompts of two rows, one layer, two heads whose scores live on different scales.
    target = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0]]).view(4, 1, 2)
    prediction = torch.tensor([[2.0, 10.0], [1.0, 20.0], [3.0, 40.0], [4.0, 30.0]]).view(4, 1, 2)
    groups = torch.tensor([0, 0, 1, 1])
    result = kept_overlap(prediction, target, groups)
    # Per head, each prompt keeps its top row: head 0 misses in prompt 0, head 1 misses in prompt 1.
    assert result["per_head"]["0.5"] == {"mean": 0.5, "per_layer": [0.5]}
    assert result["per_head"]["0.8"]["mean"] == 0.5  # at least one row is kept per prompt and head
    # One threshold per layer over 8 pairs: both keep head 1's four pairs at 50%, then the same two at 80%.
    assert result["dms"]["0.5"] == {"mean": 1.0, "per_layer": [1.0]}
    assert result["dms"]["0.8"]["mean"] == 1.0
    with pytest.raises(ValueError, match="evictions"):
        kept_overlap(prediction, target, groups, evictions=(1.0,))
    with pytest.raises(ValueError, match="groups"):
        kept_overlap(prediction, target, groups[:3])
    with pytest.raises(ValueError, match="shape"):
        kept_overlap(prediction[:, 0], target[:, 0])


def test_top_recall_hand_computed():
    # One layer, 10 rows, 2 heads: 20 pairs with oracle scores 0..19 (pair 19 the best, pair 18 next).
    target = torch.arange(20.0).view(10, 1, 2)
    prediction = target.clone()
    prediction.view(-1)[19] = -1.0  # the surrogate ranks the oracle's best pair last, the rest in order
    result = top_recall(prediction, target, evictions=(0.8, 0.9), shares=(0.05, 0.1))
    # 5% of 20 is the best pair alone, which no threshold keeps; 10% adds pair 18, kept at 80% (top 4 predicted:
    # 18, 17, 16, 15) and at 90% (top 2: 18, 17).
    assert result["0.8"]["0.05"] == {"mean": 0.0, "min": 0.0, "per_layer": [0.0]}
    assert result["0.8"]["0.1"]["mean"] == 0.5 and result["0.9"]["0.1"]["mean"] == 0.5
    # The oracle keeps its own top; a reversed ranking keeps none of it; layers are averaged.
    both = torch.cat([target, -target], dim=1)  # layer 0 the oracle itself, layer 1 reversed
    result = top_recall(both, torch.cat([target, target], dim=1), evictions=(0.8,), shares=(0.05, 0.2))
    assert result["0.8"]["0.2"] == {"mean": 0.5, "min": 0.0, "per_layer": [1.0, 0.0]}
    assert set(result) == {"0.8"} and set(result["0.8"]) == {"0.05", "0.2"}
    with pytest.raises(ValueError, match="evictions and shares"):
        top_recall(prediction, target, shares=(0.0,))
    with pytest.raises(ValueError, match="shape"):
        top_recall(prediction[:, 0], target[:, 0])


def test_kinds_plot_gives_each_surrogate_one_colour():
    # Five surrogates at three eviction rates are 15 series: one colour cycle over them repeated colours across
    # surrogates (the fourth surrogate's first series took the first one's colour).
    names = ["bundled", "a", "b", "H", "wd03"]
    styles = _bar_styles(names, list(EVICTIONS))
    colours = [{styles[name, e]["color"] for e in EVICTIONS} for name in names]
    assert all(len(c) == 1 for c in colours)  # a surrogate keeps its colour at every rate
    assert len({c.pop() for c in colours}) == len(names)  # and no two surrogates share one
    assert [styles["H", e]["alpha"] for e in EVICTIONS] == pytest.approx([1.0, 0.7, 0.4])  # lighter as more is evicted
    assert _bar_styles(names, [None])["H", None]["alpha"] == 1.0  # the R^2 panel: one series per surrogate
    assert len({v["color"] for v in _bar_styles([str(i) for i in range(12)], [None]).values()}) == 12


class FirstFeatures(nn.Module):
    """A stand-in surrogate that predicts the first H features of each layer's input."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.n_heads = n_heads

    def forward_all(self, X):
        return X[:, :, : self.n_heads]


def test_r2_and_overlap_per_kind():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    X = torch.cat([x, x]).view(8, 1, 1)
    y = torch.cat([2 * x + 1, torch.tensor([0.0, 2.0, 1.0, 3.0])]).view(8, 1, 1)
    kinds = ["code"] * 4 + ["prose"] * 4
    prompt_index = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    result = evaluate_surrogate(FirstFeatures(1), X, y, prompt_index=prompt_index, kinds=kinds)
    assert result["per_kind"]["code"]["mean_r2"] == pytest.approx(1.0)
    # prose: Pearson r = 4 / sqrt(5 * 5) = 0.8
    assert result["per_kind"]["prose"]["mean_r2"] == pytest.approx(0.64)
    assert result["mean_r2"] == pytest.approx(np.corrcoef(X.flatten(), y.flatten())[0, 1] ** 2)
    assert result["per_kind"]["prose"]["n_pairs"] == 4 and result["per_kind"]["prose"]["n_prompts"] == 2
    assert result["per_kind"]["code"]["overlap"]["per_head"]["0.5"]["mean"] == 1.0  # a monotone map keeps the ranks
    # prose, prompt 1 rows (0, 2) and prompt 2 rows (1, 3) have the same order in x and y: per head 1.0;
    # pooled, the top two of y are rows 1 and 3 (2, 3), of x rows 2 and 3: half of them.
    assert result["per_kind"]["prose"]["overlap"]["per_head"]["0.5"]["mean"] == 1.0
    assert result["per_kind"]["prose"]["overlap"]["dms"]["0.5"]["mean"] == 0.5
    assert "per_head" not in result["per_kind"]["code"] and np.asarray(result["per_head"]).shape == (1, 1)
    with pytest.raises(ValueError, match="kinds"):
        evaluate_surrogate(FirstFeatures(1), X, y, kinds=kinds[:3])


def write_prompts(directory, subsets):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "prompts.jsonl").write_text(
        "".join(json.dumps({"subset": s, "source": "x", "tokens": 10}) + "\n" for s in subsets)
    )


def test_collection_kinds(tmp_path):
    write_prompts(tmp_path, ["man-pages", "c-headers", "nemotron-math"])
    with (tmp_path / "prompts.jsonl").open("a") as f:
        f.write(json.dumps({"subset": "other", "kind": "dialogue", "source": "y", "tokens": 10}) + "\n")
    kinds = collection_kinds(tmp_path, torch.tensor([0, 0, 1, 2, 3]))
    assert kinds == ["docs-en", "docs-en", "code-c", "nemotron-math", "dialogue"]
    with pytest.raises(ValueError, match="describes 4 prompts"):
        collection_kinds(tmp_path, torch.tensor([4]))
    with pytest.raises(FileNotFoundError, match="prompts.jsonl"):
        collection_kinds(tmp_path / "missing", torch.tensor([0]))


@pytest.fixture(scope="module")
def kinds_collections(tmp_path_factory, tiny_tokenizer):
    """A train collection of 4 prompts (2 code-c, 2 dialogue) and a test collection of 2 (code-c, dialogue)."""
    root = tmp_path_factory.mktemp("kinds")
    model = make_tiny_llama()
    texts = ["int main(void) { return 0; }", "A: hi there\nB: hello you", "#define X 1\n#define Y 2", "A: ok?\nB: ok."]
    tests = ["struct s { int a; };", "A: bye now\nB: see you"]
    ids = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts + tests]
    collect(model, tiny_tokenizer, ids[:4], root / "train", n_tokens=8, shard_size=2)
    collect(model, tiny_tokenizer, ids[4:], root / "test", n_tokens=8, shard_size=2)
    write_prompts(root / "train", ["c-headers", "chat-en", "c-headers", "chitchat-en"])
    write_prompts(root / "test", ["c-headers", "plays-en"])
    return root


def test_leave_kinds_out(kinds_collections, tmp_path):
    root = kinds_collections
    config = MLPConfig(hidden_dim=8, batch_size=16, max_epochs=2)
    report = leave_kinds_out([root / "train"], tmp_path / "out", test_dirs=[root / "test"], mlp_config=config)
    assert set(report["kinds"]) == {"code-c", "dialogue"}
    for entry in report["kinds"].values():
        # 8 positions per prompt: fit on the 2 training prompts of the other kind, test on the 3 of this kind.
        assert entry["n_train_pairs"] == 16 and entry["n_test_pairs"] == 24 and entry["n_test_prompts"] == 3
        for model_type in ("linear", "mlp"):
            result = entry["surrogates"][model_type]
            assert 0 <= result["mean_r2"] <= 1 and set(result["overlap"]) == {"per_head", "dms"}
    saved = json.loads((tmp_path / "out" / "leave_kinds_out.json").read_text())
    assert saved["kinds"]["dialogue"]["n_test_pairs"] == 24
    assert (tmp_path / "out" / "leave_kinds_out.png").read_bytes()[:4] == b"\x89PNG"
    only = leave_kinds_out([root / "train"], tmp_path / "one", kinds=["dialogue"], model_types=("linear",))
    assert list(only["kinds"]) == ["dialogue"] and only["kinds"]["dialogue"]["n_test_pairs"] == 16
    with pytest.raises(ValueError, match="math"):
        leave_kinds_out([root / "train"], tmp_path / "x", kinds=["math"], model_types=("linear",))


def test_fit_and_save_reports_kinds_and_evaluate_saved(kinds_collections, tmp_path):
    root = kinds_collections
    config = MLPConfig(hidden_dim=8, batch_size=16, max_epochs=2)
    report = fit_and_save(root / "train", tmp_path / "fit", test_dir=root / "test", mlp_config=config)
    for model_type in ("linear", "mlp"):
        per_kind = report["surrogates"][model_type]["per_kind"]
        assert set(per_kind) == {"code-c", "dialogue"} and per_kind["dialogue"]["n_pairs"] == 8
        assert set(report["surrogates"][model_type]["overlap"]["dms"]) == {"0.5", "0.67", "0.8"}
        recall = report["surrogates"][model_type]["top_recall"]
        assert set(recall) == {"0.8", "0.9"} and set(recall["0.9"]) == {"0.01", "0.05"}
        assert 0 <= recall["0.9"]["0.05"]["min"] <= recall["0.9"]["0.05"]["mean"] <= 1
        assert "top_recall" in per_kind["dialogue"]
    assert (tmp_path / "fit" / "kinds.png").exists()
    surrogates = {t: tmp_path / "fit" / t for t in ("linear", "mlp")}
    evaluated = evaluate_saved(surrogates, [root / "test"], tmp_path / "eval")
    # The saved surrogates reload and score the test rows as they did right after the fit.
    for model_type in ("linear", "mlp"):
        assert evaluated["surrogates"][model_type]["mean_r2"] == pytest.approx(
            report["surrogates"][model_type]["mean_r2"], abs=1e-6
        )
    assert evaluated["n_prompts"] == 2 and (tmp_path / "eval" / "kinds.png").exists()
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["surrogates"]["mlp"]["per_kind"]
    both = evaluate_saved({"linear": surrogates["linear"]}, [root / "train", root / "test"], tmp_path / "eval2")
    assert both["n_prompts"] == 6  # prompt 0 of the test collection is not prompt 0 of the train collection
    assert isinstance(KVzapSurrogate.from_pretrained(surrogates["mlp"]), KVzapSurrogate)


def test_fit_surrogate_on_rows_equals_fit_on_their_copy():
    rng = np.random.default_rng(3)
    X = torch.from_numpy(rng.normal(size=(300, 2, 8)).astype(np.float32))
    y = torch.from_numpy(rng.normal(size=(300, 2, 2)).astype(np.float32))
    rows = torch.arange(0, 300, 3)
    on_rows, _ = fit_surrogate(X, y, "linear", rows=rows)
    on_copy, _ = fit_surrogate(X[rows], y[rows], "linear")
    torch.testing.assert_close(on_rows.forward_all(X), on_copy.forward_all(X))


def test_top_weighted_mse():
    prediction, target = torch.zeros(2, 1), torch.tensor([[1.0], [3.0]])
    plain = TopWeightedMSELoss(torch.tensor([2.0]), top_weight=0.0)
    assert plain(prediction, target) == pytest.approx(nn.MSELoss()(prediction, target).item())
    # The second pair is at the top (3 >= 2): weights 1 and 2, squared errors 1 and 9.
    weighted = TopWeightedMSELoss(torch.tensor([2.0]), top_weight=1.0)
    assert weighted(prediction, target).item() == pytest.approx((1 + 2 * 9) / 3)
    with pytest.raises(ValueError, match="top_weight"):
        TopWeightedMSELoss(torch.tensor([0.0]), top_weight=-1.0)


def test_mlp_with_top_weighting():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(512, 8)).astype(np.float32)
    y = np.tanh(X[:, :2]).astype(np.float32)
    top = y >= np.quantile(y, 0.8, axis=0)  # (512, 2): the top 20% of each head
    errors = {}
    for weight in (0.0, 4.0):
        config = MLPConfig(
            hidden_dim=8, batch_size=64, max_epochs=6, valid_fraction=0.1, top_weight=weight, top_quantile=0.8
        )
        module, _ = fit_layer_mlp(X, y, config)
        with torch.no_grad():
            squared = (module(torch.from_numpy(X)).numpy() - y) ** 2
        errors[weight] = (squared[top].mean(), squared[~top].mean())
    # Same seed and data: the weighting trades error on the rest of the distribution for error at its top.
    assert errors[4.0][0] < 0.8 * errors[0.0][0] and errors[4.0][1] > errors[0.0][1]
    with pytest.raises(ValueError, match="top_quantile"):
        fit_layer_mlp(X, y, MLPConfig(top_quantile=1.0))
