"""How large each family's converged Flickr8K model would be in the shipped form (fp16 safetensors; limit 20 MB):
the presets at their papers' D, with the Flickr8K vocabulary (words with count >= 4 in the training captions) and
Lite0 cells, frozen (cached features) and with the fine-tuned CNN inside (pixels), and the GPU row that ships SCAN
at a smaller D. No training: sizes only.

    python bench/pretrained_sizes.py [--captions ../shared/data/flickr8k/Flickr8k.token.txt]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ["vsepp", "scan_i2t_lse", "scan_t2i_avg", "oan", "mmca", "save_dsa", "save_asa_ms3", "sman"]


def flickr8k_vocab_size(captions: Path) -> int:
    from itmatch.data.captions import read_captions
    from itmatch.data.vocab import build_vocab

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the token file's 5 known stray rows)
        table = read_captions(captions, images_dir=captions.parent / "images", fmt="flickr8k")
    return len(build_vocab([c for c, s in zip(table.captions, table.splits, strict=True) if s == "train"]))


def fp16_megabytes(preset: str, vocab_size: int, pixels: bool, overrides: Sequence[str] = ()) -> tuple[int, float]:
    """(D, MB of the model's state dict in fp16: what scripts/ship_pretrained.py writes, less a few KB of JSON)
    for a preset with `overrides` (a bench row's `key=value`s). MMCA's frozen MiniLM is not in it (it comes from
    PyPI)."""
    from itmatch.config import parse_overrides
    from itmatch.models.registry import arch, build_model, resolve_config

    mc = resolve_config(preset, parse_overrides([*overrides, f"model.pixels={str(pixels).lower()}"])).model
    mc.img_dim, mc.save.c3_dim, mc.save.c4_dim, mc.vocab_size = 1280, 40, 112, vocab_size
    tokenizer = arch(mc).tokenizer(mc)  # a model that brings its tokenizer (MMCA's WordPiece) has its vocabulary
    if tokenizer is not None:
        mc.vocab_size = len(tokenizer)
    state = build_model(mc).state_dict()
    return mc.embed_size, sum(t.numel() * (2 if t.is_floating_point() else t.element_size())
                              for t in state.values()) / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--captions", type=Path, default=ROOT.parent / "shared/data/flickr8k/Flickr8k.token.txt")
    args = parser.parse_args()
    if not args.captions.is_file():
        sys.exit(f"{args.captions}: not found (the Flickr8K captions; pass --captions)")
    vocab = flickr8k_vocab_size(args.captions)
    print(f"Flickr8K vocabulary: {vocab} words (count >= 4 in the training captions)\n")
    print("| preset | D | fp16 MB, cached features | fp16 MB, fine-tuned CNN inside |")
    print("|---|---:|---:|---:|")
    sys.path.insert(0, str(ROOT / "bench"))
    from flickr8k import GPU_CONTROLS, SHIPPED_SCAN

    rows = [(preset, preset, []) for preset in PRESETS]
    rows.append((f"{SHIPPED_SCAN} (GPU row)", *GPU_CONTROLS[SHIPPED_SCAN]))
    for label, preset, overrides in rows:
        d, frozen = fp16_megabytes(preset, vocab, False, overrides)
        _, tuned = fp16_megabytes(preset, vocab, True, overrides)
        print(f"| {label} | {d} | {frozen:.1f} | {tuned:.1f} |")
    from itmatch.pretrained import MAX_BYTES

    print(f"\n(the limit of a shipped model: {MAX_BYTES / 1e6:g} MB, decimal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
