"""Ranking losses over the score matrix of a batch."""

from __future__ import annotations

from collections.abc import Callable

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
def _without(positives: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    return torch.eye(n, dtype=torch.bool, device=device) if positives is None else positives


def intra_modal_negatives(scores: torch.Tensor, img_sim: torch.Tensor, txt_sim: torch.Tensor, strategy: str,
                          positives: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """OAN's intra-modal hard negatives of every pair i of a batch (pair i = image i, caption i):
    (index of v-bar_i, index of t-bar_i, valid_img, valid_txt), indices into the batch.

    eq11: v-bar = argmax_{v-} S(v-, v_i) and t-bar = argmax_{t-} S(t-, t_i) (intra-modal similarities
          img_sim [B, B] and txt_sim [B, B]);
    eq12: v-bar = the image paired with t-hat = argmax_{t-} S(v_i, t-), t-bar = the caption paired with
          v-hat = argmax_{v-} S(v-, t_i) (the inter-modal hard negatives of `scores` [B, B]).
    `positives` (default: the diagonal) marks pairs from the same image, which are never negatives of each
    other in either modality (it is symmetric when built from image ids, as the trainer does). A row with no
    candidate at all (a batch of one image) is not valid."""
    n = scores.shape[0]
    positives = _without(positives, n, scores.device)
    candidates = ~positives
    if strategy == "eq11":
        img_neg = img_sim.masked_fill(positives, float("-inf")).argmax(1)
        txt_neg = txt_sim.masked_fill(positives, float("-inf")).argmax(1)
    elif strategy == "eq12":
        masked = scores.masked_fill(positives, float("-inf"))
        img_neg = masked.argmax(1)  # t-hat of image i is caption j; its image is image j
        txt_neg = masked.argmax(0)  # v-hat of caption i is image j; its caption is caption j
    else:
        raise ValueError(f"unknown intra-modal negative sampling {strategy!r}; choose eq11 or eq12")
    return img_neg, txt_neg, candidates.any(1), candidates.any(0)


def oan_triplet_loss(scores: torch.Tensor, img_sim: torch.Tensor, txt_sim: torch.Tensor, margin: float = 0.2,
                     alpha_intra: float = 0.1, beta: float = 0.5, strategy: str = "eq12", hardest: bool = True,
                     positives: torch.Tensor | None = None) -> torch.Tensor:
    """OAN Eq. 10 summed over the batch: the inter-modal triplet loss of `scores` (Eq. 9, margin
    alpha_inter; the sum over negatives with hardest=False, for a warm-up) plus
    beta * ([alpha_intra - S(v, v) + S(v, v-bar)]_+ + [alpha_intra - S(t, t) + S(t, t-bar)]_+) per pair, with
    v-bar, t-bar from `intra_modal_negatives` (Eq. 11 or 12). The printed Eq. 10 lost "- S(v, v) +": the
    text derives the term from the triplet alpha - S(v, v) + S(v, v-bar) with S(v, v) = 1; the diagonal of
    img_sim / txt_sim is used for S(v, v), S(t, t). strategy="none" or beta=0: Eq. 9 alone."""
    inter = triplet_loss(scores, margin, hardest, positives)
    if strategy == "none" or beta == 0:
        return inter
    img_neg, txt_neg, valid_img, valid_txt = intra_modal_negatives(scores, img_sim, txt_sim, strategy, positives)
    rows = torch.arange(scores.shape[0], device=scores.device)
    img_term = (alpha_intra - img_sim.diagonal() + img_sim[rows, img_neg]).clamp(min=0) * valid_img
    txt_term = (alpha_intra - txt_sim.diagonal() + txt_sim[rows, txt_neg]).clamp(min=0) * valid_txt
    return inter + beta * (img_term.sum() + txt_term.sum())


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
