"""Train and evaluate every row of docs/results/flickr8k.csv on Flickr8K (224x224) features.

    python bench/flickr8k.py --row scan_t2i_avg        # one row (trains if RUN/best is absent)
    python bench/flickr8k.py                           # all rows, in order

Features come from `itmatch extract` (see README); every model uses configs/flickr8k/cpu.yaml.
SAVE rows that fuse scales read cached c3/c4 maps too: the first of them runs the multi-scale extraction
(`itmatch extract ... --scales c3,c4,c5`, about as long as the plain one) into DATA_MS; the fine-tuned
row reads the image files (data.images) and trains the backbone end to end (see docs/save.md for its cost).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEDULE = "configs/flickr8k/cpu.yaml"
DATA = "runs/data/flickr8k_lite0"
DATA_MS = "runs/data/flickr8k_lite0_ms"  # + {split}_ims_c3.npy, {split}_ims_c4.npy (SAVE ms2/ms3/NL-ms2)
IMAGES = "../shared/data/flickr8k/images"
CAPTIONS = "../shared/data/flickr8k/Flickr8k.token.txt"
RESULTS = "docs/results/flickr8k.csv"
# SAVE (docs/save.md): Table 4/5 analogue with the backbone frozen, then the best fine-tuned end to end
SAVE = ["save_nosa", "save_dsa", "save_asa", "save_asa_ms2", "save_asa_ms3", "save_nl_ms2", "save_asa_ms3_ft"]
SINGLE = ["vsepp", "summax_t2i", "scan_t2i_avg", "scan_i2t_avg", "scan_i2t_lse", *SAVE]
ENSEMBLES = {"scan_ensemble_t2i_avg+i2t_lse": ["scan_t2i_avg", "scan_i2t_lse"]}
# rows whose model reads something else than DATA's {split}_ims.npy, and their extra settings
ROW_DATA = {"save_asa_ms2": DATA_MS, "save_asa_ms3": DATA_MS, "save_nl_ms2": DATA_MS}
ROW_SETS = {"save_asa_ms3_ft": [f"data.images={IMAGES}"]}


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def ensure_multiscale() -> None:
    """Cache the c3/c4 stage maps beside a copy of the c5 grid (resumable; skipped once complete)."""
    if all((ROOT / DATA_MS / f"{split}_ims_c3.npy").exists() for split in ("train", "dev", "test")):
        return
    run(["itmatch", "extract", IMAGES, CAPTIONS, "--out", DATA_MS, "--scales", "c3,c4,c5"])


def run_row(row: str, threads: int) -> None:
    members = ENSEMBLES.get(row, [row])
    data = ROW_DATA.get(row, DATA)
    if data == DATA_MS:
        ensure_multiscale()
    for preset in members:
        out = f"runs/flickr8k/{preset}"
        if not (ROOT / out / "best").exists():
            resume = ["--resume"] if (ROOT / out / "last").exists() else []
            sets = [x for s in ROW_SETS.get(preset, []) for x in ("--set", s)]
            run(["itmatch", "train", "--preset", preset, "--config", SCHEDULE, "--data", data, "--out", out,
                 "--force", "--set", f"train.threads={threads}", *sets, *resume])
    run(["itmatch", "evaluate", *[f"runs/flickr8k/{p}/best" for p in members], "--data", data,
         "--split", "test", "--protocol", "1k", "--results", RESULTS, "--name", row, "--dataset", "flickr8k",
         "--command", f"python bench/flickr8k.py --row {row}", "--force", "--quiet",
         "--json", f"runs/flickr8k/{row}.test.json"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", action="append", choices=SINGLE + list(ENSEMBLES), help="rows to produce")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per training (0: all)")
    args = parser.parse_args()
    for row in args.row or SINGLE + list(ENSEMBLES):
        run_row(row, args.threads)
    run([sys.executable, "scripts/render_results.py"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
