"""Image-side encoders over precomputed region (or grid-cell) features."""

from __future__ import annotations

import math

import torch
from torch import nn

from itmatch.models.base import ImageEmb, l2norm
from itmatch.models.heads.common import masked_pool


class RegionEncoder(nn.Module):
    """v_i = W_v f_i + b_v (SCAN Eq. 13), optionally l2-normalised per region; with `pool` the
    regions are also averaged into one l2-normalised vector (the VSE++ baseline's image embedding)."""

    def __init__(self, img_dim: int, embed_size: int, *, norm: bool = True, pool: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(img_dim, embed_size)
        self.norm, self.pools = norm, pool
        # Xavier-uniform weights, zero bias: the public SCAN code's init.
        r = math.sqrt(6.0) / math.sqrt(img_dim + embed_size)
        nn.init.uniform_(self.fc.weight, -r, r)
        nn.init.zeros_(self.fc.bias)

    def forward(self, feats: torch.Tensor, mask: torch.Tensor) -> ImageEmb:
        regions = self.fc(feats)
        if self.norm:
            regions = l2norm(regions)
        vector = None
        if self.pools:
            m = mask.unsqueeze(-1).to(regions.dtype)
            vector = l2norm((regions * m).sum(1) / m.sum(1).clamp(min=1.0))
        return ImageEmb(regions=regions, mask=mask, vector=vector)


def transformer_unit(d: int, heads: int, ffn_dim: int, dropout: float) -> nn.TransformerEncoderLayer:
    """One MMCA Transformer unit (Fig. 3): multi-head self-attention and a position-wise ReLU FFN, each
    followed by residual + LayerNorm (post-LN, torch's norm_first=False, which is exactly this order)."""
    if d % heads:
        raise ValueError(f"embed_size {d} is not divisible by {heads} heads")
    return nn.TransformerEncoderLayer(d, heads, dim_feedforward=ffn_dim or d, dropout=dropout,
                                      activation="relu", batch_first=True, norm_first=False)


class MMCAImageEncoder(nn.Module):
    """MMCA image side (section 3.2-3.3): R = FC(regions); R_s = Transformer unit(R); i0 = l2(mean_k R_s)
    (Eq. 5). `regions` are R (the region half of the cross-attention input Y = [R; E]), `vector` is i0."""

    def __init__(self, img_dim: int, embed_size: int, heads: int = 16, ffn_dim: int = 0,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.fc = nn.Linear(img_dim, embed_size)
        r = math.sqrt(6.0) / math.sqrt(img_dim + embed_size)  # Xavier-uniform, zero bias (as RegionEncoder)
        nn.init.uniform_(self.fc.weight, -r, r)
        nn.init.zeros_(self.fc.bias)
        self.unit = transformer_unit(embed_size, heads, ffn_dim, dropout)
        self.pools = True  # has a pair-independent vector (i0)

    def forward(self, feats: torch.Tensor, mask: torch.Tensor) -> ImageEmb:
        regions = self.fc(feats)
        attended = self.unit(regions, src_key_padding_mask=~mask)
        i0 = l2norm(masked_pool(attended, mask[:, :, None], 1, "avg"))
        return ImageEmb(regions=regions, mask=mask, vector=i0)
