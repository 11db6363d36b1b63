"""What checking sources for changes costs (docs/reliability.md, Figures).

    python bench/source_changes.py                     # Flickr8K photos from ../shared/data
    python bench/source_changes.py --images DIR --n 200

1. Fingerprints of every photo of the folder: all hashed (SHA-256) vs the size + mtime fast path a re-run
   of `itmatch extract` / `itmatch index` takes when nothing changed.
2. `itmatch extract` over the first N photos, then re-run: unchanged, after one photo was replaced under
   the same name (only its row is recomputed), and with --force (everything recomputed). The photos are
   copied to a temporary folder, deleted at the end.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from itmatch.data.captions import CaptionTable
from itmatch.features.extract import extract_precomp
from itmatch.fingerprint import file_records

ROOT = Path(__file__).resolve().parents[1]


def fingerprint_cost(images: Path) -> str:
    names = sorted(p.name for p in images.iterdir() if p.is_file())
    t = time.perf_counter()
    full = file_records(images, names)
    hashed = time.perf_counter() - t
    t = time.perf_counter()
    assert file_records(images, names, full) == full
    fast = time.perf_counter() - t
    mib = sum(r["bytes"] for r in full.values() if r) / 2**20
    return f"{len(names)} files ({mib:.0f} MiB): all hashed {hashed:.2f} s, size + mtime only {fast:.3f} s"


def update_cost(images: Path, n: int, threads: int) -> str:
    photos = sorted(p for p in images.iterdir() if p.is_file())[:n + 1]
    with tempfile.TemporaryDirectory() as tmp:
        folder, out = Path(tmp) / "images", Path(tmp) / "out"
        folder.mkdir()
        table = CaptionTable(source="bench")
        for p in photos[:n]:
            shutil.copy(p, folder / p.name)
            for c in range(5):
                table.add(p.name, f"caption {c}", "train")

        def run(**kw) -> float:
            t = time.perf_counter()
            extract_precomp(folder, table, out, progress=False, num_threads=threads, **kw)
            return time.perf_counter() - t

        first, unchanged = run(), run()
        before = np.load(out / "train_ims.npy")
        shutil.copy(photos[n], folder / photos[n // 2].name)  # another photo under an existing name
        update = run()
        rows = int((np.load(out / "train_ims.npy") != before).reshape(n, -1).any(1).sum())
        force = run(force=True)
    return (f"N={n}: first extraction {first:.1f} s; re-run unchanged {unchanged:.2f} s; one photo replaced "
            f"{update:.1f} s ({rows} row changed); --force {force:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", default=str(ROOT.parent / "shared/data/flickr8k/images"))
    ap.add_argument("--n", type=int, default=200, help="photos extracted in part 2")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    images = Path(args.images)
    if not images.is_dir():
        raise SystemExit(f"{images}: no such folder (pass --images DIR)")
    print(fingerprint_cost(images))
    print(update_cost(images, args.n, args.threads))


if __name__ == "__main__":
    main()
