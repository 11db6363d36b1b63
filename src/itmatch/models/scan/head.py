"""Stacked Cross Attention (SCAN, Lee et al. 2018, Eq. 1-8), all pairs of a block at once, without ever
building the attended vectors; its attention core also serves OAN's inter-modal terms.
How a block is scored with one GEMM and per-item Gram matrices: docs/scan.md, "The per-item-precompute identity".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from itmatch.config import NORMS, POOLS
from itmatch.models.base import EPS, ImageEmb, SimilarityHead, TextEmb, masked_pool
from itmatch.models.region_word import add_region_gram, add_word_gram, region_word_dots
from itmatch.models.scan import fused


def attention_logits(s: torch.Tensor, query_mask: torch.Tensor, context_mask: torch.Tensor, how: str,
                     clip_slope: float, lam: float, inplace: bool = False) -> torch.Tensor:
    """lambda_1 * (the region-word similarity normalised over the query axis, dim 3), -inf on padded
    context entries (dim 1): the logits of the attention softmax over dim 1 (SCAN Eq. 3, and its unnumbered t-i twin
    in section 3.1).

    clipped_l2norm: [s]_+ / (sqrt(sum [s]_+^2) + eps), where [.]_+ is LeakyReLU(clip_slope) (the code uses
    0.1; the paper writes a plain ReLU, clip_slope=0). Padded query entries hold s = 0 (Matcher.encode_*
    zero padded vectors) and [.]_+ keeps them at 0, so they stay out of the norm without a mask pass over
    the block; only the softmax normalisation needs `query_mask`. `s` is never modified; with `inplace`
    (no autograd) the intermediate buffer is reused, so the block costs one buffer, not four."""
    if how not in NORMS:
        raise ValueError(f"unknown normalisation {how!r}; choose one of {NORMS}")
    if how == "softmax":
        x = torch.softmax(s.masked_fill(~query_mask, float("-inf")), dim=3)
    elif how in ("clipped_l2norm", "clipped"):
        x = F.leaky_relu(s, clip_slope)
    else:
        x = s if how == "l2norm" else s * lam  # a copy: s is needed again for the attended dot
    scale: torch.Tensor | float = lam
    if how in ("clipped_l2norm", "l2norm"):
        # vector_norm: zero gradient where a whole column is zero (padded words in i-t), not NaN
        scale = lam / (torch.linalg.vector_norm(x, dim=3, keepdim=True) + EPS)
    elif how == "no_norm":
        scale = 1.0
    if not bool(context_mask.all()):
        bias = torch.zeros(context_mask.shape, dtype=s.dtype, device=s.device)
        bias = bias.masked_fill_(~context_mask, float("-inf"))[:, :, None, None]
        # one pass: mask and scale
        return torch.addcmul(bias, x, torch.as_tensor(scale, dtype=s.dtype, device=s.device))
    if isinstance(scale, float) and scale == 1.0:
        return x
    return x.mul_(scale) if inplace and x is not s else x * scale


def context_attention(sim: torch.Tensor, query_mask: torch.Tensor, context_mask: torch.Tensor, norm: str,
                      clip_slope: float, lam: float, inplace: bool = False) -> torch.Tensor:
    """The attention weights of a block [B, C, b, Q] over its context axis (dim 1), 0 on padded context
    entries: softmax_C(attention_logits(sim)) (SCAN Eq. 3 and its t-i twin, OAN Eq. 4)."""
    return torch.softmax(attention_logits(sim, query_mask[None, None], context_mask, norm, clip_slope, lam, inplace),
                         dim=1)


def attended_relevance(s: torch.Tensor, query_mask: torch.Tensor, context_mask: torch.Tensor, gram: torch.Tensor,
                       queries: torch.Tensor, norm: str, clip_slope: float, lam: float,
                       sim: torch.Tensor | None = None) -> torch.Tensor:
    """cos(query, attended vector) for every query of every pair of a block (SCAN Eq. 1-3 / 7-8, OAN Eq. 4-5).

    s [B, C, b, Q]: raw dots between item B's context entries C (regions for t-i, words for i-t) and item
    b's queries Q, with the attended axis at dim 1 (image-major [n, k, m, l] for t-i, caption-major
    [m, l, n, k] for i-t: then the softmax and the attended sums run over dim 1 and the Gram product is a
    plain bmm over the context items). gram [B, C, C]: the context items' Gram matrices; queries [b, Q, D].
    `sim`: what the attention logits are computed from when it is not s itself (OAN: cosines). Padded
    queries / context entries are zero vectors (Matcher.encode_*), so s = 0 there.

    The attended vector a = sum_c alpha_c x_c is never materialised: its dot with the query is
    sum_c alpha_c s_c, its squared norm alpha^T G alpha. Without autograd the block's buffers are reused
    (s is consumed). Returns [B, b, Q]."""
    n_ctx, c, n_q, q = s.shape
    inplace = not s.requires_grad  # evaluation: reuse buffers, autograd needs the originals
    alpha = context_attention(s if sim is None else sim, query_mask, context_mask, norm, clip_slope, lam, inplace)
    dot = (s.mul_(alpha) if inplace else s * alpha).sum(1)  # [B, b, Q] = query . attended vector
    g_alpha = torch.bmm(gram, alpha.view(n_ctx, c, n_q * q)).view(n_ctx, c, n_q, q)
    sq_norm = (g_alpha.mul_(alpha) if inplace else g_alpha * alpha).sum(1)  # ||a||^2 = alpha^T G alpha
    return dot / (queries.norm(dim=-1)[None] * sq_norm.clamp(min=EPS * EPS).sqrt()).clamp(min=EPS)


class ScanHead(SimilarityHead):
    """direction t2i: words attend to regions, words are scored and pooled (Eq. 7-8);
    direction i2t: regions attend to words, regions are scored and pooled (Eq. 4-6)."""

    # s, logits -> alpha, G.alpha (3 float32 buffers) + allocator slack; calibrated against peak RSS
    # (docs/performance.md, "The memory budget")
    bytes_per_cell = 26.0
    bytes_per_pair = 0.0

    def __init__(self, direction: str = "t2i", pool: str = "avg", lambda_softmax: float = 9.0,
                 lambda_lse: float = 6.0, norm: str = "clipped_l2norm", clip_slope: float = 0.1) -> None:
        super().__init__()
        if direction not in ("t2i", "i2t"):
            raise ValueError(f"direction must be 't2i' or 'i2t', not {direction!r}")
        if pool not in POOLS:
            raise ValueError(f"unknown pooling {pool!r}; choose one of {POOLS}")
        if norm not in NORMS:
            raise ValueError(f"unknown normalisation {norm!r}; choose one of {NORMS}")
        self.direction, self.pool, self.norm = direction, pool, norm
        self.lambda_softmax, self.lambda_lse, self.clip_slope = lambda_softmax, lambda_lse, clip_slope

    def prepare_images(self, img: ImageEmb) -> ImageEmb:
        if self.direction == "t2i":
            add_region_gram(img)
        return img

    def prepare_texts(self, txt: TextEmb) -> TextEmb:
        if self.direction == "i2t":
            add_word_gram(txt)
        return txt

    has_word_attention = True

    def word_attention(self, img: ImageEmb, txt: TextEmb) -> tuple[torch.Tensor, str]:
        """t-i: alpha' (each word over the regions); i-t: alpha (each region over the words)."""
        return self.attention(img, txt)[0, :, 0, :], "regions" if self.direction == "t2i" else "words"

    def attention(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        """The attention weights the score uses, [n_img, k, n_txt, L] (region axis 1, word axis 3).

        t2i: alpha'_{kl} of Sec. 3.2 (Text-Image), each word's softmax over the image's regions, so
        every real word's weights sum to 1 over the real regions (what SCAN Fig. 4 draws per word).
        i2t: alpha_{kl} of Eq. 3, each region's softmax over the caption's words (sums to 1 over words).
        Entries of padded words are NaN-free but meaningless; use txt.lengths to cut them."""
        if self.direction == "t2i":
            s = region_word_dots(img, txt, "image")
            return context_attention(s, txt.mask, img.mask, self.norm, self.clip_slope, self.lambda_softmax)
        s = region_word_dots(img, txt, "text")  # caption-major [m, l, n, k]
        alpha = context_attention(s, img.mask, txt.mask, self.norm, self.clip_slope, self.lambda_softmax)
        return alpha.permute(2, 3, 0, 1)

    def forward(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        # Both directions are one computation (attended_relevance): t-i in the image-major layout
        # (regions attended by words), i-t in the caption-major one (words attended by regions).
        if self.direction == "t2i":
            s = region_word_dots(img, txt, "image")
            # on CUDA without autograd: one Triton kernel from the dots on (models/scan/fused.py); None: here
            scores = fused.head_scores(self, s, img, txt)
            if scores is not None:
                return scores
            relevance = attended_relevance(s, txt.mask, img.mask, img.extras["gram"], txt.words, self.norm,
                                           self.clip_slope, self.lambda_softmax)
            query_mask = txt.mask
        else:
            s = region_word_dots(img, txt, "text")
            relevance = attended_relevance(s, img.mask, txt.mask, txt.extras["gram"], img.regions, self.norm,
                                           self.clip_slope, self.lambda_softmax)
            query_mask = img.mask
        scores = masked_pool(relevance, query_mask[None], 2, self.pool, self.lambda_lse)  # Eq. 5-6 / 8
        return scores if self.direction == "t2i" else scores.T


class TwoWayScanHead(SimilarityHead):
    """The average of a t-i and an i-t ScanHead on one model: S = (S_t2i + S_i2t) / 2 (SAVE footnote 1,
    after SCAN, which averages the scores of two separately trained models; see docs/save.md). Each
    direction keeps its own lambdas and per-item precompute (t-i the image Gram, i-t the caption Gram:
    distinct sides, so the two `extras["gram"]` never collide)."""

    def __init__(self, t2i: ScanHead, i2t: ScanHead) -> None:
        super().__init__()
        if (t2i.direction, i2t.direction) != ("t2i", "i2t"):
            raise ValueError("TwoWayScanHead takes a t2i head and an i2t head, in that order")
        self.t2i, self.i2t = t2i, i2t
        # the two directions run one after the other: the peak is the larger of the two
        self.bytes_per_cell = max(t2i.bytes_per_cell, i2t.bytes_per_cell)
        self.bytes_per_pair = max(t2i.bytes_per_pair, i2t.bytes_per_pair)

    has_word_attention = True

    def word_attention(self, img: ImageEmb, txt: TextEmb) -> tuple[torch.Tensor, str]:
        """Its t-i half's alpha' (each word over the regions)."""
        return self.t2i.word_attention(img, txt)

    def prepare_images(self, img: ImageEmb) -> ImageEmb:
        return self.i2t.prepare_images(self.t2i.prepare_images(img))

    def prepare_texts(self, txt: TextEmb) -> TextEmb:
        return self.i2t.prepare_texts(self.t2i.prepare_texts(txt))

    def forward(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        return (self.t2i(img, txt) + self.i2t(img, txt)) / 2
