"""Photos per second of the host side of feature extraction: decode, resize, normalise (`preprocess`), on the
thread that prepares the next batch while the network runs on this one.

    python bench/decode_speed.py [--images ../shared/data/flickr8k/images] [--n 200] [--threads 1,2]

Two normalisations side by side in one run, on the same photos: the float32 formula in torch, as
`normalise_pixels` was written until 2026-11-26, and the NumPy one it is now (bit for bit the same numbers:
tests/features/test_features.py). Each is timed with the main thread idle, and beside a busy "network" (a torch
matmul loop on the main thread using torch's intra-op threads, as the backbone's forward does during `itmatch
extract` on a CPU, or the CPU side of a GPU's launches): a torch op on a second thread starts an OpenMP team of its
own, whose threads wait for cores the network holds. Then the pipeline on --threads decode threads at once.
Figures are ratios within one run; absolute photos/s depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from itmatch.features.pipeline import decode_image, normalise_pixels, to_pixels  # noqa: E402

FAMILY, SIZE = "efficientnet-lite", 224


def torch_formula(pixels: np.ndarray) -> torch.Tensor:
    """The normalisation as it was written in torch (the reference of this bench)."""
    return (torch.from_numpy(pixels) - 127.0) / 128.0


def numpy_formula(pixels: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(normalise_pixels(FAMILY, pixels))


def photos_per_second(paths: list[Path], normalise, threads: int) -> float:
    def one(path: Path) -> torch.Tensor:
        return normalise(to_pixels(decode_image(path), SIZE))

    started = time.perf_counter()
    with ThreadPoolExecutor(threads, thread_name_prefix="decode") as pool:
        for _ in pool.map(one, paths):
            pass
    return len(paths) / (time.perf_counter() - started)


class BusyNetwork:
    """A matmul loop on its own thread, with torch's intra-op threads (what the backbone's forward keeps busy)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        a = torch.randn(512, 512)
        while not self.stop.is_set():
            a = torch.tanh(a @ a / 512)

    def __enter__(self) -> BusyNetwork:
        self.thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", default=str(ROOT.parent / "shared" / "data" / "flickr8k" / "images"))
    parser.add_argument("--n", type=int, default=200, help="photos timed in each measurement")
    parser.add_argument("--threads", default="1,2", help="decode threads to time, comma-separated")
    args = parser.parse_args()
    paths = sorted(Path(args.images).glob("*.jpg"))[:args.n]
    if not paths:
        print(f"no photos in {args.images}: pass --images DIR (e.g. ../shared/data/flickr8k/images)")
        return 1
    for path in paths:  # the files in the page cache before any timing
        path.read_bytes()
    print(f"{len(paths)} photos of {args.images}, torch intra-op threads {torch.get_num_threads()}")
    for busy in (False, True):
        context = BusyNetwork() if busy else _Idle()
        with context:
            old = photos_per_second(paths, torch_formula, 1)
            new = photos_per_second(paths, numpy_formula, 1)
        where = "beside a busy network" if busy else "main thread idle"
        print(f"one decode thread, {where}: torch normalisation {old:.0f} photos/s, NumPy {new:.0f} photos/s "
              f"({new / old:.1f}x)")
    with BusyNetwork():
        rates = {n: photos_per_second(paths, numpy_formula, n) for n in map(int, args.threads.split(","))}
    first = next(iter(rates.values()))
    print("beside a busy network, NumPy normalisation: " + ", ".join(
        f"{n} decode thread(s) {rate:.0f} photos/s ({rate / first:.1f}x)" for n, rate in rates.items()))
    return 0


class _Idle:
    def __enter__(self) -> _Idle:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
