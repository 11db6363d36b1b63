"""Pieces every region-word head shares."""

from __future__ import annotations

import torch

from itmatch.models.base import ImageEmb, TextEmb


def region_word_dots(img: ImageEmb, txt: TextEmb, layout: str = "image") -> torch.Tensor:
    """Raw region-word dots of a whole block in one GEMM, s = v_nk . e_ml.

    layout "image": [n, k, m, l] (regions of an image are a batch-matmul axis, words contiguous);
    layout "text": [m, l, n, k] (the same numbers, caption-major), for heads whose per-item work is per
    caption (SCAN i-t), so that no permuted copy of the block is ever made."""
    n, k, d = img.regions.shape
    m, length, _ = txt.words.shape
    regions, words = img.regions.reshape(n * k, d), txt.words.reshape(m * length, d)
    if layout == "image":
        return (regions @ words.T).view(n, k, m, length)
    if layout == "text":
        return (words @ regions.T).view(m, length, n, k)
    raise ValueError(f"layout must be 'image' or 'text', not {layout!r}")


def pair_mask(img: ImageEmb, txt: TextEmb) -> torch.Tensor:
    """[n, k, m, l] bool: region k of image n and word l of caption m are both real."""
    return img.mask[:, :, None, None] & txt.mask[None, None, :, :]


def masked_pool(values: torch.Tensor, mask: torch.Tensor, dim: int, how: str, lse_lambda: float = 1.0
                ) -> torch.Tensor:
    """Pool `values` over `dim`, ignoring masked-out entries: avg, sum, max, or lse
    (log(sum exp(lambda x)) / lambda, SCAN Eq. 5/7)."""
    if how == "avg":
        return values.masked_fill(~mask, 0.0).sum(dim) / mask.sum(dim).clamp(min=1)
    if how == "sum":
        return values.masked_fill(~mask, 0.0).sum(dim)
    if how == "max":
        return values.masked_fill(~mask, float("-inf")).amax(dim)
    if how == "lse":
        return torch.logsumexp((values * lse_lambda).masked_fill(~mask, float("-inf")), dim) / lse_lambda
    raise ValueError(f"unknown pooling {how!r}; choose avg, lse, max or sum")
