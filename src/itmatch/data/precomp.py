"""SCAN "precomp" layout: {split}_ims.npy [N, k, D] float32, {split}_caps.txt (5 per image, captions
5i..5i+4 describe image i) and {split}_ids.txt (one image id per line; optional on read).

itmatch addition: {split}_extra_caps.tsv (optional, `itmatch extract --extra-captions keep`), the captions
of images that have more than 5, one `ROW<TAB>caption` a line (ROW: the image's row in {split}_ims.npy).
Training pairs them with their image like the others; evaluation keeps the protocol's 5 per image."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from itmatch.data.caption_hints import not_utf8
from itmatch.data.captions import CAPTIONS_PER_IMAGE
from itmatch.errors import DataError
from itmatch.io import file_sha256, write_text_atomic

SPLITS = ("train", "dev", "test", "testall")


def features_path(root: str | Path, split: str) -> Path:
    return Path(root) / f"{split}_ims.npy"


def scale_path(root: str | Path, split: str, scale: str) -> Path:
    """Cached backbone stage map of a multi-scale dataset (SAVE): c5 is the main `{split}_ims.npy`
    (the final grid), the finer maps sit beside it as `{split}_ims_c3.npy`, `{split}_ims_c4.npy`,
    each float32 [N, h*w, C] in row-major cell order."""
    return features_path(root, split) if scale == "c5" else Path(root) / f"{split}_ims_{scale}.npy"


def captions_path(root: str | Path, split: str) -> Path:
    return Path(root) / f"{split}_caps.txt"


def extra_captions_path(root: str | Path, split: str) -> Path:
    return Path(root) / f"{split}_extra_caps.tsv"


def ids_path(root: str | Path, split: str) -> Path:
    return Path(root) / f"{split}_ids.txt"


META_NAME = "meta.json"


def partial_path(root: str | Path, split: str) -> Path:
    """The main array of a split being extracted (renamed to `{split}_ims.npy` once every image is done)."""
    return Path(root) / f"{split}_ims.npy.partial"


def shards_root(root: str | Path, split: str) -> Path:
    """Where the torchrun ranks of `itmatch extract` write their shares of `split` (removed once meta.json
    records the split)."""
    return Path(root) / f".shards-{split}"


def progress_path(root: str | Path, split: str) -> Path:
    """The extractor's progress file of a split being extracted or updated (gone once it is complete)."""
    return Path(root) / f"{split}.progress.json"


def read_meta(root: str | Path) -> dict | None:
    """The meta.json `itmatch extract` wrote in `root`; None for directories it did not write (hand-made or SCAN's
    own precomp files)."""
    meta = Path(root) / META_NAME
    if not meta.is_file():
        return None
    try:
        data = json.loads(meta.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise DataError("corrupt meta.json", path=meta, hint="re-extract, or delete it for hand-made data") from None
    return data if isinstance(data, dict) and data.get("format") == "itmatch-precomp" else None


def split_manifest(root: Path, split: str) -> dict | None:
    """What `itmatch extract` recorded about a split in meta.json (its manifest, written last); None for
    directories not written by the extractor (hand-made or SCAN's own precomp files)."""
    data = read_meta(root)
    if data is None:
        if not (root / META_NAME).exists() and progress_path(root, split).exists():  # (hand-made data has none)
            raise DataError(f"split {split!r} is being extracted, or its first extraction did not finish",
                            path=progress_path(root, split), hint="rerun the same `itmatch extract` command; it "
                                                                  "resumes")
        return None
    meta = root / META_NAME
    splits = data.get("splits")
    info = splits.get(split) if isinstance(splits, dict) else None
    if isinstance(info, dict):
        return info
    if extraction_started(root, split):
        raise DataError(f"split {split!r} is not recorded as complete in meta.json: its extraction did not "
                        f"finish", path=meta, hint="rerun the same `itmatch extract` command; it resumes")
    # never extracted: rerunning cannot help; the split name is wrong, or the captions have no such rows
    has = [s for s in splits if isinstance(splits[s], dict)] if isinstance(splits, dict) else []
    close = difflib.get_close_matches(split, has, n=1, cutoff=0.6)
    meant = f"did you mean {close[0]!r}? " if close else ""
    other = close[0] if close else (has[0] if has else "SPLIT")
    raise DataError(f"split {split!r} is not in this dataset (meta.json has: {', '.join(has) or 'no split'})",
                    path=meta, hint=f"{meant}use a split it has (itmatch evaluate --split {other}; itmatch train "
                                    f"--set data.val_split={other}, or data.train_split={other}), or extract "
                                    f"{split!r} into this directory: `itmatch extract` with caption rows of split "
                                    f"{split!r} (a CSV split column, or --default-split {split})")


def extraction_started(root: Path, split: str) -> bool:
    """Did an `itmatch extract` run start on `split` in `root` (its progress file, partial or final arrays,
    torchrun shares or caption files are there), so that a split meta.json does not record is unfinished
    rather than never extracted?"""
    traces = (progress_path(root, split), features_path(root, split), partial_path(root, split),
              captions_path(root, split), shards_root(root, split))
    return any(p.exists() for p in traces)


def read_lines(path: Path) -> list[str]:
    """Lines without their newline; a missing final newline is fine (f30k test_caps lacks one)."""
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError("file not found", path=path,
                        hint="check the dataset directory, or run `itmatch extract` to create it") from None
    except UnicodeDecodeError:
        raise not_utf8(path, in_place=True) from None


class MultiScaleArray:
    """Several per-image arrays of one split (cached stage maps, {scale: [N, k_s, C_s]}) indexed as one:
    `a[i]` is {scale: [k_s, C_s]}, `a[i:j]` a lazy MultiScaleArray of those rows, len(a) = N.
    `batch_tensor` turns a slice into what `Matcher.encode_images` takes (a dict of tensors)."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        sizes = {k: int(v.shape[0]) for k, v in arrays.items()}
        if not arrays or len(set(sizes.values())) != 1:
            raise DataError(f"multi-scale arrays of different lengths: {sizes}",
                            hint="re-extract the split with `itmatch extract --scales ...`")
        self.arrays = arrays

    def __len__(self) -> int:
        return int(next(iter(self.arrays.values())).shape[0])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    @property
    def dims(self) -> dict[str, int]:
        return {k: int(v.shape[2]) for k, v in self.arrays.items()}

    def __getitem__(self, index: int | slice) -> dict[str, np.ndarray] | MultiScaleArray:
        if isinstance(index, slice):
            return MultiScaleArray({k: v[index] for k, v in self.arrays.items()})
        return {k: v[index] for k, v in self.arrays.items()}


#: what a split's `images` may be: one [N, k, D] array, cached multi-scale maps, or lazily decoded image
#: files (itmatch.data.images.ImageFiles); all support len(), [i] and [i:j].
ImageSource = Any


def batch_tensor(images: ImageSource) -> torch.Tensor | dict[str, torch.Tensor]:
    """A slice of a split's images -> the tensor(s) `Matcher.encode_images` takes."""
    if isinstance(images, MultiScaleArray):
        return {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in images.arrays.items()}
    if hasattr(images, "load_batch"):  # ImageFiles: decodes and preprocesses the images
        return images.load_batch()
    return torch.from_numpy(np.array(images, dtype=np.float32))


@dataclass
class PrecompSplit:
    """One split of a precomp dataset. `images` is memory-mapped (or a MultiScaleArray of memory-mapped
    stage maps, or ImageFiles for pixel-input models); captions are strings."""

    root: Path
    split: str
    images: ImageSource  # [N, k, D] float32, memory-mapped
    captions: list[str]
    ids: list[str]
    per_image: int = CAPTIONS_PER_IMAGE
    # (image row, caption): captions beyond per_image kept for training (`{split}_extra_caps.tsv`)
    extra: list[tuple[int, str]] = field(default_factory=list)

    @property
    def n_images(self) -> int:
        return int(self.images.shape[0])

    @property
    def training_captions(self) -> list[str]:
        """Every caption training pairs with an image: `captions` (caption j describes image j // per_image)
        then the extra ones (caption len(captions) + e describes image extra[e][0])."""
        return self.captions + [caption for _, caption in self.extra]

    def image_of(self, j: int) -> int:
        """The image row of training caption j (an index into `training_captions`)."""
        return j // self.per_image if j < len(self.captions) else self.extra[j - len(self.captions)][0]

    def __len__(self) -> int:
        return len(self.captions)

    def head(self, n_images: int) -> PrecompSplit:
        """The first `n_images` images and their captions (SCAN evaluates dev on the first 1000)."""
        return self.slice(0, min(n_images, self.n_images))

    def slice(self, start: int, stop: int) -> PrecompSplit:
        """Images [start, stop) and their captions, e.g. one COCO 1K fold."""
        p = self.per_image
        extra = [(row - start, caption) for row, caption in self.extra if start <= row < stop]
        return PrecompSplit(self.root, self.split, self.images[start:stop],
                            self.captions[p * start:p * stop], self.ids[start:stop], p, extra)


def _open_features(fpath: Path, split: str, check_finite: bool, hint: str, manifest: dict | None = None,
                   verify_checksum: bool = False) -> np.ndarray:
    """One memory-mapped float32 [N, k, D] feature array, validated; `manifest` (the split's meta.json
    entry, for the main array) adds the size, image count and optionally SHA-256 checks."""
    if not fpath.is_file():
        raise DataError(f"no features for split {split!r}", path=fpath, hint=hint)
    if manifest is not None:
        size = manifest.get("features_bytes")
        if isinstance(size, int) and fpath.stat().st_size != size:
            raise DataError(f"{fpath.stat().st_size} bytes, meta.json recorded {size}: the file was truncated or "
                            f"replaced", path=fpath, hint="re-extract this split (itmatch extract --force)")
        digest = manifest.get("features_sha256")
        if verify_checksum and isinstance(digest, str) and file_sha256(fpath) != digest:
            raise DataError("SHA-256 differs from meta.json: the file was modified or damaged", path=fpath,
                            hint="re-extract this split (itmatch extract --force)")
    try:
        images = np.load(fpath, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise DataError(f"not a readable .npy array ({exc})", path=fpath,
                        hint="the file is truncated or was not written by numpy; re-extract it") from None
    if not isinstance(images, np.ndarray):  # np.load returns an NpzFile for zip archives
        raise DataError("not a .npy array (an .npz archive?)", path=fpath,
                        hint="precomp features are one float32 .npy array per split")
    if images.ndim != 3 or images.dtype != np.float32 or 0 in images.shape:
        raise DataError(f"expected float32 [N, k, D] features with N, k, D > 0, found {images.dtype} "
                        f"{list(images.shape)}", path=fpath,
                        hint="precomp features are float32 arrays of shape [images, regions, dim]")
    if manifest is not None and isinstance(manifest.get("images"), int) and manifest["images"] != images.shape[0]:
        raise DataError(f"{images.shape[0]} images, meta.json recorded {manifest['images']}", path=fpath,
                        hint="re-extract this split (itmatch extract --force)")
    if check_finite:
        assert_finite(images, fpath)
    return images


def read_precomp(root: str | Path, split: str, *, check_finite: bool = True,
                 per_image: int = CAPTIONS_PER_IMAGE, verify_checksum: bool = False,
                 scales: tuple[str, ...] = ()) -> PrecompSplit:
    """Open one split, validating shapes, dtype, counts, (optionally) that every feature is finite, and,
    for directories written by `itmatch extract`, the main features' size (and with `verify_checksum`
    their SHA-256) against meta.json. `scales` (e.g. ("c4", "c5")) opens those cached stage maps
    (`scale_path`) as a MultiScaleArray."""
    root = Path(root)
    manifest = split_manifest(root, split)
    if manifest is not None and progress_path(root, split).exists():
        # meta.json still describes the split as it was before an update (changed photos) that did not finish
        raise DataError(f"an update of split {split!r} by `itmatch extract` did not finish (its sources changed)",
                        path=progress_path(root, split), hint="rerun the same `itmatch extract` command; it resumes")
    main = features_path(root, split)
    if scales:
        hint = "extract the split with `itmatch extract ... --scales c3,c4,c5` (multi-scale models need it)"
        arrays = {s: _open_features(scale_path(root, split, s), split, check_finite, hint,
                                    manifest if scale_path(root, split, s) == main else None, verify_checksum)
                  for s in scales}
        images: ImageSource = MultiScaleArray(arrays)
    else:
        images = _open_features(main, split, check_finite,
                                "run `itmatch extract` (or point --data at a directory with this split)",
                                manifest, verify_checksum)
    captions, ids = read_text_side(root, split, len(images), per_image)
    return PrecompSplit(root, split, images, captions, ids, per_image, read_extra_captions(root, split, len(images)))


def read_extra_captions(root: str | Path, split: str, n: int) -> list[tuple[int, str]]:
    """The kept extra captions of a split of `n` images ([] when it has none), validated."""
    path = extra_captions_path(root, split)
    if not path.exists():
        return []
    extra = []
    for lineno, line in enumerate(read_lines(path), 1):
        row, tab, caption = line.partition("\t")
        if not tab or not row.isdigit() or not caption.strip():
            raise DataError("expected ROW<TAB>caption", path=path, line=lineno,
                            hint="re-extract with `itmatch extract ... --extra-captions keep`, or delete the file")
        if int(row) >= n:
            raise DataError(f"image row {row} is out of range: the split has {n} images", path=path, line=lineno,
                            hint="the file belongs to another extraction; re-extract the split")
        extra.append((int(row), caption))
    return extra


def extra_captions_text(ids: list[str], extra: dict[str, list[str]]) -> list[str]:
    """The lines of `{split}_extra_caps.tsv` for the split's rows `ids` and {image id: its extra captions}."""
    return [f"{row}\t{caption}" for row, image_id in enumerate(ids) for caption in extra.get(image_id, ())]


def read_text_side(root: str | Path, split: str, n: int, per_image: int = CAPTIONS_PER_IMAGE
                   ) -> tuple[list[str], list[str]]:
    """Captions and image ids of a split of `n` images, validated (5 captions per image, none empty)."""
    root = Path(root)
    cpath = captions_path(root, split)
    captions = read_lines(cpath)
    if len(captions) != per_image * n:
        raise DataError(f"{len(captions)} caption lines for {n} images; the precomp layout needs "
                        f"{per_image} x {n} = {per_image * n}", path=cpath,
                        hint=f"captions {per_image}i..{per_image}i+{per_image - 1} must describe image i")
    for i, cap in enumerate(captions):
        if not cap.strip():
            raise DataError("empty caption", path=cpath, line=i + 1,
                            hint="every line must hold one caption; remove the image or write its caption")
    ipath = ids_path(root, split)
    ids = read_lines(ipath) if ipath.exists() else [str(i) for i in range(n)]
    if len(ids) != n:
        raise DataError(f"{len(ids)} ids for {n} images", path=ipath, hint="write one image id per line")
    return captions, ids


def assert_finite(array: np.ndarray, path: Path, chunk: int = 256) -> None:
    """Scan a (memory-mapped) array chunk by chunk for NaN/inf and name the first bad image."""
    for start in range(0, array.shape[0], chunk):
        block = np.asarray(array[start:start + chunk])
        bad = ~np.isfinite(block).reshape(block.shape[0], -1).all(axis=1)
        if bad.any():
            first = start + int(np.flatnonzero(bad)[0])
            raise DataError(f"non-finite (NaN/inf) features in image {first} "
                            f"({int(bad.sum())} bad images in rows {start}..{start + block.shape[0] - 1})",
                            path=path, hint="re-extract the features of those images")


def write_captions(root: str | Path, split: str, ids: list[str], captions: list[str],
                   per_image: int = CAPTIONS_PER_IMAGE) -> None:
    """Write {split}_caps.txt and {split}_ids.txt atomically (features are written by the extractor)."""
    if len(captions) != per_image * len(ids):
        raise DataError(f"{len(captions)} captions for {len(ids)} images (need {per_image} each)")
    for i, cap in enumerate(captions):
        if cap.splitlines() != [cap] or not cap.strip():  # (any break the file's reader splits on, a final one too)
            raise DataError(f"caption {i} of image {ids[i // per_image]!r} is empty or spans lines")
    write_text_atomic(captions_path(root, split), "\n".join(captions) + "\n")
    write_text_atomic(ids_path(root, split), "\n".join(ids) + "\n")


def write_features(root: str | Path, split: str, features: np.ndarray) -> None:
    """Write a whole feature array atomically (small datasets, tests); the extractor streams instead."""
    from itmatch.io import atomic_path

    arr = np.ascontiguousarray(features, dtype=np.float32)
    with atomic_path(features_path(root, split)) as tmp, open(tmp, "wb") as fh:
        np.save(fh, arr)
