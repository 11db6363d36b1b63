"""SMAN's image and text sides up to the intra-modal context (section III-A and III-B1)."""

from __future__ import annotations

import torch
from torch import nn

from itmatch.errors import DataError
from itmatch.models.base import ImageEmb, TextEmb, l2norm
from itmatch.models.encoders import RNNTextEncoder
from itmatch.models.sman.attention import GuidedAttention


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
        # the spatial GRU (Eq. 3) reads every cell in grid order, masked or not: a masked cell is not one that is
        # not there, so train.region_dropout is refused
        self.reads_region_mask = False
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


class SMANTextEncoder(nn.Module):
    """SMAN's text side up to the intra-modal context (Ji et al., section III-A2 and III-B1).

    S_l = the two directions of a BiLSTM averaged per step (Eq. 1; `rnn` may be "gru"), t(0) = mean of
    S_l (Eq. 8), textual attention guided by t(0) (Eq. 9-10), t(1) = sum_l a_l S_l (Eq. 11, no
    projection: S is already in the common space). Output: TextEmb with words = S, extras t0, t1 and
    att1 (the weights of Eq. 10), vector = [t0/|t0|, t1/|t1|]. Word embeddings start Xavier-uniform
    (the paper's random init); pretrained vectors are copied in by the trainer (model.word_vectors)."""

    def __init__(self, vocab_size: int, word_dim: int, embed_size: int, att_hidden: int, *,
                 rnn: str = "lstm", dropout: float = 0.0) -> None:
        super().__init__()
        self.rnn = RNNTextEncoder(vocab_size, word_dim, embed_size, bidirectional=True, rnn=rnn, combine="mean",
                                  norm=False, pool="mean", dropout=dropout)
        nn.init.xavier_uniform_(self.rnn.embed.weight)
        self.att = GuidedAttention(embed_size, embed_size, att_hidden)

    @property
    def embed(self) -> nn.Embedding:
        return self.rnn.embed

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> TextEmb:
        enc = self.rnn(tokens, lengths)
        words, t0 = enc.words, enc.vector  # Eq. 1, Eq. 8
        assert t0 is not None
        att1 = self.att(words, t0, enc.mask)  # Eq. 9-10
        t1 = torch.bmm(att1.unsqueeze(1), words).squeeze(1)  # Eq. 11
        return TextEmb(words=words, lengths=lengths, vector=torch.cat([l2norm(t0), l2norm(t1)], -1),
                       extras={"t0": t0, "t1": t1, "att1": att1}, word_axes={"att1": (1,)})
