"""torch Datasets over a precomp split, and the collate that pads captions.

Training iterates over captions (each paired with its image, as SCAN does); evaluation encodes every
image and every caption once, through the two item datasets below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from itmatch.data.precomp import PrecompSplit
from itmatch.data.vocab import Vocab

CaptionTransform = Callable[[str, int], str]  # (caption, caption index) -> caption; e.g. a perturbation


@dataclass
class TextBatch:
    tokens: torch.Tensor  # [B, L] long, 0-padded
    lengths: torch.Tensor  # [B] long


def pad_tokens(sequences: list[list[int]]) -> TextBatch:
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    tokens = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.long)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return TextBatch(tokens, lengths)


@dataclass
class PairBatch:
    images: torch.Tensor  # [B, k, D]
    text: TextBatch
    image_index: torch.Tensor  # [B] index of the image in the split
    caption_index: torch.Tensor  # [B]


class PairDataset(Dataset):
    """(image features, caption tokens) for every caption of a split."""

    def __init__(self, split: PrecompSplit, vocab: Vocab, transform: CaptionTransform | None = None) -> None:
        self.split, self.vocab, self.transform = split, vocab, transform

    def __len__(self) -> int:
        return len(self.split.captions)

    def __getitem__(self, j: int) -> tuple[np.ndarray, list[int], int, int]:
        caption = self.split.captions[j]
        if self.transform is not None:
            caption = self.transform(caption, j)
        i = j // self.split.per_image
        return np.asarray(self.split.images[i], dtype=np.float32), self.vocab.encode(caption), i, j


def collate_pairs(items: list[tuple[np.ndarray, list[int], int, int]]) -> PairBatch:
    feats, tokens, img_idx, cap_idx = zip(*items, strict=True)
    return PairBatch(torch.from_numpy(np.stack(feats)), pad_tokens(list(tokens)),
                     torch.tensor(img_idx), torch.tensor(cap_idx))


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


def encode_all_captions(captions: list[str], vocab: Vocab) -> list[list[int]]:
    return [vocab.encode(c) for c in captions]
