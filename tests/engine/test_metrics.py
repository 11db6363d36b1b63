"""Metrics against a brute-force reference (with ties), and the COCO 5-fold protocol."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from itmatch.engine.metrics import average_folds, retrieval_metrics


def brute_ranks(scores: np.ndarray, per_image: int = 5):
    """Loop version of the documented rule: ties with a negative count against the ground truth."""
    n_img, n_txt = scores.shape
    i2t, t2i = [], []
    for i in range(n_img):
        positives = range(per_image * i, per_image * i + per_image)
        best = max(scores[i, j] for j in positives)
        i2t.append(sum(1 for j in range(n_txt) if j not in positives and scores[i, j] >= best))
    for j in range(n_txt):
        own = j // per_image
        t2i.append(sum(1 for i in range(n_img) if i != own and scores[i, j] >= scores[own, j]))
    return i2t, t2i


def brute_metrics(ranks):
    r = sorted(ranks)
    n = len(r)
    median = (r[(n - 1) // 2] + r[n // 2]) / 2
    return {"r1": 100 * sum(x < 1 for x in r) / n, "r5": 100 * sum(x < 5 for x in r) / n,
            "r10": 100 * sum(x < 10 for x in r) / n, "medr": math.floor(median) + 1, "meanr": sum(r) / n + 1}


@pytest.mark.parametrize("seed", range(5))
def test_metrics_match_brute_force_with_ties(seed):
    rng = np.random.default_rng(seed)
    n = 23
    scores = rng.integers(0, 6, size=(n, 5 * n)).astype(np.float32)  # coarse values: many ties
    for i in range(n):  # make some items clearly right
        if i % 3 == 0:
            scores[i, 5 * i + 2] = 9
    result = retrieval_metrics(torch.from_numpy(scores))
    i2t, t2i = brute_ranks(scores)
    for direction, ranks in (("image_to_text", i2t), ("text_to_image", t2i)):
        expected = brute_metrics(ranks)
        for key, value in expected.items():
            assert result[direction][key] == pytest.approx(value), (direction, key)
    assert result["rsum"] == pytest.approx(sum(result[d][f"r{k}"] for d in ("image_to_text", "text_to_image")
                                               for k in (1, 5, 10)))
    assert result["mR"] == pytest.approx(result["rsum"] / 6)


def test_constant_scores_are_not_rewarded():
    result = retrieval_metrics(torch.zeros(10, 50))
    assert result["image_to_text"]["r1"] == 0 and result["text_to_image"]["r1"] == 0


def test_nan_scores_count_as_the_lowest_never_as_hits(caplog):
    """A diverged model's NaN scores must not look perfect (taken as they are, an all-NaN matrix ranks every ground
    truth first: rsum 600) nor lift a row above the same row at -inf; the evaluation says how many there were."""
    all_nan = retrieval_metrics(torch.full((10, 50), float("nan")))
    assert all_nan["rsum"] <= retrieval_metrics(torch.zeros(10, 50))["rsum"]
    scores = torch.from_numpy(np.random.default_rng(0).normal(size=(10, 50)).astype(np.float32))
    scores[3] = float("nan")  # one image's scores
    scores[:, 7] = float("nan")  # one caption's
    as_lowest = scores.nan_to_num(nan=float("-inf"))
    with caplog.at_level("WARNING", logger="itmatch.evaluate"):
        result = retrieval_metrics(scores)
    assert result == retrieval_metrics(as_lowest)
    i2t, t2i = brute_ranks(as_lowest.numpy())
    assert result["image_to_text"]["r1"] == pytest.approx(brute_metrics(i2t)["r1"])
    assert result["text_to_image"]["r10"] == pytest.approx(brute_metrics(t2i)["r10"])
    assert "59 of 500 scores are NaN" in caplog.text


def test_perfect_scores():
    scores = torch.full((4, 20), -1.0)
    for i in range(4):
        scores[i, 5 * i:5 * i + 5] = 1.0
    result = retrieval_metrics(scores)
    assert result["rsum"] == 600 and result["image_to_text"]["medr"] == 1


def test_coco_five_fold_average_recomputes_rsum():
    from itmatch.data.precomp import PrecompSplit
    from itmatch.engine.evaluate import protocol_folds

    rng = np.random.default_rng(0)
    split = PrecompSplit(root=None, split="testall", images=np.zeros((5000, 1, 1), np.float32),
                         captions=[f"c{j}" for j in range(25000)], ids=[str(i) for i in range(5000)])
    folds = protocol_folds(split, "coco1k")
    assert [f.n_images for f in folds] == [1000] * 5
    assert folds[2].captions[0] == "c10000" and folds[4].ids[-1] == "4999"
    results = [retrieval_metrics(torch.from_numpy(rng.standard_normal((30, 150)).astype(np.float32)))
               for _ in range(5)]
    avg = average_folds(results)
    for d in ("image_to_text", "text_to_image"):
        for key in ("r1", "r5", "r10", "medr", "meanr"):
            assert avg[d][key] == pytest.approx(np.mean([r[d][key] for r in results]))
    assert avg["rsum"] == pytest.approx(sum(avg[d][f"r{k}"] for d in ("image_to_text", "text_to_image")
                                            for k in (1, 5, 10)))
    with pytest.raises(Exception, match="5000"):
        protocol_folds(split.head(1000), "coco5k")
    with pytest.warns(UserWarning, match="one fold; COCO's 1K results average all five: --protocol coco1k"):
        assert protocol_folds(split, "1k")[0].n_images == 1000  # (COCO's testall read as 1K: said)


def test_a_score_matrix_of_the_wrong_shape_is_refused_in_both_directions():
    """text_to_image_ranks ranked a [4, 19] matrix without a word (only image_to_text_ranks checked the shape)."""
    from itmatch.engine.metrics import image_to_text_ranks, text_to_image_ranks

    for ranks in (image_to_text_ranks, text_to_image_ranks):
        with pytest.raises(ValueError, match=r"score matrix \(4, 19\) is not \[N, 5N\]"):
            ranks(torch.zeros(4, 19))


@pytest.mark.parametrize("seed", range(3))
def test_recall_curve_is_recall_at_every_k_of_the_brute_force_ranks(seed):
    rng = np.random.default_rng(seed)
    n = 23
    scores = rng.integers(0, 6, size=(n, 5 * n)).astype(np.float32)  # ties, as above
    result = retrieval_metrics(torch.from_numpy(scores), curve=True)
    for direction, ranks in zip(("image_to_text", "text_to_image"), brute_ranks(scores), strict=True):
        curve = result["recall_curve"][direction]
        assert len(curve) == 100
        for k in range(1, 101):  # (past the 115 captions / 23 images every query is found: 100%)
            assert curve[k - 1] == pytest.approx(100 * sum(r < k for r in ranks) / len(ranks), abs=1e-4), k
        for k in (1, 5, 10):
            assert curve[k - 1] == pytest.approx(result[direction][f"r{k}"], abs=1e-4)
    assert "recall_curve" not in retrieval_metrics(torch.from_numpy(scores))  # (training's validation: not asked)


def test_fold_curves_average_point_by_point():
    rng = np.random.default_rng(1)
    folds = [retrieval_metrics(torch.from_numpy(rng.standard_normal((30, 150)).astype(np.float32)), curve=True)
             for _ in range(3)]
    avg = average_folds(folds)
    for d in ("image_to_text", "text_to_image"):
        assert avg["recall_curve"][d][4] == pytest.approx(np.mean([f["recall_curve"][d][4] for f in folds]), abs=1e-4)
        assert avg["recall_curve"][d][9] == pytest.approx(avg[d]["r10"], abs=1e-4)
