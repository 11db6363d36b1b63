"""Photo search with a SMAN model (docs/search.md, docs/sman.md): index N real Flickr8K test photos with an
untrained SMAN at the preset's sizes (and SCAN t-i AVG for comparison), then report per model the stored
bytes per photo by array, the indexing and loading seconds, one query's seconds and the largest difference
between the searcher's scores and `itmatch.load(CKPT).score` of the same stored features (0 = identical).

    python bench/sman_index.py [--images 200] [--data ../shared/data/flickr8k]

Untrained weights: the figures are costs and exactness, not quality. The photos are copied to a temporary
folder (never into the repository); the script exits with a message when the data is absent.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import itmatch
from itmatch.data.vocab import Vocab
from itmatch.engine.checkpoint import save_checkpoint
from itmatch.inference import score_matrix
from itmatch.models.registry import build_model, resolve_config
from itmatch.retrieval.index import build_index, load_index
from itmatch.retrieval.search import Searcher

QUERY = "a black dog runs through the grass"


def untrained_checkpoint(preset: str, folder: Path) -> Path:
    vocab = Vocab(QUERY.split())
    cfg = resolve_config(preset, {"model": {"img_dim": 1280, "vocab_size": len(vocab)}})
    torch.manual_seed(0)
    save_checkpoint(folder, build_model(cfg.model), cfg, vocab)
    return folder


def measure(preset: str, photos: Path, work: Path) -> dict[str, float | dict[str, int]]:
    ckpt = untrained_checkpoint(preset, work / f"ckpt-{preset}")
    out = work / f"index-{preset}"
    started = time.perf_counter()
    build_index(photos, ckpt, out, progress=False)
    index_s = time.perf_counter() - started
    index = load_index(out)
    n = len(index.ids)
    per_photo = {name: int(np.prod(spec["shape"][1:])) * 4
                 for name, spec in index.manifest["arrays"].items()}
    started = time.perf_counter()
    searcher = Searcher(out)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    searcher.search(QUERY, k=10)
    query_s = time.perf_counter() - started
    with torch.inference_mode():
        got = score_matrix(searcher.model, searcher.images, searcher.encode_query(QUERY))[:, 0]
    reference = itmatch.load(ckpt).score(torch.from_numpy(np.array(index.features())), [QUERY])[:, 0]
    return {"photos": n, "bytes_per_photo": per_photo, "index_s": index_s, "load_s": load_s, "query_s": query_s,
            "max_abs_diff": float((got - reference).abs().max())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--data", type=Path,
                        default=Path(__file__).resolve().parents[2] / "shared" / "data" / "flickr8k")
    parser.add_argument("--presets", nargs="+", default=["sman", "scan_t2i_avg"])
    args = parser.parse_args()
    ids_file = args.data / "Flickr_8k.testImages.txt"
    if not ids_file.is_file():
        print(f"Flickr8K not found at {args.data} (needs Flickr_8k.testImages.txt and images/): nothing measured",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        photos = work / "photos"
        photos.mkdir()
        for name in ids_file.read_text().split()[:args.images]:
            shutil.copy(args.data / "images" / name, photos / name)
        for preset in args.presets:
            r = measure(preset, photos, work)
            sizes = ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in r["bytes_per_photo"].items())
            print(f"{preset}: {r['photos']} photos; per photo {sizes}; index {r['index_s']:.1f} s, "
                  f"load {r['load_s']:.2f} s, query {1000 * r['query_s']:.1f} ms, "
                  f"max |search - load().score| {r['max_abs_diff']:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
