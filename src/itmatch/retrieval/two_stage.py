"""Two-stage scoring: a global first stage proposes K candidates per query in both directions and the model's
pair head re-scores exactly those pairs, into an ordinary [n_img, n_txt] score matrix (-inf elsewhere), so the
retrieval metrics apply unchanged (docs/performance.md). `pruned_scores` is the exact variant for a head whose
score stays within a known bound of its global cosine: every query gets the rank exhaustive scoring gives
(MMCA; docs/mmca.md, 'Safe pruning').
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from itmatch.errors import ConfigError, whole_number
from itmatch.inference import DEFAULT_BUDGET, HOST, score_pairs
from itmatch.models.base import ImageEmb, Matcher, TextEmb
from itmatch.retrieval.first_stage import FirstStageIndex


@dataclass
class TwoStageResult:
    scores: torch.Tensor  # [n_img, n_txt], exact head scores on candidate pairs, -inf elsewhere
    pairs_scored: int  # distinct pairs re-scored by the pair head (union of both directions)
    pairs_total: int  # n_img * n_txt, what exhaustive scoring costs
    timings: dict[str, float] = field(default_factory=dict)  # seconds: index, search, rerank

    @property
    def fraction(self) -> float:
        return self.pairs_scored / self.pairs_total


def first_stage_vectors(img: ImageEmb, txt: TextEmb) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair-independent embeddings a model computed (VSE++); an error naming the fix otherwise."""
    if img.vector is None or txt.vector is None:
        raise ConfigError("this model has no pair-independent embedding for the first stage",
                          hint="pass a first-stage model trained on the same data (--first-stage CKPT, "
                               "e.g. a VSE++ checkpoint)")
    return img.vector, txt.vector


@torch.inference_mode()
def two_stage_scores(model: Matcher, img: ImageEmb, txt: TextEmb, k: int, img_vectors: torch.Tensor,
                     txt_vectors: torch.Tensor, index: str = "flat", progress: bool = False,
                     budget_bytes: float = DEFAULT_BUDGET) -> TwoStageResult:
    """Re-rank the first stage's top `k` captions of every image and top `k` images of every caption with
    `model`'s exact pair head. `img_vectors` [n_img, D'] / `txt_vectors` [n_txt, D'] come from any model
    with a global embedding (the same one for VSE++, a separate first-stage model for SCAN).

    A pair proposed by both directions is scored once: the work is K (n_img + n_txt) pairs at most, instead
    of n_img x n_txt. The candidate pairs of all queries go through the engine's score_pairs together
    (blocks of one image x its candidate captions, the ordinary head call), not one head call per query;
    `budget_bytes` bounds the score matrix plus one block, as for score_matrix."""
    n, m = len(img), len(txt)
    if len(img_vectors) != n or len(txt_vectors) != m:
        raise ConfigError(f"first-stage vectors ({len(img_vectors)} images, {len(txt_vectors)} captions) do "
                          f"not match the embeddings ({n} images, {m} captions)")
    k = whole_number("k (--rerank K)", k, hint="pass k >= 1, the first-stage candidates re-scored per query (e.g. 100)")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    caption_index = FirstStageIndex(index).build(txt_vectors)
    image_index = FirstStageIndex(index).build(img_vectors)
    timings["index"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, txt_of_img = caption_index.search(img_vectors, k)  # [n, k] candidate captions per image
    _, img_of_txt = image_index.search(txt_vectors, k)  # [m, k] candidate images per caption
    timings["search"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    # the union of both directions' candidates, each pair once (image-major, as score_pairs groups them)
    # (on the host, where FAISS answers and the score matrix lives)
    rows = torch.cat([torch.arange(n, device=HOST)[:, None].expand_as(txt_of_img).reshape(-1), img_of_txt.reshape(-1)])
    cols = torch.cat([txt_of_img.reshape(-1), torch.arange(m, device=HOST)[:, None].expand_as(img_of_txt).reshape(-1)])
    found = (rows >= 0) & (cols >= 0)  # IVF may return -1 when a query's probed lists hold < k items
    pairs = torch.unique(rows[found].long() * m + cols[found].long())
    images, captions = pairs // m, pairs % m
    scores = torch.full((n, m), float("-inf"), device=HOST)
    # the budget covers the [n, m] matrix too, as in score_matrix
    scores[images, captions] = score_pairs(model, img, txt, images, captions, budget_bytes - 4.0 * n * m, progress)
    timings["rerank"] = time.perf_counter() - t0
    return TwoStageResult(scores, len(pairs), n * m, timings)


#: slack added to a head's score bound: the same pair's score differs by ~1e-6 between block shapes (float32
#: sums in another order), and i1 . c1 of l2norm'ed vectors by as much beyond 1
PRUNING_SLACK = 1e-4


#: a model with its encodings of the items: the one model, or one member of an ensemble, that pruned_scores scores
Member = tuple[Matcher, ImageEmb, TextEmb]


@torch.inference_mode()
def pruned_scores(members: Sequence[Member], per_image: int = 5, progress: bool = False,
                  budget_bytes: float = DEFAULT_BUDGET) -> TwoStageResult:
    """A score matrix that ranks every query's ground truth exactly as exhaustive scoring does (so every
    metric equals the exhaustive one), with exact head scores only where the ranking needs them.

    The head's `score_bound` b bounds every pair's score S to [s - b, s + b] around its global cosine s.
    A query's rank counts the other items scoring >= its ground truth's exact score G (engine.metrics), so a
    pair with s + b < G cannot count and one with s - b > G must; only pairs with |s - G| <= b, in the
    row of their image or the column of their caption, are scored exactly. The others keep s, which lies
    on the same side of both their targets as S does: one matrix serves both directions.
    Caption j belongs to image j // per_image (the evaluation protocol's layout).

    `members` is one model or an ensemble (each model with its own encodings of the same items): the
    ensemble's score is the mean of its members' scores (as exhaustive ensembles rank), so it lies within the
    mean of their bounds of the mean of their cosines, and the same argument holds with s, S and b averaged."""
    if not members:
        raise ConfigError("safe pruning needs at least one model")
    for model, _, _ in members:
        if model.head.score_bound is None:
            raise ConfigError(f"{type(model.head).__name__} has no bound on its score around a global cosine, so "
                              "no pair can be ruled out without scoring it",
                              hint="evaluate it exhaustively, or two-stage with --rerank K")
    n, m = len(members[0][1]), len(members[0][2])
    if any((len(img), len(txt)) != (n, m) for _, img, txt in members):
        raise ConfigError("the ensemble's members encoded different items",
                          hint="evaluate every member on the same split")
    if m != per_image * n:
        raise ConfigError(f"{m} captions for {n} images: safe pruning needs {per_image} captions per image")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    scores = _mean(  # s = i0 . c0, kept where the bound decides
        [(img_vec.float() @ txt_vec.float().T).to(HOST) for img_vec, txt_vec in
         (first_stage_vectors(img, txt) for _, img, txt in members)])
    timings["search"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    free = budget_bytes - 5.0 * n * m  # the matrix and the undecided mask

    def exact(images: torch.Tensor, captions: torch.Tensor) -> torch.Tensor:
        return _mean([score_pairs(model, img, txt, images, captions, free, progress) for model, img, txt in members])

    captions = torch.arange(m, device=HOST)
    owners = captions // per_image
    truth = exact(owners, captions)  # G of each caption (text -> image)
    best = truth.view(n, per_image).amax(1)  # G of each image (image -> text): its best caption
    margin = _mean([model.head.score_bound for model, _, _ in members]) + PRUNING_SLACK
    undecided = ((scores - best[:, None]).abs() <= margin) | ((scores - truth[None, :]).abs() <= margin)
    undecided[owners, captions] = False  # scored above
    images, others = undecided.nonzero(as_tuple=True)
    del undecided
    scores[owners, captions] = truth
    scores[images, others] = exact(images, others)
    timings["rerank"] = time.perf_counter() - t0
    return TwoStageResult(scores, m + len(images), n * m, timings)



def _mean(values: list) -> Any:
    """The members' mean, summed in order and divided once, as evaluate_models averages an ensemble's scores."""
    return sum(values[1:], values[0]) / len(values)
