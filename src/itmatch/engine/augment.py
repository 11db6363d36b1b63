"""Training-time augmentation of cached region features: region dropout, VSE∞'s "size augmentation" (Chen et
al., "Learning the Best Pooling Strategy for Visual Semantic Embedding", CVPR 2021: each training
image keeps a random subset of its regions, each dropped with probability 0.2). With frozen features every epoch
shows a model the same cells of an image; dropping some of them is the cheapest way to show it another view.

It is a mask, not a gather: a dropped region is marked padding in the batch's region mask, which every image
encoder that declares `reads_region_mask` treats exactly as a region that is not there (tests/engine/
test_augment.py checks each such model against the same images with those regions removed). The draw uses the
global torch generator of the features' device, like dropout, so a resumed run draws the same masks
(train.py saves those generators in `last/`)."""

from __future__ import annotations

import torch

from itmatch.config import Config
from itmatch.errors import ConfigError
from itmatch.models.base import ImageInput, Matcher


def region_keep_mask(feats: torch.Tensor, p: float) -> torch.Tensor:
    """[N, k] bool, True on the regions an image keeps: each of its k regions is dropped independently with
    probability `p`; an image that would lose all of them keeps one, drawn at random, so that every image
    still has an embedding."""
    n, k = feats.shape[:2]
    draws = torch.rand(n, k, device=feats.device)
    keep = draws >= p
    # the region with the largest draw is a uniformly random one, and kept whenever any region is
    keep[torch.arange(n, device=feats.device), draws.argmax(1)] = True
    return keep


def training_region_mask(model: Matcher, images: ImageInput, cfg: Config) -> torch.Tensor | None:
    """The region mask of a training batch's images: None (all regions real) unless train.region_dropout is
    set, the model is training and the images are cached region features [N, k, C] (check_region_dropout has
    refused every other input when the run started)."""
    p = cfg.train.region_dropout
    if not (p and model.training and isinstance(images, torch.Tensor) and images.ndim == 3):
        return None
    return region_keep_mask(images, p)


def check_region_dropout(cfg: Config, model: Matcher) -> None:
    """train.region_dropout needs cached region features read by an encoder that honours the region mask:
    refused at the start of a run, before anything is written, with what to change."""
    if not cfg.train.region_dropout:
        return
    if cfg.train.finetune_backbone or cfg.model.pixels:
        raise ConfigError("train.region_dropout drops cached region features; this run reads pixels "
                          "(train.finetune_backbone / model.pixels), whose grid the CNN makes inside the model",
                          hint="train on cached features (itmatch extract) or set train.region_dropout=0")
    if not getattr(model.image_encoder, "reads_region_mask", False):
        encoder = type(model.image_encoder).__name__
        raise ConfigError(f"train.region_dropout: the {cfg.model.arch} image encoder ({encoder}) reads every cell "
                          "of the grid, masked or not, so a dropped region would still be seen",
                          hint="set train.region_dropout=0 for this model")
