"""Image files as a split's `images`, for models that read pixels (SAVE end to end).

`ImageFiles` behaves like the precomp feature array (len, [i], [i:j]) but decodes files on access: the image
pipeline's deterministic resize in evaluation, a random crop and flip before it in training. The rules, and
what happens to a file that cannot be decoded: docs/save.md ('Decisions where the paper is silent', 'Bad input').
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from itmatch.data.precomp import PrecompSplit, ids_path, read_lines, read_text_side
from itmatch.errors import DataError
from itmatch.features.backbones import backbone_spec
from itmatch.features.pipeline import UnreadableImage, decode_image, preprocess
from itmatch.features.views import random_crop_flip

log = logging.getLogger("itmatch.data")


class ImageFiles:
    """Lazily decoded images of a split: `files[i]` -> float32 [3, S, S] (normalised for `backbone`),
    or None for an unreadable file when `augment` (training); `files[i:j]` -> ImageFiles of those;
    `load_batch()` -> [n, 3, S, S] tensor of all of them (deterministic; raises on a bad file).

    The training augmentation's RNG: `files[i]` draws from one RNG seeded with `seed` (each copy of the object
    has its own, e.g. in every DataLoader worker); `files.draw(i, key)` from an RNG seeded with (seed, *key)
    alone, which the trainer uses (key: epoch, caption index), so that crops depend on neither the process
    nor what it decoded before."""

    def __init__(self, images_dir: str | Path, ids: Sequence[str], backbone: str = "lite0", *,
                 augment: bool = False, seed: int = 0) -> None:
        self.images_dir, self.ids = Path(images_dir), list(ids)
        self.backbone, self.augment = backbone, augment
        spec = backbone_spec(backbone)
        self.family, self.size = spec.family, spec.image_size
        self.seed = seed
        self.rng = random.Random(seed)
        self.reported: set[str] = set()

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self.ids), 3, self.size, self.size)

    def load(self, index: int, augment: bool | None = None, rng: random.Random | None = None) -> torch.Tensor | None:
        augment = self.augment if augment is None else augment
        path = self.images_dir / self.ids[index]
        try:
            image = decode_image(path)
        except UnreadableImage as exc:
            reason = exc.reason
            if not augment:
                raise DataError(f"{reason} (image {self.ids[index]!r})", path=path,
                                hint="evaluation needs every image of the split: replace the file, or "
                                     "re-extract the split with --skip-bad-images to drop it") from None
            if str(path) not in self.reported:
                self.reported.add(str(path))
                log.warning("skipping the captions of an unreadable training image: %s (%s)", path, reason)
            return None
        if augment:
            image = random_crop_flip(image, self.rng if rng is None else rng)
        return preprocess(image, self.family, self.size)

    def draw(self, index: int, key: tuple[int, ...]) -> torch.Tensor | None:
        """Image `index` as `files[index]`, its augmentation drawn from an RNG seeded with (seed, *key) only."""
        return self.load(index, rng=random.Random("/".join(map(str, (self.seed, *key)))))

    def __getitem__(self, index: int | slice) -> torch.Tensor | None | ImageFiles:
        if isinstance(index, slice):
            sub = ImageFiles(self.images_dir, self.ids[index], self.backbone, augment=self.augment, seed=self.seed)
            sub.rng, sub.reported = self.rng, self.reported
            return sub
        return self.load(index)

    def load_batch(self) -> torch.Tensor:
        """Every image of this (slice of the) split, deterministic preprocessing: [n, 3, S, S]."""
        return torch.stack([self.load(i, augment=False) for i in range(len(self))])


def read_image_split(root: str | Path, split: str, images_dir: str | Path, backbone: str = "lite0", *,
                     augment: bool = False, seed: int = 0) -> PrecompSplit:
    """A split whose `images` are the files named by `{split}_ids.txt` in `images_dir` (captions from
    `{split}_caps.txt`), for pixel-input models; no feature array is needed."""
    images_dir = Path(images_dir)
    if not images_dir.is_dir():
        raise DataError("images folder not found", path=images_dir,
                        hint="set data.images to the folder holding the files named in {split}_ids.txt")
    ipath = ids_path(root, split)
    ids = read_lines(ipath)
    missing = [i for i in ids if not (images_dir / i).is_file()]
    if missing and not augment:
        raise DataError(f"{len(missing)} of {len(ids)} images of split {split!r} are not in {images_dir}, "
                        f"e.g. {missing[0]!r}", path=images_dir / missing[0],
                        hint="evaluation needs every image: check data.images")
    captions, ids = read_text_side(root, split, len(ids))
    files = ImageFiles(images_dir, ids, backbone, augment=augment, seed=seed)
    return PrecompSplit(Path(root), split, files, captions, ids)

