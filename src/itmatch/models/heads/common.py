"""Pieces every region-word head shares."""

from __future__ import annotations

import torch

from itmatch.models.base import ImageEmb, TextEmb


def region_word_dots(img: ImageEmb, txt: TextEmb) -> torch.Tensor:
    """s[n, k, m, l] = v_nk . e_ml for a whole block in one GEMM (layout chosen so that the region
    axis is a batch-matmul axis and the word axis is contiguous)."""
    n, k, d = img.regions.shape
    m, length, _ = txt.words.shape
    return (img.regions.reshape(n * k, d) @ txt.words.reshape(m * length, d).T).view(n, k, m, length)


def pair_mask(img: ImageEmb, txt: TextEmb) -> torch.Tensor:
    """[n, k, m, l] bool: region k of image n and word l of caption m are both real."""
    return img.mask[:, :, None, None] & txt.mask[None, None, :, :]


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
