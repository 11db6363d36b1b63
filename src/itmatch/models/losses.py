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


def intra_pair_loss(matched: torch.Tensor, margin: float = 0.25, form: str = "similarity",
                    levels: int = 3) -> torch.Tensor:
    """SMAN's intra-pair constraint (Eq. 22), summed over the batch's matched pairs; `matched` holds
    their scores d(v_i, t_i). Eq. 22 has one term per direction, d(v, t+) and d(t, v+); for the matched
    pairs of a batch both are d(v_i, t_i), hence the factor 2.

    Eq. 22 is written for a distance, [d - m2]_+, but d is the similarity of Eq. 19-20 (a sum of
    `levels` cosines); taken literally it would push matched pairs apart. form="similarity" (default)
    flips the sign, [m2 - d]_+: a matched pair must reach a similarity of at least m2.
    form="distance" turns d into the distance sum_k (1 - cos_k) = levels - d and keeps Eq. 22's shape,
    [(levels - d) - m2]_+. Both are zero once the matched pairs satisfy the margin; docs/sman.md."""
    if form == "similarity":
        gap = margin - matched
    elif form == "distance":
        gap = (levels - matched) - margin
    else:
        raise ValueError(f"unknown intra-pair form {form!r}; choose similarity or distance")
    return 2 * gap.clamp(min=0).sum()
