"""The real trainer's host time a step: `itmatch.engine.train.train` at a tiny joint dimension (D = 32), where the
arithmetic costs little and what the host does around it (the batch's captions, the loader, the step's calls)
dominates, as it does on a GPU whose steps are bound by kernel launches (docs/gpu.md, "The sixth GPU session": the
trainer ran 2.4-2.7x below the model step alone). Each preset is trained twice in the same run, side by side:

- `once`:  as the trainer trains, each training caption encoded once a run (data/datasets.py, PairDataset);
- `every step`: with an identity caption transform, which makes the dataset encode every batch's captions again
  (the trainer's behaviour before 2026-12-04, and still that of a perturbation study's transformed captions).

    python bench/trainer_host.py [--presets vsepp] [--batches 150] [--data runs/data/flickr8k_lite0]

Milliseconds a step from the epoch's train_seconds (resident features, length-bucketed batches of 128, one thread,
the CPU; the validation on 20 dev images is not counted). Exits with a message when the features are absent.

Then the validation of a later epoch, side by side (the whole dev split, 1000 images and 5000 captions, the first
preset's model from its `once` run, the best of --repeats): with the vocabulary as it is, which tokenizes every dev
caption twice a validation (the ids, then the unknown-word report: the trainer until 2026-12-04), and through a
RememberedVocab after one validation, as the trainer's epochs after the first read them now.

Measured 2026-12-04 (CPU AMD EPYC, 2 cores): VSE++ 28.0 ms once against 40.7 every step (1.45x); SCAN t-i AVG 628 /
619 and SMAN 995 / 976, where the CPU's arithmetic of the region-word pairs hides the 13 ms (a GPU does that
arithmetic in a few ms, so there the 13 ms of host time stand beside ~20 ms of launches). The validation, measured
the same day (`--batches 60`, VSE++ at D = 32): 1.17 s tokenizing the captions against 0.18 s with them remembered.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import timed  # noqa: E402  (best of `repeats` after one untimed call)

from itmatch.config import parse_overrides  # noqa: E402
from itmatch.data.vocab import RememberedVocab  # noqa: E402
from itmatch.engine.checkpoint import load_checkpoint  # noqa: E402
from itmatch.engine.evaluate import evaluate_models  # noqa: E402
from itmatch.engine.inputs import open_split  # noqa: E402
from itmatch.engine.train import train  # noqa: E402
from itmatch.models.registry import resolve_config  # noqa: E402


def identity(caption: str, j: int) -> str:
    return caption


def ms_a_step(preset: str, data: str, batches: int, out: Path, per_step: bool) -> float:
    cfg = resolve_config(preset, parse_overrides([
        f"data.path={data}", "model.embed_size=32", "model.word_dim=32", "train.epochs=1",
        f"train.max_batches={batches}", "train.val_images=20", "train.threads=1", "train.bucket_by_length=true",
        "train.device=cpu", "train.resident=on"]))
    train(cfg, out, force=True, progress=False, transform=identity if per_step else None)
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "train_seconds" in line]
    return 1000 * epochs[-1]["train_seconds"] / batches


def validation_seconds(run: Path, repeats: int) -> tuple[float, float]:
    """Seconds of a validation on the whole dev split by the run's model: tokenizing the captions each time, and with
    them remembered (the best of `repeats` each)."""
    ckpt = load_checkpoint(run / "best")
    dev = open_split(ckpt.config, ckpt.config.data.val_split)
    cpu = torch.device("cpu")
    # (timed's untimed first call is, for the remembered one, the first epoch's validation, which reads the captions)
    return tuple(timed(lambda vocab=vocab: evaluate_models([(ckpt.model, vocab)], dev), cpu, repeats)
                 for vocab in (ckpt.vocab, RememberedVocab(ckpt.vocab)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="vsepp", help="comma list of presets")
    parser.add_argument("--batches", type=int, default=150, help="training steps timed per run")
    parser.add_argument("--data", default="runs/data/flickr8k_lite0", help="precomp directory (itmatch extract)")
    parser.add_argument("--repeats", type=int, default=3, help="timed validations each way (the best is kept)")
    args = parser.parse_args()
    if not (Path(args.data) / "train_ims.npy").is_file():
        print(f"no extracted features at {args.data}: run `itmatch extract ... --out {args.data}` first")
        return 1
    torch.set_num_threads(1)
    print(f"ms a training step, D = 32, batch 128, {args.batches} steps, one CPU thread")
    print(f"{'preset':<16} {'once':>8} {'every step':>11} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            once = ms_a_step(preset, args.data, args.batches, Path(tmp) / f"{preset}_once", per_step=False)
            every = ms_a_step(preset, args.data, args.batches, Path(tmp) / f"{preset}_every", per_step=True)
            print(f"{preset:<16} {once:8.1f} {every:11.1f} {every / once:5.2f}x", flush=True)
        preset = args.presets.split(",")[0]
        tokenized, remembered = validation_seconds(Path(tmp) / f"{preset}_once", args.repeats)
        print(f"validation on the dev split, {preset}: {tokenized:.2f} s tokenizing its captions, {remembered:.2f} s "
              f"with them remembered ({tokenized / remembered:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
