"""Convert a trained checkpoint to the shipped form of a pretrained model (fp16 safetensors, at most 20 MB),
loadable by name with itmatch.load(NAME) and `itmatch index PHOTOS --model NAME`:

    python scripts/ship_pretrained.py runs/flickr8k_gpu/scan_i2t_lse/best scan_i2t_lse-flickr8k \
        --results docs/results/flickr8k_gpu.csv --row scan_i2t_lse

writes src/itmatch/pretrained/scan_i2t_lse-flickr8k/ (model.safetensors, manifest.json, config.json, vocab.json,
card.json with the results row and the command that trained it). Commit each shipped file once, when final.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from itmatch.engine.results import read_rows
from itmatch.errors import DataError, ItmatchError
from itmatch.pretrained import MAX_BYTES, PRETRAINED_DIR, ship


def results_row(path: Path, row: str) -> dict[str, str]:
    rows = {r["name"]: r for r in read_rows(path)}
    if row not in rows:
        raise DataError(f"no row {row!r}", path=path, hint=f"one of: {', '.join(rows) or 'the file has no rows'}")
    return rows[row]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="checkpoint directory written by `itmatch train` (e.g. RUN/best)")
    parser.add_argument("name", help="the name to load it by, e.g. scan_i2t_lse-flickr8k")
    parser.add_argument("--results", type=Path, help="results CSV holding the model's row (docs/results/*.csv)")
    parser.add_argument("--row", help="the row of --results that evaluated this checkpoint")
    parser.add_argument("--max-mb", type=float, default=MAX_BYTES / 1e6, help="size limit in MB (default 20)")
    parser.add_argument("--out-root", type=Path, default=PRETRAINED_DIR,
                        help=f"where shipped models live (default {PRETRAINED_DIR})")
    parser.add_argument("--force", action="store_true", help="replace a shipped model of the same name")
    args = parser.parse_args(argv)
    if (args.results is None) != (args.row is None):
        parser.error("--results and --row go together")
    if not args.out_root.is_dir():  # (ship writes a temporary folder there first)
        parser.error(f"--out-root {args.out_root}: no such folder")
    try:
        row = results_row(args.results, args.row) if args.results else None
        target = ship(args.checkpoint, args.name, root=args.out_root, results=row,
                      max_bytes=int(args.max_mb * 1e6), force=args.force)
    except ItmatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in target.iterdir())
    print(f"shipped {args.name}: {target} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
