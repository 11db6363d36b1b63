"""Open a dataset split in the form a model's image encoder reads (registry.image_inputs): the precomp
feature array, cached multi-scale stage maps, or image files for pixel-input models."""

from __future__ import annotations

from pathlib import Path

from itmatch.config import Config, get_key
from itmatch.data.precomp import META_NAME, MultiScaleArray, PrecompSplit, read_meta, read_precomp
from itmatch.data.views import with_views
from itmatch.errors import ConfigError, DataError
from itmatch.models.registry import arch, image_inputs, pixel_backbone


def open_split(cfg: Config, split: str, *, train: bool = False, data_path: str | None = None) -> PrecompSplit:
    """`split` of `data_path` (default cfg.data.path) for the model of `cfg`; `train` turns on the
    training augmentation of pixel inputs (evaluation is deterministic)."""
    root = data_path or cfg.data.path
    inputs = image_inputs(cfg.model)
    if inputs == ("pixels",):
        from itmatch.data.images import read_image_split

        if not cfg.data.images:
            raise ConfigError("this model reads images: data.images (the images folder) is not set",
                              hint="pass --set data.images=DIR (the files named in {split}_ids.txt)")
        return read_image_split(root, split, cfg.data.images, pixel_backbone(cfg.model), augment=train,
                                seed=cfg.train.seed)
    opened = read_precomp(root, split, scales=inputs)
    return with_views(opened, cfg.data.train_views, cfg.train.seed) if train else opened


def image_dims(cfg: Config, split: PrecompSplit) -> dict[str, int]:
    """The channel counts of `split`'s image inputs, by the config key of the model of `cfg` that holds each
    (model.img_dim, and the keys of `Arch.feature_dims`, e.g. SAVE's c3/c4 channels)."""
    images = split.images
    if isinstance(images, MultiScaleArray):
        dims = images.dims
    elif hasattr(images, "load_batch"):  # image files: the model's own backbone fixes the channels
        from itmatch.features.backbones import backbone_spec

        dims = {"c5": backbone_spec(pixel_backbone(cfg.model)).out_dim}
    else:
        dims = {"c5": int(images.shape[2])}
    wanted = arch(cfg.model).feature_dims(cfg.model)
    return {wanted[scale]: dim for scale, dim in dims.items()}


def fill_image_dims(cfg: Config, split: PrecompSplit) -> None:
    """Set the channel counts the model's config takes from the data (image_dims); a conflicting override is an
    error, and so is a region count other than the one the model reads (Arch.regions_key: found by the first
    batch, after the run directory was written, until 2026-11-27)."""
    regions_key = arch(cfg.model).regions_key(cfg.model)
    shape = getattr(split.images, "shape", None)  # (the precomp array: N x regions x channels)
    if regions_key is not None and shape is not None and get_key(cfg, regions_key) != shape[1]:
        raise ConfigError(f"{regions_key}={get_key(cfg, regions_key)} but the features have {shape[1]} regions an "
                          "image", hint=f"extract 7x7 grid features (e.g. EfficientNet-Lite0 at 224 px), or set "
                                        f"{regions_key}={shape[1]} if this many cells in row-major order is intended")
    for key, dim in image_dims(cfg, split).items():
        parent, name = key.rsplit(".", 1)
        holder = get_key(cfg, parent)
        current = getattr(holder, name)
        if current and current != dim:
            raise ConfigError(f"{key}={current} but the features are {dim}-d",
                              hint=f"drop the override; {key} is taken from the data")
        setattr(holder, name, dim)


def data_backbone(root: str | Path) -> str:
    """The backbone that extracted a precomp directory's features, as its meta.json records it ("" if none)."""
    return str((read_meta(root) or {}).get("backbone", ""))


def check_image_features(cfg: Config, split: PrecompSplit) -> None:
    """A trained model against the features of `split` (evaluation): the backbone that extracted them, then their
    channel counts; a DataError naming both. (The channels alone do not tell: Lite0's 7 x 7 and Lite2's 9 x 9
    cells are both 1280-d, and a Lite0 model scored Lite2's without a word.)"""
    found = data_backbone(split.root)
    if image_inputs(cfg.model) != ("pixels",) and cfg.data.backbone and found and found != cfg.data.backbone:
        raise DataError(f"the {split.split!r} features here were extracted with {found}, but the checkpoint's model "
                        f"was trained on {cfg.data.backbone} features", path=split.root / META_NAME,
                        hint="evaluate on the data directory the checkpoint was trained on (its data.path, the "
                             f"default), or on an extraction with --backbone {cfg.data.backbone}")
    for key, dim in image_dims(cfg, split).items():
        wanted = get_key(cfg, key)
        if wanted != dim:
            raise DataError(f"the {split.split!r} features here are {dim}-d but the checkpoint's model reads "
                            f"{wanted}-d ones ({key}): they come from another backbone or layer", path=split.root,
                            hint="evaluate on the data directory the checkpoint was trained on (its data.path, the "
                                 "default), or on an extraction with its data.backbone")
