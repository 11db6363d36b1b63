"""MMCA's encoders (section 3.2-3.3): the image self-attention unit, the frozen BERT-like text encoder and
the phrase CNN over its output."""

from __future__ import annotations

import math

import torch
from torch import nn

from itmatch.models.base import ImageEmb, TextEmb, l2norm, length_mask, masked_pool


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
        self.reads_region_mask = True  # masked regions: keys the attention skips, left out of the mean

    def forward(self, feats: torch.Tensor, mask: torch.Tensor) -> ImageEmb:
        regions = self.fc(feats)
        attended = self.unit(regions, src_key_padding_mask=~mask)
        i0 = l2norm(masked_pool(attended, mask[:, :, None], 1, "avg"))
        return ImageEmb(regions=regions, mask=mask, vector=i0)


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
