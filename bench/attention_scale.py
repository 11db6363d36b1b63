"""How sharp can the papers' attention be at their literal scales? (docs/oan.md, docs/save.md)

OAN's inter-modal attention (Eq. 4) and SAVE's DSA (Eq. 3) both take a softmax of l2-normalised cosines, logits
in [0, 1] times a scale lambda, so one object's weight is at most e^lambda / (e^lambda + M - 1) of M, however well
it matches. This prints that bound for OAN's and SCAN's scales, and measures what DSA does to real grid cells:
the mean cosine between the attended cells of an image (the input cells' for comparison) and between each
attended cell and the image's mean cell, at SAVE's lambda = 1 and at larger ones.

    python bench/attention_scale.py --data runs/data/flickr8k_lite0 --images 64
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

from itmatch.models.save.encoder import DeterministicSelfAttention


def peak_weight(lam: float, objects: int) -> float:
    """The largest weight a softmax over `objects` logits in [0, lam] can give one of them."""
    return math.exp(lam) / (math.exp(lam) + objects - 1)


def mean_offdiagonal_cosine(cells: torch.Tensor) -> float:
    """Mean cosine between the different cells of each image ([N, M, C]), over images."""
    unit = torch.nn.functional.normalize(cells, dim=2, eps=1e-8)
    cos = unit @ unit.transpose(1, 2)
    m = cells.shape[1]
    return float(((cos.sum((1, 2)) - cos.diagonal(dim1=1, dim2=2).sum(1)) / (m * (m - 1))).mean())


def cosine_to_mean(cells: torch.Tensor, reference: torch.Tensor) -> float:
    """Mean cosine between each cell and its image's mean input cell."""
    mean = reference.mean(1, keepdim=True)
    return float(torch.nn.functional.cosine_similarity(cells, mean.expand_as(cells), dim=2, eps=1e-8).mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="runs/data/flickr8k_lite0", help="a precomp directory (grid features)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--images", type=int, default=64, help="the first N images of the split")
    parser.add_argument("--lambdas", default="1,4,9,20", help="DSA scales to measure (1: SAVE's Eq. 3)")
    args = parser.parse_args(argv)

    print("Largest weight of one object (uniform in brackets):")
    for name, lam, objects in [("OAN T-V, paper lambda_TV = 0.9, 49 cells", 0.9, 49),
                               ("OAN V-T, paper lambda_VT = 0.5, 12 words", 0.5, 12),
                               ("SCAN t-i, lambda_1 = 9, 49 cells", 9.0, 49),
                               ("SCAN i-t, lambda_1 = 4, 12 words", 4.0, 12),
                               ("SAVE DSA, lambda = 1 (none in Eq. 3), 49 cells", 1.0, 49)]:
        print(f"  {name}: {100 * peak_weight(lam, objects):.1f} % ({100 / objects:.1f} %)")

    path = Path(args.data) / f"{args.split}_ims.npy"
    if not path.is_file():
        print(f"{path}: not found (extract the features first: itmatch extract ... --out {args.data})",
              file=sys.stderr)
        return 2
    cells = torch.from_numpy(np.load(path, mmap_mode="r")[: args.images].astype(np.float32))
    print(f"\nDSA on {len(cells)} {args.split} images of {args.data} ({cells.shape[1]} cells of {cells.shape[2]}):")
    print(f"  input cells: mean cosine between cells {mean_offdiagonal_cosine(cells):.3f}, "
          f"to the image's mean cell {cosine_to_mean(cells, cells):.3f}")
    with torch.no_grad():
        for lam in (float(x) for x in args.lambdas.split(",")):
            out = DeterministicSelfAttention(lam)(cells)
            print(f"  lambda = {lam:g}: mean cosine between attended cells {mean_offdiagonal_cosine(out):.3f}, "
                  f"to the image's mean cell {cosine_to_mean(out, cells):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
