"""Region-word pieces the heads over regions and words share (SCAN, Sum-Max, OAN)."""

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


def add_region_gram(img: ImageEmb) -> ImageEmb:
    """extras["gram"] = V V^T [N, k, k], once per image: ||sum_k alpha_k v_k||^2 = alpha^T G alpha."""
    img.extras["gram"] = img.regions @ img.regions.transpose(1, 2)
    return img


def add_word_gram(txt: TextEmb) -> TextEmb:
    """extras["gram"] = E E^T [M, L, L], once per caption; both of its axes are word axes (padded and
    trimmed with the words)."""
    txt.extras["gram"] = txt.words @ txt.words.transpose(1, 2)
    txt.word_axes["gram"] = (1, 2)
    return txt
