"""OAN's loss: the inter-modal triplet loss plus intra-modal hard negatives (Eq. 9-12)."""

from __future__ import annotations

import torch

from itmatch.models.losses import triplet_loss


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
