"""Sum-Max alignment (SCAN Eq. 9-10, after Karpathy & Fei-Fei): no attention, every word takes its
best region (t-i) or every region its best word (i-t), and the maxima are summed."""

from __future__ import annotations

import torch

from itmatch.models.base import ImageEmb, SimilarityHead, TextEmb, masked_pool
from itmatch.models.region_word import region_word_dots


class SumMaxHead(SimilarityHead):
    bytes_per_cell = 10.0  # s (+ a masked copy with padding); calibrated: docs/performance.md, "The memory budget"
    bytes_per_pair = 0.0

    def __init__(self, direction: str = "t2i") -> None:
        super().__init__()
        if direction not in ("t2i", "i2t"):
            raise ValueError(f"direction must be 't2i' or 'i2t', not {direction!r}")
        self.direction = direction

    def forward(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        if self.direction == "t2i":  # S'_SM = sum_words max_regions s
            s = region_word_dots(img, txt, "image")  # [n, k, m, l]
            context_mask, query_mask = img.mask, txt.mask
        else:  # caption-major [m, l, n, k]: the max runs over dim 1 in both directions
            s = region_word_dots(img, txt, "text")
            context_mask, query_mask = txt.mask, img.mask
        if not bool(context_mask.all()):
            s = s.masked_fill(~context_mask[:, :, None, None], float("-inf"))
        best = s.amax(1)  # [B, b, Q]
        scores = masked_pool(best, query_mask[None], dim=2, how="sum")
        return scores if self.direction == "t2i" else scores.T
