"""Recall@K, median and mean rank, rsum (DESIGN.md section 3).

Ranks are 0-based. Ties are broken *against* the ground truth: a negative that scores exactly as high
as the best positive counts as ranked above it, so a constant (degenerate) model scores at or below
chance instead of looking perfect. Ties among the positives themselves do not matter (the best one counts).
A NaN score (a diverged model, a bad feature) counts as the lowest score. Taken as it is, every comparison with it
is false: a NaN ground truth would rank first, and an all-NaN matrix would score rsum 600.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch

KS = (1, 5, 10)
DIRECTIONS = ("image_to_text", "text_to_image")
CURVE_K = 100  # a recall curve: R@1 ... R@100, where the 1K protocol's 1000 images or 5000 captions still differ
log = logging.getLogger("itmatch.evaluate")


def nan_lowest(scores: torch.Tensor) -> torch.Tensor:
    """`scores` with NaN as -inf, so that a NaN ground truth ranks below every item (ties count against it) and a
    NaN negative below the ground truth: never rewarded."""
    # Checked first: the copy of a 1K test matrix per direction is not free in the common case without NaN.
    if not scores.isnan().any():
        return scores
    # posinf/neginf given, or nan_to_num would clamp +-inf (masked scores) to the largest finite floats.
    return scores.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def _check_shape(scores: torch.Tensor, per_image: int) -> tuple[int, int]:
    n_img, n_txt = scores.shape
    if n_txt != per_image * n_img:
        raise ValueError(f"score matrix {tuple(scores.shape)} is not [N, {per_image}N]")
    return n_img, n_txt


def image_to_text_ranks(scores: torch.Tensor, per_image: int = 5) -> torch.Tensor:
    """rank of image i = number of non-matching captions scoring >= its best matching caption."""
    n_img, n_txt = _check_shape(scores, per_image)
    scores = nan_lowest(scores)
    owner = torch.arange(n_txt, device=scores.device) // per_image
    positive = owner[None, :] == torch.arange(n_img, device=scores.device)[:, None]
    best = scores.masked_fill(~positive, float("-inf")).amax(1, keepdim=True)
    return ((scores >= best) & ~positive).sum(1)


def matched_scores(scores: torch.Tensor, per_image: int = 5) -> torch.Tensor:
    """Each caption's score with its own image (captions in image order, `per_image` each): [n_txt]."""
    _, n_txt = _check_shape(scores, per_image)
    caption = torch.arange(n_txt, device=scores.device)
    return scores[caption // per_image, caption]


def text_to_image_ranks(scores: torch.Tensor, per_image: int = 5) -> torch.Tensor:
    """rank of caption j = number of other images scoring >= its own image."""
    scores = nan_lowest(scores)
    own = matched_scores(scores, per_image)
    return (scores >= own[None, :]).sum(0) - 1


def rank_metrics(ranks: torch.Tensor) -> dict[str, float]:
    r = ranks.double().cpu().numpy()
    out = {f"r{k}": 100.0 * float(np.mean(r < k)) for k in KS}
    out["medr"] = math.floor(float(np.median(r))) + 1
    out["meanr"] = float(r.mean()) + 1
    return out


def recall_curve(ranks: torch.Tensor, max_k: int = CURVE_K) -> list[float]:
    """R@K for K = 1 ... max_k (percent, as rank_metrics' r1/r5/r10): the share of queries whose first match is
    among the top K."""
    r = ranks.cpu().numpy()
    within = np.cumsum(np.bincount(np.minimum(r, max_k), minlength=max_k + 1)[:max_k])  # [K-1]: ranks < K
    return [round(100.0 * float(n) / len(r), 4) for n in within]


def retrieval_metrics(scores: torch.Tensor, per_image: int = 5, curve: bool = False) -> dict[str, Any]:
    """Both directions plus rsum and mR for one score matrix [n_img, per_image * n_img]; with `curve`, also
    each direction's R@1 ... R@CURVE_K under "recall_curve"."""
    scores = scores.float()
    nans = int(scores.isnan().sum())
    if nans:
        log.warning("%d of %d scores are NaN (a diverged model, or NaN in its inputs): each counts as the lowest "
                    "score, so its pairs rank last", nans, scores.numel())
    ranks = {"image_to_text": image_to_text_ranks(scores, per_image),
             "text_to_image": text_to_image_ranks(scores, per_image)}
    result: dict[str, Any] = with_rsum({d: rank_metrics(ranks[d]) for d in DIRECTIONS})
    if curve:
        result["recall_curve"] = {d: recall_curve(ranks[d]) for d in DIRECTIONS}
    return result


def with_rsum(result: dict) -> dict:
    rsum = sum(result[d][f"r{k}"] for d in DIRECTIONS for k in KS)
    result["rsum"], result["mR"] = rsum, rsum / 6
    return result


def average_folds(folds: list[dict]) -> dict:
    """COCO 1K: each metric averaged over folds; rsum recomputed from the averaged recalls."""
    avg = with_rsum({d: {m: float(np.mean([f[d][m] for f in folds])) for m in folds[0][d]} for d in DIRECTIONS})
    if "recall_curve" in folds[0]:  # the curves the same way, point by point
        avg["recall_curve"] = {d: [round(float(v), 4) for v in np.mean([f["recall_curve"][d] for f in folds], 0)]
                               for d in DIRECTIONS}
    return avg
