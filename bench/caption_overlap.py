"""Which captions of an evaluation split appear word for word in another caption collection? (docs/mmca.md,
'The text encoder and the test captions')

MMCA's frozen text encoder here, all-MiniLM-L6-v2, was trained by its authors on sentence pairs that include
Flickr30K's captions, and Flickr30K holds Flickr8K's photos. Only Flickr30K's dev and test captions are on this
machine (`../shared/data/precomp-captions/f30k_precomp`), so this counts the Flickr8K test images whose captions
appear there; if all of Flickr8K is in Flickr30K, the count is about the share those files are of Flickr30K.
Captions are compared lower-cased, with runs of spaces as one.

    python bench/caption_overlap.py --data runs/data/flickr8k_lite0 \
        ../shared/data/precomp-captions/f30k_precomp/dev_caps.txt \
        ../shared/data/precomp-captions/f30k_precomp/test_caps.txt
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path

from itmatch.data.captions import CAPTIONS_PER_IMAGE
from itmatch.data.precomp import read_lines

#: Flickr30K's images (Young et al. 2014): the share of them the given files cover is the share to expect
FLICKR30K_IMAGES = 31_783


def normalised(caption: str) -> str:
    return " ".join(caption.lower().split())


def overlap(split_captions: list[str], others: Iterable[str]) -> tuple[int, int]:
    """(captions of the split found in `others`, images of the split with at least one of them); caption j belongs
    to image j // 5, as in a precomp split."""
    known = {normalised(c) for c in others}
    found = [j for j, c in enumerate(split_captions) if normalised(c) in known]
    return len(found), len({j // CAPTIONS_PER_IMAGE for j in found})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("others", nargs="+", type=Path, help="caption files, one caption a line")
    parser.add_argument("--data", type=Path, required=True, help="precomp directory of the split")
    parser.add_argument("--split", default="test")
    args = parser.parse_args(argv)
    captions = read_lines(args.data / f"{args.split}_caps.txt")
    others = [c for path in args.others for c in read_lines(path)]
    found, images = overlap(captions, others)
    share = len(others) / CAPTIONS_PER_IMAGE / FLICKR30K_IMAGES
    print(f"{args.split}: {found} of {len(captions)} captions, of {images} of {len(captions) // CAPTIONS_PER_IMAGE} "
          f"images, appear in {len(others)} captions of {len(args.others)} file(s) ({100 * share:.1f}% of "
          f"Flickr30K's images, if they are Flickr30K's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
