"""The Matcher contract shared by every model: encode each side once, then score all pairs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Self

import torch
from torch import nn

from itmatch.models.losses import triplet_loss

EPS = 1e-8  # the public SCAN code's epsilon in l2norm and cosine similarity
#: What `Matcher.encode_images` accepts: region features, or a dict of named multi-scale maps.
ImageInput = torch.Tensor | Mapping[str, torch.Tensor]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = EPS) -> torch.Tensor:
    """x / (||x|| + eps), as the public SCAN code (not F.normalize, which clamps instead). The norm is
    torch.linalg.vector_norm, whose gradient at a zero vector is 0; sqrt(sum x^2) gives 0 * inf = NaN there
    (an all-zero grid cell, a padded word)."""
    return x / (torch.linalg.vector_norm(x, dim=dim, keepdim=True) + eps)


def length_mask(lengths: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
    """[B, L] bool, True on real time steps."""
    max_len = int(lengths.max()) if max_len is None else max_len
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


def masked_pool(values: torch.Tensor, mask: torch.Tensor, dim: int, how: str, lse_lambda: float = 1.0
                ) -> torch.Tensor:
    """Pool `values` over `dim`, ignoring masked-out entries: avg, sum, max, or lse
    (log(sum exp(lambda x)) / lambda, SCAN Eq. 5/7)."""
    if how == "avg":
        return values.masked_fill(~mask, 0.0).sum(dim) / mask.sum(dim).clamp(min=1)
    if how == "sum":
        return values.masked_fill(~mask, 0.0).sum(dim)
    if how == "max":
        return values.masked_fill(~mask, float("-inf")).amax(dim)
    if how == "lse":
        return torch.logsumexp((values * lse_lambda).masked_fill(~mask, float("-inf")), dim) / lse_lambda
    raise ValueError(f"unknown pooling {how!r}; choose avg, lse, max or sum")


def zero_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x [B, L, D] with the padded steps (mask False) set to 0. Matcher.encode_* guarantee it once per
    item, so that heads get s = 0 on padding from the block GEMM instead of a mask pass per block."""
    return x if bool(mask.all()) else x.masked_fill(~mask[..., None], 0.0)


@dataclass
class Embeddings:
    """Per-item tensors, first dimension = item. `extras` holds per-item parts a head precomputes
    once (e.g. Gram matrices), so that pair scoring never recomputes them."""

    extras: dict[str, torch.Tensor] = field(default_factory=dict, kw_only=True)

    def tensors(self) -> list[torch.Tensor]:
        """Every per-item tensor: the tensor fields, then the extras."""
        fixed = [v for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)]
        return [*fixed, *self.extras.values()]

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Self:
        """The same embeddings with `fn` applied to every per-item tensor (fields and extras, in the order
        of tensors(): collectives such as an all-gather rely on it being the same on every rank)."""
        changes: dict[str, Any] = {f.name: fn(v) for f in fields(self)
                                   if isinstance(v := getattr(self, f.name), torch.Tensor)}
        changes["extras"] = {k: fn(v) for k, v in self.extras.items()}
        return replace(self, **changes)

    def take(self, index: torch.Tensor | slice) -> Self:
        """The same embeddings restricted to some items (a block of the evaluator, a batch): views for a
        slice, copies for indices (or a bool mask)."""
        # index_select, not value[index], for a list of indices: faster on CPU (docs/performance.md,
        # "Where the code's constants come from"), and the re-ranker gathers captions per block
        # (an index tensor may live elsewhere than the embeddings: e.g. the evaluator's CPU caption order)
        if isinstance(index, torch.Tensor) and index.ndim == 1 and index.dtype != torch.bool:
            return self.map_tensors(lambda value: value.index_select(0, index.to(value.device)))
        if isinstance(index, torch.Tensor):
            return self.map_tensors(lambda value: value[index.to(value.device)])
        return self.map_tensors(lambda value: value[index])

    def to(self, device: torch.device | str) -> Self:
        return self.map_tensors(lambda value: value.to(device))

    def vectors_only(self) -> Self:
        """What a pair-independent head scores: the item vectors alone (its score is one product of them). The other
        per-item tensors (regions or words, the mask) become empty ones of width 0, new, since views would keep
        their storage, and the extras are dropped: an index's photos and a caption collection held for such a head
        keep ~k and ~L times less (docs/search.md, "What a search keeps in memory")."""
        if getattr(self, "vector", None) is None:
            raise ValueError("vectors_only: these embeddings have no item vector")
        changes = {f.name: value.new_empty((value.shape[0], 0, *value.shape[2:])) for f in fields(self)
                   if f.name != "vector" and isinstance(value := getattr(self, f.name), torch.Tensor)
                   and value.dim() > 1}
        return replace(self, **changes, extras={})


@dataclass
class ImageEmb(Embeddings):
    regions: torch.Tensor  # [N, k, D], zero on masked-out regions
    mask: torch.Tensor  # [N, k] bool, True on real regions
    vector: torch.Tensor | None = None  # [N, D] pair-independent embedding, when the model has one

    def __len__(self) -> int:
        return int(self.regions.shape[0])


@dataclass
class TextEmb(Embeddings):
    words: torch.Tensor  # [M, L, D], zero beyond each caption's length
    lengths: torch.Tensor  # [M]
    vector: torch.Tensor | None = None
    #: extras key -> its word axes (e.g. a word Gram matrix: (1, 2); per-word keys: (1,)); the evaluator
    #: pads these when it concatenates captions of different lengths, trimmed() cuts them. Others: per item.
    word_axes: dict[str, tuple[int, ...]] = field(default_factory=dict, kw_only=True)

    def __len__(self) -> int:
        return int(self.words.shape[0])

    @property
    def mask(self) -> torch.Tensor:
        return length_mask(self.lengths, self.words.shape[1])

    def padded_to(self, length: int) -> TextEmb:
        """Zero-pad the words and the word axes of extras to `length` steps (to concatenate or all-gather
        captions of different padded lengths)."""
        if length == self.words.shape[1]:
            return self

        def pad(t: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
            widths: list[int] = []
            for d in range(t.dim() - 1, 0, -1):  # F.pad lists the last dimension first
                widths += [0, length - t.shape[d] if d in axes else 0]
            return nn.functional.pad(t, widths)

        extras = {k: pad(v, self.word_axes[k]) if self.word_axes.get(k) else v for k, v in self.extras.items()}
        return replace(self, words=pad(self.words, (1,)), extras=extras)

    def narrowed(self, length: int) -> TextEmb:
        """Views of the words and of the word axes of extras cut to `length` columns (no copy)."""
        if length == self.words.shape[1]:
            return self
        extras = {}
        for key, value in self.extras.items():
            for axis in self.word_axes.get(key, ()):
                value = value.narrow(axis, 0, length)
            extras[key] = value
        return replace(self, words=self.words[:, :length], extras=extras)

    def trimmed(self) -> TextEmb:
        """Drop padding columns beyond the longest caption present (after taking a block)."""
        return self.narrowed(int(self.lengths.max()))

    def take_trimmed(self, index: torch.Tensor) -> TextEmb:
        """take(index).trimmed(), but the padding columns are cut before the gather, so they are never
        copied (a block of short captions taken from a tensor padded to the longest caption)."""
        return self.narrowed(int(self.lengths[index].max())).take(index)


#: one block of a score matrix: image rows, caption columns, their embeddings (the inference core plans them,
#: the score cache keys finished ones by them; defined here, below both, so that neither imports the other)
Block = tuple[slice, torch.Tensor | slice, TextEmb]


class SimilarityHead(nn.Module):
    """score(img, txt) -> [n_img, n_txt]. `prepare_*` add per-item parts once per item."""

    #: The memory contract, which every head must declare (a class attribute, or set in __init__; `Matcher`
    #: refuses a head without it): bytes of temporaries per (image, caption, region, word) cell and per
    #: (image, caption) pair, from which the evaluator sizes its blocks. Both 0: a pair-independent head (the
    #: whole score matrix is one matrix product). No default: a pair head that forgot it would look
    #: pair-independent and be scored in one block of unbounded size.
    bytes_per_cell: float
    bytes_per_pair: float
    #: largest block (region x word cells) the head computes fastest, 0: the evaluator's default. A head
    #: with large per-pair activations (MMCA's transformer unit) caps its blocks so they stay in the cache.
    max_block_cells: int = 0
    #: b such that |score(i, t) - vector_i . vector_t| <= b for every pair: a head whose score is its
    #: global cosine plus a bounded pair term (MMCA: alpha * i1 . c1 of unit vectors). None: no such bound.
    #: Safe pruning (retrieval.two_stage.pruned_scores) scores exactly only the pairs it cannot rule out.
    score_bound: float | None = None

    @property
    def pair_independent(self) -> bool:
        """True when a block costs no per-pair temporaries: the whole score matrix is one product."""
        return self.bytes_per_cell <= 0 and self.bytes_per_pair <= 0

    #: whether the score is built from per-word attention weights over the image's regions (word_attention)
    has_word_attention: bool = False

    def word_attention(self, img: ImageEmb, txt: TextEmb) -> tuple[torch.Tensor, str]:
        """The first pair's per-word attention over regions that the score uses, [k, L], and the axis its
        weights sum to 1 over ("regions" or "words"): what search explains (docs/search.md)."""
        raise ValueError(f"{type(self).__name__} has no per-word attention over regions")

    def prepare_images(self, img: ImageEmb) -> ImageEmb:
        return img

    def prepare_texts(self, txt: TextEmb) -> TextEmb:
        return txt

    def forward(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def training_loss(self, img: ImageEmb, txt: TextEmb, margin: float, hardest: bool,
                      positives: torch.Tensor | None = None) -> torch.Tensor:
        """The batch loss; img[i] and txt[i] are the matched pairs. The default is the triplet ranking
        loss over the batch's score matrix (SCAN Eq. 11/12); a head whose paper adds terms (MMCA's
        three-term loss, OAN's intra-modal negatives, SMAN's intra-pair constraint) overrides this."""
        return triplet_loss(self(img, txt), margin, hardest, positives)


class Matcher(nn.Module):
    """An image encoder, a text encoder and a similarity head.

    `lr_scales` maps a parameter-name prefix to a learning-rate multiplier (e.g. a fine-tuned backbone
    at lr / 10); the trainer puts those parameters in their own optimizer group."""

    def __init__(self, image_encoder: nn.Module, text_encoder: nn.Module, head: SimilarityHead) -> None:
        super().__init__()
        undeclared = [name for name in ("bytes_per_cell", "bytes_per_pair") if getattr(head, name, None) is None]
        if undeclared:
            raise TypeError(f"{type(head).__name__} does not declare its memory contract ({', '.join(undeclared)}): "
                            "set both (0.0 and 0.0 for a pair-independent head; see SimilarityHead)")
        self.image_encoder, self.text_encoder, self.head = image_encoder, text_encoder, head
        self.lr_scales: dict[str, float] = {}

    def encode_images(self, feats: ImageInput, mask: torch.Tensor | None = None) -> ImageEmb:
        """feats: region features [N, k, D] (every model), or what a grid model reads instead: a dict of
        cached stage maps {scale: [N, k_s, C_s]} or pixels [N, 3, S, S] (SAVE, models/save/encoder.py); the
        mask defaults to all regions real."""
        return self.head.prepare_images(self.encode_image_fields(feats, mask))

    def encode_image_fields(self, feats: ImageInput, mask: torch.Tensor | None = None) -> ImageEmb:
        """What the image encoder gives per image, before the head adds its per-item parts
        (`encode_images` = `head.prepare_images` of this): what a photo index stores, so that loading it
        and preparing it gives exactly `encode_images` (a head may rewrite fields, e.g. SMAN-SIM's vector)."""
        if mask is None and isinstance(feats, torch.Tensor) and feats.ndim == 3:
            mask = torch.ones(feats.shape[:2], dtype=torch.bool, device=feats.device)
        img = self.image_encoder(feats, mask)
        img.regions = zero_padding(img.regions, img.mask)
        return img

    def encode_texts(self, tokens: torch.Tensor, lengths: torch.Tensor) -> TextEmb:
        txt = self.text_encoder(tokens, lengths)
        txt.words = zero_padding(txt.words, txt.mask)
        return self.head.prepare_texts(txt)

    def score(self, img: ImageEmb, txt: TextEmb) -> torch.Tensor:
        return self.head(img, txt)

    def training_loss(self, img: ImageEmb, txt: TextEmb, margin: float, hardest: bool,
                      positives: torch.Tensor | None = None) -> torch.Tensor:
        return self.head.training_loss(img, txt, margin, hardest, positives)

    @property
    def has_global_embedding(self) -> bool:
        return bool(getattr(self.image_encoder, "pools", False))
