"""Text-side encoders over word ids."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from itmatch.models.attention import GuidedAttention
from itmatch.models.base import TextEmb, l2norm, length_mask, masked_pool


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


class PhraseCNN(nn.Module):
    """1-D CNN over word features with windows 1, 2, 3 (MMCA Eq. 6), ReLU, then max over word positions:
    q_l = max_k ReLU(W_l e_{k:k+l-1} + b_l); returns concat(q_1, q_2, q_3) [B, len(windows) * filters].

    Only windows that lie inside the caption count (a "valid" convolution); a caption shorter than a window
    keeps one window, padded with zeros, so that every q_l exists."""

    def __init__(self, in_dim: int, filters: int = 256, windows: tuple[int, ...] = (1, 2, 3)) -> None:
        super().__init__()
        self.windows = windows
        self.convs = nn.ModuleList(nn.Conv1d(in_dim, filters, w) for w in windows)

    @property
    def out_dim(self) -> int:
        return sum(c.out_channels for c in self.convs)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        # padded positions hold arbitrary values (e.g. Transformer outputs of padding queries); a short
        # caption's single window must see zeros there
        xt = x.masked_fill(~length_mask(lengths, length)[:, :, None], 0.0).transpose(1, 2)  # [B, in, L]
        pooled = []
        for w, conv in zip(self.windows, self.convs, strict=True):
            p = torch.relu(conv(nn.functional.pad(xt, (0, w - 1))))  # [B, F, L]: window k covers k..k+w-1
            valid = length_mask((lengths - w + 1).clamp(min=1), length)  # [B, L]
            pooled.append(masked_pool(p, valid[:, None, :], 2, "max"))
        return torch.cat(pooled, dim=1)


class FrozenTransformer(nn.Module):
    """A pretrained BERT-like encoder used as a fixed feature extractor (MMCA: "the weights of BERT are
    fixed"): token ids -> last hidden states E [B, L, H].

    The Hugging Face module is deliberately *not* a registered submodule: its weights are not trainable
    parameters (not in the optimizer, not in gradient clipping), `model.train()` never switches on its
    dropout, and checkpoints do not copy its ~90 MB of weights (they are re-read from
    model.mmca.text_model). A fingerprint buffer of the weights is saved instead, and loading a
    checkpoint with a different encoder is an error."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        hf_model.eval()
        for p in hf_model.parameters():
            p.requires_grad_(False)
        object.__setattr__(self, "hf", hf_model)  # not registered (see class docstring)
        self.hidden_size = int(hf_model.config.hidden_size)
        self.register_buffer("fingerprint", self._fingerprint(), persistent=True)

    def _fingerprint(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.stack([sum(p.double().abs().sum() for p in self.hf.parameters()),
                                torch.tensor(float(sum(p.numel() for p in self.hf.parameters())),
                                             dtype=torch.float64)])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        saved = state_dict.get(prefix + "fingerprint")
        if saved is not None and not torch.allclose(saved.double(), self.fingerprint, rtol=1e-9):
            from itmatch.errors import CheckpointError

            raise CheckpointError("the checkpoint was trained with another frozen text encoder than "
                                  "model.mmca.text_model loads now (weights fingerprint differs)",
                                  hint="install the encoder the checkpoint was trained with "
                                       "(its model.mmca.text_model in config.json)")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def _apply(self, fn, recurse: bool = True):  # .to(device), .double(), ... reach the unregistered encoder
        self.hf._apply(fn)
        return super()._apply(fn, recurse)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        self.hf.eval()  # always: no dropout, whatever mode the Matcher is in
        with torch.no_grad():
            mask = length_mask(lengths, tokens.shape[1]).long()
            out = self.hf(input_ids=tokens, attention_mask=mask, token_type_ids=torch.zeros_like(tokens))
        return out.last_hidden_state.detach()


class MMCATextEncoder(nn.Module):
    """MMCA text side (section 3.3). Frozen encoder -> E; c0 = l2(FC(concat_l max_k p_{l,k})) (Eq. 6-7),
    with Eq. 7's LayerNorm before the l2 norm as an option. `words` are E projected to the joint size d,
    the word half of the cross-attention module's input Y = [R; E] (Eq. 8-10 need R and E of one size)."""

    def __init__(self, encoder: FrozenTransformer, embed_size: int, filters: int = 256,
                 layernorm: bool = False) -> None:
        super().__init__()
        self.encoder = encoder
        self.cnn = PhraseCNN(encoder.hidden_size, filters)
        self.fc = nn.Linear(self.cnn.out_dim, embed_size)
        self.norm = nn.LayerNorm(embed_size) if layernorm else nn.Identity()
        self.word_fc = nn.Linear(encoder.hidden_size, embed_size)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> TextEmb:
        e = self.encoder(tokens, lengths)
        c0 = l2norm(self.norm(self.fc(self.cnn(e, lengths))))
        return TextEmb(words=self.word_fc(e), lengths=lengths, vector=c0)
