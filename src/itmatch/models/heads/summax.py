"""Sum-Max alignment (SCAN Eq. 9-10, after Karpathy & Fei-Fei): no attention, every word takes its
best region (t-i) or every region its best word (i-t), and the maxima are summed."""

from __future__ import annotations

import torch

from itmatch.models.base import ImageEmb, SimilarityHead, TextEmb, masked_pool
from itmatch.models.heads.common import region_word_dots


class SumMaxHead(SimilarityHead):
    bytes_per_cell = 12.0

    def __init__(self, direction: str = "t2i") -> None:
        super().__init__()
        if direction not in ("t2i", "i2t"):
            raise ValueError(f"direction must be 't2i' or 'i2t', not {direction!r}")
        self.direction = direction

    def forward(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        s = region_word_dots(img, txt)  # [n, k, m, l]
        rmask = img.mask[:, :, None, None]
        wmask = txt.mask[None, None, :, :]
        if self.direction == "t2i":  # S'_SM = sum_words max_regions s
            best = s.masked_fill(~rmask, float("-inf")).amax(1)  # [n, m, l]
            return masked_pool(best, txt.mask[None], dim=2, how="sum")
        best = s.masked_fill(~wmask, float("-inf")).amax(3)  # [n, k, m]
        return masked_pool(best, img.mask[:, :, None], dim=1, how="sum")
