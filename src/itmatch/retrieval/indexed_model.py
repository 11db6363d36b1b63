"""One index with the model that built it, as a Searcher scores with it; several over the same photos are an ensemble.

An ensemble's score for a pair is the mean of its models' scores, the rule `itmatch evaluate` applies to several
checkpoints (score matrices averaged before ranking; docs/search.md, 'Ensembles'). Each model reads the photos through
its own index, so its members may differ in backbone, text encoder and head; the indexes must hold the same photos.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from itmatch.errors import ConfigError, DataError
from itmatch.inference import TextBuckets, score_matrix
from itmatch.models.base import ImageEmb, TextEmb
from itmatch.retrieval.index import (
    ImageIndex,
    index_command,
    load_index,
    model_identity,
    pretrained_name,
    same_image_encoder,
    same_model,
)
from itmatch.retrieval.matcher import ImageTextMatcher, load
from itmatch.retrieval.names import public_id

log = logging.getLogger("itmatch.retrieval")

SHOWN = 3  # photo names an error lists of each kind of difference between two indexes


@dataclass(frozen=True)
class IndexedModel:
    """An index, the model that built it (checked against the index's record) and the index's encodings, prepared once
    on the model's device (the head's per-image parts included; a pair-independent head's, their vectors alone), in
    the index's row order, or, once `aligned` to an ensemble's first index, in that one's (`index` keeps its own)."""

    index: ImageIndex
    matcher: ImageTextMatcher
    images: ImageEmb

    @property
    def name(self) -> str:
        """What a user calls the model: its shipped name, else its preset (or architecture)."""
        model = self.index.manifest["model"]
        return pretrained_name(model) or model.get("preset") or model.get("arch") or "unknown"

    @property
    def has_word_attention(self) -> bool:
        return self.matcher.model.head.has_word_attention

    def scores(self, images: ImageEmb, texts: TextEmb | TextBuckets) -> torch.Tensor:
        """[images, texts] scores by this model, in fp32 whatever the precision it runs in (so that an ensemble's
        members average alike)."""
        with self.matcher.placement.arithmetic():
            return score_matrix(self.matcher.model, images, texts).float()


def open_indexed_model(index_dir: Path | str, checkpoint: Path | str | None, *, verify: bool,
                       device: str | torch.device, precision: str, trust_modified: bool) -> IndexedModel:
    """Load an index and its model (`checkpoint`, a path or a shipped name; default the one the index records),
    refusing another model than the index's."""
    from itmatch.pretrained import resolve_checkpoint  # (a path, or a pretrained model's name)

    index = load_index(index_dir, verify=verify)
    ckpt = resolve_checkpoint(checkpoint) if checkpoint is not None else index.checkpoint()
    backbone, identity = index.manifest["model"]["backbone"], None
    with contextlib.suppress(FileNotFoundError):  # (no checkpoint files: the loader below says what is missing)
        identity = model_identity(ckpt, backbone)
    if identity is not None and not same_image_encoder(index.manifest["model"], identity):
        # another model is said to be one before it is loaded with the index's backbone, which the loader would
        # refuse first (a backbone the model was not trained on); a damaged checkpoint is the loader's to say
        index.check_model(identity)
    matcher = load(ckpt, backbone=backbone, device=device, precision=precision, trust_modified=trust_modified)
    index.check_model(identity or model_identity(ckpt, matcher.backbone_name))
    head = matcher.model.head
    with torch.inference_mode():
        images = index.image_emb().to(matcher.device)
        if not index.vectors_only:  # (an index of vectors alone holds them prepared)
            images = head.prepare_images(images)
    if head.pair_independent and not index.vectors_only:
        # an index written before 2026-12-05 holds such a model's regions too: searched as it is, from its vectors
        log.info("%s holds regions its model never reads; `%s` rewrites it without them, from its stored "
                 "features", public_id(str(index.root)), index_command(index.root, index.manifest))
        images = images.vectors_only()
    return IndexedModel(index, matcher, images)


def ensemble_of(members: list[IndexedModel]) -> list[IndexedModel]:
    """The members with every one's rows in the first's order (`aligned`); ConfigError where two were built with the
    same model (it would only weigh that model twice)."""
    for n, member in enumerate(members):
        for earlier in members[:n]:
            if same_model(earlier.index.manifest["model"], member.index.manifest["model"]):
                raise ConfigError(f"the ensemble names one model twice: {public_id(str(member.index.root))} was built "
                                  f"with the same model as {public_id(str(earlier.index.root))} ({earlier.name})",
                                  hint="give each model's index once: an ensemble averages different models' scores")
    return [members[0], *(aligned(members[0], member) for member in members[1:])]


def aligned(first: IndexedModel, other: IndexedModel) -> IndexedModel:
    """`other` with its rows in `first`'s order, so that row r is the same photo in both; DataError unless the two
    indexes hold the same photos (the same names with the same contents)."""
    mine = {e["id"]: e["sha256"] for e in first.index.images}
    theirs = {e["id"]: e["sha256"] for e in other.index.images}
    lacks = [i for i in mine if i not in theirs]
    extra = [i for i in theirs if i not in mine]
    changed = [i for i in mine if i in theirs and theirs[i] != mine[i]]
    differences = [(what, ids) for what, ids in ((f"lacks {len(lacks)} of its photos", lacks),
                                                 (f"holds {len(extra)} it lacks", extra),
                                                 (f"holds {len(changed)} with other contents", changed)) if ids]
    if differences:
        same_folder = {**other.index.manifest, "images_root": first.index.manifest["images_root"]}
        said = "; ".join(f"{what} ({', '.join(public_id(i) for i in ids[:SHOWN])}{', ...' if len(ids) > SHOWN else ''})"
                         for what, ids in differences)
        raise DataError(f"the ensemble's indexes hold different photos: against {public_id(str(first.index.root))}, "
                        f"this one {said}", path=other.index.root,
                        hint="index the same photo folder with each model (again after the photos change; an index "
                             f"updates in place): {index_command(first.index.root, first.index.manifest)}, then "
                             f"{index_command(other.index.root, same_folder)}")
    row = {i: n for n, i in enumerate(theirs)}
    order = [row[i] for i in mine]
    if order == list(range(len(order))):
        return other
    return replace(other, images=other.images.take(torch.tensor(order, dtype=torch.long)))
