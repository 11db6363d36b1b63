"""Photos per second of the host side of feature extraction (decode, resize, normalise: `Backbone.preprocess`), by
how many threads decode, and what a second decode thread does to `itmatch extract` on a CPU.

    python bench/decode_speed.py [--images ../shared/data/flickr8k/images] [--n 200] [--threads 1,2] [--extract 128]

1. The pipeline on each --threads count of decode threads at once, beside a busy "network" (a torch matmul loop
   on another thread using torch's intra-op threads, as the backbone's forward keeps the host busy on a CPU), with
   the normalisation in NumPy (`normalise_pixels`, as it is) and in torch (the same float32 formula, as it was
   until 2026-11-26): a torch op on a decode thread starts an OpenMP team of its own, so torch's threads do not
   add up. A GPU network leaves the host's cores free, which is why `decode_threads` gives a GPU extraction one
   thread a core (up to 8).
2. (--extract N) `itmatch extract` over N photos on the CPU with one decode thread (`decode_threads`' choice for a
   CPU network) and with --extract-threads (default 2), alternated twice, best of each kept, the features checked
   equal.
Figures are ratios within one run; absolute photos/s depend on the machine and its load (run it on a quiet one:
another process competing for the cores changes which threads win them). On this project's 2-core machine the
thread counts and the two normalisations come out within its noise (2026-11-26: 0.8x to 1.8x for a second thread,
run to run); what the threads are for, a GPU host's free cores, wants the run on a GPU machine's 16 cores.
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
from itmatch.features import extract, extract_split  # noqa: E402
from itmatch.features.pipeline import decode_image, preprocess, to_pixels  # noqa: E402

FAMILY, SIZE = "efficientnet-lite", 224


def torch_preprocess(path: Path) -> torch.Tensor:
    """The pipeline with the normalisation in torch, as it was written (the reference of this bench)."""
    return (torch.from_numpy(to_pixels(decode_image(path), SIZE)) - 127.0) / 128.0


def numpy_preprocess(path: Path) -> torch.Tensor:
    return preprocess(decode_image(path), FAMILY, SIZE)


def photos_per_second(paths: list[Path], threads: int, pipeline=numpy_preprocess) -> float:
    started = time.perf_counter()
    with ThreadPoolExecutor(threads, thread_name_prefix="decode") as pool:
        for _ in pool.map(pipeline, paths):
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


def extraction_seconds(paths: list[Path], threads: int, out: Path) -> float:
    """`extract_precomp` of `paths` (5 made-up captions each) on the CPU with `threads` decode threads."""
    table = CaptionTable(source="bench")
    for path in paths:
        for c in range(5):
            table.add(path.name, f"caption {c}", "train")
    chosen = extract_split.decode_threads
    extract_split.decode_threads = lambda device: threads
    try:
        started = time.perf_counter()
        extract.extract_precomp(paths[0].parent, table, out, progress=False, force=True, batch_size=32)
        return time.perf_counter() - started
    finally:
        extract_split.decode_threads = chosen


def compare_extraction(paths: list[Path], threads: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "images"
        folder.mkdir()
        for path in paths:
            shutil.copy(path, folder / path.name)
        copies = sorted(folder.iterdir())
        times: dict[int, list[float]] = {1: [], threads: []}
        arrays = {}
        for k, n in enumerate((1, threads, threads, 1)):
            out = Path(tmp) / f"out{k}"  # (a fresh folder each time: nothing is reused from an earlier run)
            times[n].append(extraction_seconds(copies, n, out))
            arrays[n] = np.load(out / "train_ims.npy")
        one, more = min(times[1]), min(times[threads])
        print(f"itmatch extract on the CPU, {len(paths)} photos, batch 32 (best of 2 each, alternated): 1 decode "
              f"thread {len(paths) / one:.1f} photos/s, {threads} threads {len(paths) / more:.1f} photos/s "
              f"({one / more:.2f}x); features identical: {np.array_equal(arrays[1], arrays[threads])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", default=str(ROOT.parent / "shared" / "data" / "flickr8k" / "images"))
    parser.add_argument("--n", type=int, default=200, help="photos timed in each measurement")
    parser.add_argument("--threads", default="1,2", help="decode threads to time, comma-separated")
    parser.add_argument("--extract", type=int, default=0, metavar="N",
                        help="also time `itmatch extract` over N photos with 1 and --extract-threads (0: not)")
    parser.add_argument("--extract-threads", type=int, default=2)
    args = parser.parse_args()
    paths = sorted(Path(args.images).glob("*.jpg"))[:args.n]
    if not paths:
        print(f"no photos in {args.images}: pass --images DIR (e.g. ../shared/data/flickr8k/images)")
        return 1
    for path in paths:  # the files in the page cache before any timing
        path.read_bytes()
    print(f"{len(paths)} photos of {args.images}, torch intra-op threads {torch.get_num_threads()}")
    counts = [int(n) for n in args.threads.split(",")]
    with BusyNetwork():
        for name, pipeline in (("NumPy", numpy_preprocess), ("torch", torch_preprocess)):
            rates = {n: photos_per_second(paths, n, pipeline) for n in counts}
            first = rates[counts[0]]
            print(f"beside a busy network, normalisation in {name}: " + ", ".join(
                f"{n} decode thread(s) {rate:.0f} photos/s ({rate / first:.1f}x)" for n, rate in rates.items()))
    if args.extract:
        compare_extraction(sorted(Path(args.images).glob("*.jpg"))[:args.extract], args.extract_threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
