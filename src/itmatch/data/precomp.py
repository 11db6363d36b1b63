"""SCAN "precomp" layout: {split}_ims.npy [N, k, D] float32, {split}_caps.txt (5 per image, captions
5i..5i+4 describe image i) and {split}_ids.txt (one image id per line; optional on read)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from itmatch.data.captions import CAPTIONS_PER_IMAGE
from itmatch.errors import DataError
from itmatch.io import write_text_atomic

SPLITS = ("train", "dev", "test", "testall")


def features_path(root: str | Path, split: str) -> Path:
    return Path(root) / f"{split}_ims.npy"


def captions_path(root: str | Path, split: str) -> Path:
    return Path(root) / f"{split}_caps.txt"


def ids_path(root: str | Path, split: str) -> Path:
    return Path(root) / f"{split}_ids.txt"


META_NAME = "meta.json"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split_manifest(root: Path, split: str) -> dict | None:
    """What `itmatch extract` recorded about a split in meta.json (its manifest, written last); None for
    directories not written by the extractor (hand-made or SCAN's own precomp files)."""
    meta = root / META_NAME
    if not meta.is_file():
        return None
    try:
        data = json.loads(meta.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise DataError("corrupt meta.json", path=meta, hint="re-extract, or delete it for hand-made data") from None
    if not isinstance(data, dict) or data.get("format") != "itmatch-precomp":
        return None
    splits = data.get("splits")
    info = splits.get(split) if isinstance(splits, dict) else None
    if not isinstance(info, dict):
        raise DataError(f"split {split!r} is not recorded as complete in meta.json: its extraction did not "
                        f"finish", path=meta, hint="rerun the same `itmatch extract` command; it resumes")
    return info


def read_lines(path: Path) -> list[str]:
    """Lines without their newline; a missing final newline is fine (f30k test_caps lacks one)."""
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError("file not found", path=path,
                        hint="check the dataset directory, or run `itmatch extract` to create it") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", path=path) from None


@dataclass
class PrecompSplit:
    """One split of a precomp dataset. `images` is memory-mapped; captions are strings."""

    root: Path
    split: str
    images: np.ndarray  # [N, k, D] float32, memory-mapped
    captions: list[str]
    ids: list[str]
    per_image: int = CAPTIONS_PER_IMAGE

    @property
    def n_images(self) -> int:
        return int(self.images.shape[0])

    def __len__(self) -> int:
        return len(self.captions)

    def head(self, n_images: int) -> PrecompSplit:
        """The first `n_images` images and their captions (SCAN evaluates dev on the first 1000)."""
        return self.slice(0, min(n_images, self.n_images))

    def slice(self, start: int, stop: int) -> PrecompSplit:
        """Images [start, stop) and their captions, e.g. one COCO 1K fold."""
        p = self.per_image
        return PrecompSplit(self.root, self.split, self.images[start:stop],
                            self.captions[p * start:p * stop], self.ids[start:stop], p)


def read_precomp(root: str | Path, split: str, *, check_finite: bool = True,
                 per_image: int = CAPTIONS_PER_IMAGE, verify_checksum: bool = False) -> PrecompSplit:
    """Open one split, validating shapes, dtype, counts, (optionally) that every feature is finite, and,
    for directories written by `itmatch extract`, the features' size (and with `verify_checksum` their
    SHA-256) against meta.json."""
    root = Path(root)
    fpath, cpath = features_path(root, split), captions_path(root, split)
    if not fpath.is_file():
        raise DataError(f"no features for split {split!r}", path=fpath,
                        hint="run `itmatch extract` (or point --data at a directory with this split)")
    manifest = split_manifest(root, split)
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
    captions = read_lines(cpath)
    n = images.shape[0]
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
    if check_finite:
        assert_finite(images, fpath)
    return PrecompSplit(root, split, images, captions, ids, per_image)


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
        if "\n" in cap or not cap.strip():
            raise DataError(f"caption {i} of image {ids[i // per_image]!r} is empty or spans lines")
    write_text_atomic(captions_path(root, split), "\n".join(captions) + "\n")
    write_text_atomic(ids_path(root, split), "\n".join(ids) + "\n")


def write_features(root: str | Path, split: str, features: np.ndarray) -> None:
    """Write a whole feature array atomically (small datasets, tests); the extractor streams instead."""
    from itmatch.io import atomic_path

    arr = np.ascontiguousarray(features, dtype=np.float32)
    with atomic_path(features_path(root, split)) as tmp, open(tmp, "wb") as fh:
        np.save(fh, arr)
