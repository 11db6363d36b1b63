"""The command line shared by the scripts that read trained checkpoints on the first images of a split
(scripts/asa_state.py, scripts/sman_intra_pair.py): which checkpoints, which data, which split, how many images."""

from __future__ import annotations

import argparse
from pathlib import Path


def checkpoint_sample_parser(description: str | None, what: str, images: int) -> argparse.ArgumentParser:
    """A parser of CHECKPOINT... [--data DIR] [--split SPLIT] [--images N]; `what`: the checkpoints it reads (e.g.
    "SAVE checkpoint directories"), `images`: how many images it reads by default."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", type=Path, help=f"{what} (RUN/best, RUN/last)")
    parser.add_argument("--data", help="precomp directory (default: the checkpoint's data.path)")
    parser.add_argument("--split", default="dev", help="split whose first images are read (default dev)")
    parser.add_argument("--images", type=int, default=images, help=f"images read (default {images})")
    return parser
