"""SMAN's intra-pair constraint (Eq. 22)."""

from __future__ import annotations

import torch


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
