"""The main job on the embedded default: synth -> extract -> train SCAN t-i AVG -> evaluate.

Sized to finish in a few minutes on 2 CPU cores: 1000/100/100 rendered images, D = 256, 6 epochs with
one warm-up epoch on the sum over negatives (see docs/training.md). Each step is skipped when its
output is already complete, so an interrupted demo resumes where it stopped."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from itmatch.errors import OverwriteError

DEMO_SETTINGS = {
    "model": {"embed_size": 256},
    "train": {"epochs": 6, "lr": 2e-4, "lr_update": 4, "batch_size": 128, "val_images": 100, "log_every": 10,
              "checkpoint_every": 10},
    "loss": {"warmup_epochs": 1},
}


def run_demo(out: Path, *, force: bool = False, epochs: int = 6, n_train: int = 1000, n_eval: int = 100,
             progress: bool = True, device: str = "auto", precision: str = "fp32") -> dict:
    from itmatch.data.captions import read_captions
    from itmatch.data.precomp import features_path, read_precomp
    from itmatch.data.synth import render_synthetic
    from itmatch.device import resolve
    from itmatch.engine.checkpoint import load_checkpoint
    from itmatch.engine.evaluate import evaluate_models, format_table
    from itmatch.engine.train import train
    from itmatch.features.extract import extract_precomp
    from itmatch.models.registry import resolve_config

    placement = resolve(device, precision)  # (before any work)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force and not (out / "demo.started").exists():
        raise OverwriteError(f"{out} exists and is not a demo directory", path=out,
                             hint="pass --force or another --out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.started").touch()
    timings = {}

    t = time.perf_counter()
    scenes = out / "synth"
    if force or not (scenes / "dataset_synth.json").exists():
        render_synthetic(scenes, n_train=n_train, n_dev=n_eval, n_test=n_eval, seed=0, force=True,
                         progress=progress)
    timings["synth"] = time.perf_counter() - t

    t = time.perf_counter()
    precomp = out / "precomp"
    if force or not features_path(precomp, "test").exists():
        table = read_captions(scenes / "dataset_synth.json")
        extract_precomp(scenes / "images", table, precomp, force=True, progress=progress,
                        device=placement.device, precision=precision)
    timings["extract"] = time.perf_counter() - t

    t = time.perf_counter()
    run = out / "scan_t2i_avg"
    settings = {**DEMO_SETTINGS, "train": {**DEMO_SETTINGS["train"], "epochs": epochs},
                "data": {"path": str(precomp)}}
    cfg = resolve_config("scan_t2i_avg", settings)
    state_file = run / "last" / "state.json"
    trained = json.loads(state_file.read_text(encoding="utf-8")).get("epoch", 0) if state_file.is_file() else 0
    if not force and trained > epochs:
        print(f"note: the demo's model in {run} has trained {trained} epochs already, more than --epochs {epochs}; "
              f"it is evaluated as it is (--force starts over)", file=sys.stderr)
    if force or trained < epochs:
        # a killed demo continues its training from its last (mid-epoch) checkpoint, and a finished one trains
        # on up to --epochs (a resume override of train.epochs); --force starts over
        resume = not force and (run / "config.json").exists()
        train(cfg, run, resume=resume, force=True, progress=progress, device=str(placement.device),
              precision=precision, resume_overrides={"train": {"epochs": epochs}} if resume else None)
    timings["train"] = time.perf_counter() - t

    ckpt = load_checkpoint(run / "best")
    result = evaluate_models([(ckpt.model.to(placement.device), ckpt.vocab)], read_precomp(precomp, "test"), "full",
                             precision=precision)
    timings = {k: round(v, 1) for k, v in timings.items()}
    print(format_table(result))
    # a random ranking puts a positive first with probability ~1/N in both directions
    print(f"R@1 at chance: {100 / result['n_images']:.1f} in both directions; step seconds: {timings}")
    result["timings"] = timings
    return result
