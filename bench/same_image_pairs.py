"""How often do two captions of one image share a training batch? (docs/training.md, 'Length-bucketed batches')

Under the public SCAN code's loss (no `loss.mask_same_image`) such a pair makes each caption the other's negative.
Length bucketing groups captions of similar length, and an image's five captions tend to be alike in length, so it
raises the count; this prints the mean number of same-image caption pairs per batch, bucketed
(`LengthBucketSampler`, as training draws them) and random (`randperm` cut into batches), over a few epochs each.

    python bench/same_image_pairs.py --data runs/data/flickr8k_lite0
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

from itmatch.data.datasets import LengthBucketSampler
from itmatch.data.vocab import tokenize


def pairs_per_batch(batches: Iterable[list[int]], per_image: int = 5) -> float:
    """Mean number of pairs of captions of one image in a batch (caption j belongs to image j // per_image)."""
    counts = [sum(n * (n - 1) // 2 for n in Counter(j // per_image for j in batch).values()) for batch in batches]
    return sum(counts) / len(counts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="precomp directory (its train_caps.txt)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    captions = (args.data / "train_caps.txt").read_text(encoding="utf-8").splitlines()
    lengths = [len(tokenize(c)) + 2 for c in captions]  # (<start> and <end>, as the sampler sees them)
    g = torch.Generator().manual_seed(0)
    bucketed = [pairs_per_batch(LengthBucketSampler(lengths, args.batch_size, g)) for _ in range(args.epochs)]
    g = torch.Generator().manual_seed(0)
    size = args.batch_size
    random = []
    for _ in range(args.epochs):
        order = torch.randperm(len(captions), generator=g).tolist()
        random.append(pairs_per_batch(order[i:i + size] for i in range(0, len(order) - size + 1, size)))
    print(f"same-image caption pairs per batch of {size}, {args.epochs} epochs each: "
          f"bucketed {sum(bucketed) / len(bucketed):.2f}, random {sum(random) / len(random):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
