"""What writing a checkpoint costs, and verifying its manifest on load (docs/reliability.md, row 6).

    python bench/checkpoint_verify.py [--preset scan_t2i_avg] [--embed 1024] [--words 8000] [--repeat 5]

Writes an untrained checkpoint of the preset (default SCAN t-i) at the given size (Lite0 grid features, 1280-d) with
its optimizer's state (the preset's: Adam, SMAN's Adadelta), as `itmatch train` writes `RUN/last`, into a temporary
directory, then times (median of --repeat) the save, the whole `load_checkpoint`, `verify_manifest` alone (SHA-256 of
every file) and the part of it that the JSON files (config.json, vocab.json, state.json) add. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from itmatch.data.vocab import Vocab
from itmatch.engine.checkpoint import CONFIG, STATE, VOCAB, load_checkpoint, save_checkpoint, verify_manifest
from itmatch.engine.train import make_optimizer
from itmatch.io import file_sha256
from itmatch.models.registry import build_model, resolve_config


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="scan_t2i_avg", help="the model and optimizer (default scan_t2i_avg)")
    parser.add_argument("--embed", type=int, default=1024, help="model.embed_size (default 1024)")
    parser.add_argument("--words", type=int, default=8000, help="vocabulary size (default 8000)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    cfg = resolve_config(args.preset, {"model": {"embed_size": args.embed, "img_dim": 1280}})
    vocab = Vocab(f"word{i}" for i in range(args.words))
    cfg.model.vocab_size = len(vocab)
    model = build_model(cfg.model)
    optimizer = make_optimizer(cfg, model, epoch=0)
    for p in model.parameters():  # one step fills the optimizer's state, as a trained run's is
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "last"
        save_seconds = median_seconds(lambda: save_checkpoint(ckpt, model, cfg, vocab, optimizer, {"epoch": 1}),
                                      args.repeat)
        size = sum(p.stat().st_size for p in ckpt.iterdir())
        load_seconds = median_seconds(lambda: load_checkpoint(ckpt), args.repeat)
        verify_seconds = median_seconds(lambda: verify_manifest(ckpt), args.repeat)
        json_seconds = median_seconds(lambda: [file_sha256(ckpt / n) for n in (CONFIG, VOCAB, STATE)], args.repeat)
    print(json.dumps({"preset": args.preset, "optimizer": type(optimizer).__name__, "embed_size": args.embed,
                      "words": args.words, "checkpoint_mb": round(size / 1e6, 1),
                      "save_s": round(save_seconds, 3), "load_s": round(load_seconds, 3),
                      "verify_s": round(verify_seconds, 3), "json_files_s": round(json_seconds, 4),
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
