"""Photo search with an ensemble of shipped models against each model alone, on the 1000 Flickr8K test photos: index
the photos once per model (`itmatch index`), search every test caption (5000, or the first --queries) through
`Searcher`, as a user's `itmatch search` does, and report text-to-image R@1/5/10 per searcher beside the results
table's figures for the same models (docs/results/flickr8k_gpu.csv, evaluated from extracted features by `itmatch
evaluate`), and the seconds a query takes, each searcher measured in the same run (docs/search.md, 'Ensembles').
Then the other way, as `itmatch search INDEX --image PHOTO --captions FILE` does: each test photo (or the first
--photos) searched over the 5000 test captions, image-to-text R@1/5/10 (a photo's own captions, matched by their
text) and the seconds a photo query takes (decoding the photo and reading it through the CNN included).

    python bench/ensemble_search.py [--models mmca_alpha0_lite2_decay4-flickr8k,vsepp_seed1-flickr8k]
                                    [--table-row ensemble_dev_pick_shipped] [--data ../shared/data/flickr8k]
                                    [--queries N] [--photos N]

The photos are copied into --work (default runs/bench/ensemble_search, git-ignored; never the repository), where the
indexes stay, so a rerun encodes nothing again. Exits with a message when the data is absent.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
import warnings
from pathlib import Path

from tqdm import tqdm

from itmatch.data.captions import SkippedRowsWarning, read_flickr8k
from itmatch.engine.results import read_rows
from itmatch.pretrained import shipped
from itmatch.retrieval.index import build_index
from itmatch.retrieval.search import Searcher

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "flickr8k_gpu.csv"
KS = (1, 5, 10)


def test_split(data: Path, photos: Path) -> list[tuple[str, str]]:
    """(photo name, caption) of every test caption; the test photos copied into `photos` once."""
    with warnings.catch_warnings():  # (the official file's one known bad row, 2258277193_586949ec62.jpg.1: no test row)
        warnings.simplefilter("ignore", SkippedRowsWarning)
        table = read_flickr8k(data)
    pairs = [(image, caption) for image, caption, split in zip(table.image_ids, table.captions, table.splits,
                                                                strict=True) if split == "test"]
    photos.mkdir(parents=True, exist_ok=True)
    for image in sorted({image for image, _ in pairs}):
        if not (photos / image).is_file():
            shutil.copy2(data / "images" / image, photos / image)
    return pairs


def recalls(searcher: Searcher, pairs: list[tuple[str, str]], what: str) -> tuple[list[float], float]:
    """Text-to-image R@K (percent) over `pairs`, and the mean seconds of one query."""
    found = dict.fromkeys(KS, 0)
    start = time.perf_counter()
    for image, caption in tqdm(pairs, desc=what, unit="query"):
        ranked = [hit.id for hit in searcher.search(caption, k=max(KS))]
        for k in KS:
            found[k] += image in ranked[:k]
    return [100 * found[k] / len(pairs) for k in KS], (time.perf_counter() - start) / len(pairs)


def photo_recalls(searcher: Searcher, pairs: list[tuple[str, str]], photos: Path, n: int | None, what: str
                  ) -> tuple[list[float], float]:
    """Image-to-text R@K (percent) of the first `n` test photos (all: None), each searched over the captions the
    searcher holds (the test captions), and the mean seconds of one photo query after a first, untimed one (which
    encodes the captions and loads the CNNs)."""
    own: dict[str, set[str]] = {}
    for image, caption in pairs:
        own.setdefault(image, set()).add(caption)
    images = list(own)[:n]
    searcher.search_image(photos / images[0], k=1)
    found = dict.fromkeys(KS, 0)
    start = time.perf_counter()
    for image in tqdm(images, desc=f"{what} (photos)", unit="query"):
        ranked = [r["caption"] for r in searcher.search_image(photos / image, k=max(KS))]
        for k in KS:
            found[k] += not own[image].isdisjoint(ranked[:k])
    return [100 * found[k] / len(images) for k in KS], (time.perf_counter() - start) / len(images)


def table_figures(rows: dict[str, dict[str, str]], row: str, direction: str = "text_to_image") -> list[str]:
    """The results table's R@1/5/10 of `row` in `direction` (blank where the table has no such row)."""
    return [rows[row][f"{direction}_r{k}"] if row in rows else "" for k in KS]


def report(title: str, measured: dict[str, tuple[list[float], float]], table: dict[str, dict[str, str]],
           table_rows: dict[str, str], direction: str, members: list[str], device: object) -> None:
    """One line per searcher (its recalls beside its table row's) and the ensemble's query time against its
    members' queries run one after the other."""
    print(title)
    print(f"{'searcher':<36} {'R@1':>6} {'R@5':>6} {'R@10':>6}  {'table row':<36} {'R@1':>5} {'R@5':>5} {'R@10':>5}  "
          "s/query")
    for name, (got, seconds) in measured.items():
        figures = table_figures(table, table_rows[name], direction)
        print(f"{name:<36} " + " ".join(f"{r:6.1f}" for r in got) + f"  {table_rows[name]:<36} "
              + " ".join(f"{f:>5}" for f in figures) + f"  {seconds:.4f}")
    alone, together = sum(measured[name][1] for name in members), measured["ensemble"][1]
    print(f"an ensemble query takes {together / alone:.2f}x its members' queries together "
          f"({together:.4f} s against {alone:.4f} s), on {device}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mmca_alpha0_lite2_decay4-flickr8k,vsepp_seed1-flickr8k",
                   help="comma-separated shipped model names, the ensemble's members (default: the pair "
                        "ensemble_dev_pick_shipped chose on dev)")
    p.add_argument("--table-row", default="ensemble_dev_pick_shipped",
                   help="the results table's row of the ensemble, printed beside it")
    p.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/flickr8k")
    p.add_argument("--work", type=Path, default=Path("runs/bench/ensemble_search"))
    p.add_argument("--queries", type=int, default=None,
                   help="caption queries: the first N test captions (default all 5000; 0: none)")
    p.add_argument("--photos", type=int, default=None,
                   help="photo queries: the first N test photos (default all 1000; 0: no photo queries)")
    args = p.parse_args()
    if not (args.data / "images").is_dir():
        print(f"no Flickr8K photos at {args.data / 'images'} (the shared data): nothing to measure", file=sys.stderr)
        return 2
    names, models = args.models.split(","), shipped()
    if unknown := [n for n in names if n not in models]:
        print(f"not shipped models: {', '.join(unknown)} (itmatch models --pretrained lists them)", file=sys.stderr)
        return 2
    pairs = test_split(args.data, args.work / "photos")
    indexes = []
    for name in names:
        indexes.append(args.work / name)
        build_index(args.work / "photos", name, indexes[-1])
    captions = [caption for _, caption in pairs]
    searchers = {name: Searcher(index, captions=captions) for name, index in zip(names, indexes, strict=True)}
    searchers["ensemble"] = Searcher(indexes[0], ensemble=indexes[1:], captions=captions)
    table_rows = {**{name: models[name].card["results"]["name"] for name in names}, "ensemble": args.table_row}
    table = {r["name"]: r for r in read_rows(RESULTS)}
    device = searchers["ensemble"].matcher.device
    n_photos = len({image for image, _ in pairs})
    if args.queries != 0:
        queries = pairs[:args.queries]
        texts = {name: recalls(searcher, queries, name) for name, searcher in searchers.items()}
        report(f"{len(queries)} test captions over {n_photos} photos; text-to-image recall (%), each caption's own "
               "photo among the first K; `table`: the results table's row, from extracted features",
               texts, table, table_rows, "text_to_image", names, device)
    if args.photos != 0:
        photos = {name: photo_recalls(searcher, pairs, args.work / "photos", args.photos, name)
                  for name, searcher in searchers.items()}
        report(f"\n{min(args.photos or n_photos, n_photos)} test photos over the {len(pairs)} "
               "test captions; image-to-text recall (%), one of the photo's captions among the first K",
               photos, table, table_rows, "image_to_text", names, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
