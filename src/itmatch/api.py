"""Python API in the spirit of open_clip: itmatch.list_models(), itmatch.load(checkpoint)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from itmatch.data.precomp import MultiScaleArray
from itmatch.engine.checkpoint import Checkpoint, load_checkpoint
from itmatch.engine.evaluate import encode_captions, encode_images, score_matrix
from itmatch.errors import DataError
from itmatch.models.base import ImageEmb, TextEmb
from itmatch.models.registry import image_inputs
from itmatch.retrieval.two_stage import TwoStageResult, first_stage_vectors, two_stage_scores

ImageInput = str | Path | Image.Image


class ImageTextMatcher:
    """A trained model with its vocabulary and (lazily) the CNN its features came from."""

    def __init__(self, checkpoint: Checkpoint, backbone: str | None = None) -> None:
        self.checkpoint = checkpoint
        self.model, self.vocab = checkpoint.model.eval(), checkpoint.vocab
        save = checkpoint.config.model.save
        own = save.backbone if image_inputs(checkpoint.config.model) else ""
        self.backbone_name = backbone or checkpoint.config.data.backbone or own or "lite0"
        self._backbone = None

    @property
    def backbone(self):
        if self._backbone is None:
            from itmatch.features.backbones import load_backbone

            self._backbone = load_backbone(self.backbone_name)
        return self._backbone

    @torch.inference_mode()
    def image_features(self, images: Sequence[ImageInput], batch_size: int = 8
                       ) -> torch.Tensor | MultiScaleArray:
        """What the model reads for image files or PIL images, as `itmatch extract` computes it: region
        features [N, k, D]; for a multi-scale model (SAVE) its cached stage maps; for a pixel model the
        preprocessed pixels [N, 3, S, S]."""
        inputs = image_inputs(self.checkpoint.config.model)
        parts = []
        for start in range(0, len(images), batch_size):
            batch = []
            for item in images[start:start + batch_size]:
                if isinstance(item, Image.Image):
                    batch.append(self.backbone.preprocess(item))
                    continue
                try:
                    with Image.open(item) as im:
                        batch.append(self.backbone.preprocess(im))
                except OSError as exc:
                    raise DataError(f"cannot read image ({exc})", path=item,
                                    hint="pass a readable JPEG/PNG file") from None
            x = torch.stack(batch)
            if inputs == ("pixels",):
                parts.append(x)
            elif inputs:
                maps = self.backbone.stage_maps(x)
                parts.append({s: maps[s].flatten(2).transpose(1, 2) for s in inputs})
            else:
                parts.append(self.backbone(x))
        if isinstance(parts[0], dict):
            return MultiScaleArray({s: torch.cat([p[s] for p in parts]).numpy() for s in inputs})
        return torch.cat(parts)

    def encode_images(self, images: Sequence[ImageInput] | torch.Tensor | np.ndarray) -> ImageEmb:
        """Paths or PIL images (run through the backbone), or precomputed [N, k, D] features."""
        if isinstance(images, np.ndarray | torch.Tensor):
            return encode_images(self.model, np.asarray(images, dtype=np.float32))
        feats = self.image_features(list(images))
        return encode_images(self.model, feats if isinstance(feats, MultiScaleArray) else feats.numpy())

    def encode_texts(self, texts: Sequence[str]) -> TextEmb:
        if isinstance(texts, str):
            texts = [texts]
        return encode_captions(self.model, list(texts), self.vocab)

    def score(self, images: ImageEmb | Sequence[ImageInput] | torch.Tensor,
              texts: TextEmb | Sequence[str]) -> torch.Tensor:
        """Scores [n_images, n_texts] (embeddings from encode_* or raw inputs)."""
        img = images if isinstance(images, ImageEmb) else self.encode_images(images)
        txt = texts if isinstance(texts, TextEmb) else self.encode_texts(texts)
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
        return two_stage_scores(self.model, img, txt, k, img_vec, txt_vec, index)

    def rank(self, query: str | ImageInput, candidates: ImageEmb | TextEmb | Sequence, top_k: int = 10
             ) -> list[tuple[int, float]]:
        """Text query -> best candidate images, or image query -> best candidate texts: (index, score)."""
        if isinstance(query, str) and Path(query).suffix.lower() not in (".jpg", ".jpeg", ".png"):
            scores = self.score(candidates, [query])[:, 0]
        else:
            scores = self.score([query], candidates)[0]
        top = torch.topk(scores, min(top_k, scores.numel()))
        return [(int(i), float(s)) for s, i in zip(top.values, top.indices, strict=True)]


def load(checkpoint: str | Path, backbone: str | None = None, *, trust_modified: bool = False) -> ImageTextMatcher:
    """Load a checkpoint directory written by `itmatch train` (e.g. RUN/best). A checkpoint whose files
    differ from its manifest (an edited config.json or vocab.json, damaged weights) is refused unless
    `trust_modified`."""
    return ImageTextMatcher(load_checkpoint(checkpoint, trust_modified=trust_modified), backbone)
