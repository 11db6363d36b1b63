"""The inference core: encode every image and caption once, plan memory-bounded blocks, and score all pairs
(`score_matrix`) or listed pairs (`score_pairs`) with a model's own head. It stands below `engine`, `retrieval`
and `api`, which all use it, and imports none of them; its submodule `score_cache` keeps the finished blocks a
killed run resumes from. How scoring is made fast and what the budget bounds: docs/performance.md.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from itmatch import distributed as dist
from itmatch.data.datasets import pad_tokens
from itmatch.data.precomp import ImageSource, batch_tensor
from itmatch.data.vocab import AnyVocab
from itmatch.device import (
    DEVICE_MEMORY_FRACTION,
    OutOfMemoryError,
    free_memory,
    module_device,
    release_cached_memory,
    to_device,
)
from itmatch.errors import ConfigError, DataError
from itmatch.inference.score_cache import ScoreCache
from itmatch.models.base import Block, ImageEmb, Matcher, TextEmb

DEFAULT_BUDGET = 4 * 1024**3
#: where finished scores go: the score matrix lives on the host whatever the model's device, and only
#: finished blocks are copied to it
HOST = torch.device("cpu")


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
#: in the cache; blocks of at most MAX_BLOCK_CELLS cells keep the head's elementwise passes near the caches.
#: Measured (`python bench/perf.py --sections blocks`): docs/performance.md, "Where the code's constants come from".
CAPTIONS_PER_BLOCK = 128
MAX_BLOCK_CELLS = 1 << 22
#: The cap on a GPU, where there is no cache to stay in and each block pays its kernel launches and a GEMM: 4 M cells
#: cut SCAN's 1000 x 5000 Flickr30K matrix into 717 blocks of ~7,000 pairs, which scored at 26 % of an H100's fp32
#: peak; 64 M cells make it 62 blocks (docs/gpu.md, "Block size on a GPU"). The memory budget still bounds a block.
GPU_BLOCK_CELLS = 1 << 26
#: Largest copy of gathered captions per block (score_pairs): well under glibc's 32 MB mmap threshold, so
#: block copies reuse heap memory; fresh large allocations page-fault on every call, which is much slower
#: (measured: docs/performance.md, "Where the code's constants come from").
MAX_GATHER_BYTES = 8 << 20

TextBuckets = list[tuple[torch.Tensor, TextEmb]]  # (caption indices, their embeddings), by length


def _size(n_bytes: float) -> str:
    """Bytes in the unit that shows them (a tiny test budget is not "0.0 MB")."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes:.0f} bytes"


def require_items(count: int, what: str, path: object = None) -> None:
    if count == 0:
        raise DataError(f"no {what} to score: the {'gallery' if what == 'images' else 'query set'} is empty",
                        path=path, hint=f"pass at least one {what[:-1]}")


@torch.inference_mode()
def encode_images(model: Matcher, features: ImageSource, batch_size: int = 128, progress: bool = False
                  ) -> ImageEmb:
    """Encode every image of a split's `images` (a feature array, cached multi-scale maps, or image
    files for pixel-input models) once, in batches, on the model's device (where the embeddings stay)."""
    require_items(len(features), "images")
    device = module_device(model)
    parts = []
    for start in tqdm(range(0, len(features), batch_size), desc="encode images", disable=not progress,
                      leave=False):
        parts.append(model.encode_images(to_device(batch_tensor(features[start:start + batch_size]), device)))
    return concat_images(parts)


@torch.inference_mode()
def encode_caption_buckets(model: Matcher, captions: Sequence[str], vocab: AnyVocab,
                           bucket_size: int = CAPTIONS_PER_BLOCK, batch_size: int = 256,
                           progress: bool = False) -> TextBuckets:
    """Captions encoded in length-sorted batches and kept in buckets of `bucket_size`, each padded only to
    its own longest caption (the evaluator's blocks): no [M, longest caption, D] tensor is ever built,
    about 5x less memory than padding everything to the longest caption on Flickr30K/COCO."""
    require_items(len(captions), "captions")
    device = module_device(model)
    tokens = [vocab.encode(c) for c in captions]
    order = sorted(range(len(tokens)), key=lambda j: len(tokens[j]))
    buckets: TextBuckets = []
    for b0 in tqdm(range(0, len(order), bucket_size), desc="encode captions", disable=not progress,
                   leave=False):
        chunk = order[b0:b0 + bucket_size]
        parts = []
        for start in range(0, len(chunk), batch_size):
            batch = pad_tokens([tokens[j] for j in chunk[start:start + batch_size]])
            parts.append(model.encode_texts(batch.tokens.to(device), batch.lengths.to(device)))
        buckets.append((torch.tensor(chunk, device=HOST), concat_texts(parts).trimmed()))
    return buckets


def bucket_texts(txt: TextEmb, bucket_size: int = CAPTIONS_PER_BLOCK) -> TextBuckets:
    """Length buckets of already-encoded captions (see encode_caption_buckets)."""
    require_items(len(txt), "captions")
    order = torch.argsort(txt.lengths.to(HOST), stable=True)  # (host: the columns of the host matrix)
    return [(order[b0:b0 + bucket_size], txt.take(order[b0:b0 + bucket_size]).trimmed())
            for b0 in range(0, len(txt), bucket_size)]


def scoring_form(model: Matcher, txt: TextEmb | TextBuckets, bucket_size: int = CAPTIONS_PER_BLOCK
                 ) -> TextEmb | TextBuckets:
    """Captions in the form score_matrix scores them: a pair-independent head's one matrix product takes their
    vectors alone (TextEmb.vectors_only: a caption collection of 5000 kept for VSE++ held 0.74 GB of word
    embeddings it never read), a pair head's blocks take length buckets (bucket_texts). Keep this form of captions
    scored again and again (a caption collection searched by photo): bucketing 5000 captions, or merging buckets
    back for one product, costs far more than scoring them against one photo (docs/search.md, "Photo → captions")."""
    if model.head.pair_independent:
        if isinstance(txt, TextEmb):
            return txt if txt.words.shape[1] == 0 else txt.vectors_only()
        return unbucket_texts([(columns, t.vectors_only()) for columns, t in txt])
    if not isinstance(txt, TextEmb):
        return txt
    return bucket_texts(txt, bucket_size)


def unbucket_texts(buckets: TextBuckets) -> TextEmb:
    """The captions of `buckets` as one padded TextEmb in their original order."""
    merged = concat_texts([t for _, t in buckets])
    order = torch.cat([c for c, _ in buckets])
    inverse = torch.empty(len(order), dtype=torch.long, device=order.device)
    inverse[order] = torch.arange(len(order), device=order.device)
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


def default_block_cells(device: torch.device) -> int:
    """score_matrix's cap on a block's region-word cells on `device`: the cache-sized one on a CPU, GPU_BLOCK_CELLS
    on a GPU."""
    return GPU_BLOCK_CELLS if device.type == "cuda" else MAX_BLOCK_CELLS


def block_cells(model: Matcher, max_cells: int = MAX_BLOCK_CELLS) -> int:
    """The cap on a block's region-word cells: `max_cells`, or the head's own smaller one."""
    return min(max_cells, model.head.max_block_cells or max_cells)


def split_buckets(model: Matcher, img: ImageEmb, buckets: TextBuckets, budget_bytes: float,
                  max_cells: int = MAX_BLOCK_CELLS) -> TextBuckets:
    """Caption buckets cut into runs of captions small enough that one image x a run fits the budget
    beside the score matrix and the block cap (block_cells); buckets that fit are returned as they are.
    A head with large per-pair temporaries (MMCA: a transformer over k + L tokens per pair; measured:
    docs/performance.md, "Where the code's constants come from") can exceed a budget with one image per
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


def score_blocks(model: Matcher, img: ImageEmb, texts: TextEmb | TextBuckets, budget_bytes: float = DEFAULT_BUDGET,
                 max_cells: int = MAX_BLOCK_CELLS, world: int = 1) -> list[Block]:
    """The blocks score_matrix fills, in order: per caption bucket (cut by split_buckets if one image x the
    bucket exceeds the budget or the block cap), runs of images sized by the budget and the cap (see
    images_per_block, which also refuses a budget too small); a pair-independent head is one matrix
    product over the captions in their order (buckets merged back; a TextEmb as it is), cut into `world` shards
    of image rows."""
    n = len(img)
    if model.head.pair_independent:
        txt = texts if isinstance(texts, TextEmb) else unbucket_texts(texts)
        # (the check alone: it refuses a budget without room for the score matrix)
        images_per_block(model, img, [(torch.arange(len(txt), device=HOST), txt)], budget_bytes)
        return [(slice(*dist.shard_bounds(n, r, world)), slice(0, len(txt)), txt) for r in range(world)]
    buckets = split_buckets(model, img, scoring_form(model, texts), budget_bytes, max_cells)
    rows_per_bucket = images_per_block(model, img, buckets, budget_bytes, block_cells(model, max_cells))
    return [(slice(i0, min(n, i0 + rows)), columns, block_txt)
            for (columns, block_txt), rows in zip(buckets, rows_per_bucket, strict=True)
            for i0 in range(0, n, rows)]


@torch.inference_mode()
def score_matrix(model: Matcher, img: ImageEmb, txt: TextEmb | TextBuckets,
                 budget_bytes: float = DEFAULT_BUDGET, progress: bool = False,
                 captions_per_block: int = CAPTIONS_PER_BLOCK, max_cells: int | None = None,
                 cache: ScoreCache | None = None, on_block: Callable[[int], None] | None = None) -> torch.Tensor:
    """All-pairs scores [n_img, n_txt] in float32, exact (the head's own numbers, block by block).

    Captions are bucketed by length so that a block is padded only to its own longest caption; every
    block is one batched call of the model's head; images per block follow from the memory budget
    (see images_per_block) and the cap on a block's region-word cells (`max_cells`; default: the model's
    device's, default_block_cells). Uses torch's intra-op threads (all cores unless set otherwise); the
    progress bar shows pairs/s. With a `cache`, finished blocks of a pair head are kept on disk and an
    interrupted run over the same inputs continues from them (inference.score_cache). `on_block(pairs)` is
    called after every block (the evaluator's advice on long runs)."""
    out = _score_blocks(model, img, txt, budget_bytes, progress, captions_per_block, max_cells, world=1,
                        cache=cache, on_block=on_block)
    assert out is not None
    return out


@torch.inference_mode()
def sharded_score_matrix(model: Matcher, img: ImageEmb, txt: TextEmb | TextBuckets,
                         budget_bytes: float = DEFAULT_BUDGET, progress: bool = False,
                         captions_per_block: int = CAPTIONS_PER_BLOCK, max_cells: int | None = None,
                         cache: ScoreCache | None = None, on_block: Callable[[int], None] | None = None
                         ) -> torch.Tensor | None:
    """score_matrix shared by the ranks of a torchrun group: rank r scores blocks r, r + W, ... of the
    single-process block plan and rank 0 assembles them (the other ranks return None), so every number
    is the single process's. A pair-independent head (one matrix product) is split by image rows."""
    return _score_blocks(model, img, txt, budget_bytes, progress, captions_per_block, max_cells,
                         world=dist.world_size(), cache=cache, on_block=on_block)


def _score_blocks(model: Matcher, img: ImageEmb, txt: TextEmb | TextBuckets, budget_bytes: float,
                  progress: bool, captions_per_block: int, max_cells: int | None, world: int,
                  cache: ScoreCache | None = None, on_block: Callable[[int], None] | None = None
                  ) -> torch.Tensor | None:
    require_items(len(img), "images")
    texts = scoring_form(model, txt, captions_per_block)
    n, m = len(img), len(texts) if isinstance(texts, TextEmb) else sum(len(c) for c, _ in texts)
    device = module_device(model)
    budget_bytes = device_budget(device, budget_bytes, 4.0 * n * m)
    if world > 1:  # every rank must plan the same blocks (rank 0 places them by number): the smallest budget, since
        budget_bytes = -dist.max_over_ranks(-int(budget_bytes))  # each GPU's free memory sizes its own
    blocks = score_blocks(model, img, texts, budget_bytes, max_cells or default_block_cells(device), world)
    score_block = BlockScorer(model)
    # (a pair-independent head is one matrix product: nothing worth keeping)
    stored = cache.matrix(model, img, blocks, world) if cache is not None and not model.head.pair_independent else None
    bar = tqdm(total=n * m, desc="score pairs", unit="pair", unit_scale=True, disable=not progress,
               leave=False)
    one_product = model.head.pair_independent and world == 1  # the one block is the whole matrix
    out = torch.empty(n, m, device=HOST) if world == 1 and not one_product else None
    pieces = {}  # (sharded: this rank's blocks, sent to rank 0)
    try:
        for k in range(dist.rank() if world > 1 else 0, len(blocks), world):  # this rank's share
            rows, columns, block_txt = blocks[k]
            piece = stored.load(k) if stored is not None else None
            if piece is None:
                start = time.perf_counter()
                piece = score_block(img.take(rows), block_txt).to(HOST)
                if stored is not None:
                    stored.save(k, piece, time.perf_counter() - start)
            if out is not None:
                out[rows, columns] = piece
            else:
                pieces[k] = piece
            bar.update(piece.numel() * world)
            if on_block is not None:
                on_block(piece.numel() * world)
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
    out = torch.empty(n, m, device=HOST)
    for k, (rows, columns, _) in enumerate(blocks):
        out[rows, columns] = pieces.pop(k)  # (frees each piece as it is placed)
    return out


def device_budget(device: torch.device, budget_bytes: float, out_bytes: float) -> float:
    """The budget a block plan is sized by. On the CPU: the user's budget (the score matrix and one block's
    temporaries share the host memory). On a GPU the matrix stays on the host and the block's temporaries
    take the device's memory: the host matrix plus DEVICE_MEMORY_FRACTION of the device's free memory,
    rounded down to a power of two so that the block plan (and so a --resume-dir key) does not change with
    a few MB of free memory more or less between two runs."""
    free = free_memory(device)
    if free is None:
        return budget_bytes
    usable = DEVICE_MEMORY_FRACTION * free
    return out_bytes + (2.0 ** int(np.log2(usable)) if usable >= 1 else 0.0)


class BlockScorer:
    """`model.score` of one block (in float32), cut into smaller pieces when the device runs out of memory:
    halve the images, then the captions, until a piece fits. The smaller size is kept for later blocks, and
    said once (a warning), so one tight block plan costs one failed attempt, not one per block. The scores
    are the head's own, whatever the cut (each pair is computed by the same code; within float32 summation
    order). A single pair that does not fit is a ConfigError."""

    def __init__(self, model: Matcher) -> None:
        self.model = model
        self.rows: int | None = None  # largest piece that fitted, once a block did not
        self.columns: int | None = None
        self.warned = False

    def __call__(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        n, m = len(img), len(txt)
        rows, columns = min(n, self.rows or n), min(m, self.columns or m)
        if rows == n and columns == m:
            return self._attempt(img, txt)
        # (each piece through __call__ again: it is cut further if the sizes shrank meanwhile)
        pieces = [[self(img.take(slice(i, i + rows)), txt.take(slice(j, j + columns)).trimmed())
                   for j in range(0, m, columns)] for i in range(0, n, rows)]
        return torch.cat([torch.cat(row, 1) for row in pieces], 0)

    def _attempt(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        try:
            return self.model.score(img, txt).float()
        except OutOfMemoryError:
            release_cached_memory(module_device(self.model))
            n, m = len(img), len(txt)
            if n == 1 and m == 1:
                raise ConfigError("out of device memory scoring a single image-caption pair",
                                  hint="free the GPU (other processes), use a smaller model, or --device cpu"
                                  ) from None
            if n > 1:
                self.rows = (n + 1) // 2
            else:
                self.columns = (m + 1) // 2
            if not self.warned:
                self.warned = True
                warnings.warn(f"out of device memory scoring a block of {n} images x {m} captions: retrying with "
                              f"smaller blocks (at most {self.rows or n} x {self.columns or m}); nothing scored is "
                              "lost", stacklevel=3)
            return self(img, txt)


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
    require_items(len(img), "images")
    require_items(len(txt), "captions")
    images, captions = images.long().reshape(-1), captions.long().reshape(-1)
    if len(images) != len(captions):
        raise ConfigError(f"{len(images)} image indices but {len(captions)} caption indices: pairs need one of each")
    out = torch.empty(len(images), device=HOST)
    if len(images) == 0:
        return out
    if int(images.min()) < 0 or int(images.max()) >= len(img) or int(captions.min()) < 0 \
            or int(captions.max()) >= len(txt):
        raise ConfigError(f"pair indices out of range for {len(img)} images x {len(txt)} captions")
    lengths = txt.lengths.to(HOST)[captions]
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
    score_block = BlockScorer(model)
    start = 0
    for i, count in zip(firsts.tolist(), counts.tolist(), strict=True):
        one_image = img.take(slice(i, i + 1))
        end_of_image = start + count
        while start < end_of_image:
            # the block's longest caption is its last (sorted): shrink the block until it fits
            end = min(end_of_image, start + fit(lengths[start]))
            while fit(lengths[end - 1]) < end - start:
                end = start + fit(lengths[end - 1])
            out[order[start:end]] = score_block(one_image, txt.take_trimmed(captions[start:end]))[0].to(HOST)
            bar.update(end - start)
            start = end
    bar.close()
    return out


