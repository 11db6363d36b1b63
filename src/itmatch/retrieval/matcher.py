"""A trained model ready for raw inputs: `load(checkpoint)` gives an `ImageTextMatcher` that encodes image files
(through the image pipeline, features/pipeline.py) and sentences, scores, re-ranks and ranks them.

It is the public Python API (`itmatch.load`, re-exported by itmatch.api) and what the photo index and search
build their model with; it lives here, at the retrieval layer, so that retrieval does not import the api layer
above it (docs/architecture.md)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from itmatch.data.precomp import MultiScaleArray, assert_finite
from itmatch.device import Placement, resolve
from itmatch.engine.checkpoint import Checkpoint, load_checkpoint
from itmatch.errors import ConfigError, DataError, UnknownWordsWarning, whole_number
from itmatch.features.backbones import BACKBONE_NAMES, backbone_spec
from itmatch.features.pipeline import IMAGE_SUFFIXES, decode_image, grid_features
from itmatch.inference import encode_captions, encode_images, require_items, score_matrix
from itmatch.models.base import ImageEmb, TextEmb
from itmatch.models.registry import arch, image_inputs, pixel_backbone
from itmatch.retrieval.two_stage import TwoStageResult, first_stage_vectors, two_stage_scores

#: an image file's path, its bytes, or a decoded PIL image
ImageInput = str | Path | bytes | Image.Image
_ONE_IMAGE = (str, Path, bytes, Image.Image)
#: how rank() reads its query: decided from the query ("auto"), or said by the caller
QUERY_KINDS = ("auto", "text", "image")
#: the models whose score attends from words to regions, so that word_attention has maps to give: one wording for
#: the matcher's error, `itmatch serve`'s log and the search page's note (Searcher.explain_note)
WORD_ATTENTION_MODELS = "a SCAN, SAVE or OAN (with inter-modal attention) model"
_PHOTOS_HINT = "or pass the photos themselves (paths, bytes or PIL images): the matcher computes what the model reads"


def _text_list(texts: object) -> list[str]:
    """Captions as a list of strings (one str is a list of one); a DataError for anything else, before any work."""
    if isinstance(texts, str):
        return [texts]
    if texts is None or isinstance(texts, bytes | Path | Image.Image | ImageEmb) or not isinstance(texts, Iterable):
        raise DataError(f"the texts must be a caption (str) or a list of captions, got {type(texts).__name__}",
                        hint="pass captions as strings, e.g. [\"a dog runs\"]")
    items = list(texts)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise DataError(f"text {i} is a {type(item).__name__} ({item!r:.40}), not a string",
                            hint="pass captions as strings")
    require_items(len(items), "captions")
    return items


def _image_list(images: object) -> list[ImageInput]:
    """Images as a list of paths, bytes or PIL images (one of them is a list of one); a DataError for anything
    else or for none, before any is decoded."""
    if isinstance(images, _ONE_IMAGE):
        return [images]
    if images is None or isinstance(images, TextEmb) or not isinstance(images, Iterable):
        raise DataError(f"the images must be an image or a list of images, got {type(images).__name__}",
                        hint="pass paths (str or pathlib.Path), bytes or PIL images, or one array of "
                             "precomputed features")
    items = list(images)
    for i, item in enumerate(items):
        if not isinstance(item, _ONE_IMAGE):
            raise DataError(f"image {i} is a {type(item).__name__}, not an image file's path, its bytes or a "
                            "PIL image", hint="pass paths (str or pathlib.Path), bytes or PIL images; precomputed "
                                              "features go in as one array [N, ...], not a list of arrays")
    require_items(len(items), "images")
    return items


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
        trained = pixel_backbone(mc) or cached
        #: the CNN the model was trained on (its own, or the one that extracted its features), "" if unknown
        self.trained_backbone = trained if trained in BACKBONE_NAMES else ""
        if backbone:
            backbone_spec(backbone)  # (an unknown name: ConfigError listing the known ones)
            if self.trained_backbone and backbone != self.trained_backbone:
                raise ConfigError(
                    f"backbone={backbone!r}, but the model was trained on {self.trained_backbone} features: "
                    f"photos read through {backbone} would give features it was not trained on (scored without an "
                    "error when their size matches)",
                    path=checkpoint.path, hint=f"leave backbone unset (the model reads photos through "
                                               f"{self.trained_backbone}), or train a model on {backbone} features")
        self.backbone_name = backbone or self.trained_backbone or "lite0"  # (an unknown extractor: try Lite0's size)
        #: whether features given precomputed are known to be `backbone_name`'s grid cells: the CNN the model was
        #: trained on, or one named at load (an index of photos read through it); not the guess of Lite0
        self._grid_known = bool(backbone or self.trained_backbone)
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
    def image_features(self, images: ImageInput | Sequence[ImageInput], batch_size: int = 8
                       ) -> torch.Tensor | MultiScaleArray:
        """What the model reads for image files (paths or their bytes) or PIL images (one of them alone is a list
        of one), as `itmatch extract` computes it (features/pipeline.py): region features [N, k, D]; for a
        multi-scale model (SAVE) its cached stage maps; for a pixel model the preprocessed pixels [N, 3, S, S].
        An empty list, an item of another type or a `batch_size` below 1 raises before any image is read; an
        unreadable file raises DataError naming it."""
        batch_size = whole_number("batch_size", batch_size, "pass batch_size >= 1 (images per backbone pass)")
        images = _image_list(images)
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

    def photo_reading(self) -> tuple[str, tuple[str, ...], Placement]:
        """How this model reads a photo: its CNN, what it takes of it (cells, stage maps or pixels) and where it
        runs. Two models with the same reading get the same `image_features` of a photo, so an ensemble computes
        them once for both."""
        return self.backbone_name, image_inputs(self.checkpoint.config.model), self.placement

    def expected_input(self) -> tuple[str, tuple[int | None, ...]]:
        """What the model reads for N images given precomputed: a description and the shape after N (None where
        the model does not fix the size), e.g. ("region features", (49, 1280)) for a model of Lite0 features,
        ("preprocessed pixels", (3, 260, 260)) for one that reads pixels through Lite2; a multi-scale model (SAVE
        on cached stage maps) reads several arrays, not one: ("stage maps c4, c5", ())."""
        mc = self.checkpoint.config.model
        inputs = image_inputs(mc)
        if inputs == ("pixels",):
            size = backbone_spec(self.backbone_name).image_size
            return "preprocessed pixels", (3, size, size)
        if inputs:
            return f"stage maps {', '.join(inputs)}", ()
        cells = backbone_spec(self.trained_backbone).grid ** 2 if self.trained_backbone else None
        return "region features", (cells, mc.img_dim or None)

    def _check_features(self, feats: np.ndarray) -> None:
        """A precomputed array against what the model reads (expected_input), then NaN/inf: a DataError naming
        the expected shape, or the first non-finite image (as read_precomp names a dataset's)."""
        what, after = self.expected_input()
        shape = list(feats.shape)
        if not after:
            raise DataError(f"the model reads {what} (several arrays), not one array; got an array of shape "
                            f"{shape}", hint="pass the photos themselves (paths, bytes or PIL images)")
        wanted = ", ".join(["N", *(str(d) if d is not None else "k" if i == 0 else "D" for i, d in enumerate(after))])
        if feats.ndim != 1 + len(after) or any(d is not None and d != g for d, g in zip(after, shape[1:], strict=True)):
            detail = (f": {after[0]} cells of the {self.trained_backbone} grid, {after[1]} channels each"
                      if after[0] and what == "region features" else "")
            raise DataError(f"expected {what} [{wanted}]{detail}; got an array of shape {shape}",
                            hint="pass the features of the extractor the model was trained on (e.g. what "
                                 "image_features() returns), " + _PHOTOS_HINT)
        require_items(shape[0], "images")
        assert_finite(feats, Path("<precomputed features>"))

    def encode_images(self, images: ImageInput | Sequence[ImageInput] | torch.Tensor | np.ndarray) -> ImageEmb:
        """Embeddings of images, kept on the matcher's device. `images` is one image or a list of them: paths
        (str or pathlib.Path), the files' bytes or PIL images, run through the backbone (`image_features`); or
        what the model reads, precomputed for N images, as one numpy array or tensor: region features
        [N, k, D] (pixels [N, 3, S, S] for a model that reads pixels; `expected_input` gives the shape). An array
        of another shape, one with NaN/inf, or no images at all raise DataError before anything is encoded."""
        if isinstance(images, torch.Tensor):
            images = images.detach().cpu().numpy()
        if isinstance(images, np.ndarray):
            if not (np.issubdtype(images.dtype, np.integer) or np.issubdtype(images.dtype, np.floating)):
                raise DataError(f"precomputed features must be real numbers, got an array of {images.dtype}",
                                hint="pass a float array, " + _PHOTOS_HINT)
            feats = np.asarray(images, dtype=np.float32)
            self._check_features(feats)
            with self.placement.arithmetic():
                return encode_images(self.model, feats)
        if isinstance(images, MultiScaleArray):  # (a multi-scale model's image_features(), given back)
            self._check_scales(images)
            with self.placement.arithmetic():
                return encode_images(self.model, images)
        feats = self.image_features(images)
        with self.placement.arithmetic():
            return encode_images(self.model, feats if isinstance(feats, MultiScaleArray) else feats.numpy())

    def _check_scales(self, maps: MultiScaleArray) -> None:
        """Cached stage maps against the scales the model reads (a DataError naming both), and at least one image."""
        wanted = image_inputs(self.checkpoint.config.model)
        if wanted == ("pixels",) or set(maps.arrays) != set(wanted):
            raise DataError(f"stage maps of scales {', '.join(sorted(maps.arrays))} given, but the model reads "
                            f"{', '.join(wanted) or 'region features [N, k, D]'}", hint=_PHOTOS_HINT)
        require_items(len(maps), "images")

    def encode_texts(self, texts: str | Sequence[str]) -> TextEmb:
        """Embeddings of captions (one str is a list of one), kept on the matcher's device. Every caption is
        encoded as the model reads it: words the vocabulary does not know become <unk> (`unknown_words` lists
        them), an empty caption is just <start> <end>; neither warns. An item that is not a str, or no caption
        at all, raises DataError."""
        texts = _text_list(texts)
        with self.placement.arithmetic():
            return encode_captions(self.model, texts, self.vocab)

    def score(self, images: ImageEmb | ImageInput | Sequence[ImageInput] | torch.Tensor | np.ndarray,
              texts: TextEmb | str | Sequence[str]) -> torch.Tensor:
        """Scores [n_images, n_texts] on the host, of embeddings from encode_* or raw inputs (what encode_images
        and encode_texts take). Every caption gets a score, also an empty one or one none of whose words the
        model knows (read as <unk>: such a score means little); unlike rank(), which refuses such a text query
        and leaves such candidate texts out, score() neither warns nor drops anything (check texts with
        unknown_words()). Bad inputs raise DataError before any image is read."""
        txt = texts if isinstance(texts, TextEmb) else _text_list(texts)  # (checked before any image is read)
        img = images if isinstance(images, ImageEmb) else self.encode_images(images)
        txt = txt if isinstance(txt, TextEmb) else self.encode_texts(txt)
        with self.placement.arithmetic():
            return score_matrix(self.model, img, txt)

    def rerank_scores(self, images: ImageEmb | ImageInput | Sequence[ImageInput] | torch.Tensor | np.ndarray,
                      texts: TextEmb | str | Sequence[str], k: int = 100,
                      first_stage: ImageTextMatcher | None = None, index: str = "flat") -> TwoStageResult:
        """Two-stage scores: a FAISS first stage (this model's global embedding, or `first_stage`'s, e.g.
        a VSE++ model for SCAN) proposes the top `k` per query in both directions; this model's pair head
        re-scores them exactly. `.scores` is [n_images, n_texts] with -inf outside the candidates. Inputs are
        those of score(); bad ones and a `k` below 1 raise before any image is read."""
        k = whole_number("k", k, "pass k >= 1, the first-stage candidates re-scored per query (e.g. 100)")
        if first_stage is not None and (isinstance(images, ImageEmb) or isinstance(texts, TextEmb)):
            raise DataError("a separate first-stage model needs the raw images and texts, not embeddings",
                            hint="pass paths / features and strings")
        texts = texts if isinstance(texts, TextEmb) else _text_list(texts)
        img = images if isinstance(images, ImageEmb) else self.encode_images(images)
        txt = texts if isinstance(texts, TextEmb) else self.encode_texts(texts)
        if first_stage is None:
            img_vec, txt_vec = first_stage_vectors(img, txt)
        else:
            img_vec, txt_vec = first_stage_vectors(first_stage.encode_images(images),
                                                   first_stage.encode_texts(texts))
        with self.placement.arithmetic():
            return two_stage_scores(self.model, img, txt, k, img_vec, txt_vec, index)

    def unknown_words(self, text: str) -> list[str]:
        """The words of `text` the model's vocabulary does not know, each once, in order: the model reads
        each as <unk> ([UNK] for WordPiece), so their meaning is lost."""
        return list(dict.fromkeys(self.vocab.coverage(text).unknown))

    def rank(self, query: str | ImageInput | ImageEmb | torch.Tensor | np.ndarray,
             candidates: ImageEmb | TextEmb | Sequence | torch.Tensor | np.ndarray, top_k: int = 10, *,
             query_kind: str = "auto") -> list[tuple[int, float]]:
        """Text query -> best candidate images, or image query -> best candidate texts: up to `top_k` (>= 1)
        (index, score) pairs, best first. Candidates are what score() takes on the other side.

        Image or text (query_kind="auto"): a pathlib.Path, bytes, a PIL image, one image's precomputed
        features (an array or tensor, e.g. [k, D]) or its embedding (an ImageEmb of one image) is an image. A
        str is an image path when it ends in a photo format's extension (`features.pipeline.IMAGE_SUFFIXES`:
        .jpg, .png, .webp, .gif, .bmp, .tif, as `itmatch index` takes), and one naming no file is a DataError
        "image file not found", not read as words. Any other str is a caption, even the name of a file.
        query_kind="text" reads a str as a caption whatever it looks like (a caption ending in ".png", a word
        that is also the name of a file in the working directory); query_kind="image" reads it as a path.

        Unknown words are not dropped silently: a text query with some warns (UnknownWordsWarning), one
        without any known word (or an empty one) is a DataError; candidate texts (strings) without any known
        word are never ranked (they are left out of the result, so they cannot outrank a text the model can
        read). score() does neither: it scores every caption as the model reads it."""
        top_k = whole_number("top_k", top_k, "pass top_k >= 1, the number of best candidates to return")
        if self._is_text_query(query, query_kind):
            self._check_query(query)
            scores = self.score(candidates, [query])[:, 0]
        else:
            texts = candidates if isinstance(candidates, TextEmb) else _text_list(candidates)
            scores = self.score(self._one_image(query, "rank's image query"), texts)[0]
            if not isinstance(texts, TextEmb):
                readable = torch.tensor([self.vocab.coverage(t).has_known_word for t in texts], dtype=torch.bool)
                scores = scores.masked_fill(~readable, -torch.inf)
                top_k = min(top_k, int(readable.sum()))
        top = torch.topk(scores, min(top_k, scores.numel()))
        return [(int(i), float(s)) for s, i in zip(top.values, top.indices, strict=True)]

    @staticmethod
    def _is_text_query(query: object, query_kind: str) -> bool:
        """rank()'s rule (its docstring): whether `query` is a caption; a str that looks like a path to an image
        file that does not exist raises DataError."""
        if query_kind not in QUERY_KINDS:
            raise ConfigError(f"query_kind must be one of {', '.join(QUERY_KINDS)}, got {query_kind!r}",
                              hint='"auto" tells an image path from a caption; "text" or "image" says which')
        if query_kind == "text":
            if not isinstance(query, str):
                raise DataError(f"query_kind='text' needs the query as a str, got {type(query).__name__}",
                                hint="pass the caption as a string, or leave query_kind unset for an image")
            return True
        if not isinstance(query, str) or query_kind == "image":
            return False
        # (the ending decides, not whether a file exists: "dog" stays a caption beside a file named dog)
        if Path(query).suffix.lower() not in IMAGE_SUFFIXES:
            return True
        try:
            found = Path(query).is_file()
        except (OSError, ValueError):  # (a name too long for the filesystem, a NUL: not a file)
            found = False
        if not found:
            raise DataError("image file not found", path=query,
                            hint=f"check the path (a relative one is read from {Path.cwd()}); a query that ends "
                                 "in an image file's extension is read as an image path: to rank by it as "
                                 "text, pass query_kind=\"text\"")
        return False

    def _one_image(self, image: object, what: str) -> ImageEmb:
        """The embedding of one image given as a photo (path, bytes, PIL image), its precomputed features
        (with or without the leading axis of 1) or its embedding; DataError for anything else or several."""
        if isinstance(image, ImageEmb):
            img = image
        elif isinstance(image, torch.Tensor | np.ndarray):
            _, after = self.expected_input()
            img = self.encode_images(image[None] if after and image.ndim == len(after) else image)
        elif isinstance(image, _ONE_IMAGE):
            img = self.encode_images([image])
        else:
            raise DataError(f"{what} must be one image, got {type(image).__name__}",
                            hint="pass a path (str or pathlib.Path), the file's bytes, a PIL image, one image's "
                                 "features or its embedding from encode_images")
        if len(img) != 1:
            given = "an embedding" if isinstance(image, ImageEmb) else "features"
            raise DataError(f"{what} takes one image, got {given} of {len(img)} images",
                            hint="pass one photo, or one image's embedding: emb.take(slice(i, i + 1))")
        return img

    @torch.inference_mode()
    def word_attention(self, image: ImageEmb | ImageInput | torch.Tensor | np.ndarray, text: str
                       ) -> WordAttention:
        """The model's attention from the words of `text` (one caption) to the grid cells of one image: a photo
        (path, bytes, PIL image), its precomputed features, or its embedding from encode_images (an embedding
        of several images is a DataError: take one, `emb.take(slice(i, i + 1))`). ConfigError for a model whose
        score has no such attention (VSE++, MMCA, SMAN); DataError for regions that are not a CNN's grid cells
        (features of an unknown extractor, e.g. bottom-up boxes: `_attention_grid`), which no map can place."""
        head = self.model.head
        if not head.has_word_attention:
            raise ConfigError(f"the {self.checkpoint.config.model.arch} model has no per-word attention over "
                              "regions", hint=f"attention maps need {WORD_ATTENTION_MODELS}; see docs/search.md")
        if not isinstance(text, str):
            raise DataError(f"word_attention takes one caption (a str), got {type(text).__name__}",
                            hint="pass the caption as a string")
        img = self._one_image(image, "word_attention")
        txt = self.encode_texts([text])
        with self.placement.arithmetic():
            alpha, normalised_over = head.word_attention(img, txt)
            score = float(self.model.score(img, txt)[0, 0])
        length = int(txt.lengths[0])
        grid = self._attention_grid(image, alpha.shape[0])
        coverage = self.vocab.coverage(text)
        return WordAttention(tokens=["<start>", *coverage.words, "<end>"], known=[True, *coverage.known, True],
                             maps=alpha[:, :length].float().cpu().T.reshape(length, grid, grid).numpy(),
                             normalised_over=normalised_over, score=score)

    def _attention_grid(self, image: object, regions: int) -> int:
        """The side of the grid whose cells the image's `regions` are, for word_attention's maps: a photo's are
        the cells of the CNN that read it; features or an embedding given precomputed are the cells of the CNN the
        model was trained on (or the one named at load). A DataError where they are not known to be grid cells:
        a model of features of an unknown extractor (an empty data.backbone, e.g. a converted SCAN checkpoint's
        36 bottom-up boxes, which a square count would have drawn as a fake 6 x 6 grid), or a count that is not
        the CNN's grid: a map over them has no place on the photo."""
        photo = isinstance(image, _ONE_IMAGE)
        if not (photo or self._grid_known):
            raise DataError(f"the image's {regions} regions are not grid cells: the model was trained on features "
                            "of an unknown extractor (its data.backbone is empty, e.g. bottom-up boxes of a "
                            "converted checkpoint), so no spatial map of the words' attention can be drawn",
                            path=self.checkpoint.path,
                            hint=f"pass the photo itself: its map is drawn over the grid cells of the CNN that "
                                 f"reads it ({self.backbone_name} unless itmatch.load(CKPT, backbone=...) names "
                                 "another); or use a model trained on grid features (`itmatch extract`)")
        grid = backbone_spec(self.backbone_name).grid
        if regions != grid * grid:
            raise DataError(f"the image has {regions} regions, not the {grid} x {grid} grid cells of the "
                            f"{self.backbone_name} backbone, so no spatial map of the words' attention can be "
                            "drawn", path=self.checkpoint.path,
                            hint=f"pass the photo itself, or its {self.backbone_name} features (what "
                                 "image_features() returns)")
        return grid

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
    refused unless `trust_modified`.

    `backbone` (lite0 | lite2 | resnet50 | resnet152) is the ImageNet CNN that reads photos; unset, the one the
    model was trained on: its own (a model that reads pixels) or the one that extracted its training features
    (the checkpoint's data.backbone). Naming another is a ConfigError (same-sized features of another CNN would
    be scored without a word), unless the checkpoint does not record a known one (features of another extractor,
    an empty data.backbone): then the backbone is used if its features have the model's size (default lite0)."""
    from itmatch.pretrained import resolve_checkpoint

    placement = resolve(device, precision, device_setting="device=", precision_setting="precision=")
    if backbone:
        backbone_spec(backbone)  # (an unknown name: before the checkpoint is read)
    return ImageTextMatcher(load_checkpoint(resolve_checkpoint(checkpoint), trust_modified=trust_modified), backbone,
                          placement)
