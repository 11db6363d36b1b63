"""Mean-pooled cosine: the cosine of the mean of an image's region embeddings and the mean of a caption's word
embeddings. The simplest baseline below VSE++ (no recurrent text encoder), and the worked example of adding a
model in docs/architecture.md: this package is all it took."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from itmatch.config import ModelConfig, option, register_options
from itmatch.models.base import ImageEmb, Matcher, SimilarityHead, TextEmb, l2norm, length_mask
from itmatch.models.encoders import RegionEncoder
from itmatch.models.registry import Arch, Preset, register_arch, register_presets


@register_options("meanpool")
@dataclass
class MeanPoolConfig:
    dropout: float = option(0.1, min=0, max=1)  # on the word embeddings


class MeanWordEncoder(nn.Module):
    """Word embeddings -> a linear map to the joint space; the caption's vector is the l2-normalised mean."""

    def __init__(self, vocab_size: int, word_dim: int, embed_size: int, dropout: float) -> None:
        super().__init__()
        self.embed, self.drop = nn.Embedding(vocab_size, word_dim), nn.Dropout(dropout)
        self.project = nn.Linear(word_dim, embed_size)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> TextEmb:
        words = self.project(self.drop(self.embed(tokens)))
        real = length_mask(lengths.to(words.device), words.shape[1]).unsqueeze(-1).to(words.dtype)
        vector = l2norm((words * real).sum(1) / real.sum(1).clamp(min=1.0))
        return TextEmb(words=words, lengths=lengths, vector=vector)


class CosineHead(SimilarityHead):
    """S(i, t) = v_i . v_t of the two unit vectors: the whole score matrix is one matrix product."""

    bytes_per_cell = bytes_per_pair = 0.0  # the memory contract: pair-independent
    score_bound = 0.0  # the score is the global cosine itself (first stage = exact)

    def forward(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        return img.vector @ txt.vector.T


@register_arch
class MeanPool(Arch):
    name = "meanpool"
    norm_keys = ("img_norm",)  # (model.img_norm / txt_norm: registry.Arch.norm_keys)

    def build(self, mc: ModelConfig) -> Matcher:
        image = RegionEncoder(mc.img_dim, mc.embed_size, norm=mc.img_norm, pool=True)
        text = MeanWordEncoder(mc.vocab_size, mc.word_dim, mc.embed_size, mc.meanpool.dropout)
        return Matcher(image, text, CosineHead())


@register_presets
def meanpool_presets() -> dict[str, Preset]:
    """SCAN's Flickr30K schedule (the papers give this baseline none of its own)."""
    return {"meanpool": {"model": {"arch": "meanpool"}, "train": {"epochs": 30, "lr": 2e-4, "lr_update": 15},
                         "paper": "this toolkit's baseline: mean-pooled cosine (SCAN's Flickr30K schedule)"}}
