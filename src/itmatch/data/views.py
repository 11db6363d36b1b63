"""Training on augmented views of the photos with frozen features (`data.train_views`).

Each view is a precomp directory of the training split extracted from the K-th random crop and flip of every photo
(`itmatch extract --view K`, features/views.py). In training, each caption's image is drawn from the photo itself and
its views, uniformly, with an RNG seeded from (train.seed, epoch, caption index) alone: a resumed run, a DataLoader
worker and a second process draw the same view. Evaluation and selection never see a view (the dev and test splits
are the photos themselves). docs/training.md "Augmented views".
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import numpy as np

from itmatch.data.precomp import META_NAME, PrecompSplit, features_path, ids_path, read_meta, read_precomp
from itmatch.errors import ConfigError, DataError


class FeatureViews:
    """A training split's feature array and its augmented views, read like the array itself (len, shape, [i],
    [i:j]: the photos' own features) plus `draw(i, (epoch, j))`: image i as one of the 1 + len(views) arrays,
    chosen by (seed, epoch, j) only."""

    def __init__(self, photos: np.ndarray, views: list[np.ndarray], seed: int = 0) -> None:
        self.arrays = [photos, *views]
        self.seed = seed

    @property
    def shape(self) -> tuple[int, ...]:
        return self.arrays[0].shape

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, index: int | slice) -> np.ndarray | FeatureViews:
        if isinstance(index, slice):
            return FeatureViews(self.arrays[0][index], [a[index] for a in self.arrays[1:]], self.seed)
        return self.arrays[0][index]

    def view_index(self, key: tuple[int, ...]) -> int:
        """Which array (0: the photos) the draw of `key` reads."""
        return random.Random("/".join(map(str, ("views", self.seed, *key)))).randrange(len(self.arrays))

    def draw(self, index: int, key: tuple[int, ...]) -> np.ndarray:
        return self.arrays[self.view_index(key)][index]


def view_roots(spec: str) -> list[Path]:
    """The directories of `data.train_views` (comma-separated; blanks around the commas ignored)."""
    return [Path(part.strip()) for part in spec.split(",") if part.strip()]


def with_views(train: PrecompSplit, spec: str, seed: int) -> PrecompSplit:
    """`train` (the photos' own training split) with the views of `spec` (data.train_views) to draw from; each view
    directory must hold an augmented view (meta.json `view` >= 1) of the same backbone and the same images in the
    same order, each view once."""
    roots = view_roots(spec)
    if not roots:
        return train
    if not isinstance(train.images, np.ndarray):
        raise ConfigError("data.train_views is for models that read one precomp feature array (it is not for "
                          "multi-scale maps or image files)",
                          hint="unset data.train_views, or fine-tune from pixels (train.finetune_backbone), which "
                               "draws its crops afresh")
    base_meta = read_meta(train.root) or {}
    seen: dict[int, Path] = {}
    arrays = []
    for root in roots:
        meta = read_meta(root)
        where = root / META_NAME
        if meta is None:
            raise DataError("not a directory `itmatch extract` wrote (no meta.json)", path=where,
                            hint="extract the view with `itmatch extract IMAGES CAPTIONS --out DIR --splits "
                                 f"{train.split} --view K`")
        view = meta.get("view", 0)
        if not isinstance(view, int) or view < 1:
            raise DataError("holds the photos' own features, not an augmented view (meta.json has no view >= 1)",
                            path=where, hint="extract a view with `itmatch extract ... --view K` (K >= 1) into "
                                             "its own --out and list that directory in data.train_views")
        if view in seen:
            raise ConfigError(f"data.train_views lists view {view} twice ({seen[view]} and {root})",
                              hint="list each view once: a repeated view would be drawn twice as often")
        seen[view] = root
        for key in ("backbone", "image_size", "normalisation"):
            if base_meta and meta.get(key) != base_meta.get(key):
                raise DataError(f"view {view} was extracted with {key} {meta.get(key)!r}, the training features "
                                f"in {train.root} with {base_meta.get(key)!r}", path=where,
                                hint=f"extract the views with the options of {train.root} (e.g. the same "
                                     "--backbone)")
        split = read_precomp(root, train.split)
        if split.ids != train.ids:
            raise DataError(f"view {view}'s {train.split} split lists other images (or another order) than "
                            f"{train.root}", path=ids_path(root, train.split),
                            hint="extract the view from the same captions and photos as the training features")
        if split.images.shape != train.images.shape:
            raise DataError(f"view {view}'s features are {list(split.images.shape)}, the training features "
                            f"{list(train.images.shape)}", path=features_path(root, train.split),
                            hint="extract the view with the backbone of the training features")
        arrays.append(split.images)
    return replace(train, images=FeatureViews(train.images, arrays, seed))
