"""Image-side encoders over precomputed region (or grid-cell) features."""

from __future__ import annotations

import math

import torch
from torch import nn

from itmatch.errors import DataError
from itmatch.models.attention import GuidedAttention
from itmatch.models.base import ImageEmb, l2norm, masked_pool

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


def read_pixels_through(encoder: nn.Module, backbone: nn.Module) -> nn.Module:
    """Let a region-grid encoder read pixels: `backbone` (an ImageNet CNN, `features.backbones.Backbone`)
    becomes its submodule `backbone` (parameters under `image_encoder.backbone.`, as SAVE's, so that a model
    trained on cached features of the same CNN loads into it with `train.init_from`), and a forward pre-hook
    turns a pixel batch [N, 3, S, S] into the grid [N, k, C] the encoder reads, with an all-true mask. Cached
    features [N, k, C] pass unchanged. A hook rather than a wrapper module keeps every other parameter name."""
    encoder.backbone = backbone
    encoder.register_forward_pre_hook(_pixels_to_grid)
    return encoder


def _pixels_to_grid(encoder: nn.Module, args: tuple) -> tuple | None:
    feats = args[0]
    if isinstance(feats, torch.Tensor) and feats.ndim == 4:
        grid = encoder.backbone(feats)
        return grid, torch.ones(grid.shape[:2], dtype=torch.bool, device=grid.device)
    return None


class SMANImageEncoder(nn.Module):
    """SMAN's image side up to the intra-modal context (Ji et al., section III-A1 and III-B1).

    Input: a grid of M regions in spatial (row-major) order, I_1..I_M (the paper's ResNet-152 res5c 7x7;
    here the EfficientNet-Lite 7x7 grid). Output: ImageEmb with regions = I (after dropout), extras
    v0 (Eq. 2-4), v1 (Eq. 7) and att1 (the weights of Eq. 6), and vector = [v0/|v0|, v1/|v1|], whose
    dot with the caption's is d(0) + d(1) of Eq. 19-20 (pair-independent)."""

    def __init__(self, img_dim: int, embed_size: int, att_hidden: int, *, regions: int = 49,
                 spatial: bool = True, divide_by_m: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        self.regions, self.divide_by_m = regions, divide_by_m
        self.pools = True  # has a pair-independent vector (a first-stage score d(0) + d(1))
        self.drop = nn.Dropout(dropout)
        self.p0 = nn.Linear(img_dim, embed_size)  # P(0), Eq. 2
        self.gru = nn.GRU(img_dim, embed_size, batch_first=True) if spatial else None  # Eq. 3
        self.att = GuidedAttention(img_dim, embed_size, att_hidden)  # Eq. 5-6
        self.p1 = nn.Linear(img_dim, embed_size)  # P(1), Eq. 7

    def forward(self, feats: torch.Tensor, mask: torch.Tensor) -> ImageEmb:
        if feats.shape[1] != self.regions:
            raise DataError(f"SMAN expects a grid of M = {self.regions} regions per image, found {feats.shape[1]}",
                            hint="extract 7x7 grid features (e.g. EfficientNet-Lite0 at 224 px), or set "
                                 f"model.sman.regions={feats.shape[1]} if this many cells in row-major order "
                                 "is intended")
        x = self.drop(feats)
        m = mask.unsqueeze(-1).to(x.dtype)
        count = m.sum(1).clamp(min=1.0)
        v0 = torch.tanh(self.p0((x * m).sum(1) / count))  # v(glo), Eq. 2
        if self.gru is not None:
            states, _ = self.gru(x)  # regions in spatial order, Eq. 3
            v0 = v0 + (states * m).sum(1) / count  # v(0) = v(glo) + v(loc), Eq. 4
        att1 = self.att(x, v0, mask)  # Eq. 5-6
        pooled = torch.bmm(att1.unsqueeze(1), x).squeeze(1)
        if self.divide_by_m:
            pooled = pooled / count
        v1 = torch.tanh(self.p1(pooled))  # Eq. 7
        return ImageEmb(regions=x, mask=mask, vector=torch.cat([l2norm(v0), l2norm(v1)], -1),
                        extras={"v0": v0, "v1": v1, "att1": att1})


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
