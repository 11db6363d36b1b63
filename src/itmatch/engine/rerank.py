"""Two-stage scoring: a global first stage (i . c of the pair-independent vectors) picks candidates, the full
model scores only those (DESIGN.md section 4: "global first stage -> re-rank top K").

For MMCA the first stage is exactly the self-attention module's i0 . c0 and the second adds the cross
module's alpha * i1 . c1; any model whose encoders fill `ImageEmb.vector` / `TextEmb.vector` can use it.
The result is a full [n_img, n_txt] matrix with -inf outside the candidates, so the usual metrics apply:
a query whose match is not among its K candidates ranks below every candidate (R@k for k <= K is exact
with respect to the candidates; medr/meanr beyond K are not meaningful).
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from itmatch.engine.evaluate import DEFAULT_BUDGET, score_matrix
from itmatch.models.base import ImageEmb, Matcher, TextEmb


def global_scores(img: ImageEmb, txt: TextEmb) -> torch.Tensor:
    """First stage: [n_img, n_txt] dot products of the global vectors (cosine for l2-normalised ones)."""
    if img.vector is None or txt.vector is None:
        raise ValueError("re-ranking needs a model with global image and caption vectors (ImageEmb/TextEmb.vector)")
    return img.vector.float() @ txt.vector.float().T


def candidate_mask(first: torch.Tensor, k: int) -> torch.Tensor:
    """[n_img, n_txt] bool: the top-k captions of each image and the top-k images of each caption."""
    n, m = first.shape
    mask = torch.zeros(n, m, dtype=torch.bool)
    mask.scatter_(1, first.topk(min(k, m), dim=1).indices, True)  # image -> text candidates
    mask.scatter_(0, first.topk(min(k, n), dim=0).indices, True)  # text -> image candidates
    return mask


@torch.inference_mode()
def rerank_scores(model: Matcher, img: ImageEmb, txt: TextEmb, k: int, budget_bytes: float = DEFAULT_BUDGET,
                  progress: bool = False) -> torch.Tensor:
    """Full scores `model.score` for the candidates of `candidate_mask(global_scores, k)`, -inf elsewhere.

    Candidates are scored image by image (each image with its candidate captions, in one or more
    budget-sized calls), so the work is the number of candidate pairs, about (n_img + n_txt) * k."""
    mask = candidate_mask(global_scores(img, txt), k)
    out = torch.full(mask.shape, float("-inf"))
    bar = tqdm(total=int(mask.sum()), desc=f"re-rank top {k}", unit="pair", unit_scale=True,
               disable=not progress, leave=False)
    for i in range(len(img)):
        columns = mask[i].nonzero().squeeze(1)
        if len(columns):
            block = score_matrix(model, img.take(slice(i, i + 1)), txt.take(columns), budget_bytes)
            out[i, columns] = block[0]
            bar.update(len(columns))
    bar.close()
    return out
