"""torch Datasets over a precomp split, and the collate that pads captions.

Training iterates over captions (each paired with its image, as SCAN does); evaluation encodes every
image and every caption once, through the two item datasets below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from itmatch.data.precomp import PrecompSplit
from itmatch.data.vocab import Vocab
from itmatch.errors import DataError

CaptionTransform = Callable[[str, int], str]  # (caption, caption index) -> caption; e.g. a perturbation


@dataclass
class TextBatch:
    tokens: torch.Tensor  # [B, L] long, 0-padded
    lengths: torch.Tensor  # [B] long

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TextBatch:
        return TextBatch(self.tokens.to(device, non_blocking=non_blocking),
                         self.lengths.to(device, non_blocking=non_blocking))


def pad_tokens(sequences: list[list[int]]) -> TextBatch:
    """Token ids padded with 0 into a host batch (explicitly the CPU: a batch is built on the host and moved
    to the model's device whole, with TextBatch.to / PairBatch.to)."""
    # (filled in numpy, then one tensor: not one torch.tensor a caption, which every training step paid for)
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    tokens = np.zeros((len(sequences), int(lengths.max())), dtype=np.int64)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = s
    return TextBatch(torch.from_numpy(tokens), torch.from_numpy(lengths))


def stack_images(items: list) -> torch.Tensor | dict[str, torch.Tensor]:
    """Collate per-item images -- a feature array [k, D], a pixel tensor [3, S, S] (ImageFiles) or a
    {scale: [k_s, C_s]} dict (MultiScaleArray) -- into what `Matcher.encode_images` takes."""
    first = items[0]
    if isinstance(first, dict):
        return {k: torch.from_numpy(np.stack([np.asarray(it[k], dtype=np.float32) for it in items]))
                for k in first}
    if isinstance(first, torch.Tensor):
        return torch.stack(items)
    return torch.from_numpy(np.stack([np.asarray(it, dtype=np.float32) for it in items]))


@dataclass
class PairBatch:
    # [B, k, D], {scale: [B, k_s, C_s]} or pixels [B, 3, S, S]; None in a batch of captions only (`collate_captions`:
    # training with the features resident on the device fills them in there, engine/resident.py)
    images: torch.Tensor | dict[str, torch.Tensor] | None
    text: TextBatch
    image_index: torch.Tensor  # [B] index of the image in the split
    caption_index: torch.Tensor  # [B]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PairBatch:
        """The whole batch on `device` (images, tokens, lengths and indices: the loss builds its masks from
        image_index). `non_blocking` overlaps the copy with compute when the batch is in pinned memory."""
        images = ({k: v.to(device, non_blocking=non_blocking) for k, v in self.images.items()}
                  if isinstance(self.images, dict) else
                  None if self.images is None else self.images.to(device, non_blocking=non_blocking))
        return PairBatch(images, self.text.to(device, non_blocking),
                         self.image_index.to(device, non_blocking=non_blocking),
                         self.caption_index.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PairBatch:
        """Page-locked copies (the DataLoader calls this with pin_memory=True, for a GPU run)."""
        images = ({k: v.pin_memory() for k, v in self.images.items()} if isinstance(self.images, dict)
                  else None if self.images is None else self.images.pin_memory())
        return PairBatch(images, TextBatch(self.text.tokens.pin_memory(), self.text.lengths.pin_memory()),
                         self.image_index.pin_memory(), self.caption_index.pin_memory())


class PairDataset(Dataset):
    """(image features, caption tokens) for every training caption of a split (`training_captions`: the
    per-image ones, then the extra ones kept by `itmatch extract --extra-captions keep`).

    An item's key is a caption index j, or (epoch, j) in training: image files (ImageFiles) are then augmented
    with an RNG seeded from (train.seed, epoch, j) alone, so a batch is the same whichever process decodes it
    (DataLoader workers) and whatever was decoded before (a resumed run). `read_images=False` leaves the image
    out (None; `collate_captions`): the training loop gathers it from features resident on the device."""

    def __init__(self, split: PrecompSplit, vocab: Vocab, transform: CaptionTransform | None = None, *,
                 read_images: bool = True) -> None:
        self.split, self.vocab, self.transform = split, vocab, transform
        self.captions = split.training_captions
        self.read_images = read_images
        # each caption's ids, encoded once (the lists are shared: never changed in place): the Treebank tokenizer's
        # regexes take ~0.1 ms a caption, ~13 ms a batch of 128 (bench/trainer_host.py, two CPU cores), which every
        # step paid again; on a GPU a step's launches take ~20 ms. A transform's captions are encoded each time: they
        # may change with the epoch.
        self._ids: list[list[int] | None] = [None] * len(self.captions)

    def __len__(self) -> int:
        return len(self.captions)

    def caption_ids(self, j: int) -> list[int]:
        """Caption j's token ids as the vocabulary encodes it (untransformed), encoded on first use and kept."""
        ids = self._ids[j]
        if ids is None:
            ids = self._ids[j] = self.vocab.encode(self.captions[j])
        return ids

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Any, list[int], int, int]:
        """(image, tokens, image index, caption index); the image is None when an image file cannot be
        decoded in training (ImageFiles reports it; `collate_pairs` drops the pair), or not read."""
        epoch, j = key if isinstance(key, tuple) else (None, key)
        ids = (self.caption_ids(j) if self.transform is None else
               self.vocab.encode(self.transform(self.captions[j], j)))
        i = self.split.image_of(j)
        images = self.split.images
        if not self.read_images:
            image = None
        elif epoch is not None and hasattr(images, "draw"):  # image files: the augmentation of (epoch, j)
            image = images.draw(i, (epoch, j))
        else:
            image = images[i]
        if isinstance(image, np.ndarray):
            image = np.asarray(image, dtype=np.float32)
        return image, ids, i, j


def collate_pairs(items: list[tuple[Any, list[int], int, int]]) -> PairBatch:
    items = [it for it in items if it[0] is not None]  # unreadable training images (reported already)
    if not items:
        raise DataError("no readable image in a training batch",
                        hint="check data.images: every image of the batch failed to decode (see the log)")
    feats, tokens, img_idx, cap_idx = zip(*items, strict=True)
    return PairBatch(stack_images(list(feats)), pad_tokens(list(tokens)),
                     torch.tensor(img_idx), torch.tensor(cap_idx))


def collate_captions(items: list[tuple[Any, list[int], int, int]]) -> PairBatch:
    """A batch without its images (`PairDataset(read_images=False)`): the tokens and both indices; the images
    are gathered by `image_index` from features already on the device."""
    _, tokens, img_idx, cap_idx = zip(*items, strict=True)
    return PairBatch(None, pad_tokens(list(tokens)), torch.tensor(img_idx), torch.tensor(cap_idx))


class LengthBucketSampler(torch.utils.data.Sampler[list[int]]):
    """Random batches of captions of similar length: shuffle, cut into pools of `pool` batches, sort each
    pool by caption length, cut it into batches, shuffle the batches. Padding (and so the cost of every
    region-word head, linear in the padded length) drops to near the mean length. The images of a batch
    stay a random sample, so negatives stay random images."""

    def __init__(self, lengths: list[int], batch_size: int, generator: torch.Generator, pool: int = 32) -> None:
        self.lengths, self.batch_size, self.generator, self.pool = lengths, batch_size, generator, pool

    def __len__(self) -> int:
        return len(self.lengths) // self.batch_size

    def __iter__(self):
        order = torch.randperm(len(self.lengths), generator=self.generator).tolist()
        span = self.batch_size * self.pool
        batches = []
        for start in range(0, len(order), span):
            chunk = sorted(order[start:start + span], key=lambda j: self.lengths[j])
            batches += [chunk[b:b + self.batch_size] for b in range(0, len(chunk), self.batch_size)]
        batches = [b for b in batches if len(b) == self.batch_size]  # drop_last
        for i in torch.randperm(len(batches), generator=self.generator).tolist():
            yield batches[i]
