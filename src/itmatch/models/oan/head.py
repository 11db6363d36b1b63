"""Object-oriented inter- and intra-modal attention (OAN, Huang et al., section 4.2-4.4), all pairs of a block at
once: the inter-modal terms (pair-dependent) run SCAN's attention core, the intra-modal term (pair-independent)
is one matrix product of per-item vectors. The score's equations and what is computed once per item:
docs/oan.md, "The score (Eq. 4-8, 14)" and "Per-item precompute".
"""

from __future__ import annotations

import math

import torch
from torch import nn

from itmatch.models.base import EPS, ImageEmb, SimilarityHead, TextEmb, l2norm, masked_pool
from itmatch.models.oan.config import INTRA, NEGATIVES
from itmatch.models.oan.loss import oan_triplet_loss
from itmatch.models.region_word import add_region_gram, add_word_gram, region_word_dots
from itmatch.models.scan.head import attended_relevance, context_attention


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, L, D], [B, L] bool -> [B, D], the mean over the real objects."""
    m = mask.unsqueeze(-1).to(x.dtype)
    return (x * m).sum(1) / m.sum(1).clamp(min=1.0)


class IntraModalAttention(nn.Module):
    """Single-hop multi-head context-aware attention over one modality's objects (Eq. 6-8):
    c = mean_i x_i, h_i^k = tanh(W_c^k c)^T tanh(W_x^k x_i), w^k = softmax_i(lambda h^k), x^k = sum_i w_i^k x_i.

    W_c^k and W_x^k are D x D without bias (the paper writes none), Xavier-uniform per head; the K heads
    are one D -> K*D matrix each so that the keys of all heads are one GEMM."""

    def __init__(self, dim: int, heads: int, lam: float) -> None:
        super().__init__()
        if heads < 1:
            raise ValueError(f"the intra-modal attention needs at least one head, not {heads}")
        self.heads, self.lam = heads, lam
        self.context = nn.Linear(dim, heads * dim, bias=False)
        self.key = nn.Linear(dim, heads * dim, bias=False)
        bound = math.sqrt(6.0 / (dim + dim))  # Xavier-uniform of each D x D head
        for layer in (self.context, self.key):
            nn.init.uniform_(layer.weight, -bound, bound)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, D], mask [B, L] -> (attended [B, K, D], weights [B, K, L] summing to 1 over real objects)."""
        b, length, d = x.shape
        query = torch.tanh(self.context(masked_mean(x, mask))).view(b, self.heads, d)  # tanh(W_c^k c)
        keys = torch.tanh(self.key(x)).view(b, length, self.heads, d)  # tanh(W_x^k x_i)
        h = torch.einsum("bkd,blkd->bkl", query, keys)  # Eq. 6
        weights = torch.softmax((self.lam * h).masked_fill(~mask[:, None, :], float("-inf")), dim=2)  # Eq. 7
        return weights @ x, weights  # Eq. 8


def set_vector(sets: torch.Tensor) -> torch.Tensor:
    """[B, K, D] -> [B, K*D] with a.b = S(set_a, set_b) = 1/K sum_k cos(a_k, b_k) (the set-wise cosine)."""
    return l2norm(sets).flatten(1) / math.sqrt(sets.shape[1])


class OANHead(SimilarityHead):
    """The OAN similarity (Eq. 4-8, 14) and objective (Eq. 10-13).

    Switches for the Table 2 ablations: `inter=False` drops the two inter-modal terms, `intra="none"` the
    intra-modal term, `intra="mean"` replaces the intra-modal attention by mean pooling (with inter=False:
    "no attention"). When one side is off, the other takes the whole weight (1 instead of 1 - gamma or
    gamma), so the loss scale and margins keep their meaning."""

    # per direction: dots, cosines, logits -> alpha, G.alpha; SCAN's calibrated bound kept, above what OAN
    # measured (docs/oan.md, "Per-item precompute")
    bytes_per_cell = 26.0
    bytes_per_pair = 0.0

    def __init__(self, *, k_heads: int = 6, embed_size: int = 512, lambda_tt: float = 1.0, lambda_vv: float = 1.0,
                 lambda_tv: float = 0.9, lambda_vt: float = 0.5, gamma: float = 0.3, inter: bool = True,
                 intra: str = "attention", negatives: str = "eq12", alpha_intra: float = 0.1,
                 beta: float = 0.5) -> None:
        super().__init__()
        if intra not in INTRA:
            raise ValueError(f"model.oan.intra must be one of {INTRA}, not {intra!r}")
        if negatives not in NEGATIVES:
            raise ValueError(f"model.oan.negatives must be one of {NEGATIVES}, not {negatives!r}")
        if not inter and intra == "none":
            raise ValueError("model.oan.inter=false with model.oan.intra=none leaves no similarity; "
                             "use intra=mean for the 'no attention' ablation")
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"model.oan.gamma must be in [0, 1], not {gamma}")
        self.inter, self.intra, self.negatives = inter, intra, negatives
        self.lambda_tv, self.lambda_vt, self.gamma = lambda_tv, lambda_vt, gamma
        self.alpha_intra, self.beta = alpha_intra, beta
        if intra == "attention":
            self.text_attention = IntraModalAttention(embed_size, k_heads, lambda_tt)
            self.image_attention = IntraModalAttention(embed_size, k_heads, lambda_vv)
        if not inter:  # only the pair-independent term: one matrix product, no per-cell temporaries
            self.bytes_per_cell = 0.0

    # ---- per-item parts -------------------------------------------------------------------------------
    def intra_sets(self, objects: torch.Tensor, mask: torch.Tensor, image: bool) -> torch.Tensor:
        """The instance-wise intra-modal set [B, K, D] (e_TT or v_VV), or the mean of the objects [B, 1, D]."""
        if self.intra == "attention":
            return (self.image_attention if image else self.text_attention)(objects, mask)[0]
        return masked_mean(objects, mask).unsqueeze(1)

    def prepare_images(self, img: ImageEmb) -> ImageEmb:
        if self.inter:
            add_region_gram(img)
        # also used with intra="none": the intra-modal negatives of Eq. 10 compare images through it
        img.vector = set_vector(self.intra_sets(img.regions, img.mask, image=True))
        return img

    def prepare_texts(self, txt: TextEmb) -> TextEmb:
        if self.inter:
            add_word_gram(txt)
        txt.vector = set_vector(self.intra_sets(txt.words, txt.mask, image=False))
        return txt

    # ---- pair scores ----------------------------------------------------------------------------------
    # T-V is SCAN t-i (image-major block [n, k, m, l], words attend to regions), V-T is SCAN i-t
    # (caption-major block [m, l, n, k], regions attend to words), through the same attention core;
    # OAN's logits come from cosines with a plain ReLU: s_ij = [cos]_+, l2-normalised over the query axis.
    def _cosines(self, dots: torch.Tensor, img: ImageEmb, txt: TextEmb, layout: str) -> torch.Tensor:
        """cos(e_i, v_j) of a block of raw dots in `layout` ("image" [n, k, m, l] or "text" [m, l, n, k])."""
        r, w = img.regions.norm(dim=-1), txt.words.norm(dim=-1)
        norms = r[:, :, None, None] * w[None, None] if layout == "image" else w[:, :, None, None] * r[None, None]
        return dots / norms.clamp(min=EPS)

    def inter_relevance(self, img: ImageEmb, txt: TextEmb, direction: str) -> torch.Tensor:
        """cos(query, attended vector): "tv" [n, m, l] per word (attending to regions, lambda_TV),
        "vt" [m, n, k] per region (attending to words, lambda_VT) (Eq. 4-5)."""
        if direction == "tv":
            dots = region_word_dots(img, txt, "image")
            return attended_relevance(dots, txt.mask, img.mask, img.extras["gram"], txt.words, "clipped_l2norm",
                                      0.0, self.lambda_tv, sim=self._cosines(dots, img, txt, "image"))
        dots = region_word_dots(img, txt, "text")
        return attended_relevance(dots, img.mask, txt.mask, txt.extras["gram"], img.regions, "clipped_l2norm",
                                  0.0, self.lambda_vt, sim=self._cosines(dots, img, txt, "text"))

    @property
    def has_word_attention(self) -> bool:  # type: ignore[override]
        return self.inter

    def word_attention(self, img: ImageEmb, txt: TextEmb) -> tuple[torch.Tensor, str]:
        """The T-V weights of Eq. 4 (each textual object over the visual objects)."""
        if not self.inter:
            return super().word_attention(img, txt)
        alpha_tv, _ = self.attention(img, txt)  # [n, k, m, l], a softmax over regions k
        return alpha_tv[0, :, 0, :], "regions"

    def attention(self, img: ImageEmb, txt: TextEmb) -> tuple[torch.Tensor, torch.Tensor]:
        """The inter-modal attention weights of a block, each [n, k, m, l]: T-V weights sum to 1 over
        regions k (Eq. 4 with s-bar), V-T weights over words l (Eq. 4 with s-hat)."""
        dots = region_word_dots(img, txt, "image")
        alpha_tv = context_attention(self._cosines(dots, img, txt, "image"), txt.mask, img.mask, "clipped_l2norm",
                                     0.0, self.lambda_tv)
        dots = region_word_dots(img, txt, "text")
        alpha_vt = context_attention(self._cosines(dots, img, txt, "text"), img.mask, txt.mask, "clipped_l2norm",
                                     0.0, self.lambda_vt)
        return alpha_tv, alpha_vt.permute(2, 3, 0, 1)

    def components(self, img: ImageEmb, txt: TextEmb) -> dict[str, torch.Tensor]:
        """The set-wise similarities of every pair, [n_img, n_txt] each: "vt" = S(v_VT, e_VT),
        "tv" = S(v_TV, e_TV), "intra" = S(v_VV, e_TT); only the enabled ones."""
        out: dict[str, torch.Tensor] = {}
        if self.inter:
            out["tv"] = masked_pool(self.inter_relevance(img, txt, "tv"), txt.mask[None], 2, "avg")
            out["vt"] = masked_pool(self.inter_relevance(img, txt, "vt"), img.mask[None], 2, "avg").T
        if self.intra != "none":
            out["intra"] = img.vector @ txt.vector.T
        return out

    def weights(self) -> dict[str, float]:
        """The weight of each component in Eq. 13-14."""
        if not self.inter:
            return {"intra": 1.0}
        if self.intra == "none":
            return {"vt": 1.0, "tv": 1.0}
        return {"vt": 1.0 - self.gamma, "tv": 1.0 - self.gamma, "intra": self.gamma}

    def forward(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        """Eq. 14."""
        parts = self.components(img, txt)
        return sum(w * parts[name] for name, w in self.weights().items())

    def training_loss(self, img: ImageEmb, txt: TextEmb, margin: float, hardest: bool,
                      positives: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 13: each similarity's Eq. 10 loss (its own inter-modal hard negatives, alpha_inter =
        margin), weighted as in Eq. 14. The intra-modal similarities S(v, v') and S(t, t') are the
        set-wise cosines of the intra-modal sets (the only per-item sets whose elements correspond across
        items), shared by the three terms."""
        parts = self.components(img, txt)
        img_sim, txt_sim = img.vector @ img.vector.T, txt.vector @ txt.vector.T
        strategy, beta = self.negatives, self.beta
        total = img.regions.new_zeros(())
        for name, w in self.weights().items():
            total = total + w * oan_triplet_loss(parts[name], img_sim, txt_sim, margin, self.alpha_intra,
                                                 beta, strategy, hardest, positives)
        return total
