"""Seconds per training batch of SAVE variants on real Flickr8K photos: frozen backbone with cached
stage maps vs end to end from image files (backbone fine-tuned). A few batches only; the Flickr8K epoch
(30000 captions / batch) is an extrapolation.

Both the process CPU seconds per batch (with --threads 1: the time on one dedicated core, stable when
the machine is shared) and the wall-clock seconds under the current load are reported.

    python bench/save_speed.py --images ../shared/data/flickr8k/images --data runs/data/flickr8k_lite0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from itmatch.data.datasets import PairDataset, collate_pairs
from itmatch.data.images import read_image_split
from itmatch.data.vocab import build_vocab
from itmatch.engine.train import make_optimizer
from itmatch.features.backbones import load_backbone
from itmatch.models.registry import build_model, preset_config

CACHED = ["save_nosa", "save_dsa", "save_asa", "save_asa_ms2", "save_asa_ms3", "save_nl_ms2"]
END_TO_END = ["save_asa_ms3_ft"]


def _step(model, optimizer, images, text) -> tuple[float, float]:
    started, cpu = time.perf_counter(), time.process_time()
    img = model.encode_images(images)
    txt = model.encode_texts(text.tokens, text.lengths)
    loss = model.training_loss(img, txt, 0.2, hardest=True)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
    optimizer.step()
    return time.process_time() - cpu, time.perf_counter() - started


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", required=True, help="Flickr8K images folder")
    p.add_argument("--data", required=True, help="precomp directory (train captions and ids)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=2, help="timed steps per cached model (after one warm-up)")
    p.add_argument("--e2e-steps", type=int, default=2, help="timed end-to-end steps (no warm-up)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--embed", type=int, default=512, help="D (the CPU schedule's 512)")
    p.add_argument("--presets", nargs="*", default=CACHED + END_TO_END,
                   help="presets to time (a pixel preset is timed end to end)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    split = read_image_split(args.data, "train", args.images, augment=True)
    vocab = build_vocab(split.captions)
    ds = PairDataset(split, vocab)
    # one caption per image: a batch of distinct images, as most random batches are
    out: dict[str, object] = {"batch": args.batch, "threads": args.threads, "load_avg": os.getloadavg()}

    t0 = time.process_time()
    items = [ds[5 * i] for i in range(args.batch)]
    out["decode_augment_cpu_s"] = round(time.process_time() - t0, 2)
    batch = collate_pairs(items)
    bb = load_backbone("lite0")
    cached: dict[str, torch.Tensor] = {}
    if any(p in CACHED for p in args.presets):
        t0 = time.process_time()
        with torch.no_grad():  # (not inference_mode: these maps then enter autograd graphs)
            maps = bb.stage_maps(batch.images)
        out["backbone_forward_cpu_s"] = round(time.process_time() - t0, 2)
        cached = {k: v.flatten(2).transpose(1, 2).contiguous() for k, v in maps.items()}

    def run(preset: str, images, steps: int, warmup: int) -> dict:
        cfg = preset_config(preset)
        mc = cfg.model
        mc.vocab_size, mc.embed_size, mc.img_dim = len(vocab), args.embed, 1280
        mc.save.c3_dim, mc.save.c4_dim = bb.stage_dims[0], bb.stage_dims[1]
        model = build_model(mc).train()
        optimizer = make_optimizer(cfg, model, 0)
        times = [_step(model, optimizer, images, batch.text) for _ in range(warmup + steps)][warmup:]
        return {"cpu_s_per_batch": round(statistics.median(t[0] for t in times), 2),
                "wall_s": [round(t[1], 2) for t in times]}

    for preset in args.presets:
        e2e = preset_config(preset).model.save.pixels
        out[preset] = run(preset, batch.images, args.e2e_steps, 0) if e2e else run(preset, cached, args.steps, 1)
        print(preset, out[preset], file=sys.stderr, flush=True)
    batches = 30000 // args.batch
    out["flickr8k_epoch_batches"] = batches
    timed = {k: v for k, v in out.items() if isinstance(v, dict) and "cpu_s_per_batch" in v}
    out["extrapolated_epoch_cpu_minutes"] = {k: round(v["cpu_s_per_batch"] * batches / 60, 1)
                                             for k, v in timed.items()}
    # end to end also decodes and augments every image of every batch
    for preset in (p for p in args.presets if p in END_TO_END):
        out["extrapolated_epoch_cpu_minutes"][preset] = round(
            (out[preset]["cpu_s_per_batch"] + out["decode_augment_cpu_s"]) * batches / 60, 1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
