"""Image-side encoders over precomputed region (or grid-cell) features."""

from __future__ import annotations

import math

import torch
from torch import nn

from itmatch.models.base import ImageEmb, l2norm

ACTIVATIONS = {"none": nn.Identity, "tanh": nn.Tanh}


class RegionEncoder(nn.Module):
    """v_i = W_v f_i + b_v (SCAN Eq. 13), or v_j = tanh(W_V u_j + b_V) with activation="tanh" (OAN Eq. 3),
    optionally l2-normalised per region; with `pool` the regions are also averaged into one
    l2-normalised vector (the VSE++ baseline's image embedding)."""

    def __init__(self, img_dim: int, embed_size: int, *, norm: bool = True, pool: bool = False,
                 activation: str = "none") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
        self.fc = nn.Linear(img_dim, embed_size)
        self.activation = ACTIVATIONS[activation]()
        self.norm, self.pools = norm, pool
        # Xavier-uniform weights, zero bias: the public SCAN code's init.
        r = math.sqrt(6.0) / math.sqrt(img_dim + embed_size)
        nn.init.uniform_(self.fc.weight, -r, r)
        nn.init.zeros_(self.fc.bias)

    def forward(self, feats: torch.Tensor, mask: torch.Tensor) -> ImageEmb:
        regions = self.activation(self.fc(feats))
        if self.norm:
            regions = l2norm(regions)
        vector = None
        if self.pools:
            m = mask.unsqueeze(-1).to(regions.dtype)
            vector = l2norm((regions * m).sum(1) / m.sum(1).clamp(min=1.0))
        return ImageEmb(regions=regions, mask=mask, vector=vector)
