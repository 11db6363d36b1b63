"""Global embedding similarity (VSE++): cosine of two l2-normalised vectors."""

from __future__ import annotations

import torch

from itmatch.models.base import ImageEmb, SimilarityHead, TextEmb


class GlobalCosineHead(SimilarityHead):
    bytes_per_cell = bytes_per_pair = 0.0  # pair-independent: one matrix product
    score_bound = 0.0  # the score is the global cosine itself

    def forward(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        if img.vector is None or txt.vector is None:
            raise ValueError("the global head needs pooled image and caption vectors")
        return img.vector @ txt.vector.T
