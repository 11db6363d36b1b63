"""Similarity functions: score(img, txt) -> [n_img, n_txt] for every pair, batched."""

from itmatch.models.heads.global_cosine import GlobalCosineHead
from itmatch.models.heads.scan import ScanHead, TwoWayScanHead
from itmatch.models.heads.summax import SumMaxHead

__all__ = ["GlobalCosineHead", "ScanHead", "SumMaxHead", "TwoWayScanHead"]
