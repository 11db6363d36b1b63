"""Similarity functions: score(img, txt) -> [n_img, n_txt] for every pair, batched."""

from itmatch.models.heads.global_cosine import GlobalCosineHead
from itmatch.models.heads.mmca import MMCAHead
from itmatch.models.heads.oan import OANHead
from itmatch.models.heads.scan import ScanHead, TwoWayScanHead
from itmatch.models.heads.sman import SMANHead
from itmatch.models.heads.summax import SumMaxHead

__all__ = ["GlobalCosineHead", "MMCAHead", "OANHead", "SMANHead", "ScanHead", "SumMaxHead", "TwoWayScanHead"]
