"""SMAN's multi-modal attention, score and loss (Ji et al., section III-B2 and III-C), all pairs of a block
at once: d = sum_k cos(v(k), t(k)) (Eq. 19-20), levels 0 and 1 one matrix product of the encoders' vectors,
level 2 pair-dependent through the fusion gate (Eq. 12), with everything else computed once per item in
`prepare_*`. What is per item and what per pair: docs/sman.md, "Cost: what is per item, what is per pair".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from itmatch.models.base import ImageEmb, SimilarityHead, TextEmb, l2norm
from itmatch.models.losses import triplet_loss
from itmatch.models.sman.attention import GuidedAttention, masked_softmax
from itmatch.models.sman.config import FORMS
from itmatch.models.sman.loss import intra_pair_loss


def fusion_gate(v_hat: torch.Tensor, t_hat: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """o(v) = sigmoid(alpha v^ + (1 - alpha) t^), o(t) = sigmoid(alpha t^ + (1 - alpha) v^) (Eq. 12).
    Broadcasts: v_hat [n, 1, D] with t_hat [1, m, D] gives every pair."""
    return torch.sigmoid(alpha * v_hat + (1 - alpha) * t_hat), torch.sigmoid(alpha * t_hat + (1 - alpha) * v_hat)


class SMANHead(SimilarityHead):
    """steps=2: d(0) + d(1) + d(2) (SMAN); steps=1: d(0) + d(1), intra-modal attention only (SMAN-IM,
    SMAN-IM-LOC). The training loss is Eq. 21 + lambda * Eq. 22 (see `training_loss`)."""

    # pair-independent when every level is per item (steps 1, alpha 1); otherwise set in __init__
    bytes_per_cell = bytes_per_pair = 0.0

    def __init__(self, img_dim: int, embed_size: int, att_hidden: int, *, regions: int = 49, steps: int = 2,
                 alpha: float = 0.9, divide_by_m: bool = False, intra_pair_weight: float = 1.0,
                 intra_pair_margin: float = 0.25, intra_pair_form: str = "similarity") -> None:
        super().__init__()
        if steps not in (1, 2):
            raise ValueError(f"model.sman.steps must be 1 or 2, not {steps}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"model.sman.alpha must be in [0, 1], not {alpha}")
        if intra_pair_form not in FORMS:
            raise ValueError(f"model.sman.intra_pair_form must be one of {FORMS}, not {intra_pair_form!r}")
        self.steps, self.alpha, self.divide_by_m = steps, alpha, divide_by_m
        self.intra_pair_weight, self.intra_pair_margin = intra_pair_weight, intra_pair_margin
        self.intra_pair_form = intra_pair_form
        self.levels = steps + 1
        self.per_item = steps == 1 or alpha == 1.0
        if steps == 2:
            self.u_v = nn.Linear(embed_size, embed_size)  # U_v, Eq. 12
            self.u_t = nn.Linear(embed_size, embed_size)  # U_t
            self.att_v = GuidedAttention(img_dim, embed_size, att_hidden)  # Eq. 13-14
            self.att_t = GuidedAttention(embed_size, embed_size, att_hidden)  # Eq. 16-17
            self.p2 = nn.Linear(img_dim, embed_size)  # P(2), Eq. 15
        if not self.per_item:
            # float32 temporaries of one block, per (image, caption) pair: o(v), o(t), v(2) before and
            # after tanh, t(2) and its transpose, the cosine's normalised copies (~9 D), the two queries
            # (2 H) and, per region and per word, logits and weights (counted per cell: 16 bytes * (M + L)
            # ~ 16 * M + 16 * L; the L part is expressed through bytes_per_cell = 16 / M).
            self.bytes_per_pair = 4.0 * (9 * embed_size + 2 * att_hidden + 4 * regions)
            self.bytes_per_cell = 16.0 / regions

    # ----- per-item parts ------------------------------------------------------------------------------
    def prepare_images(self, img: ImageEmb) -> ImageEmb:
        if self.steps == 2:
            img.extras["hat"] = self.u_v(img.extras["v0"] + img.extras["v1"])
            img.extras["keys2"] = self.att_v.keys(img.regions)  # [N, M, H]
            proj = F.linear(img.regions, self.p2.weight)  # P(2) I_m without the bias, [N, M, D]
            img.extras["proj2"] = proj / img.mask.sum(1)[:, None, None] if self.divide_by_m else proj
            if self.alpha == 1.0:  # o(v) = sigmoid(U_v(v0 + v1)): v(2) is per image
                o_v, _ = fusion_gate(img.extras["hat"], img.extras["hat"], 1.0)
                v2 = self.attend_images(img, self.att_v.query(o_v)[:, None])[:, 0]
                img.vector = torch.cat([img.vector, l2norm(v2)], -1)
        return img

    def prepare_texts(self, txt: TextEmb) -> TextEmb:
        if self.steps == 2:
            txt.extras["hat"] = self.u_t(txt.extras["t0"] + txt.extras["t1"])
            txt.extras["keys2"] = self.att_t.keys(txt.words)  # [M, L, H]
            txt.word_axes["keys2"] = (1,)
            if self.alpha == 1.0:
                _, o_t = fusion_gate(txt.extras["hat"], txt.extras["hat"], 1.0)
                t2 = self.attend_texts(txt, self.att_t.query(o_t)[None])[:, 0]
                txt.vector = torch.cat([txt.vector, l2norm(t2)], -1)
        return txt

    # ----- multi-modal attention ---------------------------------------------------------------------
    def attend_images(self, img: ImageEmb, queries: torch.Tensor, weights: bool = False) -> torch.Tensor:
        """v(2) of Eq. 13-15 for queries [n, m, H] (query j of image i) -> [n, m, D] (or the weights
        [n, M, m] with weights=True). One bmm per block for the logits, one for the weighted sum."""
        logits = torch.bmm(img.extras["keys2"], queries.transpose(1, 2))  # [n, M, m]
        att = masked_softmax(logits, img.mask[:, :, None], dim=1)
        if weights:
            return att
        return torch.tanh(torch.bmm(att.transpose(1, 2), img.extras["proj2"]) + self.p2.bias)

    def attend_texts(self, txt: TextEmb, queries: torch.Tensor, weights: bool = False) -> torch.Tensor:
        """t(2) of Eq. 16-18 for queries [n, m, H] (query i of caption j) -> [m, n, D] (or the weights
        [m, L, n] with weights=True)."""
        logits = torch.bmm(txt.extras["keys2"], queries.permute(1, 2, 0))  # [m, L, n]
        att = masked_softmax(logits, txt.mask[:, :, None], dim=1)
        if weights:
            return att
        return torch.bmm(att.transpose(1, 2), txt.words)  # [m, n, D]

    def multimodal(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        """d(2) = cos(v(2), t(2)) for every pair of the block, [n, m] (Eq. 12-19)."""
        o_v, o_t = fusion_gate(img.extras["hat"][:, None], txt.extras["hat"][None], self.alpha)  # [n, m, D]
        v2 = self.attend_images(img, self.att_v.query(o_v))  # [n, m, D]
        t2 = self.attend_texts(txt, self.att_t.query(o_t))  # [m, n, D]
        return (l2norm(v2) * l2norm(t2).transpose(0, 1)).sum(-1)

    def forward(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        if img.vector is None or txt.vector is None:
            raise ValueError("the SMAN head needs the SMAN encoders' level vectors")
        scores = img.vector @ txt.vector.T  # d(0) + d(1) (+ d(2) when it is per item)
        if not self.per_item:
            scores = scores + self.multimodal(img, txt)
        return scores

    # ----- objective ---------------------------------------------------------------------------------
    def training_loss(self, img: ImageEmb, txt: TextEmb, margin: float, hardest: bool,
                      positives: torch.Tensor | None = None) -> torch.Tensor:
        """L = L_inter-pair (Eq. 21: bidirectional triplet ranking, margin m1 = `margin`, hardest
        negatives as the paper) + lambda * L_intra-pair (Eq. 22, margin m2; sign: docs/sman.md)."""
        scores = self(img, txt)
        total = triplet_loss(scores, margin, hardest, positives)
        if self.intra_pair_weight > 0:
            total = total + self.intra_pair_weight * intra_pair_loss(
                scores.diagonal(), self.intra_pair_margin, self.intra_pair_form, self.levels)
        return total
