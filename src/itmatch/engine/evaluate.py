"""Evaluation: encode every image and caption once, fill the score matrix in memory-bounded blocks,
then apply the protocol of DESIGN.md section 3 (1K, COCO 5-fold 1K, COCO 5K, any split; ensembles)."""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm.auto import tqdm

from itmatch.data.datasets import pad_tokens
from itmatch.data.precomp import ImageSource, PrecompSplit, batch_tensor
from itmatch.data.vocab import AnyVocab, unknown_word_report
from itmatch.engine import distributed as dist
from itmatch.engine.metrics import average_folds, retrieval_metrics
from itmatch.engine.score_cache import ScoreCache
from itmatch.errors import ConfigError, DataError
from itmatch.models.base import ImageEmb, Matcher, TextEmb

if TYPE_CHECKING:  # (two_stage imports this module)
    from itmatch.retrieval.two_stage import TwoStageResult

PROTOCOLS = ("1k", "full", "coco1k", "coco5k")
DEFAULT_BUDGET = 4 * 1024**3


def concat_texts(parts: list[TextEmb]) -> TextEmb:
    """Concatenate caption embeddings of different padded lengths (pads words and the word axes of
    extras, e.g. word Grams)."""
    longest = max(p.words.shape[1] for p in parts)
    parts = [p.padded_to(longest) for p in parts]
    vector = torch.cat([p.vector for p in parts]) if parts[0].vector is not None else None
    return TextEmb(words=torch.cat([p.words for p in parts]), lengths=torch.cat([p.lengths for p in parts]),
                   vector=vector, extras={k: torch.cat([p.extras[k] for p in parts]) for k in parts[0].extras},
                   word_axes=parts[0].word_axes)


def concat_images(parts: list[ImageEmb]) -> ImageEmb:
    vector = torch.cat([p.vector for p in parts]) if parts[0].vector is not None else None
    return ImageEmb(regions=torch.cat([p.regions for p in parts]), mask=torch.cat([p.mask for p in parts]),
                    vector=vector, extras={k: torch.cat([p.extras[k] for p in parts]) for k in parts[0].extras})


#: Captions per block (a length bucket) and the largest block in region-word cells. The budget only
#: bounds a block from above. A bucket's words are re-read by every block of images, so a bucket must stay
#: in the cache: 128 captions (~6 MB at D = 1024) scored 2.5-3.5x faster than 1024 (~50 MB, over the 32 MB
#: L3) on an idle machine, 64-256 within noise (`python bench/perf.py --sections blocks`). Blocks of ~4M
#: cells (16 MB per float32 buffer) keep the head's elementwise passes near the caches.
CAPTIONS_PER_BLOCK = 128
MAX_BLOCK_CELLS = 1 << 22
#: Largest copy of gathered captions per block (score_pairs): well under glibc's 32 MB mmap threshold, so
#: block copies reuse heap memory; fresh large allocations page-fault on every call (measured: a fresh
#: 34 MB gather 150-230 ms, the same gather into reused memory 3 ms, docs/performance.md).
MAX_GATHER_BYTES = 8 << 20

TextBuckets = list[tuple[torch.Tensor, TextEmb]]  # (caption indices, their embeddings), by length


def _size(n_bytes: float) -> str:
    """Bytes in the unit that shows them (a tiny test budget is not "0.0 MB")."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes:.0f} bytes"


def _require_items(count: int, what: str, path: object = None) -> None:
    if count == 0:
        raise DataError(f"no {what} to score: the {'gallery' if what == 'images' else 'query set'} is empty",
                        path=path, hint=f"pass at least one {what[:-1]}")


@torch.inference_mode()
def encode_images(model: Matcher, features: ImageSource, batch_size: int = 128, progress: bool = False
                  ) -> ImageEmb:
    """Encode every image of a split's `images` (a feature array, cached multi-scale maps, or image
    files for pixel-input models) once, in batches."""
    _require_items(len(features), "images")
    parts = []
    for start in tqdm(range(0, len(features), batch_size), desc="encode images", disable=not progress,
                      leave=False):
        parts.append(model.encode_images(batch_tensor(features[start:start + batch_size])))
    return concat_images(parts)


@torch.inference_mode()
def encode_caption_buckets(model: Matcher, captions: Sequence[str], vocab: AnyVocab,
                           bucket_size: int = CAPTIONS_PER_BLOCK, batch_size: int = 256,
                           progress: bool = False) -> TextBuckets:
    """Captions encoded in length-sorted batches and kept in buckets of `bucket_size`, each padded only to
    its own longest caption (the evaluator's blocks): no [M, longest caption, D] tensor is ever built,
    about 5x less memory than padding everything to the longest caption on Flickr30K/COCO."""
    _require_items(len(captions), "captions")
    tokens = [vocab.encode(c) for c in captions]
    order = sorted(range(len(tokens)), key=lambda j: len(tokens[j]))
    buckets: TextBuckets = []
    for b0 in tqdm(range(0, len(order), bucket_size), desc="encode captions", disable=not progress,
                   leave=False):
        chunk = order[b0:b0 + bucket_size]
        parts = []
        for start in range(0, len(chunk), batch_size):
            batch = pad_tokens([tokens[j] for j in chunk[start:start + batch_size]])
            parts.append(model.encode_texts(batch.tokens, batch.lengths))
        buckets.append((torch.tensor(chunk), concat_texts(parts).trimmed()))
    return buckets


def bucket_texts(txt: TextEmb, bucket_size: int = CAPTIONS_PER_BLOCK) -> TextBuckets:
    """Length buckets of already-encoded captions (see encode_caption_buckets)."""
    _require_items(len(txt), "captions")
    order = torch.argsort(txt.lengths, stable=True)
    return [(order[b0:b0 + bucket_size], txt.take(order[b0:b0 + bucket_size]).trimmed())
            for b0 in range(0, len(txt), bucket_size)]


def unbucket_texts(buckets: TextBuckets) -> TextEmb:
    """The captions of `buckets` as one padded TextEmb in their original order."""
    merged = concat_texts([t for _, t in buckets])
    order = torch.cat([c for c, _ in buckets])
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[order] = torch.arange(len(order))
    return merged.take(inverse)


def encode_captions(model: Matcher, captions: Sequence[str], vocab: AnyVocab, batch_size: int = 256,
                    progress: bool = False) -> TextEmb:
    """Encode captions in length-sorted batches (little padding), returned in the original order."""
    return unbucket_texts(encode_caption_buckets(model, captions, vocab, batch_size=batch_size,
                                                 progress=progress))


def images_per_block(model: Matcher, img: ImageEmb, buckets: TextBuckets, budget_bytes: float,
                     max_cells: int = MAX_BLOCK_CELLS) -> list[int]:
    """Images per block for each caption bucket. The budget bounds what scoring adds on top of the
    encoded embeddings: the float32 score matrix plus the head's temporaries for one block
    (`bytes_per_cell` per image x caption x region x word, calibrated against measured peak RSS).
    Raises ConfigError, stating the minimum, when not even one image per block fits."""
    n = len(img)
    m = sum(len(c) for c, _ in buckets)
    out_bytes = 4.0 * n * m
    k = img.regions.shape[1]
    cells = [k * len(t) * t.words.shape[1] for _, t in buckets]  # per image, per bucket
    # + bytes_per_pair per image x caption, for heads whose temporaries scale with pairs, not cells (SMAN)
    per_image = [model.head.bytes_per_cell * c + model.head.bytes_per_pair * len(t)
                 for c, (_, t) in zip(cells, buckets, strict=True)]
    minimum = out_bytes + max(per_image)
    if budget_bytes < minimum:
        raise ConfigError(
            f"memory budget {_size(budget_bytes)} is too small: the minimum for {n} images x {m} "
            f"captions is {_size(minimum)} (score matrix {_size(out_bytes)} + one block of "
            f"1 image x {len(buckets[int(np.argmax(per_image))][1])} captions {_size(max(per_image))})",
            hint=f"raise the budget to at least {minimum / 2**30:.3g} GB (--budget-gb), or score fewer items")
    if model.head.pair_independent:
        return [n for _ in buckets]
    free = budget_bytes - out_bytes
    return [max(1, min(n, int(free // b), max_cells // max(1, c))) for b, c in zip(per_image, cells, strict=True)]


def block_cells(model: Matcher, max_cells: int = MAX_BLOCK_CELLS) -> int:
    """The cap on a block's region-word cells: `max_cells`, or the head's own smaller one."""
    return min(max_cells, model.head.max_block_cells or max_cells)


def split_buckets(model: Matcher, img: ImageEmb, buckets: TextBuckets, budget_bytes: float,
                  max_cells: int = MAX_BLOCK_CELLS) -> TextBuckets:
    """Caption buckets cut into runs of captions small enough that one image x a run fits the budget
    beside the score matrix and the block cap (block_cells); buckets that fit are returned as they are.
    A head with large per-pair temporaries (MMCA: a transformer over k + L tokens per pair, ~4 MB per pair
    at D = 256, so a bucket of 1000 long captions needed 4.2 GB) can exceed a budget with one image per
    block; with runs of captions the minimum budget is one image x one caption."""
    if model.head.pair_independent:
        return buckets
    free = budget_bytes - 4.0 * len(img) * sum(len(c) for c, _ in buckets)
    k = img.regions.shape[1]
    cap = block_cells(model, max_cells)
    out: TextBuckets = []
    for columns, txt in buckets:
        per_caption = model.head.bytes_per_cell * k * txt.words.shape[1] + model.head.bytes_per_pair
        run = len(txt) if per_caption * len(txt) <= free else max(1, int(free // per_caption))
        run = min(run, max(1, cap // (k * txt.words.shape[1])))
        out += [(columns[c0:c0 + run], txt.take(slice(c0, c0 + run)).trimmed()) for c0 in range(0, len(txt), run)]
    return out


Block = tuple[slice, torch.Tensor | slice, TextEmb]  # image rows, caption columns, their embeddings


def score_blocks(model: Matcher, img: ImageEmb, buckets: TextBuckets, budget_bytes: float = DEFAULT_BUDGET,
                 max_cells: int = MAX_BLOCK_CELLS, world: int = 1) -> list[Block]:
    """The blocks score_matrix fills, in order: per caption bucket (cut by split_buckets if one image x the
    bucket exceeds the budget or the block cap), runs of images sized by the budget and the cap (see
    images_per_block, which also refuses a budget too small); a pair-independent head is one matrix
    product, cut into `world` shards of image rows."""
    buckets = split_buckets(model, img, buckets, budget_bytes, max_cells)
    rows_per_bucket = images_per_block(model, img, buckets, budget_bytes, block_cells(model, max_cells))
    n = len(img)
    if model.head.pair_independent:
        txt = unbucket_texts(buckets)
        return [(slice(*dist.shard_bounds(n, r, world)), slice(0, len(txt)), txt) for r in range(world)]
    return [(slice(i0, min(n, i0 + rows)), columns, block_txt)
            for (columns, block_txt), rows in zip(buckets, rows_per_bucket, strict=True)
            for i0 in range(0, n, rows)]


@torch.inference_mode()
def score_matrix(model: Matcher, img: ImageEmb, txt: TextEmb | TextBuckets,
                 budget_bytes: float = DEFAULT_BUDGET, progress: bool = False,
                 captions_per_block: int = CAPTIONS_PER_BLOCK, max_cells: int = MAX_BLOCK_CELLS,
                 cache: ScoreCache | None = None) -> torch.Tensor:
    """All-pairs scores [n_img, n_txt] in float32, exact (the head's own numbers, block by block).

    Captions are bucketed by length so that a block is padded only to its own longest caption; every
    block is one batched call of the model's head; images per block follow from the memory budget
    (see images_per_block). Uses torch's intra-op threads (all cores unless set otherwise); the
    progress bar shows pairs/s. With a `cache`, finished blocks of a pair head are kept on disk and an
    interrupted run over the same inputs continues from them (engine.score_cache)."""
    out = _score_blocks(model, img, txt, budget_bytes, progress, captions_per_block, max_cells, world=1,
                        cache=cache)
    assert out is not None
    return out


@torch.inference_mode()
def sharded_score_matrix(model: Matcher, img: ImageEmb, txt: TextEmb | TextBuckets,
                         budget_bytes: float = DEFAULT_BUDGET, progress: bool = False,
                         captions_per_block: int = CAPTIONS_PER_BLOCK, max_cells: int = MAX_BLOCK_CELLS,
                         cache: ScoreCache | None = None) -> torch.Tensor | None:
    """score_matrix shared by the ranks of a torchrun group: rank r scores blocks r, r + W, ... of the
    single-process block plan and rank 0 assembles them (the other ranks return None), so every number
    is the single process's. A pair-independent head (one matrix product) is split by image rows."""
    return _score_blocks(model, img, txt, budget_bytes, progress, captions_per_block, max_cells,
                         world=dist.world_size(), cache=cache)


ADVICE_AFTER_SECONDS = 60.0  # of scoring, before estimating the whole matrix's time
LONG_SCORING_SECONDS = 900.0  # estimated scoring time from which a run without --resume-dir is told about it


class _LongScoringAdvice:
    """Says once, after a minute of scoring without a cache, when the whole matrix will take long enough
    that losing it to a kill would hurt, and how to avoid that."""

    def __init__(self, pairs: int) -> None:
        self.pairs, self.after, self.long = pairs, ADVICE_AFTER_SECONDS, LONG_SCORING_SECONDS
        self.start, self.done, self.said = time.perf_counter(), 0, False

    def __call__(self, scored: int) -> None:
        self.done += scored
        elapsed = time.perf_counter() - self.start
        if self.said or elapsed < self.after:
            return
        self.said = True
        total = elapsed * self.pairs / self.done
        if total >= self.long and dist.is_main():
            warnings.warn(f"scoring {self.pairs:,} pairs will take about {total / 60:.0f} min at this rate; "
                          "nothing is kept if it is killed: `itmatch evaluate --resume-dir DIR` (resume_dir=) "
                          "keeps finished blocks so that a rerun continues, `--rerank K` scores only a first "
                          "stage's top K", stacklevel=4)


def _score_blocks(model: Matcher, img: ImageEmb, txt: TextEmb | TextBuckets, budget_bytes: float,
                  progress: bool, captions_per_block: int, max_cells: int, world: int,
                  cache: ScoreCache | None = None) -> torch.Tensor | None:
    _require_items(len(img), "images")
    buckets = bucket_texts(txt, captions_per_block) if isinstance(txt, TextEmb) else txt
    n, m = len(img), sum(len(c) for c, _ in buckets)
    blocks = score_blocks(model, img, buckets, budget_bytes, max_cells, world)
    # (a pair-independent head is one matrix product: nothing worth keeping)
    stored = cache.matrix(model, img, blocks, world) if cache is not None and not model.head.pair_independent else None
    bar = tqdm(total=n * m, desc="score pairs", unit="pair", unit_scale=True, disable=not progress,
               leave=False)
    one_product = model.head.pair_independent and world == 1  # the one block is the whole matrix
    out = torch.empty(n, m) if world == 1 and not one_product else None
    pieces = {}  # (sharded: this rank's blocks, sent to rank 0)
    advise = _LongScoringAdvice(n * m) if stored is None and not model.head.pair_independent else None
    try:
        for k in range(dist.rank() if world > 1 else 0, len(blocks), world):  # this rank's share
            rows, columns, block_txt = blocks[k]
            piece = stored.load(k) if stored is not None else None
            if piece is None:
                start = time.perf_counter()
                piece = model.score(img.take(rows), block_txt).float()
                if stored is not None:
                    stored.save(k, piece, time.perf_counter() - start)
            if out is not None:
                out[rows, columns] = piece
            else:
                pieces[k] = piece
            bar.update(piece.numel() * world)
            if advise is not None:
                advise(piece.numel() * world)
    except BaseException:  # interrupted (Ctrl-C, an error): keep what was scored since the last write
        if stored is not None:
            stored.flush()
        raise
    bar.close()
    if world > 1:
        gathered = dist.gather_objects(pieces)  # (also: every rank has finished its blocks)
        if gathered is None:
            return None
        pieces = {k: v for part in gathered for k, v in part.items()}
        del gathered
    if stored is not None:
        stored.finish()
    if out is not None:
        return out
    if one_product:
        return pieces[0]
    out = torch.empty(n, m)
    for k, (rows, columns, _) in enumerate(blocks):
        out[rows, columns] = pieces.pop(k)  # (frees each piece as it is placed)
    return out


def item_bytes(emb: ImageEmb | TextEmb) -> int:
    """Bytes of one item's tensors (what take() copies per item)."""
    return sum(t[0].numel() * t.element_size() for t in emb.tensors())


def captions_per_block(model: Matcher, txt: TextEmb, regions: int, length: int, free_bytes: float,
                       max_cells: int = MAX_BLOCK_CELLS) -> int:
    """Captions of length <= `length` that one block of 1 image x c captions taken from `txt` may hold:
    the head's temporaries (`bytes_per_cell` per region x word cell, `bytes_per_pair` per caption) plus
    the gathered captions within `free_bytes`, at most `max_cells` region-word cells (the cache-sized cap
    of score_matrix) and at most MAX_GATHER_BYTES of gathered captions."""
    copy = item_bytes(txt.narrowed(length))
    per_caption = model.head.bytes_per_cell * regions * length + model.head.bytes_per_pair + copy
    return max(1, min(max_cells // max(1, regions * length), MAX_GATHER_BYTES // copy, int(free_bytes // per_caption)))


@torch.inference_mode()
def score_pairs(model: Matcher, img: ImageEmb, txt: TextEmb, images: torch.Tensor, captions: torch.Tensor,
                budget_bytes: float = DEFAULT_BUDGET, progress: bool = False,
                max_cells: int = MAX_BLOCK_CELLS) -> torch.Tensor:
    """Exact head scores [P] of the listed pairs (images[p], captions[p]), e.g. two-stage candidates.

    The pairs are grouped by image and, within an image, sorted by caption length; each block is one
    call of the model's ordinary all-pairs head on 1 image x up to `captions_per_block` of its listed
    captions (padded only to the block's own longest caption), so every head is scored by the same code
    as score_matrix, and no pair outside the list is computed. Grouping by image means the image side
    (regions, Gram matrices: k x D per image, the larger side) is never copied; only the listed
    captions' words are gathered, once per pair (docs/performance.md, "re-ranking engine")."""
    _require_items(len(img), "images")
    _require_items(len(txt), "captions")
    images, captions = images.long().reshape(-1), captions.long().reshape(-1)
    if len(images) != len(captions):
        raise ConfigError(f"{len(images)} image indices but {len(captions)} caption indices: pairs need one of each")
    out = torch.empty(len(images))
    if len(images) == 0:
        return out
    if int(images.min()) < 0 or int(images.max()) >= len(img) or int(captions.min()) < 0 \
            or int(captions.max()) >= len(txt):
        raise ConfigError(f"pair indices out of range for {len(img)} images x {len(txt)} captions")
    lengths = txt.lengths[captions]
    k, longest = img.regions.shape[1], int(lengths.max())
    free = budget_bytes - 4.0 * len(images)  # the [P] result, then one block's temporaries and copies
    needed = (model.head.bytes_per_cell * k * longest + model.head.bytes_per_pair
              + item_bytes(txt.narrowed(longest)))
    if free < needed:
        raise ConfigError(f"memory budget {_size(budget_bytes)} is too small for {len(images)} pairs: "
                          f"the minimum is {_size(4.0 * len(images) + needed)}",
                          hint="raise the budget (--budget-gb), or score fewer pairs")
    fit = functools.cache(lambda length: captions_per_block(model, txt, k, length, free,
                                                            block_cells(model, max_cells)))
    # image-major, then by caption length: a block of consecutive pairs shares one image and has
    # captions of similar lengths
    order = torch.argsort(images * (longest + 1) + lengths, stable=True)
    images, captions, lengths = images[order], captions[order], lengths[order].tolist()
    firsts, counts = torch.unique_consecutive(images, return_counts=True)
    bar = tqdm(total=len(images), desc="score pairs", unit="pair", unit_scale=True, disable=not progress,
               leave=False)
    start = 0
    for i, count in zip(firsts.tolist(), counts.tolist(), strict=True):
        one_image = img.take(slice(i, i + 1))
        end_of_image = start + count
        while start < end_of_image:
            # the block's longest caption is its last (sorted): shrink the block until it fits
            end = min(end_of_image, start + fit(lengths[start]))
            while fit(lengths[end - 1]) < end - start:
                end = start + fit(lengths[end - 1])
            out[order[start:end]] = model.score(one_image, txt.take_trimmed(captions[start:end]))[0].float()
            bar.update(end - start)
            start = end
    bar.close()
    return out


def split_scores(model: Matcher, vocab: AnyVocab, split: PrecompSplit, budget_bytes: float = DEFAULT_BUDGET,
                 progress: bool = False, sharded: bool = False, cache: ScoreCache | None = None
                 ) -> torch.Tensor | None:
    """The split's exhaustive score matrix [n_img, n_txt]; sharded: see sharded_score_matrix (None on
    ranks other than 0). Every rank encodes every item: encoding is a small part of a pair head's cost."""
    img = encode_images(model, split.images, progress=progress)
    buckets = encode_caption_buckets(model, split.captions, vocab, progress=progress)
    scorer = sharded_score_matrix if sharded else score_matrix
    return scorer(model, img, buckets, budget_bytes, progress, cache=cache)


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


def rerank_split_scores(model: Matcher, vocab: AnyVocab, split: PrecompSplit, k: int,
                        first_stage: tuple[Matcher, AnyVocab] | None = None, index: str = "flat",
                        progress: bool = False) -> tuple[torch.Tensor, dict]:
    """Two-stage scores of a split (retrieval.two_stage): the first stage is `model`'s own global
    embedding (VSE++) or that of a separate `first_stage` model (for SCAN and other pair heads)."""
    from itmatch.retrieval.two_stage import first_stage_vectors, two_stage_scores

    img = encode_images(model, split.images, progress=progress)
    txt = encode_captions(model, split.captions, vocab, progress=progress)
    if first_stage is None:
        img_vec, txt_vec = first_stage_vectors(img, txt)
    else:
        fs_model, fs_vocab = first_stage
        img_vec, txt_vec = first_stage_vectors(encode_images(fs_model.eval(), split.images),
                                               encode_captions(fs_model, split.captions, fs_vocab))
    result = two_stage_scores(model, img, txt, k, img_vec, txt_vec, index, progress)
    return result.scores, {"k": k, "index": index, **_two_stage_info(result)}


def pruned_split_scores(model: Matcher, vocab: AnyVocab, split: PrecompSplit, progress: bool = False
                        ) -> tuple[torch.Tensor, dict]:
    """Safe-pruned scores of a split (retrieval.two_stage.pruned_scores): exhaustive ranks, fewer pairs."""
    from itmatch.retrieval.two_stage import pruned_scores

    img = encode_images(model, split.images, progress=progress)
    txt = encode_captions(model, split.captions, vocab, progress=progress)
    result = pruned_scores(model, img, txt, split.per_image, progress)
    return result.scores, {"pruned": True, "bound": model.head.score_bound, **_two_stage_info(result)}


def _two_stage_info(result: TwoStageResult) -> dict:
    return {"pairs_scored": result.pairs_scored, "pairs_total": result.pairs_total,
            "fraction_scored": round(result.fraction, 5),
            "seconds": {key: round(v, 3) for key, v in result.timings.items()}}


def evaluate_models(models: Sequence[tuple[Matcher, AnyVocab]], split: PrecompSplit, protocol: str = "full",
                    budget_bytes: float = DEFAULT_BUDGET, progress: bool = False, rerank: int = 0,
                    first_stage: tuple[Matcher, AnyVocab] | None = None, index: str = "flat",
                    resume_dir: str | Path | None = None, prune: bool = False) -> dict:
    """Metrics of one model, or of an ensemble (score matrices averaged before ranking). With
    `rerank` K > 0: two-stage scoring (top K of a global first stage, re-scored exactly), one model.
    With `prune`: safe pruning (exhaustive metrics, only the pairs the head's score bound leaves open).

    With `resume_dir`, exhaustive scoring keeps its finished blocks there and continues from those an
    interrupted run over the same inputs left (engine.score_cache); `eval_seconds` then adds the scoring
    seconds the earlier runs spent on them, and `resumed` says how many blocks came from disk.

    Under torchrun every rank calls this: exhaustive scoring is sharded across the ranks (see
    sharded_score_matrix), rank 0 computes the metrics (two-stage scoring runs on rank 0 alone) and every
    rank returns rank 0's result."""
    if rerank and prune:
        raise ConfigError("--rerank K and --prune are two different scorings", hint="choose one of them")
    two_staged = bool(rerank or prune)
    if two_staged and len(models) != 1:
        raise ConfigError(f"{'safe pruning' if prune else 'two-stage re-ranking'} takes one model, not an ensemble",
                          hint=f"evaluate one checkpoint with {'--prune' if prune else '--rerank'}, or drop it")
    sharded = dist.is_distributed()
    if sharded and (two_staged or not dist.is_main()):
        progress = False
    start = time.perf_counter()
    cache = ScoreCache(resume_dir) if resume_dir is not None and not two_staged else None
    folds, two_stage = [], []
    for fold in protocol_folds(split, protocol):
        total = None
        for model, vocab in models:
            model.eval()
            if two_staged:
                if not dist.is_main():
                    continue
                scores, info = (pruned_split_scores(model, vocab, fold, progress) if prune else
                                rerank_split_scores(model, vocab, fold, rerank, first_stage, index, progress))
                two_stage.append(info)
            else:
                scores = split_scores(model, vocab, fold, budget_bytes, progress, sharded=sharded, cache=cache)
            if scores is not None:  # (None: a rank other than 0 of a sharded evaluation)
                total = scores if total is None else total + scores
        if total is not None:
            folds.append(retrieval_metrics(total / len(models), fold.per_image))
    resumed = (cache.resumed_blocks, cache.resumed_seconds) if cache is not None else (0, 0.0)
    if sharded:  # each rank resumed its share of the blocks (their seconds are already wall-time shares)
        per_rank = dist.gather_objects(resumed)
        resumed = (sum(b for b, _ in per_rank), sum(s for _, s in per_rank)) if per_rank is not None else resumed
    if not dist.is_main():
        return dist.broadcast_object(None)
    result = dict(folds[0] if len(folds) == 1 else average_folds(folds))
    if rerank > 0:
        result["rerank"] = rerank
    result.update(protocol=protocol, split=split.split, folds=len(folds),
                  n_images=protocol_folds(split, protocol)[0].n_images,
                  eval_seconds=round(time.perf_counter() - start + resumed[1], 2))
    if resumed[0]:
        result["resumed"] = {"blocks": resumed[0], "seconds": round(resumed[1], 2), "from": str(resume_dir)}
    if two_stage:
        result["two_stage"] = two_stage[0] if len(two_stage) == 1 else two_stage
    # after eval_seconds (comparable with earlier rows); the metrics are those of the model's own input
    captions = [c for fold in protocol_folds(split, protocol) for c in fold.captions]
    reports = [unknown_word_report(vocab, captions) for _, vocab in models]
    result["unknown_words"] = reports[0] if len(reports) == 1 else reports
    return dist.broadcast_object(result)


def format_table(result: dict) -> str:
    """A readable two-direction table."""
    rows = ["direction        R@1    R@5   R@10   medr   meanr"]
    for d in ("image_to_text", "text_to_image"):
        m = result[d]
        rows.append(f"{d:<15} {m['r1']:5.1f}  {m['r5']:5.1f}  {m['r10']:5.1f}  {m['medr']:5.1f}  {m['meanr']:6.1f}")
    rows.append(f"rsum {result['rsum']:.1f}   mR {result['mR']:.2f}   "
                f"({result.get('protocol', '')}, {result.get('n_images', '?')} images, "
                f"{result.get('eval_seconds', 0):.1f} s)")
    reports = result.get("unknown_words", [])
    reports = [reports] if isinstance(reports, dict) else reports
    for n, report in enumerate(reports):
        rows.append(format_unknown_words(report, f"model {n + 1}: " if len(reports) > 1 else ""))
    return "\n".join(rows)


def format_unknown_words(report: dict, prefix: str = "") -> str:
    """One line on the caption words the model could not read (unknown_word_report)."""
    line = (f"{prefix}unknown words: {report['unknown']:,} of {report['words']:,} caption words "
            f"({report['unknown_percent']:.2f}%) read as unknown (not in the vocabulary)")
    if report["captions_without_known_word"]:
        line += f", {report['captions_without_known_word']:,} captions without a known word"
    if report["top_unknown"]:
        line += "; most frequent: " + ", ".join(f"{w} {c}" for w, c in report["top_unknown"])
    return line

