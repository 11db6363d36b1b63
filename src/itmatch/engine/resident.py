"""Training features resident on the device (`train.resident`, issue 23): the training split's feature arrays
(precomp [N, k, D], or SAVE's cached {scale: [N, k_s, C_s]} maps) copied to the training device once, and every
batch's images gathered there by index instead of collated on the host and copied per batch. The gathered rows
are the same float32 values the host collate stacks, so training is bit-identical either way (docs/gpu.md,
"Features resident on the device"). Image files of pixel-input models always stream: they are decoded and
augmented per batch.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from itmatch.data.datasets import PairBatch
from itmatch.data.precomp import ImageSource, MultiScaleArray
from itmatch.data.views import FeatureViews
from itmatch.device import OutOfMemoryError, free_memory, release_cached_memory
from itmatch.errors import ConfigError

log = logging.getLogger("itmatch.train")

#: of the device's free memory (measured with the model on it), what `train.resident: auto` lets the features
#: take. The other half is for what is allocated later: Adam's two moment buffers (twice the parameters, made at
#: the first step), the step's activations (hundreds of MB for SCAN at batch 128, far more for MMCA's pairs),
#: validation's score blocks (they size themselves from what is free then) and the allocator's fragmentation.
RESIDENT_FRACTION = 0.5

#: rows copied to the device at a time: a memory-mapped array is read in slices of at most this many bytes, so
#: the host never holds a second full copy of it
CHUNK_BYTES = 256 * 2**20


def feature_arrays(images: ImageSource) -> dict[str, np.ndarray] | None:
    """A split's images as named arrays ({"": [N, k, D]} or the multi-scale maps); None for image files."""
    if isinstance(images, MultiScaleArray):
        return dict(images.arrays)
    if isinstance(images, np.ndarray):
        return {"": images}
    return None


def nbytes(arrays: dict[str, np.ndarray]) -> int:
    """Device bytes of the arrays as float32 tensors."""
    return sum(int(np.prod(a.shape)) * 4 for a in arrays.values())


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    out = torch.empty(tuple(array.shape), dtype=torch.float32, device=device)
    rows = max(1, CHUNK_BYTES // max(1, 4 * int(np.prod(array.shape[1:]))))
    for start in range(0, array.shape[0], rows):
        chunk = np.array(array[start:start + rows], dtype=np.float32)  # a copy: a memmap is read-only
        out[start:start + rows].copy_(torch.from_numpy(chunk))
    return out


class ResidentImages:
    """The feature arrays as float32 tensors on `device`; `fill(batch)` puts the batch's images in by its
    `image_index` (already on the device)."""

    def __init__(self, arrays: dict[str, np.ndarray], device: torch.device) -> None:
        self.multi = set(arrays) != {""}
        self.tensors = {k: _to_device(a, device) for k, a in arrays.items()}
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())

    def take(self, index: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        rows = {k: t.index_select(0, index) for k, t in self.tensors.items()}
        return rows if self.multi else rows[""]

    def fill(self, batch: PairBatch) -> PairBatch:
        return dataclasses.replace(batch, images=self.take(batch.image_index))


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GB"


def resident_images(mode: str, images: ImageSource, device: torch.device) -> tuple[ResidentImages | None, str]:
    """What `train.resident` (`mode`: auto | on | off) gives for a training split's `images` on `device`: the
    resident features, or None (the batches stream from the host), and why, in words (logged once by the
    trainer). auto: on for a CUDA device when the arrays take at most RESIDENT_FRACTION of its free memory;
    on: always for feature arrays (on the CPU it keeps them as one in-memory tensor instead of a memmap);
    image files always stream."""
    arrays = feature_arrays(images)
    if arrays is None:
        why = ("each caption's image is drawn from the augmented views (data.train_views)"
               if isinstance(images, FeatureViews) else
               "the model reads image files, which are decoded and augmented per batch")
        if mode == "on":
            log.warning("train.resident=on is ignored: %s", why)
        return None, f"streamed: {why}"
    size = nbytes(arrays)
    if mode == "off":
        return None, f"streamed: train.resident=off (features {_gb(size)})"
    if mode == "auto":
        if device.type != "cuda":
            return None, f"streamed: train.resident=auto resides only on a CUDA device, this run is on {device}"
        free = free_memory(device) or 0
        if size > RESIDENT_FRACTION * free:
            return None, (f"streamed: train.resident=auto: the features ({_gb(size)}) exceed {RESIDENT_FRACTION:.0%} "
                          f"of the {_gb(free)} free on {device}")
        why = f"train.resident=auto: the features ({_gb(size)}) fit in {RESIDENT_FRACTION:.0%} of the {_gb(free)} free"
    else:
        why = "train.resident=on"
    try:
        resident = ResidentImages(arrays, device)
    except OutOfMemoryError:
        release_cached_memory(device)
        if mode == "on":
            raise ConfigError(f"train.resident=on: the training features ({_gb(size)}) do not fit on {device}",
                              hint="set train.resident=auto (or off): the batches then stream from the host") from None
        return None, f"streamed: the features ({_gb(size)}) ran out of memory on {device} while being copied"
    return resident, f"resident on {device}: {why} ({_gb(size)} copied once; batches gathered by index there)"
