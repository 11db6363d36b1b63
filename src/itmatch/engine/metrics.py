"""Recall@K, median and mean rank, rsum (DESIGN.md section 3).

Ranks are 0-based. Ties are broken *against* the ground truth: a negative that scores exactly as high
as the best positive counts as ranked above it, so a constant (degenerate) model scores at or below
chance instead of looking perfect. Ties among the positives themselves do not matter (the best one counts).
"""

from __future__ import annotations

import math

import numpy as np
import torch

KS = (1, 5, 10)
DIRECTIONS = ("image_to_text", "text_to_image")


def image_to_text_ranks(scores: torch.Tensor, per_image: int = 5) -> torch.Tensor:
    """rank of image i = number of non-matching captions scoring >= its best matching caption."""
    n_img, n_txt = scores.shape
    if n_txt != per_image * n_img:
        raise ValueError(f"score matrix {tuple(scores.shape)} is not [N, {per_image}N]")
    owner = torch.arange(n_txt, device=scores.device) // per_image
    positive = owner[None, :] == torch.arange(n_img, device=scores.device)[:, None]
    best = scores.masked_fill(~positive, float("-inf")).amax(1, keepdim=True)
    return ((scores >= best) & ~positive).sum(1)


def text_to_image_ranks(scores: torch.Tensor, per_image: int = 5) -> torch.Tensor:
    """rank of caption j = number of other images scoring >= its own image."""
    n_img, n_txt = scores.shape
    owner = torch.arange(n_txt, device=scores.device) // per_image
    own = scores[owner, torch.arange(n_txt, device=scores.device)]
    return (scores >= own[None, :]).sum(0) - 1


def rank_metrics(ranks: torch.Tensor) -> dict[str, float]:
    r = ranks.double().cpu().numpy()
    out = {f"r{k}": 100.0 * float(np.mean(r < k)) for k in KS}
    out["medr"] = math.floor(float(np.median(r))) + 1
    out["meanr"] = float(r.mean()) + 1
    return out


def retrieval_metrics(scores: torch.Tensor, per_image: int = 5) -> dict[str, dict[str, float] | float]:
    """Both directions plus rsum and mR for one score matrix [n_img, per_image * n_img]."""
    scores = scores.float()
    result: dict[str, dict[str, float] | float] = {
        "image_to_text": rank_metrics(image_to_text_ranks(scores, per_image)),
        "text_to_image": rank_metrics(text_to_image_ranks(scores, per_image)),
    }
    return with_rsum(result)


def with_rsum(result: dict) -> dict:
    rsum = sum(result[d][f"r{k}"] for d in DIRECTIONS for k in KS)
    result["rsum"], result["mR"] = rsum, rsum / 6
    return result


def average_folds(folds: list[dict]) -> dict:
    """COCO 1K: each metric averaged over folds; rsum recomputed from the averaged recalls."""
    avg = {d: {m: float(np.mean([f[d][m] for f in folds])) for m in folds[0][d]} for d in DIRECTIONS}
    return with_rsum(avg)
