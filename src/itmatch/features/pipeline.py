"""The one image pipeline: a file, its bytes or a PIL image -> upright RGB -> the backbone's input pixels ->
grid features on the host.

Extraction, the index, the Python API, the service's uploads and models that read pixels (`data/images.py`) all
go through it, so one photo gives the same numbers everywhere (bit for bit at the same batch size:
tests/features/test_image_pipeline.py; where it sits: docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import ExifTags, Image, ImageFile, ImageOps
from torch import nn

from itmatch.device import Placement, module_device
from itmatch.errors import DataError

#: the photo formats itmatch looks for: the files `itmatch index` takes from a folder, and the endings that make a str
#: query of `ImageTextMatcher.rank` a photo's path
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"})
#: What PIL raises for a file it cannot decode (OSError covers UnidentifiedImageError and truncated files).
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)

# EfficientNet-Lite weights were trained in TensorFlow, whose Lite input pipeline normalises 0..255 RGB
# pixels with mean 127 and std 128 for every channel (efficientnet_lite_builder.py: MEAN_RGB = 127,
# STDDEV_RGB = 128) instead of the usual ImageNet mean/std; the converted PyTorch weights expect the
# same input; a check of the ImageNet predictions with both confirms the TF constants (docs/training.md,
# 'Features').
_LITE_MEAN, _LITE_STD = 127.0, 128.0
# torchvision ResNets: 0..1 RGB, ImageNet mean/std.
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


class UnreadableImage(DataError):
    """An image that is missing (`missing`) or cannot be decoded; `reason` says which, in a few words."""

    def __init__(self, reason: str, path: str | Path, *, missing: bool) -> None:
        self.reason, self.missing = reason, missing
        super().__init__(reason, path=path, hint="replace or delete the file (JPEG, PNG, WebP, GIF, BMP or TIFF)")


@contextlib.contextmanager
def strict_decoding() -> Iterator[None]:
    """Within the block PIL raises on a truncated image instead of silently padding it with grey (a global
    PIL setting: set once around a whole run, not per image, so that threads do not race on it)."""
    previous = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        yield
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = previous


def decode_threads(device: torch.device | str) -> int:
    """Host threads that decode photos while the network runs on those before them (`itmatch extract`, `itmatch
    index`). A network on the host's cores needs them: one thread, overlapping the next batch with it, as before
    (a second one gained nothing on 2 cores: bench/decode_speed.py). A network on a GPU leaves the cores free and
    outruns one thread: one a core, up to 8 (PIL's decoder and resize release the GIL, the normalisation is
    NumPy's). Not yet timed on a GPU: one thread extracted Flickr8K's 8,091 photos in 101 s on an H100."""
    return 1 if torch.device(device).type == "cpu" else max(1, min(8, os.cpu_count() or 1))


def upright_rgb(image: Image.Image) -> Image.Image:
    """EXIF orientation applied (a phone photo stored sideways comes out as shown), then any mode (greyscale,
    CMYK, palette, alpha) converted to 3-channel RGB."""
    if image.getexif().get(ExifTags.Base.Orientation, 1) != 1:  # (else exif_transpose would only copy it)
        image = ImageOps.exif_transpose(image)
    return image if image.mode == "RGB" else image.convert("RGB")


def decode_image(source: str | Path | bytes, admit: Callable[[Image.Image], None] | None = None) -> Image.Image:
    """An image file (a path) or its bytes, decoded to upright RGB (`upright_rgb`); the file is closed on
    return. A missing file or one PIL cannot decode raises UnreadableImage naming it (caused by PIL's error).
    `admit`, if given, sees the opened image before its pixels are decoded (its header: format, size) and
    raises to refuse it (the service's upload limits)."""
    path = "<bytes>" if isinstance(source, bytes) else source
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as im:
            if admit is not None:
                admit(im)
            im.load()
            return upright_rgb(im)
    except FileNotFoundError:
        raise UnreadableImage("image file not found", path, missing=True) from None
    except DECODE_ERRORS as exc:
        raise UnreadableImage(f"cannot read image: {exc}", path, missing=False) from exc


def to_pixels(image: Image.Image, size: int) -> np.ndarray:
    """The resize rule of every backbone: upright RGB (`upright_rgb`), bilinear resize to size x size (the
    aspect ratio is not kept: every part of the photo stays in view) -> float32 [3, size, size] on 0..255."""
    image = upright_rgb(image)
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BILINEAR)
    return np.ascontiguousarray(np.asarray(image, dtype=np.float32).transpose(2, 0, 1))  # [3, H, W]


def normalise_pixels(family: str, pixels: np.ndarray) -> np.ndarray:
    """0..255 RGB float32 [..., 3, H, W] -> the input a backbone family ("efficientnet-lite" | "resnet") was
    trained on, in float32 (bit for bit the torch formula it replaces: tests/features/test_features.py). NumPy, not
    torch: this runs on the threads that decode photos beside the network (`decode_threads`), where each torch op
    would start an OpenMP team of its own, as many threads as the host has cores, per decode thread."""
    if family == "efficientnet-lite":
        return (pixels - np.float32(_LITE_MEAN)) / np.float32(_LITE_STD)
    mean = np.asarray(_IMAGENET_MEAN, dtype=np.float32).reshape(3, 1, 1)
    std = np.asarray(_IMAGENET_STD, dtype=np.float32).reshape(3, 1, 1)
    return (pixels / np.float32(255.0) - mean) / std


def preprocess(image: Image.Image, family: str, size: int) -> torch.Tensor:
    """One PIL image -> the normalised float32 input [3, size, size] of a backbone of `family` (deterministic)."""
    return torch.from_numpy(normalise_pixels(family, to_pixels(image, size)))


def grid_features(backbone: nn.Module, pixels: torch.Tensor, placement: Placement | None = None,
                  stages: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """One batched forward of preprocessed pixels [B, 3, S, S] (on the host) through `backbone` on its device,
    in `placement`'s precision (default: fp32, no autocast) -> {"c5": [B, grid*grid, out_dim]} plus the finer
    stage maps named in `stages` ("c3", "c4") as [B, h*w, C], every one float32 on the host, regions row-major.

    With stages, one pass computes them all (`Backbone.stage_maps`; its c5 is the same map `forward` flattens)."""
    # without a placement the caller's own autocast (if any) applies
    arithmetic = placement.arithmetic() if placement is not None else contextlib.nullcontext()
    with torch.inference_mode(), arithmetic:
        x = pixels.to(module_device(backbone))
        if not stages:
            return {"c5": backbone(x).float().cpu()}
        maps = backbone.stage_maps(x)
        return {s: maps[s].flatten(2).transpose(1, 2).float().cpu() for s in dict.fromkeys((*stages, "c5"))}
