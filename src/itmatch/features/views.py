"""Augmented views of the photos: the random crop and flip that pixel-input training draws afresh each step
(`data/images.py`), and the fixed, numbered views of it that `itmatch extract --view K` turns into features once,
so that a frozen-feature model can train on augmented images at the cost of an extraction per view
(`data.train_views`, `data/views.py`; docs/training.md "Augmented views").

View K of a photo is a function of (K, the photo's id) alone: re-extracting, resuming or extracting on another
machine gives the same crop. View 0 is the photo itself (the deterministic preprocessing every split uses).
"""

from __future__ import annotations

import math
import random
from typing import Any

from PIL import Image, ImageOps

#: the crop: a fraction of the photo's area drawn uniformly in CROP_AREA, an aspect ratio log-uniform in
#: CROP_RATIO; then a horizontal flip with probability FLIP
CROP_AREA = (0.5, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
FLIP = 0.5


def random_crop_flip(image: Image.Image, rng: random.Random, area: tuple[float, float] = CROP_AREA,
                     ratio: tuple[float, float] = CROP_RATIO, flip: float = FLIP) -> Image.Image:
    """A random crop (fraction of the area in `area`, aspect ratio in `ratio`, log-uniform) and a
    horizontal flip with probability `flip` of an upright image (`pipeline.decode_image`); falls back to
    the whole image when no crop fits."""
    w, h = image.size
    for _ in range(10):
        target = rng.uniform(*area) * w * h
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
            image = image.crop((x, y, x + cw, y + ch))
            break
    if rng.random() < flip:
        image = ImageOps.mirror(image)
    return image


def view_of(image: Image.Image, view: int, image_id: str) -> Image.Image:
    """View `view` of the photo `image_id` (0: the photo itself; K >= 1: its K-th random crop and flip, drawn from
    an RNG seeded with (K, image_id) only)."""
    if view < 0:
        raise ValueError(f"a view is a whole number >= 0, got {view}")
    return image if view == 0 else random_crop_flip(image, random.Random(f"view/{view}/{image_id}"))


def view_meta(view: int) -> dict[str, Any]:
    """What meta.json records of an augmented view's extraction (nothing for view 0, so that the records and the
    fingerprints of every extraction made before views existed stay as they were)."""
    if view == 0:
        return {}
    return {"view": view, "view_augmentation": {"crop_area": list(CROP_AREA), "crop_aspect_ratio": list(CROP_RATIO),
                                                "flip": FLIP, "seed": f"view/{view}/IMAGE_ID"}}
