"""Encoders several systems share: region features through a fully-connected layer (SCAN, VSE++, Sum-Max,
OAN), word ids through a (Bi)GRU or (Bi)LSTM (SCAN, VSE++, Sum-Max, SAVE, OAN's BiLSTM ablation), and the hook
through which a region encoder reads pixels with an ImageNet CNN."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from itmatch.models.base import ImageEmb, TextEmb, l2norm, length_mask

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
        self.reads_region_mask = True  # a masked region is one that is not there (train.region_dropout)
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


class RNNTextEncoder(nn.Module):
    """Word embedding (uniform(-0.1, 0.1) init, as SCAN) -> (Bi)GRU or (Bi)LSTM.

    Bidirectional outputs are combined per step by averaging the two halves (SCAN) or concatenating
    them; words are then optionally l2-normalised. With `pool="last"` the caption also gets one
    vector: the last real step's state (the VSE++ baseline) or the mean of the steps (SMAN's t(0))."""

    def __init__(self, vocab_size: int, word_dim: int, embed_size: int, *, num_layers: int = 1,
                 bidirectional: bool = True, rnn: str = "gru", combine: str = "mean", norm: bool = True,
                 pool: str = "none", dropout: float = 0.0) -> None:
        super().__init__()
        if rnn not in ("gru", "lstm"):
            raise ValueError(f"rnn must be 'gru' or 'lstm', not {rnn!r}")
        if combine not in ("mean", "concat"):
            raise ValueError(f"combine must be 'mean' or 'concat', not {combine!r}")
        if pool not in ("none", "last", "mean"):
            raise ValueError(f"pool must be 'none', 'last' or 'mean', not {pool!r}")
        self.embed = nn.Embedding(vocab_size, word_dim)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)
        hidden = embed_size // 2 if (bidirectional and combine == "concat") else embed_size
        cell = nn.GRU if rnn == "gru" else nn.LSTM
        self.rnn = cell(word_dim, hidden, num_layers, batch_first=True, bidirectional=bidirectional)
        self.bidirectional, self.combine, self.norm, self.pool = bidirectional, combine, norm, pool
        self.drop = nn.Dropout(dropout)  # on the word embeddings (SMAN's 0.3); identity at 0

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> TextEmb:
        x = self.drop(self.embed(tokens))
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        words, _ = pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[1])
        if self.bidirectional and self.combine == "mean":
            half = words.shape[-1] // 2
            words = (words[..., :half] + words[..., half:]) / 2
        vector = None
        if self.pool == "last":
            vector = words[torch.arange(words.shape[0], device=words.device), lengths.to(words.device) - 1]
        elif self.pool == "mean":
            m = length_mask(lengths.to(words.device), words.shape[1]).unsqueeze(-1).to(words.dtype)
            vector = (words * m).sum(1) / lengths[:, None].to(words)
        if self.norm:
            words = l2norm(words)
            vector = l2norm(vector) if vector is not None else None
        return TextEmb(words=words, lengths=lengths, vector=vector)
