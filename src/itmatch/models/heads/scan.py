"""Stacked Cross Attention (SCAN, Lee et al. 2018, Eq. 1-8), all pairs of a block at once.

The attended vector a = sum_k alpha_k x_k is never materialised: its dot with the query is
sum_k alpha_k s_k (s = raw region-word dots, one GEMM for the block) and its squared norm is
alpha^T G alpha, with G the k x k Gram matrix of the attended item (regions of an image for t-i, words
of a caption for i-t), computed once per item in `prepare_*`. Same numbers as the direct formula,
several times less work (DESIGN.md section 4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from itmatch.models.base import EPS, ImageEmb, SimilarityHead, TextEmb
from itmatch.models.heads.common import masked_pool, region_word_dots

NORMS = ("clipped_l2norm", "l2norm", "clipped", "softmax", "no_norm")
POOLS = ("avg", "lse", "max", "sum")


def attention_logits(s: torch.Tensor, query_mask: torch.Tensor, context_mask: torch.Tensor, how: str,
                     clip_slope: float, lam: float, inplace: bool = False) -> torch.Tensor:
    """lambda_1 * (the region-word similarity normalised over the query axis, dim 3), -inf on padded
    context entries (dim 1): the logits of the attention softmax over dim 1 (SCAN Eq. 1-2 / 7).

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
        return torch.addcmul(bias, x, torch.as_tensor(scale, dtype=s.dtype))  # one pass: mask and scale
    if isinstance(scale, float) and scale == 1.0:
        return x
    return x.mul_(scale) if inplace and x is not s else x * scale


class ScanHead(SimilarityHead):
    """direction t2i: words attend to regions, words are scored and pooled (Eq. 7-8);
    direction i2t: regions attend to words, regions are scored and pooled (Eq. 4-6)."""

    # s, logits -> alpha, G.alpha (3 float32 buffers) + allocator slack: 14-25 measured (docs/performance.md)
    bytes_per_cell = 26.0

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
            img.extras["gram"] = img.regions @ img.regions.transpose(1, 2)  # [N, k, k]
        return img

    def prepare_texts(self, txt: TextEmb) -> TextEmb:
        if self.direction == "i2t":
            txt.extras["gram"] = txt.words @ txt.words.transpose(1, 2)  # [M, L, L]
        return txt

    def forward(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        # Both directions are one computation over a block s[B, C, b, Q]: item B's context entries C
        # (regions for t-i, words for i-t) are attended by item b's queries Q. t-i uses the image-major
        # layout [n, k, m, l], i-t the caption-major one [m, l, n, k], so that the softmax and the
        # attended sums run over dim 1 and the Gram product is a plain bmm over the context items.
        # Padded words / masked regions are zero (Matcher.encode_*), so s = 0 there.
        if self.direction == "t2i":
            s = region_word_dots(img, txt, "image")
            context_mask, query_mask, gram, queries = img.mask, txt.mask, img.extras["gram"], txt.words
        else:
            s = region_word_dots(img, txt, "text")
            context_mask, query_mask, gram, queries = txt.mask, img.mask, txt.extras["gram"], img.regions
        n_ctx, c, n_q, q = s.shape
        inplace = not s.requires_grad  # evaluation: reuse buffers, autograd needs the originals
        logits = attention_logits(s, query_mask[None, None], context_mask, self.norm, self.clip_slope,
                                  self.lambda_softmax, inplace)
        alpha = torch.softmax(logits, dim=1)  # Eq. 2 / 7: attention over the context entries
        del logits
        dot = (s.mul_(alpha) if inplace else s * alpha).sum(1)  # [B, b, Q] = query . attended vector
        g_alpha = torch.bmm(gram, alpha.view(n_ctx, c, n_q * q)).view(n_ctx, c, n_q, q)
        sq_norm = (g_alpha.mul_(alpha) if inplace else g_alpha * alpha).sum(1)  # ||a||^2 = alpha^T G alpha
        relevance = dot / (queries.norm(dim=-1)[None] * sq_norm.clamp(min=EPS * EPS).sqrt()).clamp(min=EPS)
        scores = masked_pool(relevance, query_mask[None], 2, self.pool, self.lambda_lse)  # Eq. 5-6 / 8
        return scores if self.direction == "t2i" else scores.T

