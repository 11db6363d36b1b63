"""OAN's textual object encoder (Eq. 1-2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from itmatch.models.base import TextEmb, length_mask


class TextCNNEncoder(nn.Module):
    """OAN Eq. 1-2: word embeddings -> 1-D convolutions of widths j in `kernels` along the caption,
    H_j = tanh(K_j * X + b_j) (zero "same" padding, so every kernel gives one output per time step; an
    even width j covers words i - (j-1)//2 .. i + j//2) -> per-step concatenation h_i = h_i^1 || ... ->
    textual object embeddings e_i = tanh(W_T h_i + b_T).

    Embeddings of padding positions are zeroed before the convolutions, so a caption's e_i do not depend
    on how far its batch is padded (training and evaluation batches differ). Word embeddings start
    uniform(-0.1, 0.1) (the paper: "randomly initialized"); convolutions and the FC are Xavier-uniform
    with zero bias (the paper: Xavier for all other weights)."""

    def __init__(self, vocab_size: int, word_dim: int, embed_size: int, *,
                 kernels: tuple[int, ...] = (1, 2, 3, 5, 7), channels: int = 0) -> None:
        super().__init__()
        if not kernels or any(j < 1 for j in kernels):
            raise ValueError(f"kernel widths must be positive integers, not {kernels!r}")
        channels = channels or embed_size
        self.embed = nn.Embedding(vocab_size, word_dim)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)
        self.kernels = tuple(kernels)
        self.convs = nn.ModuleList(nn.Conv1d(word_dim, channels, j) for j in kernels)
        self.fc = nn.Linear(channels * len(kernels), embed_size)
        for layer in (*self.convs, self.fc):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> TextEmb:
        mask = length_mask(lengths, tokens.shape[1]).unsqueeze(-1)  # [B, L, 1]
        x = (self.embed(tokens) * mask).transpose(1, 2)  # [B, word_dim, L]
        # explicit zero padding (j-1)//2 left, j//2 right: PyTorch's padding="same" copies and warns for even j
        h = torch.cat([torch.tanh(conv(F.pad(x, ((j - 1) // 2, j // 2))))
                       for j, conv in zip(self.kernels, self.convs, strict=True)], dim=1).transpose(1, 2)  # Eq. 1
        words = torch.tanh(self.fc(h)) * mask  # Eq. 2; padding steps are zero vectors
        return TextEmb(words=words, lengths=lengths)
