"""A trained model ready for raw inputs: `load(checkpoint)` gives an `ImageTextMatcher` that encodes image files
(through the image pipeline, features/pipeline.py) and sentences, scores, re-ranks and ranks them.

It is the public Python API (`itmatch.load`, re-exported by itmatch.api) and what the photo index and search
build their model with; it lives here, at the retrieval layer, so that retrieval does not import the api layer
above it (docs/architecture.md)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from itmatch.data.precomp import MultiScaleArray
from itmatch.device import Placement, resolve
from itmatch.engine.checkpoint import Checkpoint, load_checkpoint
from itmatch.errors import ConfigError, DataError, UnknownWordsWarning
from itmatch.features.pipeline import decode_image, grid_features
from itmatch.inference import encode_captions, encode_images, score_matrix
from itmatch.models.base import ImageEmb, TextEmb
from itmatch.models.registry import arch, image_inputs, pixel_backbone
from itmatch.retrieval.two_stage import TwoStageResult, first_stage_vectors, two_stage_scores

#: an image file's path, its bytes, or a decoded PIL image
ImageInput = str | Path | bytes | Image.Image


@dataclass
class WordAttention:
    """How a model attends from one caption's words to one image's grid cells, as it computes the pair's score
    (SCAN's Fig. 4 and 5 draw these)."""

    tokens: list[str]  # the caption's time steps: <start>, its words, <end> (SCAN scores all of them)
    known: list[bool]  # per token, whether the vocabulary knows it (an unknown word is read as <unk>)
    maps: np.ndarray  # [len(tokens), grid, grid]: each token's weights over the cells, row-major
    normalised_over: str  # "regions" (t-i: each word's weights sum to 1) or "words" (i-t: each cell's over words)
    score: float  # the pair's score


class ImageTextMatcher:
    """A trained model with its vocabulary and (lazily) the CNN its features came from, both on one device.
    Embeddings stay on that device; scores come back on the host."""

    def __init__(self, checkpoint: Checkpoint, backbone: str | None = None,
                 placement: Placement | None = None) -> None:
        self.checkpoint = checkpoint
        self.placement = placement or Placement(torch.device("cpu"))
        self.model, self.vocab = checkpoint.model.eval().to(self.device), checkpoint.vocab
        mc = checkpoint.config.model
        # a pixel model preprocesses for its own CNN; a cached-feature model for the CNN its data came from
        cached = checkpoint.config.data.backbone or (arch(mc).backbone(mc) if image_inputs(mc) else "")
        self.backbone_name = backbone or pixel_backbone(mc) or cached or "lite0"
        self._backbone = None

    @property
    def device(self) -> torch.device:
        return self.placement.device

    @property
    def backbone(self):
        if self._backbone is None:
            from itmatch.features.backbones import load_backbone

            backbone = load_backbone(self.backbone_name)
            self._check_feature_size(backbone.out_dim)
            self._backbone = backbone.to(self.device)
        return self._backbone

    def _check_feature_size(self, out_dim: int) -> None:
        """A model trained on cached region features of another size (other features, e.g. bottom-up regions of
        2048) cannot read this backbone's: say so, instead of failing in a matrix product."""
        mc = self.checkpoint.config.model
        if not image_inputs(mc) and mc.img_dim and mc.img_dim != out_dim:
            raise ConfigError(f"the model reads {mc.img_dim}-dimensional region features, but the "
                              f"{self.backbone_name} backbone that reads photos gives {out_dim}",
                              path=self.checkpoint.path,
                              hint="this model was trained on features of another extractor; to read photos, "
                                   "train on features from `itmatch extract`")

    @torch.inference_mode()
    def image_features(self, images: Sequence[ImageInput], batch_size: int = 8
                       ) -> torch.Tensor | MultiScaleArray:
        """What the model reads for image files (paths or their bytes) or PIL images, as `itmatch extract`
        computes it (features/pipeline.py): region features [N, k, D]; for a multi-scale model (SAVE) its
        cached stage maps; for a pixel model the preprocessed pixels [N, 3, S, S]. An unreadable file raises
        DataError naming it."""
        inputs = image_inputs(self.checkpoint.config.model)
        parts = []
        for start in range(0, len(images), batch_size):
            batch = [self.backbone.preprocess(item if isinstance(item, Image.Image) else decode_image(item))
                     for item in images[start:start + batch_size]]
            x = torch.stack(batch)  # (decoded on the host; the features come back to it)
            if inputs == ("pixels",):
                parts.append(x)
                continue
            grids = grid_features(self.backbone, x, self.placement, inputs)
            parts.append({s: grids[s] for s in inputs} if inputs else grids["c5"])
        if isinstance(parts[0], dict):
            return MultiScaleArray({s: torch.cat([p[s] for p in parts]).numpy() for s in inputs})
        return torch.cat(parts)

    def encode_images(self, images: Sequence[ImageInput] | torch.Tensor | np.ndarray) -> ImageEmb:
        """Paths or PIL images (run through the backbone), or precomputed [N, k, D] features."""
        if isinstance(images, torch.Tensor):
            images = images.detach().cpu().numpy()
        if isinstance(images, np.ndarray):
            with self.placement.arithmetic():
                return encode_images(self.model, np.asarray(images, dtype=np.float32))
        feats = self.image_features(list(images))
        with self.placement.arithmetic():
            return encode_images(self.model, feats if isinstance(feats, MultiScaleArray) else feats.numpy())

    def encode_texts(self, texts: Sequence[str]) -> TextEmb:
        if isinstance(texts, str):
            texts = [texts]
        with self.placement.arithmetic():
            return encode_captions(self.model, list(texts), self.vocab)

    def score(self, images: ImageEmb | Sequence[ImageInput] | torch.Tensor,
              texts: TextEmb | Sequence[str]) -> torch.Tensor:
        """Scores [n_images, n_texts] (embeddings from encode_* or raw inputs)."""
        img = images if isinstance(images, ImageEmb) else self.encode_images(images)
        txt = texts if isinstance(texts, TextEmb) else self.encode_texts(texts)
        with self.placement.arithmetic():
            return score_matrix(self.model, img, txt)

    def rerank_scores(self, images: ImageEmb | Sequence[ImageInput] | torch.Tensor,
                      texts: TextEmb | Sequence[str], k: int = 100,
                      first_stage: ImageTextMatcher | None = None, index: str = "flat") -> TwoStageResult:
        """Two-stage scores: a FAISS first stage (this model's global embedding, or `first_stage`'s, e.g.
        a VSE++ model for SCAN) proposes the top `k` per query in both directions; this model's pair head
        re-scores them exactly. `.scores` is [n_images, n_texts] with -inf outside the candidates."""
        img = images if isinstance(images, ImageEmb) else self.encode_images(images)
        txt = texts if isinstance(texts, TextEmb) else self.encode_texts(texts)
        if first_stage is None:
            img_vec, txt_vec = first_stage_vectors(img, txt)
        else:
            if isinstance(images, ImageEmb) or isinstance(texts, TextEmb):
                raise DataError("a separate first-stage model needs the raw images and texts, not embeddings",
                                hint="pass paths / features and strings")
            img_vec, txt_vec = first_stage_vectors(first_stage.encode_images(images),
                                                   first_stage.encode_texts(texts))
        with self.placement.arithmetic():
            return two_stage_scores(self.model, img, txt, k, img_vec, txt_vec, index)

    def unknown_words(self, text: str) -> list[str]:
        """The words of `text` the model's vocabulary does not know, each once, in order: the model reads
        each as <unk> ([UNK] for WordPiece), so their meaning is lost."""
        return list(dict.fromkeys(self.vocab.coverage(text).unknown))

    def rank(self, query: str | ImageInput, candidates: ImageEmb | TextEmb | Sequence, top_k: int = 10
             ) -> list[tuple[int, float]]:
        """Text query -> best candidate images, or image query -> best candidate texts: (index, score).

        Unknown words are not dropped silently: a text query with some warns (UnknownWordsWarning), one
        without any known word is a DataError; candidate texts (strings) without any known word are never
        ranked (they are left out of the result, so they cannot outrank a text the model can read)."""
        if isinstance(query, str) and Path(query).suffix.lower() not in (".jpg", ".jpeg", ".png"):
            self._check_query(query)
            scores = self.score(candidates, [query])[:, 0]
        else:
            scores = self.score([query], candidates)[0]
            if not isinstance(candidates, TextEmb):
                texts = [candidates] if isinstance(candidates, str) else candidates
                readable = torch.tensor([self.vocab.coverage(t).has_known_word for t in texts], dtype=torch.bool)
                scores = scores.masked_fill(~readable, -torch.inf)
                top_k = min(top_k, int(readable.sum()))
        top = torch.topk(scores, min(top_k, scores.numel()))
        return [(int(i), float(s)) for s, i in zip(top.values, top.indices, strict=True)]

    @torch.inference_mode()
    def word_attention(self, image: ImageEmb | ImageInput, text: str) -> WordAttention:
        """The model's attention from the words of `text` to the grid cells of `image` (a photo, or one image's
        embedding from encode_images): ConfigError for a model whose score has no such attention (VSE++,
        MMCA, SMAN)."""
        head = self.model.head
        if not head.has_word_attention:
            raise ConfigError(f"the {self.checkpoint.config.model.arch} model has no per-word attention over "
                              "regions", hint="attention maps need a SCAN, SAVE or OAN (with inter-modal "
                                              "attention) model; see docs/search.md")
        img = image if isinstance(image, ImageEmb) else self.encode_images([image])
        txt = self.encode_texts([text])
        with self.placement.arithmetic():
            alpha, normalised_over = head.word_attention(img, txt)
            score = float(self.model.score(img, txt)[0, 0])
        length, regions = int(txt.lengths[0]), alpha.shape[0]
        grid = math.isqrt(regions)
        if grid * grid != regions:
            raise DataError(f"the image has {regions} regions, not a square grid of cells to draw attention on")
        coverage = self.vocab.coverage(text)
        return WordAttention(tokens=["<start>", *coverage.words, "<end>"], known=[True, *coverage.known, True],
                             maps=alpha[:, :length].float().cpu().T.reshape(length, grid, grid).numpy(),
                             normalised_over=normalised_over, score=score)

    def _check_query(self, query: str) -> None:
        coverage = self.vocab.coverage(query)
        unknown = ", ".join(dict.fromkeys(coverage.unknown))
        if not coverage.has_known_word:
            raise DataError(f"none of the query's words is in the model's vocabulary (unknown: {unknown or '-'})",
                            hint="use words of the captions the model was trained on")
        if unknown:
            warnings.warn(f"not in the model's vocabulary, read as <unk>: {unknown}", UnknownWordsWarning,
                          stacklevel=3)


def load(checkpoint: str | Path, backbone: str | None = None, device: str | torch.device = "cpu",
         precision: str = "fp32", *, trust_modified: bool = False) -> ImageTextMatcher:
    """Load a checkpoint directory written by `itmatch train` (e.g. RUN/best), or a pretrained model shipped
    with the package by name (`itmatch models --pretrained` lists them), onto `device` (auto | cpu | cuda |
    cuda:N; a checkpoint written on any device loads on any other), to run in `precision` (fp32 | bf16 | fp16:
    autocast; fp32, the default, is exact). Bad settings raise ConfigError before the checkpoint is read. A
    checkpoint whose files differ from its manifest (an edited config.json or vocab.json, damaged weights) is
    refused unless `trust_modified`."""
    from itmatch.pretrained import resolve_checkpoint

    placement = resolve(device, precision, device_setting="device=", precision_setting="precision=")
    return ImageTextMatcher(load_checkpoint(resolve_checkpoint(checkpoint), trust_modified=trust_modified), backbone,
                          placement)
