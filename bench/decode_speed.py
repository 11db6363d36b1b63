"""Photos per second of the host side of feature extraction: decode, resize, normalise (`preprocess`), on the
thread that prepares the next batch while the network runs on this one.

    python bench/decode_speed.py [--images ../shared/data/flickr8k/images] [--n 200] [--threads 1,2] [--extract 400]

Two normalisations side by side in one run, on the same photos: the float32 formula in torch, as
`normalise_pixels` was written until 2026-11-26, and the NumPy one it is now (bit for bit the same numbers:
tests/features/test_features.py). Each is timed with the main thread idle, and beside a busy "network" (a torch
matmul loop on the main thread using torch's intra-op threads, as the backbone's forward does during `itmatch
extract` on a CPU, or the CPU side of a GPU's launches): a torch op on a second thread starts an OpenMP team of its
own, whose threads wait for cores the network holds. Then the pipeline on --threads decode threads at once, and
(--extract N) `itmatch extract` itself over N photos on the CPU as it was (one decode thread, torch's normalisation)
and as it is (`decode_threads`, NumPy's), alternated twice, with the arrays checked equal: on a CPU the network sets
the pace, so the extraction gains less than its decoding (--extract-threads 2 shows what a second decode thread
costs the network on a 2-core machine).
Figures are ratios within one run; absolute photos/s depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from itmatch.data.captions import CaptionTable  # noqa: E402
from itmatch.features import backbones, extract  # noqa: E402
from itmatch.features.pipeline import decode_image, decode_threads, normalise_pixels, to_pixels  # noqa: E402

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


def extraction_seconds(paths: list[Path], before: bool, out: Path, threads_now: int | None) -> float:
    """`extract_precomp` of `paths` (5 made-up captions each) on the CPU, as it was (`before`) or as it is (with
    `threads_now` decode threads instead of `decode_threads`' own choice, if given)."""
    table = CaptionTable(source="bench")
    for path in paths:
        for c in range(5):
            table.add(path.name, f"caption {c}", "train")
    threads, preprocess = extract.decode_threads, backbones.preprocess
    if threads_now is not None:
        extract.decode_threads = lambda device: threads_now
    if before:
        extract.decode_threads = lambda device: 1
        backbones.preprocess = lambda image, family, size: torch_formula(to_pixels(image, size))
    try:
        started = time.perf_counter()
        extract.extract_precomp(paths[0].parent, table, out, progress=False, force=True, batch_size=32)
        return time.perf_counter() - started
    finally:
        extract.decode_threads, backbones.preprocess = threads, preprocess


def compare_extraction(paths: list[Path], threads_now: int | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "images"
        folder.mkdir()
        for path in paths:
            shutil.copy(path, folder / path.name)
        copies = sorted(folder.iterdir())
        times: dict[bool, list[float]] = {True: [], False: []}
        arrays = {}
        for before in (True, False, False, True):
            out = Path(tmp) / ("before" if before else "now")
            times[before].append(extraction_seconds(copies, before, out, threads_now))
            arrays[before] = np.load(out / "train_ims.npy")
        same = np.array_equal(arrays[True], arrays[False])
        old, new = min(times[True]), min(times[False])
        threads = threads_now or decode_threads("cpu")
        print(f"itmatch extract, {len(paths)} photos, batch 32 (best of 2 each, alternated): one decode thread and "
              f"torch's normalisation {len(paths) / old:.1f} photos/s, {threads} thread(s) and NumPy's "
              f"{len(paths) / new:.1f} photos/s ({old / new:.2f}x); features identical: {same}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", default=str(ROOT.parent / "shared" / "data" / "flickr8k" / "images"))
    parser.add_argument("--n", type=int, default=200, help="photos timed in each measurement")
    parser.add_argument("--threads", default="1,2", help="decode threads to time, comma-separated")
    parser.add_argument("--extract", type=int, default=0, metavar="N",
                        help="also time `itmatch extract` over N photos, as it was and as it is (0: not)")
    parser.add_argument("--extract-threads", type=int, help="decode threads of the extraction as it is (default: "
                                                             "decode_threads' choice for the CPU, 1)")
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
    if args.extract:
        compare_extraction(sorted(Path(args.images).glob("*.jpg"))[:args.extract], args.extract_threads)
    return 0


class _Idle:
    def __enter__(self) -> _Idle:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
