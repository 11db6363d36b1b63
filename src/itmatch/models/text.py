"""Text-side encoders over word ids."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from itmatch.models.base import TextEmb, l2norm


class RNNTextEncoder(nn.Module):
    """Word embedding (uniform(-0.1, 0.1) init, as SCAN) -> (Bi)GRU or (Bi)LSTM.

    Bidirectional outputs are combined per step by averaging the two halves (SCAN) or concatenating
    them; words are then optionally l2-normalised. With `pool="last"` the caption also gets one
    vector: the last real step's state (the VSE++ baseline)."""

    def __init__(self, vocab_size: int, word_dim: int, embed_size: int, *, num_layers: int = 1,
                 bidirectional: bool = True, rnn: str = "gru", combine: str = "mean", norm: bool = True,
                 pool: str = "none") -> None:
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

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> TextEmb:
        x = self.embed(tokens)
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        words, _ = pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[1])
        if self.bidirectional and self.combine == "mean":
            half = words.shape[-1] // 2
            words = (words[..., :half] + words[..., half:]) / 2
        vector = None
        if self.pool == "last":
            vector = words[torch.arange(words.shape[0]), lengths - 1]
        elif self.pool == "mean":
            m = (torch.arange(words.shape[1])[None, :] < lengths[:, None]).unsqueeze(-1).to(words.dtype)
            vector = (words * m).sum(1) / lengths[:, None].to(words.dtype)
        if self.norm:
            words = l2norm(words)
            vector = l2norm(vector) if vector is not None else None
        return TextEmb(words=words, lengths=lengths, vector=vector)
