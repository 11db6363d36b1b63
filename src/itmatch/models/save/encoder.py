"""SAVE's image side (Multi-Scale Visual Semantics Aggregation with Self-Attention, section 3.1-3.3.1):
grid cells of CNN feature maps are the instance candidates ([N, k = h*w, C], row-major as the precomp
layout), self-attention (DSA or ASA) aggregates them, several scales are fused (Fig. 3) and an FC maps the
result to D. What the encoder reads (cached maps or pixels): docs/save.md, "How a model receives several scales".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from itmatch.errors import ConfigError
from itmatch.models.base import ImageEmb, l2norm
from itmatch.models.encoders import RegionEncoder

ATTENTIONS = ("none", "dsa", "asa")
FUSIONS = ("concat", "nl")
SCALE_NORMS = ("none", "layernorm")
SCALES = ("c3", "c4", "c5")


def to_tokens(fmap: torch.Tensor) -> torch.Tensor:
    """[N, C, h, w] -> [N, h*w, C] (row-major cells)."""
    return fmap.flatten(2).transpose(1, 2)


def to_map(tokens: torch.Tensor, side: int | None = None) -> torch.Tensor:
    """[N, k, C] -> [N, C, side, side]; the grid is square (side = sqrt(k) unless given)."""
    n, k, c = tokens.shape
    side = side or math.isqrt(k)
    if side * side != k:
        raise ValueError(f"{k} candidates do not form a square grid")
    return tokens.transpose(1, 2).reshape(n, c, side, side)


class DeterministicSelfAttention(nn.Module):
    """DSA, Eq. 1-3 (parameter-free; the FC of Eq. 4 follows the fusion).

    s_ij = cos(u_i, u_j) (Eq. 1), thresholded at zero and normalised over i:
    s_ij = [s_ij]_+ / sqrt(sum_i [s_ij]_+^2); alpha_ij = softmax_j(lambda * s_ij) (Eq. 3, the paper has
    lambda = 1); a_i = sum_j alpha_ij u_j (Eq. 2) on the raw candidates."""

    def __init__(self, inverse_temperature: float = 1.0) -> None:
        super().__init__()
        self.inverse_temperature = inverse_temperature

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        un = l2norm(u)
        s = (un @ un.transpose(1, 2)).clamp(min=0)  # [N, i, j]
        s = s / (torch.linalg.vector_norm(s, dim=1, keepdim=True) + 1e-8)
        alpha = torch.softmax(self.inverse_temperature * s, dim=2)
        return alpha @ u


class AdaptiveSelfAttention(nn.Module):
    """ASA, Eq. 5-8 (the non-local block of Wang et al. 2018).

    theta, phi, g: 1x1 convolutions C -> C/2 (written as Linear over the channel axis of the candidates,
    the same map); s_ij = theta(u_i)^T phi(u_j) (Eq. 6), alpha = softmax_j (Eq. 5), a_i = sum_j alpha_ij
    g(u_j) (Eq. 7); a 1x1 convolution C/2 -> C (non-local's W_z: Eq. 8 adds a to u, which needs C
    channels) and y_i = gamma a_i + u_i with gamma initialised to 0 (Eq. 8), so the block starts as the
    identity.

    `bias`: theta, phi and g with biases, as the non-local block's convolutions have them (the default), or
    without, as Eq. 6-7 write them (W u). Only theta's changes the attention: it adds b_theta^T phi(u_j), a
    learned prior over the candidates j; phi's adds a term constant over j (the softmax cancels it), and g's a
    constant that W_z's own bias can hold (docs/save.md).
    `scaled`: Eq. 6's dot products divided by sqrt(C/2), the transformer's scaling; not in the paper (nor in the
    non-local block's embedded Gaussian), which the default follows. On raw Lite0 c5 the unscaled logits make the
    attention nearly one-hot from the start; scaled, ASA collapses there all the same (docs/save.md, "How it
    collapses").
    `spectral_norm`: theta, phi, g and W_z spectrally normalised (one power iteration a training step), as SAGAN
    (Zhang et al. 2018, which Eq. 8 follows for gamma) does with every convolution; not in SAVE. It bounds the gated
    branch by |gamma| times the largest cell, where the paper's form let it grow to 29 cells' norm on raw c5."""

    def __init__(self, channels: int, reduction: int = 2, bias: bool = True, scaled: bool = False,
                 spectral_norm: bool = False) -> None:
        super().__init__()
        inner = max(1, channels // reduction)
        self.theta = nn.Linear(channels, inner, bias=bias)
        self.phi = nn.Linear(channels, inner, bias=bias)
        self.g = nn.Linear(channels, inner, bias=bias)
        self.out = nn.Linear(inner, channels)
        self.gamma = nn.Parameter(torch.zeros(1))
        self.logit_scale = inner ** -0.5 if scaled else 1.0
        if spectral_norm:  # (its power iteration's first vectors drawn aside: the model's other weights are as without)
            with torch.random.fork_rng(devices=[]):
                for layer in (self.theta, self.phi, self.g, self.out):
                    nn.utils.parametrizations.spectral_norm(layer)

    def logits(self, u: torch.Tensor) -> torch.Tensor:
        """s_ij = theta(u_i)^T phi(u_j) (Eq. 6; times 1/sqrt(C/2) if `scaled`), [N, i, j]."""
        return self.theta(u) @ self.phi(u).transpose(1, 2) * self.logit_scale

    def branch(self, u: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """gamma W_z a_i with a_i = sum_j alpha_ij g(u_j) (Eq. 7-8): what the block adds to each cell."""
        return self.gamma * self.out(alpha @ self.g(u))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.branch(u, torch.softmax(self.logits(u), dim=2)) + u  # (alpha: Eq. 5)


def make_attention(kind: str, channels: int, dsa_lambda: float = 1.0, *,
                   asa: Mapping[str, bool] | None = None) -> nn.Module:
    """One scale's self-attention; `asa`: AdaptiveSelfAttention's switches (bias, scaled, spectral_norm), for ASA
    only."""
    if kind == "none":
        return nn.Identity()
    if kind == "dsa":
        return DeterministicSelfAttention(dsa_lambda)
    if kind == "asa":
        return AdaptiveSelfAttention(channels, **(asa or {}))
    raise ValueError(f"unknown self-attention {kind!r}; choose one of {ATTENTIONS}")


def parse_scales(spec: str | Sequence[str]) -> tuple[str, ...]:
    """"c4,c5" -> ("c4", "c5"), validated and ordered finest first; a ConfigError otherwise (model.save.scales'
    check, `option(check=...)`, so a bad value is refused where it was written)."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    bad = [s for s in names if s not in SCALES]
    if bad or not names or len(set(names)) != len(names):
        raise ConfigError(f"{spec!r} is not a comma list of distinct scales among {', '.join(SCALES)}",
                          hint="write scale names separated by commas: c5, c4,c5 (ms2) or c3,c4,c5 (ms3)")
    return tuple(sorted(names, key=SCALES.index))


class Borrowed:
    """Calls a module owned elsewhere without registering it here (its parameters are already in the
    model, e.g. the backbone's c4 -> c5 layers under `image_encoder.backbone`; registering them twice
    would save them twice)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


class MultiScaleSelfAttention(nn.Module):
    """Self-attention on each scale, then fusion (section 3.3.1), -> candidates [N, k_coarsest, C_out].

    fusion "concat" (Fig. 3): x = SA(first scale); for each next scale x = [maxpool_2x2(x) ; SA(c)] along
    channels, ending at the coarsest grid (C_out = sum of the scales' channels). Max-pooling uses
    ceil_mode, so odd sides (lite2: 33 -> 17 -> 9) meet the next scale; even sides are plain 2x2 pools.
    fusion "nl" (NL-ms2 of Table 5): the blocks sit inside the backbone, without fusion: c5 is recomputed
    from SA(c4) by the backbone's `tail` (c4 -> c5) and only SA(c5) is returned (C_out = C_c5)."""

    def __init__(self, scales: Sequence[str], dims: Mapping[str, int], attention: str = "asa",
                 fusion: str = "concat", dsa_lambda: float = 1.0,
                 tail: nn.Module | Borrowed | None = None, scale_norm: str = "none", *,
                 asa: Mapping[str, bool] | None = None) -> None:
        super().__init__()
        if fusion not in FUSIONS:
            raise ValueError(f"unknown fusion {fusion!r}; choose one of {FUSIONS}")
        if scale_norm not in SCALE_NORMS:
            raise ValueError(f"unknown scale_norm {scale_norm!r}; choose one of {SCALE_NORMS}")
        self.scales, self.fusion = tuple(scales), fusion
        if scale_norm != "none" and fusion == "nl":  # (NL-ms2 feeds c4 to the backbone's own layers, which expect
            raise ValueError("scale_norm applies to fused scales (fusion concat), not NL-ms2")  # it raw)
        # one scale standardised too when asked: the control that separates "standardise c5" from "add c3/c4"
        self.standardise = scale_norm == "layernorm"
        if fusion == "nl" and (self.scales != ("c4", "c5") or tail is None):
            raise ValueError("fusion 'nl' (NL-ms2) needs scales c4,c5 and the backbone's c4 -> c5 tail")
        self.tail = tail
        self.attend = nn.ModuleDict({s: make_attention(attention, dims[s], dsa_lambda, asa=asa) for s in self.scales})
        self.out_dim = dims["c5"] if fusion == "nl" else sum(dims[s] for s in self.scales)

    @property
    def inputs(self) -> tuple[str, ...]:
        """The maps forward() reads."""
        return ("c4",) if self.fusion == "nl" else self.scales

    def cells(self, fmap: torch.Tensor) -> torch.Tensor:
        """A stage map [N, C, H, W] as the cells its self-attention reads, [N, H*W, C]."""
        tokens = to_tokens(fmap)
        if self.standardise:  # each cell: zero mean, unit variance over its channels
            tokens = F.layer_norm(tokens, tokens.shape[-1:])
        return tokens

    def _attend(self, scale: str, fmap: torch.Tensor) -> torch.Tensor:
        return to_map(self.attend[scale](self.cells(fmap)), fmap.shape[-1])

    def forward(self, maps: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if self.fusion == "nl":
            return to_tokens(self._attend("c5", self.tail(self._attend("c4", maps["c4"]))))
        x: torch.Tensor | None = None
        for scale in self.scales:
            a = self._attend(scale, maps[scale])
            if x is not None:
                x = F.max_pool2d(x, 2, 2, ceil_mode=True)
                if x.shape[-2:] != a.shape[-2:]:
                    raise ValueError(f"cannot fuse a {tuple(x.shape[-2:])} pooled map with {scale} "
                                     f"{tuple(a.shape[-2:])}: scales must halve from one to the next")
                a = torch.cat([x, a], dim=1)
            x = a
        assert x is not None
        return to_tokens(x)


class SaveImageEncoder(nn.Module):
    """Inputs -> stage maps -> `MultiScaleSelfAttention` -> FC to D (Eq. 4) (+ l2) -> ImageEmb.

    Inputs (`forward(feats, mask)`; the grid has no padding, so `mask` is ignored and all True):
      - cached maps: a dict {scale: [N, k_s, C_s]} (the precomp `{split}_ims*.npy` arrays), or one
        [N, k, C] tensor when the model reads a single scale;
      - pixels [N, 3, S, S] (the backbone's `preprocess`), when the encoder holds a `backbone`
        (end-to-end: trainable when fine-tuning, frozen otherwise)."""

    def __init__(self, fusion: MultiScaleSelfAttention, embed_size: int, *, norm: bool = True,
                 backbone: nn.Module | None = None) -> None:
        super().__init__()
        self.fusion, self.backbone = fusion, backbone
        self.project = RegionEncoder(fusion.out_dim, embed_size, norm=norm)
        self.reads_region_mask = False  # the self-attention reads the whole grid (train.region_dropout refused)

    def maps(self, feats: torch.Tensor | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if isinstance(feats, Mapping):
            missing = [s for s in self.fusion.inputs if s not in feats]
            if missing:
                raise ValueError(f"the model reads scales {self.fusion.inputs}; missing {missing} "
                                 "(extract them with `itmatch extract --scales`)")
            return {s: to_map(feats[s]) for s in self.fusion.inputs}
        if feats.ndim == 4:
            if self.backbone is None:
                raise ValueError("pixel input needs a model built with model.save.pixels=true")
            return self.backbone.stage_maps(feats)
        if len(self.fusion.inputs) != 1:
            raise ValueError(f"the model reads scales {self.fusion.inputs}; pass a dict of them")
        return {self.fusion.inputs[0]: to_map(feats)}

    def forward(self, feats: torch.Tensor | Mapping[str, torch.Tensor],
                mask: torch.Tensor | None = None) -> ImageEmb:
        candidates = self.fusion(self.maps(feats))
        full = torch.ones(candidates.shape[:2], dtype=torch.bool, device=candidates.device)
        return self.project(candidates, full)
