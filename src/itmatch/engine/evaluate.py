"""Evaluation: encode every image and caption once, fill the score matrix in memory-bounded blocks,
then apply the protocol of DESIGN.md section 3 (1K, COCO 5-fold 1K, COCO 5K, any split; ensembles)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from itmatch.data.datasets import pad_tokens
from itmatch.data.precomp import ImageSource, PrecompSplit, batch_tensor
from itmatch.data.vocab import AnyVocab
from itmatch.engine.metrics import average_folds, retrieval_metrics
from itmatch.errors import DataError
from itmatch.models.base import ImageEmb, Matcher, TextEmb

PROTOCOLS = ("1k", "full", "coco1k", "coco5k")
DEFAULT_BUDGET = 4 * 1024**3


def _pad_to(t: torch.Tensor, length: int, dims: Sequence[int]) -> torch.Tensor:
    if not dims:
        return t
    pad: list[int] = []
    for d in range(t.dim() - 1, 0, -1):
        pad += [0, length - t.shape[d] if d in dims else 0]
    return F.pad(t, pad)


def concat_texts(parts: list[TextEmb]) -> TextEmb:
    """Concatenate caption embeddings of different padded lengths (pads words and the word axes of
    extras, e.g. word Grams)."""
    longest = max(p.words.shape[1] for p in parts)
    axes = parts[0].word_axes
    words = torch.cat([_pad_to(p.words, longest, (1,)) for p in parts])
    extras = {k: torch.cat([_pad_to(p.extras[k], longest, axes.get(k, ())) for p in parts])
              for k in parts[0].extras}
    vector = torch.cat([p.vector for p in parts]) if parts[0].vector is not None else None
    return TextEmb(words=words, lengths=torch.cat([p.lengths for p in parts]), vector=vector, extras=extras,
                   word_axes=axes)


def concat_images(parts: list[ImageEmb]) -> ImageEmb:
    vector = torch.cat([p.vector for p in parts]) if parts[0].vector is not None else None
    return ImageEmb(regions=torch.cat([p.regions for p in parts]), mask=torch.cat([p.mask for p in parts]),
                    vector=vector, extras={k: torch.cat([p.extras[k] for p in parts]) for k in parts[0].extras})


@torch.inference_mode()
def encode_images(model: Matcher, features: ImageSource, batch_size: int = 128, progress: bool = False
                  ) -> ImageEmb:
    """Encode every image of a split's `images` (a feature array, cached multi-scale maps, or image
    files for pixel-input models) once, in batches."""
    parts = []
    for start in tqdm(range(0, len(features), batch_size), desc="encode images", disable=not progress,
                      leave=False):
        parts.append(model.encode_images(batch_tensor(features[start:start + batch_size])))
    return concat_images(parts)


@torch.inference_mode()
def encode_captions(model: Matcher, captions: Sequence[str], vocab: AnyVocab, batch_size: int = 256,
                    progress: bool = False) -> TextEmb:
    """Encode captions in length-sorted batches (little padding), returned in the original order."""
    tokens = [vocab.encode(c) for c in captions]
    order = sorted(range(len(tokens)), key=lambda j: len(tokens[j]))
    parts = []
    for start in tqdm(range(0, len(order), batch_size), desc="encode captions", disable=not progress,
                      leave=False):
        batch = pad_tokens([tokens[j] for j in order[start:start + batch_size]])
        parts.append(model.encode_texts(batch.tokens, batch.lengths))
    merged = concat_texts(parts)
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return merged.take(inverse)


def images_per_block(model: Matcher, img: ImageEmb, txt: TextEmb, budget_bytes: float) -> int:
    """Images per block so that the head's temporaries for (these images x `txt`) fit the budget."""
    head = model.head
    per_pair = head.bytes_per_cell * img.regions.shape[1] * txt.words.shape[1] + head.bytes_per_pair
    return max(1, min(len(img), int(budget_bytes // max(1.0, per_pair * len(txt)))))


@torch.inference_mode()
def score_matrix(model: Matcher, img: ImageEmb, txt: TextEmb, budget_bytes: float = DEFAULT_BUDGET,
                 progress: bool = False, captions_per_block: int = 1024) -> torch.Tensor:
    """All-pairs scores [n_img, n_txt] in float32. Captions are bucketed by length so that a block is
    padded only to its own longest caption; every block is one batched call of the model's head, and
    the number of images per block follows from the memory budget."""
    n, m = len(img), len(txt)
    if model.head.bytes_per_cell <= 0 and model.head.bytes_per_pair <= 0:  # pair-independent: one product
        return model.score(img, txt).float()
    order = torch.argsort(txt.lengths, stable=True)
    sorted_txt = txt.take(order)
    out = torch.empty(n, m)
    bar = tqdm(total=n * m, desc="score pairs", unit="pair", unit_scale=True, disable=not progress, leave=False)
    for t0 in range(0, m, captions_per_block):
        columns = order[t0:t0 + captions_per_block]
        block_txt = sorted_txt.take(slice(t0, t0 + captions_per_block)).trimmed()
        rows = images_per_block(model, img, block_txt, budget_bytes)
        for i0 in range(0, n, rows):
            out[i0:i0 + rows, columns] = model.score(img.take(slice(i0, i0 + rows)), block_txt).float()
            bar.update(min(rows, n - i0) * len(columns))
    bar.close()
    return out


def split_scores(model: Matcher, vocab: AnyVocab, split: PrecompSplit, budget_bytes: float = DEFAULT_BUDGET,
                 progress: bool = False, rerank: int = 0) -> torch.Tensor:
    """The split's score matrix: exhaustive, or with `rerank` = K > 0 the two-stage matrix of
    `engine.rerank.rerank_scores` (full scores for the global stage's top-K, -inf elsewhere)."""
    img = encode_images(model, split.images, progress=progress)
    txt = encode_captions(model, split.captions, vocab, progress=progress)
    if rerank > 0:
        from itmatch.engine.rerank import rerank_scores

        return rerank_scores(model, img, txt, rerank, budget_bytes, progress)
    return score_matrix(model, img, txt, budget_bytes, progress)


def protocol_folds(split: PrecompSplit, protocol: str) -> list[PrecompSplit]:
    if protocol not in PROTOCOLS:
        raise DataError(f"unknown protocol {protocol!r}", hint=f"choose one of {', '.join(PROTOCOLS)}")
    n = split.n_images
    if protocol == "full":
        return [split]
    if protocol == "1k":
        if n < 1000:
            raise DataError(f"the 1K protocol needs 1000 images, split {split.split!r} has {n}",
                            path=split.root, hint="use --protocol full for a smaller split")
        return [split.head(1000)]
    if n != 5000:
        raise DataError(f"the {protocol} protocol needs the 5000-image COCO testall split, found {n} images",
                        path=split.root, hint="use --split testall on a COCO precomp directory")
    if protocol == "coco5k":
        return [split]
    return [split.slice(1000 * f, 1000 * (f + 1)) for f in range(5)]


def evaluate_models(models: Sequence[tuple[Matcher, AnyVocab]], split: PrecompSplit, protocol: str = "full",
                    budget_bytes: float = DEFAULT_BUDGET, progress: bool = False, rerank: int = 0) -> dict:
    """Metrics of one model, or of an ensemble (score matrices averaged before ranking); `rerank` = K > 0
    scores only each query's top-K of the global stage with the full model (see engine/rerank.py)."""
    start = time.perf_counter()
    folds = []
    for fold in protocol_folds(split, protocol):
        total = None
        for model, vocab in models:
            model.eval()
            scores = split_scores(model, vocab, fold, budget_bytes, progress, rerank)
            total = scores if total is None else total + scores
        assert total is not None
        folds.append(retrieval_metrics(total / len(models), fold.per_image))
    result = dict(folds[0] if len(folds) == 1 else average_folds(folds))
    if rerank > 0:
        result["rerank"] = rerank
    result.update(protocol=protocol, split=split.split, folds=len(folds),
                  n_images=protocol_folds(split, protocol)[0].n_images,
                  eval_seconds=round(time.perf_counter() - start, 2))
    return result


def format_table(result: dict) -> str:
    """A readable two-direction table."""
    rows = ["direction        R@1    R@5   R@10   medr   meanr"]
    for d in ("image_to_text", "text_to_image"):
        m = result[d]
        rows.append(f"{d:<15} {m['r1']:5.1f}  {m['r5']:5.1f}  {m['r10']:5.1f}  {m['medr']:5.1f}  {m['meanr']:6.1f}")
    rows.append(f"rsum {result['rsum']:.1f}   mR {result['mR']:.2f}   "
                f"({result.get('protocol', '')}, {result.get('n_images', '?')} images, "
                f"{result.get('eval_seconds', 0):.1f} s)")
    return "\n".join(rows)

