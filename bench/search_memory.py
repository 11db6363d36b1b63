"""What a Searcher keeps of the 1000 Flickr8K test photos and the 5000 test captions, per shipped model: the bytes of
the tensors it holds for them, beside the bytes of the full prepared embeddings (regions or words, masks, extras and
vectors: what it kept until 2026-12-04), both measured in the same run. A model whose head is pair-independent
(VSE++, MMCA alpha = 0) scores by the item vectors alone and keeps only those (docs/search.md, "What a search keeps in
memory"); a pair head (SCAN) keeps what its blocks read.

    python bench/search_memory.py [--models mmca_alpha0_lite2_decay4-flickr8k,vsepp_seed1-flickr8k]
                                  [--data ../shared/data/flickr8k] [--work runs/bench/ensemble_search]

The indexes are bench/ensemble_search.py's (built here where they are missing, into --work, git-ignored, and brought
up to date where they are not). Exact byte
counts, not timings. Exits with a message when the data is absent. It also prints each index's bytes on disk beside
those of the image encoder's every field (the features and regions, vectors and extras: what an index of a
pair-independent model stored until 2026-12-05; docs/search.md, "Index"), and what `itmatch index --no-features`
keeps of them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ensemble_search import test_split  # noqa: E402

from itmatch.inference import encode_captions  # noqa: E402
from itmatch.models.base import Embeddings  # noqa: E402
from itmatch.retrieval.index import build_index  # noqa: E402
from itmatch.retrieval.search import Searcher  # noqa: E402


def megabytes(emb: Embeddings | list) -> float:
    """MB of the tensors of embeddings (or of length buckets of them), counted once each."""
    parts = emb if isinstance(emb, list) else [emb]
    tensors = [t for part in parts for t in (part[1] if isinstance(part, tuple) else part).tensors()]
    return sum(t.numel() * t.element_size() for t in tensors) / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mmca_alpha0_lite2_decay4-flickr8k,vsepp_seed1-flickr8k,"
                                            "scan_i2t_lse-flickr8k", help="comma list of shipped models")
    parser.add_argument("--data", default="../shared/data/flickr8k", help="Flickr8K: images/ and Flickr8k.token.txt")
    parser.add_argument("--work", default="runs/bench/ensemble_search", help="photos and indexes (git-ignored)")
    args = parser.parse_args()
    data, work = Path(args.data), Path(args.work)
    if not (data / "images").is_dir():
        print(f"no Flickr8K photos at {data / 'images'}: pass --data DIR")
        return 1
    pairs = test_split(data, work / "photos")
    captions = [caption for _, caption in pairs]
    print(f"MB a Searcher keeps of {len({i for i, _ in pairs})} photos and {len(captions)} captions (kept / full "
          "prepared embeddings)")
    for name in args.models.split(","):
        index = work / name
        build_index(work / "photos", name, index)  # (built, or brought up to date: an older layout is rewritten)
        searcher = Searcher(index, captions=captions)
        searcher.search_image(work / "photos" / pairs[0][0], k=1)  # (encodes the captions, as a first photo query)
        (member,) = searcher.members
        model = member.matcher.model
        with torch.inference_mode():
            fields = model.encode_image_fields(torch.from_numpy(np.array(member.index.features())))
            photos = model.head.prepare_images(fields)
            texts = encode_captions(model, captions, member.matcher.vocab)
        kept_photos, kept_captions = megabytes(member.images), megabytes(searcher._caption_embs[0])
        print(f"{name:<36} photos {kept_photos:8.1f} / {megabytes(photos):8.1f}   captions {kept_captions:8.1f} / "
              f"{megabytes(texts):8.1f}   ({'pair-independent' if model.head.pair_independent else 'pair'} head)",
              flush=True)
        # on disk: the index's arrays, beside what the encoder's every field would take (the layout before
        # 2026-12-05, kept for pair heads: their search reads the regions)
        arrays = member.index.manifest["arrays"]
        on_disk = {name: (index / spec["file"]).stat().st_size / 1e6 for name, spec in arrays.items()}
        every_field = on_disk["features"] + megabytes(fields)
        parts = ", ".join(f"{array} {mb:.1f}" for array, mb in on_disk.items())
        print(f"{'':<36} index on disk {sum(on_disk.values()):8.1f} MB ({parts}) / {every_field:8.1f} MB with the "
              f"encoder's every field (format version {member.index.manifest['version']}); "
              f"{sum(on_disk.values()) - on_disk['features']:.1f} MB with --no-features (the same arrays less the "
              "features)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
