"""MMCA's three-term ranking loss (Eq. 15)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def mmca_loss(scores: torch.Tensor, margin: float = 0.2, positives: torch.Tensor | None = None,
              joint_score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """MMCA Eq. 15, summed over the batch: for each matched pair (I, T) = (image i, caption i),
    [m - S(I,T) + S(I_hat, T_hat)]_+ + [m - S(I,T) + S(I_hat, T)]_+ + [m - S(I,T) + S(I, T_hat)]_+,
    with I_hat = argmax_{x != I} S(x, T) and T_hat = argmax_{y != T} S(I, y) the hardest negatives in the
    batch. The first term scores the hardest negative image against the hardest negative caption (as
    written: that pair may itself be a matched pair of the batch). `positives` as in `triplet_loss`;
    `joint_score(i_hat, t_hat)` gives S(I_hat, T_hat) when `scores` does not hold every pair."""
    b = scores.shape[0]
    diagonal = scores.diag()
    if positives is None:
        positives = torch.eye(b, dtype=torch.bool, device=scores.device)
    negatives = scores.masked_fill(positives, float("-inf"))
    hardest_caption, t_hat = negatives.max(1)  # S(I, T_hat), T_hat per image
    hardest_image, i_hat = negatives.max(0)  # S(I_hat, T), I_hat per caption
    joint = scores[i_hat, t_hat] if joint_score is None else joint_score(i_hat, t_hat)  # S(I_hat, T_hat)
    has_negative = torch.isfinite(hardest_caption) & torch.isfinite(hardest_image)
    terms = [(margin - diagonal + s).clamp(min=0) for s in (joint, hardest_image, hardest_caption)]
    return sum(t.masked_fill(~has_negative, 0.0) for t in terms).sum()
