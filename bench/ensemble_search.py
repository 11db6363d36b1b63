"""Photo search with an ensemble of shipped models against each model alone, on the 1000 Flickr8K test photos: index
the photos once per model (`itmatch index`), search every test caption (5000) through `Searcher`, as a user's
`itmatch search` does, and report text-to-image R@1/5/10 per searcher beside the results table's figures for the
same models (docs/results/flickr8k_gpu.csv, evaluated from extracted features by `itmatch evaluate`), and the
seconds a query takes, each searcher measured in the same run (docs/search.md, 'Ensembles').

    python bench/ensemble_search.py [--models mmca_alpha0_lite2_decay4-flickr8k,vsepp_seed1-flickr8k]
                                    [--table-row ensemble_dev_pick_shipped] [--data ../shared/data/flickr8k]

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


def table_figures(rows: dict[str, dict[str, str]], row: str) -> list[str]:
    """The results table's text-to-image R@1/5/10 of `row` (blank where the table has no such row)."""
    return [rows[row][f"text_to_image_r{k}"] if row in rows else "" for k in KS]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mmca_alpha0_lite2_decay4-flickr8k,vsepp_seed1-flickr8k",
                   help="comma-separated shipped model names, the ensemble's members (default: the pair "
                        "ensemble_dev_pick_shipped chose on dev)")
    p.add_argument("--table-row", default="ensemble_dev_pick_shipped",
                   help="the results table's row of the ensemble, printed beside it")
    p.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/flickr8k")
    p.add_argument("--work", type=Path, default=Path("runs/bench/ensemble_search"))
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
    searchers = {name: Searcher(index) for name, index in zip(names, indexes, strict=True)}
    searchers["ensemble"] = Searcher(indexes[0], ensemble=indexes[1:])
    table_rows = {**{name: models[name].card["results"]["name"] for name in names}, "ensemble": args.table_row}
    print(f"{len(pairs)} test captions over {len({i for i, _ in pairs})} photos; text-to-image recall (%), each "
          "caption's own photo among the first K; `table`: the results table's row, from extracted features")
    print(f"{'searcher':<36} {'R@1':>6} {'R@5':>6} {'R@10':>6}  {'table row':<36} {'R@1':>5} {'R@5':>5} {'R@10':>5}  "
          "s/query")
    table = {r["name"]: r for r in read_rows(RESULTS)}
    seconds = {}
    for name, searcher in searchers.items():
        got, seconds[name] = recalls(searcher, pairs, name)
        figures = table_figures(table, table_rows[name])
        print(f"{name:<36} " + " ".join(f"{r:6.1f}" for r in got) + f"  {table_rows[name]:<36} "
              + " ".join(f"{f:>5}" for f in figures) + f"  {seconds[name]:.4f}")
    alone = sum(seconds[name] for name in names)
    print(f"an ensemble query takes {seconds['ensemble'] / alone:.2f}x its members' queries together "
          f"({seconds['ensemble']:.4f} s against {alone:.4f} s), on {searchers['ensemble'].matcher.device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
