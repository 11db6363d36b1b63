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

from itmatch.models.base import EPS, ImageEmb, SimilarityHead, TextEmb, masked_pool
from itmatch.models.heads.common import add_region_gram, add_word_gram, region_word_dots

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


def normalise_over(s: torch.Tensor, mask: torch.Tensor, dim: int, how: str,
                   clip_slope: float) -> torch.Tensor:
    """The region-word similarity normalisation over the *query* axis `dim` (public SCAN code).

    clipped_l2norm: [s]_+ / sqrt(sum [s]_+^2), where [.]_+ is LeakyReLU(clip_slope) (the code uses 0.1;
    the paper writes a plain ReLU, clip_slope=0); padding entries do not enter the norm."""
    if how == "softmax":
        return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=dim)
    if how in ("clipped_l2norm", "clipped"):
        s = F.leaky_relu(s, clip_slope)
    if how in ("clipped_l2norm", "l2norm"):
        s = s.masked_fill(~mask, 0.0)
        # vector_norm: zero gradient where a whole column is zero (padded words in i-t), not NaN
        s = s / (torch.linalg.vector_norm(s, dim=dim, keepdim=True) + EPS)
    elif how not in ("clipped", "no_norm"):
        raise ValueError(f"unknown normalisation {how!r}; choose one of {NORMS}")
    return s


def attention_weights(sn: torch.Tensor, lam: float, mask: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax over the attended axis `dim` of lam * sn, padding excluded (SCAN Eq. 2, OAN Eq. 4)."""
    return torch.softmax((lam * sn).masked_fill(~mask, float("-inf")), dim=dim)


def attended_cosine(s: torch.Tensor, alpha: torch.Tensor, img: ImageEmb, txt: TextEmb, direction: str
                    ) -> torch.Tensor:
    """cos(query, attended vector) for every query of every pair of a block (SCAN Eq. 3, 8).

    s: raw region-word dots [n, k, m, l]; alpha: attention weights of the same shape.
    t2i: word l attends to regions (alpha sums to 1 over k), a_l = sum_k alpha_kl v_k -> [n, m, l].
    i2t: region k attends to words (alpha sums to 1 over l), a_k = sum_l alpha_kl e_l -> [n, k, m].
    a is never built: q.a = sum alpha s and ||a||^2 = alpha^T G alpha with the attended item's Gram matrix
    (extras["gram"] of the images for t2i, of the captions for i2t). Queries are not assumed unit-norm."""
    n, k, m, length = s.shape
    if direction == "t2i":
        dot = (alpha * s).sum(1)  # [n, m, l] = e_l . a_l
        g_alpha = torch.bmm(img.extras["gram"], alpha.reshape(n, k, m * length)).view(n, k, m, length)
        sq_norm = (alpha * g_alpha).sum(1)  # ||a_l||^2
        query_norm = txt.words.norm(dim=-1)[None]  # [1, m, l]
    else:
        dot = (alpha * s).sum(3)  # [n, k, m] = v_k . a_k
        per_caption = alpha.permute(2, 0, 1, 3).reshape(m, n * k, length)
        h_alpha = torch.bmm(per_caption, txt.extras["gram"]).view(m, n, k, length).permute(1, 2, 0, 3)
        sq_norm = (alpha * h_alpha).sum(3)  # [n, k, m]
        query_norm = img.regions.norm(dim=-1)[:, :, None]  # [n, k, 1]
    return dot / (query_norm * sq_norm.clamp(min=EPS * EPS).sqrt()).clamp(min=EPS)


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
            add_region_gram(img)
        return img

    def prepare_texts(self, txt: TextEmb) -> TextEmb:
        if self.direction == "i2t":
            add_word_gram(txt)
        return txt

    def attention(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        """The attention weights the score uses, [n_img, k, n_txt, L] (region axis 1, word axis 3).

        t2i: alpha'_{kl} of Sec. 3.2 (Text-Image), each word's softmax over the image's regions, so
        every real word's weights sum to 1 over the real regions (what SCAN Fig. 4 draws per word).
        i2t: alpha_{kl} of Eq. 3, each region's softmax over the caption's words (sums to 1 over words).
        Entries of padded words are NaN-free but meaningless; use txt.lengths to cut them."""
        if self.direction == "t2i":
            s = region_word_dots(img, txt, "image")
            logits = attention_logits(s, txt.mask[None, None], img.mask, self.norm, self.clip_slope,
                                      self.lambda_softmax)
            return torch.softmax(logits, dim=1)
        s = region_word_dots(img, txt, "text")  # caption-major [m, l, n, k]
        logits = attention_logits(s, img.mask[None, None], txt.mask, self.norm, self.clip_slope, self.lambda_softmax)
        return torch.softmax(logits, dim=1).permute(2, 3, 0, 1)

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

    def prepare_images(self, img: ImageEmb) -> ImageEmb:
        return self.i2t.prepare_images(self.t2i.prepare_images(img))

    def prepare_texts(self, txt: TextEmb) -> TextEmb:
        return self.i2t.prepare_texts(self.t2i.prepare_texts(txt))

    def forward(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        return (self.t2i(img, txt) + self.i2t(img, txt)) / 2
