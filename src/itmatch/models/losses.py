"""Ranking losses over the score matrix of a batch."""

from __future__ import annotations

import torch


def triplet_loss(scores: torch.Tensor, margin: float = 0.2, hardest: bool = True,
                 positives: torch.Tensor | None = None) -> torch.Tensor:
    """Hinge triplet ranking loss, summed over the batch (SCAN Eq. 11 with hardest=False, Eq. 12 with
    hardest=True: only the hardest negative caption per image and image per caption).

    scores[i, j] = S(image i, caption j); the diagonal holds the matched pairs. `positives` (bool,
    same shape) marks further pairs that must not count as negatives, e.g. two captions of one image
    in the same batch; by default only the diagonal is positive, as in the public SCAN code."""
    diagonal = scores.diag()
    if positives is None:
        positives = torch.eye(scores.shape[0], dtype=torch.bool, device=scores.device)
    cost_caption = (margin + scores - diagonal[:, None]).clamp(min=0).masked_fill(positives, 0.0)
    cost_image = (margin + scores - diagonal[None, :]).clamp(min=0).masked_fill(positives, 0.0)
    if hardest:
        return cost_caption.amax(1).sum() + cost_image.amax(0).sum()
    return cost_caption.sum() + cost_image.sum()
