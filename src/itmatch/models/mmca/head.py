"""Multi-Modality Cross Attention (MMCA, Wei et al. CVPR 2020, section 3.4-3.5), all pairs of a block at once:
S(I, T) = i0 . c0 + alpha * i1 . c1, i0 / c0 per item (the encoders' `vector`s), i1 / c1 from one Transformer
unit over every pair's stacked regions and words Y = [R; E]. What is computed once per item (the Q/K/V
projections) and what per pair: docs/mmca.md, "What is implemented" and "Cost and how it is kept down".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from itmatch.models.base import ImageEmb, SimilarityHead, TextEmb, l2norm, masked_pool
from itmatch.models.losses import triplet_loss
from itmatch.models.mmca.encoders import PhraseCNN, transformer_unit
from itmatch.models.mmca.loss import mmca_loss


class MMCAHead(SimilarityHead):
    """The cross-attention module and the score of Eq. 15's S. alpha = 0 skips the cross module."""

    bytes_per_pair = 0.0  # counted per cell (bytes_per_cell, set from the sizes in __init__)

    def __init__(self, embed_size: int, heads: int = 16, ffn_dim: int = 0, filters: int = 256,
                 dropout: float = 0.1, alpha: float = 0.2, layernorm: bool = False, three_term: bool = True,
                 train_negatives: int = 0, pair_chunk: int = 0) -> None:
        super().__init__()
        self.alpha, self.heads, self.three_term, self.train_negatives = alpha, heads, three_term, train_negatives
        self.pair_chunk = pair_chunk
        self.unit = transformer_unit(embed_size, heads, ffn_dim, dropout)
        self.cnn = PhraseCNN(embed_size, filters)
        self.fc = nn.Linear(self.cnn.out_dim, embed_size)
        self.norm = nn.LayerNorm(embed_size) if layernorm else nn.Identity()
        # Temporaries per pair at evaluation, float32: a few [T, d] activations alive at once (Y, Q/K/V, attention
        # output, LayerNorms, FFN) plus the CNN maps, T = k + L tokens. Per (region, word) cell with
        # (k + L) / (k L) <= 0.2 (k >= 36 regions, L >= 6 tokens): conservative for typical captions (measured:
        # docs/mmca.md, "Memory contract").
        d, f = embed_size, self.cnn.out_dim
        per_token = 4.0 * (6 * d + (ffn_dim or d) + f)
        self.bytes_per_cell = 0.0 if alpha == 0 else 0.2 * per_token
        # Blocks of 2^15 region-word cells at d = 256 (~47 captions of 14 words x 1 image of 49 regions), whose
        # [pairs, k + L, d] buffers stay near the size of the L2 cache, score more pairs/s than the evaluator's
        # default 2^22 (1 image x 128 captions and more); the cap scales with 1/d so a buffer keeps that size.
        # Measured with `python bench/mmca_speed.py --block-plans`: docs/mmca.md, "Block size".
        self.max_block_cells = (1 << 15) * 256 // d

    @property
    def score_bound(self) -> float:  # type: ignore[override]
        """|S - i0 . c0| = |alpha| |i1 . c1| <= |alpha|: i1 and c1 are l2-normalised (norm <= 1)."""
        return abs(self.alpha)

    # -- per-item parts ---------------------------------------------------------------------------
    def _project(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.unit.self_attn
        return F.linear(x, attn.in_proj_weight, attn.in_proj_bias)  # [.., 3d] = [Q K V]

    def prepare_images(self, img: ImageEmb) -> ImageEmb:
        if self.alpha != 0:
            img.extras["qkv"] = self._project(img.regions)  # [N, k, 3d]
        return img

    def prepare_texts(self, txt: TextEmb) -> TextEmb:
        if self.alpha != 0:
            txt.extras["qkv"] = self._project(txt.words)  # [M, L, 3d]
            txt.word_axes["qkv"] = (1,)
        return txt

    # -- pair part --------------------------------------------------------------------------------
    def cross_embeddings(self, img: ImageEmb, txt: TextEmb,
                         pairs: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(i1, c1) of every pair of the block, each [n * m, d] in row-major (image, caption) order, or of
        the listed pairs (image index, caption index), each [P, d]."""
        n, k, d = img.regions.shape
        m, length, _ = txt.words.shape

        def stack(per_image: torch.Tensor, per_caption: torch.Tensor) -> torch.Tensor:
            # [n, k, ...] and [m, L, ...] -> [P, k + L, ...]; the grid is one expand + cat copy, no gather
            if pairs is not None:
                return torch.cat([per_image[pairs[0]], per_caption[pairs[1]]], dim=1)
            shape = per_image.shape[2:]
            return torch.cat([per_image[:, None].expand(n, m, k, *shape),
                              per_caption[None].expand(n, m, length, *shape)], dim=2).view(n * m, k + length, *shape)

        y = stack(img.regions, txt.words)  # Y = [R; E] (Eq. 8-10)
        qkv = stack(img.extras["qkv"], txt.extras["qkv"])
        keep = stack(img.mask, txt.mask)  # [P, T] real tokens
        lengths = txt.lengths.repeat(n) if pairs is None else txt.lengths[pairs[1]]
        p, t = keep.shape
        q, kk, v = (z.view(p, t, self.heads, d // self.heads).transpose(1, 2) for z in qkv.chunk(3, dim=-1))
        unit = self.unit
        attended = F.scaled_dot_product_attention(  # softmax(Q K^T / sqrt(d_h)) V per head (Eq. 11)
            q, kk, v, attn_mask=None if bool(keep.all()) else keep[:, None, None, :],
            dropout_p=unit.self_attn.dropout if self.training else 0.0)
        attended = unit.self_attn.out_proj(attended.transpose(1, 2).reshape(p, t, d))  # concat heads W^O (Eq. 3)
        x = unit.norm1(y + unit.dropout1(attended))  # residual + LayerNorm after each sub-layer (post-LN)
        x = unit.norm2(x + unit.dropout2(unit.linear2(unit.dropout(unit.activation(unit.linear1(x))))))  # Eq. 4
        regions_c, words_c = x[:, :k], x[:, k:]
        i1 = l2norm(masked_pool(regions_c, keep[:, :k, None], 1, "avg"))
        c1 = l2norm(self.norm(self.fc(self.cnn(words_c, lengths))))
        return i1, c1

    def cross_scores(self, img: ImageEmb, txt: TextEmb,
                     pairs: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """i1 . c1: [n, m] for the whole block, or [P] for the listed pairs.

        When gradients are recorded and `pair_chunk` > 0, pairs go through in chunks whose activations are
        recomputed in the backward pass (activation checkpointing; dropout masks are replayed): the memory
        of one chunk instead of all pairs of the batch, for about a third more compute."""
        n, m = len(img), len(txt)
        chunk = self.pair_chunk
        if chunk > 0 and torch.is_grad_enabled() and (n * m if pairs is None else len(pairs[0])) > chunk:
            if pairs is None:
                grid = torch.arange(n * m, device=img.regions.device)
                dots = self.cross_scores(img, txt, (grid // m, grid % m))
                return dots.view(n, m)

            def dots_of(i_idx: torch.Tensor, t_idx: torch.Tensor) -> torch.Tensor:
                i1, c1 = self.cross_embeddings(img, txt, (i_idx, t_idx))
                return (i1 * c1).sum(-1)

            return torch.cat([checkpoint(dots_of, pairs[0][c:c + chunk], pairs[1][c:c + chunk], use_reentrant=False)
                              for c in range(0, len(pairs[0]), chunk)])
        i1, c1 = self.cross_embeddings(img, txt, pairs)
        dots = (i1 * c1).sum(-1)
        return dots if pairs is not None else dots.view(n, m)

    def forward(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        if img.vector is None or txt.vector is None:
            raise ValueError("MMCA needs the self-attention module's i0 and c0 (ImageEmb/TextEmb.vector)")
        scores = img.vector @ txt.vector.T  # i0 . c0
        if self.alpha == 0:
            return scores
        return scores + self.alpha * self.cross_scores(img, txt)

    def training_loss(self, img: ImageEmb, txt: TextEmb, margin: float, hardest: bool,
                      positives: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 15 (three hardest-negative hinge terms) when training on hardest negatives; during a warm-up
        on the sum over negatives the usual two-term sum (Eq. 15's joint term has no sum form).

        With `train_negatives` = h > 0 the cross module scores only the matched pairs and each image's and
        caption's h hardest negatives by i0 . c0 (plus the B joint pairs of Eq. 15's first term), about
        B (2h + 2) pairs instead of B^2; the hardest negatives are then chosen among those candidates."""
        b = len(img)
        h = self.train_negatives
        if self.alpha == 0 or h <= 0 or h >= b - 1:
            scores = self(img, txt)
            if hardest and self.three_term:
                return mmca_loss(scores, margin, positives)
            return triplet_loss(scores, margin, hardest, positives)
        first = img.vector @ txt.vector.T
        positives = torch.eye(b, dtype=torch.bool, device=first.device) if positives is None else positives
        with torch.no_grad():
            negatives = first.masked_fill(positives, float("-inf"))
            chosen = torch.eye(b, dtype=torch.bool, device=first.device)
            chosen.scatter_(1, negatives.topk(h, dim=1).indices, True)
            chosen.scatter_(0, negatives.topk(h, dim=0).indices, True)
        pairs = chosen.nonzero(as_tuple=True)
        cross = torch.zeros_like(first).index_put(pairs, self.cross_scores(img, txt, pairs))
        scores = torch.where(chosen, first + self.alpha * cross, torch.full_like(first, float("-inf")))
        if not (hardest and self.three_term):
            return triplet_loss(scores, margin, hardest, positives)

        def joint(i_hat: torch.Tensor, t_hat: torch.Tensor) -> torch.Tensor:  # S(I_hat, T_hat), B more pairs
            return first[i_hat, t_hat] + self.alpha * self.cross_scores(img, txt, (i_hat, t_hat))

        return mmca_loss(scores, margin, positives, joint)
