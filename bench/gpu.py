"""Accelerator benchmarks of issue 23 (docs/gpu.md): run them on a GPU; they also run on the CPU at small
sizes (--smoke), which is how they are kept working without one.

  python bench/gpu.py eval  --device cuda            # SCAN t-i AVG, 1000 x 36 x 1024 vs the 5000 F30K test captions
  python bench/gpu.py blocks --device cuda           # the same evaluation with caps of 4M..256M cells per block
  python bench/gpu.py train --device cuda            # training throughput per preset, fp32 vs bf16
  python bench/gpu.py train --device cuda --data runs/data/flickr8k_lite0 --epochs 20   # + recall of both
  python bench/gpu.py eval train --device cpu --smoke  # the CPU check (seconds)
  python bench/gpu.py resident --device cuda --data runs/data/flickr8k_lite0   # features resident vs streamed
  python bench/gpu.py syncs --device cuda --data runs/data/flickr8k_lite0 --presets scan_t2i_avg   # host waits
  python bench/gpu.py profile --device cuda --data runs/data/flickr8k_lite0 --presets sman   # where a step goes

eval: exact evaluation of the SCAN t-i AVG head at Flickr30K test scale (random region features, the real test
captions' lengths), seconds in fp32, TF32 and bf16 autocast, the FLOPs actually executed (torch's counter) as a
fraction of the same device's measured matmul peak (fp32, TF32, bf16 GEMMs timed in the same run), beside the
public per-caption loop (bench/scan_reference.py, the same math as SCAN's evaluation.py) on the same device and
embeddings, in each mode's precision (so every speed-up has a same-precision baseline; a ratio against the exact
float32 loop is printed as cross-precision) and in float64, timed on whole 128-image shards with the same --repeats
as the engine, with the largest difference from it. Those rows time the plain head
(ITMATCH_FUSED off); the `eval fused` rows then time the fused Triton kernel (models/scan/fused.py) in the same
modes on the same embeddings, with its largest difference from the float32 plain head (CUDA + triton only; the
CPU smoke run says it skips them).
blocks: the same evaluation with each cap on a block's region-word cells (--cells): blocks made, seconds of the
plain head (fp32) and the fused kernel (fp32, bf16), largest difference from the plain fp32 head at the default cap.
train: images/s and seconds per Flickr8K epoch of every preset's training step (forward, loss, backward, Adam)
at batch 128 in fp32 and bf16; with --data, the same schedule trained in both precisions and the 1K test
rsum of each (issue 23: bf16 must not lose more than 1 rsum).
resident: one epoch of the real trainer (itmatch.engine.train, --max-batches caps it) per preset with the
training features streamed from pinned host memory (train.resident=off) and resident on the device (on), after
a short warm-up run: train seconds and images/s of each, and the largest weight difference between the two
(0 on the CPU; on a GPU nondeterministic kernels may leave last-bit differences). The trainer copies resident
features once before its epoch timer starts: that one-off upload is timed apart (the same copy,
engine.resident.resident_images) and reported beside the epoch, with the resident epoch plus it.
--workers sets train.workers.
syncs: every call that makes the host wait for the GPU during a few steps of the real trainer and its validation,
counted per line of itmatch's source (CUDA only: torch.cuda.set_sync_debug_mode).
profile: a few steps of the real trainer per preset, plain (ms a step), under cProfile (Python functions by their own
time) and under torch.profiler (ops by their own host and device time): where the trainer's time goes beside the
model step that `train` times alone.
Writes a JSON report (--out) and prints one line per measurement; nothing here is a test."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from perf import F30K, counted_flops, make_model, random_features, read_captions  # noqa: E402

from itmatch.config import Config  # noqa: E402
from itmatch.data.datasets import pad_tokens  # noqa: E402
from itmatch.device import Placement, resolve  # noqa: E402
from itmatch.inference import (  # noqa: E402
    default_block_cells,
    encode_caption_buckets,
    encode_images,
    score_matrix,
    unbucket_texts,
)
from itmatch.models.scan import fused  # noqa: E402

FLICKR8K_TRAIN_CAPTIONS = 30000  # 6000 images x 5: one epoch at batch 128 is 234 steps
LITE0_REGIONS = 49  # `train` steps on Lite0's 7 x 7 grid of cells, what the Flickr8K rows train on


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int = 3) -> float:
    """Best wall seconds of `repeats` calls after one warm-up call (kernels compiled, allocator warm)."""
    fn()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


@contextlib.contextmanager
def mode_arithmetic(device: torch.device, mode: str) -> Iterator[None]:
    """A timed mode's arithmetic: fp32 and bf16 as itmatch runs them (Placement.arithmetic: fp32 exact, TF32 off);
    tf32 is float32 with TensorFloat-32 allowed in cuBLAS and cuDNN, which no itmatch precision turns on."""
    if mode != "tf32":
        with Placement(device, mode).arithmetic():
            yield
        return
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def matmul_peak_tflops(device: torch.device, dtype: torch.dtype, size: int, tf32: bool = False) -> float:
    """The device's dense GEMM peak as measured here: best of a few size^3 products in `dtype`."""
    with mode_arithmetic(device, "tf32" if tf32 else "fp32"):  # (a bf16 product is bf16 either way)
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        return 2 * size**3 / timed(lambda: a @ b, device, 5) / 1e12


def eval_inputs(args, device: torch.device):
    """SCAN t-i AVG at the paper's D = 1024 on `device`, and its embeddings of --images random region grids and the
    first --captions Flickr30K test captions (in length buckets): what `eval` and `blocks` score."""
    model, cfg, vocab = make_model("scan_t2i_avg")
    model.to(device)
    captions = read_captions(F30K[0], args.captions)
    with torch.inference_mode():
        img = encode_images(model, random_features(args.images))
        buckets = encode_caption_buckets(model, captions, vocab)
    return model, cfg, img, buckets


def section_eval(args, placement: Placement) -> dict:
    device = placement.device
    model, cfg, img, buckets = eval_inputs(args, device)
    n, m = len(img), sum(len(c) for c, _ in buckets)
    with fused.switched(False):  # the plain head's FLOPs (the kernel's elementwise work is not counted either way)
        flops = counted_flops(lambda: score_matrix(model, img.take(torch.arange(1)), buckets)) * n
    gemm = 4096 if device.type == "cuda" else 1024
    peaks = {"fp32": matmul_peak_tflops(device, torch.float32, gemm)}
    if device.type == "cuda":
        peaks["tf32"] = matmul_peak_tflops(device, torch.float32, gemm, tf32=True)
        peaks["bf16"] = matmul_peak_tflops(device, torch.bfloat16, gemm)
    with fused.switched(False):
        reference = score_matrix(model, img, buckets)  # the plain head in float32: what every row is compared with
    rows = []
    for mode in (["fp32", "tf32", "bf16"] if device.type == "cuda" else ["fp32", "bf16"]):
        with mode_arithmetic(device, mode), fused.switched(False):
            seconds = timed(lambda: score_matrix(model, img, buckets), device, args.repeats)
            scores = score_matrix(model, img, buckets)
        peak = peaks.get(mode, peaks["fp32"])
        row = {"mode": mode, "images": n, "captions": m, "seconds": round(seconds, 4), "tflop": flops / 1e12,
               "tflops": flops / seconds / 1e12, "peak_tflops": peak, "fraction_of_peak": flops / seconds / 1e12 / peak,
               "max_abs_diff_vs_fp32": float((scores - reference).abs().max())}
        rows.append(row)
        print(f"eval {mode:<5} {seconds:8.3f} s  {row['tflops']:.3g} TFLOP/s = {100 * row['fraction_of_peak']:.0f}% "
              f"of the {peak:.3g} measured  (max diff vs fp32 {row['max_abs_diff_vs_fp32']:.1e})", flush=True)
    fused_rows = section_fused(model, img, buckets, reference, rows, device, args.repeats)
    public = public_loop(args, img, buckets, reference, device, [row["mode"] for row in rows])
    by_mode = {r["mode"]: r for r in public}
    for row in rows:  # the engine's mode against the loop in the same precision, and against the float32 loop
        same = by_mode.get(row["mode"])
        row["speedup_vs_loop_same_precision"] = same["seconds_all_images"] / row["seconds"] if same else None
        row["speedup_vs_loop_fp32"] = by_mode["fp32"]["seconds_all_images"] / row["seconds"]
        row["speedup_vs_loop_fp32_is_cross_precision"] = row["mode"] != "fp32"
        print(f"eval {row['mode']:<5} {row['speedup_vs_loop_same_precision']:.1f}x the loop in {row['mode']} (same "
              f"precision); {row['speedup_vs_loop_fp32']:.1f}x the exact float32 loop"
              + (" (CROSS-PRECISION: engine in " + row["mode"] + ", loop in exact fp32)" if row["mode"] != "fp32"
                 else ""), flush=True)
    for row in fused_rows.get("modes", []):
        row["speedup_vs_loop_same_precision"] = by_mode[row["mode"]]["seconds_all_images"] / row["seconds"]
        row["speedup_vs_loop_fp32"] = by_mode["fp32"]["seconds_all_images"] / row["seconds"]
        row["speedup_vs_loop_fp32_is_cross_precision"] = row["mode"] != "fp32"
    return {"preset": "scan_t2i_avg", "embed": cfg.model.embed_size, "regions": 36, "modes": rows,
            "fused": fused_rows, "public_loop": public, "measured_peak_tflops": peaks}


def public_loop(args, img, buckets, reference: torch.Tensor, device: torch.device, modes: list[str]) -> list[dict]:
    """The public per-caption loop (bench/scan_reference.py: SCAN's shard_xattn_t2i, shards of 128) on the same device
    and embeddings, in each engine mode's precision (fp32 exact; tf32: float32 with TF32 on; bf16: under bf16 autocast)
    and in float64 (as SCAN's evaluation.py runs it). Its cost is one step per caption per 128-image shard, each step
    growing with the shard's images (on a GPU nearly not at all: it is bound by launches), so it is timed on whole
    shards, never on a few images scaled up: the first shard and the last, partial one (if any), each the best of
    --repeats after a warm-up, as the engine is timed; the other full shards cost what the first does. With
    --reference-captions C, every k-th caption (C of them), its time extrapolated by caption count (the per-caption
    steps are independent); by default all captions, nothing extrapolated."""
    from scan_reference import _xattn

    n = len(img)
    txt = unbucket_texts(buckets)
    m_all = len(txt)
    step = max(1, m_all // args.reference_captions) if args.reference_captions else 1
    sub = torch.arange(0, m_all, step)[:args.reference_captions or None]
    txt = txt.take(sub.to(txt.lengths.device)).trimmed()
    m, lengths = len(txt), txt.lengths.tolist()
    full, partial = divmod(n, 128)
    shards = ([(0, 128, full)] if full else []) + ([(full * 128, n, 1)] if partial else [])  # (first, end, count)
    out = []
    for mode, dtype in [*((mode, torch.float32) for mode in modes), ("fp64", torch.float64)]:
        images, words = img.regions.to(dtype), txt.words.to(dtype)

        def shard(i0, i1, images=images, words=words):
            with torch.inference_mode():
                return torch.cat([_xattn(images[i0:i1], words[j0:j0 + 128], lengths[j0:j0 + 128], "t2i", "avg", 9.0,
                                         6.0) for j0 in range(0, m, 128)], 1)

        seconds, diff = 0.0, 0.0
        with mode_arithmetic(device, "fp32" if mode == "fp64" else mode):
            for i0, i1, count in shards:
                seconds += count * timed(functools.partial(shard, i0, i1), device, args.repeats) * m_all / m
                expected = reference[i0:i1][:, sub]
                diff = max(diff, float((shard(i0, i1).float().cpu() - expected).abs().max()))
        precision = {"fp32": "float32, exact", "tf32": "float32 with TF32 on", "bf16": "float32 under bf16 autocast",
                     "fp64": "float64, as SCAN's evaluation.py"}[mode]
        out.append({"mode": mode, "dtype": str(dtype).removeprefix("torch."), "precision": precision,
                    "timed_shards": [[i0, i1] for i0, i1, _ in shards], "captions_timed": m,
                    "seconds_all_images": round(seconds, 3), "max_abs_diff_vs_engine_fp32": diff})
        print(f"public loop {mode:<5} ({precision}) {seconds:8.2f} s for {n} images x {m_all} captions (whole "
              f"128-image shards timed: {', '.join(f'{i0}-{i1}' for i0, i1, _ in shards)}, best of {args.repeats}"
              + (f"; {m} captions timed, extrapolated" if m < m_all else "")
              + f"), max diff vs the fp32 engine {diff:.1e}", flush=True)
    return out


def section_fused(model, img, buckets, reference: torch.Tensor, plain_rows: list[dict], device: torch.device,
                  repeats: int) -> dict:
    """The fused t-i kernel (models/scan/fused.py, docs/gpu.md) in each mode of the plain rows, on the same
    embeddings in the same run: seconds, the plain head's seconds beside them, the largest difference from the
    float32 plain head (`reference`), and how many blocks went through the kernel (0: why not)."""
    missing = fused.triton_missing() if device.type == "cuda" else f"the device is {device.type}, the kernel needs CUDA"
    if missing:
        print(f"eval fused: skipped ({missing})", flush=True)
        return {"skipped": missing}
    rows = []
    for plain_row in plain_rows:
        mode = plain_row["mode"]
        with mode_arithmetic(device, mode), fused.switched(True):
            seconds = timed(lambda: score_matrix(model, img, buckets), device, repeats)
            before = fused.launches
            scores = score_matrix(model, img, buckets)
            launched = fused.launches - before
            why = None if launched else fused.unusable_reason("clipped_l2norm", "avg", *_probe(device))
        plain = plain_row["seconds"]
        row = {"mode": mode, "seconds": round(seconds, 4), "plain_seconds": plain, "speedup": plain / seconds,
               "kernel_launches": launched, "kernel_off_because": why,
               "max_abs_diff_vs_fp32_plain": float((scores - reference).abs().max())}
        rows.append(row)
        used = f"{launched} kernel launches" if launched else f"KERNEL NOT USED: {why}"
        print(f"eval fused {mode:<5} {seconds:8.3f} s  ({row['speedup']:.1f}x the plain head's {plain:.3f} s; {used})"
              f"  (max diff vs the fp32 plain head {row['max_abs_diff_vs_fp32_plain']:.1e})", flush=True)
    return {"modes": rows}


def section_blocks(args, placement: Placement) -> dict:
    """The evaluation of `eval` with each cap on a block's region-word cells (--cells): the blocks it makes, and the
    seconds of the plain head in fp32 and of the fused kernel (where it runs) in fp32 and bf16, with the largest
    difference from the plain head in fp32 at the device's default cap. The GPU's default cap
    (inference.GPU_BLOCK_CELLS) was chosen from one such sweep's reasoning before it was measured: this measures it."""
    device = placement.device
    model, _, img, buckets = eval_inputs(args, device)
    with fused.switched(False):
        reference = score_matrix(model, img, buckets)
    kernel = device.type == "cuda" and not fused.triton_missing()
    modes = [("fp32", False), *([("fp32", True), ("bf16", True)] if kernel else [])]
    rows = []
    for cells in args.cells:
        row: dict = {"max_cells": cells}
        for mode, use_kernel in modes:
            name = f"{'fused' if use_kernel else 'plain'}_{mode}"
            with mode_arithmetic(device, mode), fused.switched(use_kernel):
                row[f"{name}_seconds"] = round(timed(lambda c=cells: score_matrix(model, img, buckets, max_cells=c),
                                                     device, args.repeats), 4)
                blocks: list[int] = []  # (the blocks scored, budget included: the plan the timings ran)
                scores = score_matrix(model, img, buckets, max_cells=cells, on_block=blocks.append)
            row["blocks"] = len(blocks)
            row[f"{name}_max_diff"] = float((scores - reference).abs().max())
        rows.append(row)
        print(f"blocks {cells:>11,} cells {row['blocks']:5d} blocks  " + "  ".join(
            f"{k.removesuffix('_seconds')} {v:.3f} s" for k, v in row.items() if k.endswith("_seconds")), flush=True)
    return {"preset": "scan_t2i_avg", "images": len(img), "default_cells": default_block_cells(device), "rows": rows}


def _probe(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 1 x 1 x 1 x 1 block (dots, Gram, words) on `device`: asks fused.unusable_reason why it was off, if it was."""
    return (torch.zeros(1, 1, 1, 1, device=device), torch.zeros(1, 1, 1, device=device),
            torch.zeros(1, 1, 1, device=device))


def training_step(model, cfg, feats: torch.Tensor, batch, optimizer, scaler, placement: Placement) -> None:
    with placement.arithmetic():
        loss = model.training_loss(model.encode_images(feats), model.encode_texts(batch.tokens, batch.lengths),
                                   cfg.loss.margin, hardest=True)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
    scaler.step(optimizer)
    scaler.update()


def section_train(args, placement: Placement) -> dict:
    device = placement.device
    precisions = ["fp32", "bf16"]
    captions = read_captions(F30K[0], args.batch)
    feats = torch.from_numpy(random_features(args.batch, seed=2, k=LITE0_REGIONS, dim=args.img_dim)).to(device)
    rows = []
    for preset in args.presets:
        for precision in precisions:
            model, cfg, vocab = make_model(preset, embed=args.embed, img_dim=args.img_dim, training=True,
                                           regions=LITE0_REGIONS)
            model.to(device).train()
            run = Placement(device, precision)
            batch = pad_tokens([vocab.encode(c) for c in captions]).to(device)
            optimizer = torch.optim.Adam(model.parameters(), lr=2e-4)
            scaler = run.grad_scaler()
            step = functools.partial(training_step, model, cfg, feats, batch, optimizer, scaler, run)
            seconds = timed(step, device, args.steps)
            row = {"preset": preset, "precision": precision, "embed": cfg.model.embed_size, "batch": args.batch,
                   "seconds_per_step": round(seconds, 4), "images_per_s": args.batch / seconds,
                   "flickr8k_epoch_seconds": FLICKR8K_TRAIN_CAPTIONS // args.batch * seconds}
            rows.append(row)
            print(f"train {preset:<16} {precision}  {row['images_per_s']:8.0f} img/s  "
                  f"{row['flickr8k_epoch_seconds']:7.1f} s per Flickr8K epoch (model step only)", flush=True)
    recall = []
    if args.data:
        recall = train_both_precisions(args, placement)
    return {"steps": rows, "recall": recall}


def train_both_precisions(args, placement: Placement) -> list[dict]:
    """The same schedule trained in fp32 and in bf16 on a precomp dataset, and the 1K test rsum of each."""
    from itmatch.data.precomp import read_precomp
    from itmatch.engine.checkpoint import load_checkpoint
    from itmatch.engine.evaluate import evaluate_models
    from itmatch.engine.train import train
    from itmatch.models.registry import resolve_config

    out = []
    for preset in args.presets:
        for precision in ("fp32", "bf16"):
            run = Path(args.runs) / f"{preset}_{precision}"
            cfg = resolve_config(preset, {"data": {"path": args.data}, "train": {
                "epochs": args.epochs, "lr_update": max(1, args.epochs // 2), "bucket_by_length": True,
                "max_batches": args.max_batches}, "loss": {"warmup_epochs": 1}})
            t0 = time.perf_counter()
            train(cfg, run, force=True, progress=False, device=str(placement.device), precision=precision)
            seconds = time.perf_counter() - t0
            ckpt = load_checkpoint(run / "best")
            split = read_precomp(args.data, "test")
            result = evaluate_models([(ckpt.model.to(placement.device), ckpt.vocab)], split,
                                     "1k" if split.n_images >= 1000 else "full", precision=precision)
            out.append({"preset": preset, "precision": precision, "epochs": args.epochs,
                        "train_seconds": round(seconds, 1), "test_rsum": result["rsum"]})
            print(f"recall {preset:<16} {precision}  rsum {result['rsum']:.1f} after {seconds:.0f} s", flush=True)
    return out


def upload_seconds(args, preset: str, device: torch.device) -> float | None:
    """Seconds of the one-off copy of a run's training features to `device` that train.resident=on makes before the
    trainer's epoch timer starts (the trainer's own call, engine.resident.resident_images, on the same split; the
    memmap already in the page cache, as it was for the timed run); None where the features stream anyway."""
    from itmatch.engine.inputs import open_split
    from itmatch.engine.resident import resident_images
    from itmatch.models.registry import resolve_config

    cfg = resolve_config(preset, {"data": {"path": args.data}})
    images = open_split(cfg, cfg.data.train_split, train=True).images
    synchronize(device)
    t0 = time.perf_counter()
    resident, _ = resident_images("on", images, device)
    synchronize(device)
    seconds = time.perf_counter() - t0
    if resident is None:  # (image files: nothing is copied)
        return None
    del resident
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return seconds


def trainer_epoch(args, placement: Placement, preset: str, out: Path, **settings) -> tuple[Config, dict]:
    """One epoch of the real trainer (`itmatch.engine.train.train`) of `preset` on --data into `out` on the
    placement's device: length-bucketed batches, the validation on 100 dev images, and the train.* `settings`
    (max_batches, resident, ...) over those. Its config and its epoch's record in metrics.jsonl (batches,
    train_seconds, ...): what `resident`, `syncs` and `profile` train and time."""
    from itmatch.engine.train import train
    from itmatch.models.registry import resolve_config

    cfg = resolve_config(preset, {"data": {"path": args.data}, "train": {
        "epochs": 1, "val_images": 100, "bucket_by_length": True, **settings}})
    train(cfg, out, force=True, progress=False, device=str(placement.device))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    return cfg, next(x for x in lines if "train_seconds" in x)


def section_resident(args, placement: Placement) -> dict:
    from itmatch.engine.checkpoint import load_checkpoint

    if not args.data:
        raise SystemExit("resident: pass --data (a precomp directory to train on)")
    rows = []
    for preset in args.presets:
        def run(mode: str, name: str, max_batches: int, preset=preset) -> tuple[dict, dict]:
            out = Path(args.runs) / f"{preset}_resident_{name}"
            cfg, epoch = trainer_epoch(args, placement, preset, out, max_batches=max_batches, resident=mode,
                                       workers=args.workers)
            return ({"batch": cfg.train.batch_size, **{k: epoch[k] for k in ("batches", "train_seconds")}},
                    load_checkpoint(out / "last").model.state_dict())

        run("off", "warmup", 3)  # CUDA context, cuDNN and allocator warm before either timed run
        (streamed, w_off), (resident, w_on) = run("off", "off", args.max_batches), run("on", "on", args.max_batches)
        diff = max(float((w_off[k].float() - w_on[k].float()).abs().max()) if w_off[k].numel() else 0.0
                   for k in w_off)
        upload = upload_seconds(args, preset, placement.device)
        row = {"preset": preset, "workers": args.workers, "streamed": streamed, "resident": resident,
               "upload_seconds": upload, "max_weight_difference": diff,
               "order": "warm-up (streamed), streamed, resident; then the upload alone"}
        for r in (streamed, resident):
            r["images_per_s"] = r["batches"] * r["batch"] / max(r["train_seconds"], 1e-9)
        resident["train_seconds_with_upload"] = resident["train_seconds"] + (upload or 0.0)
        rows.append(row)
        print(f"resident {preset:<16} streamed {streamed['train_seconds']:7.1f} s ({streamed['images_per_s']:7.0f} "
              f"img/s)  resident {resident['train_seconds']:7.1f} s ({resident['images_per_s']:7.0f} img/s) + the "
              f"one-off upload {upload if upload is not None else float('nan'):.2f} s = "
              f"{resident['train_seconds_with_upload']:.1f} s  "
              f"{streamed['batches']} batches, weights differ by {diff:.2g}", flush=True)
    return {"rows": rows}


@contextlib.contextmanager
def counted_syncs(source: Path) -> Iterator[Counter[str]]:
    """Count, per line of the code under `source` that made it (the innermost such frame), every call that makes
    the host wait for the GPU within the block: torch.cuda.set_sync_debug_mode("warn") turns each into a warning,
    caught here instead of printed."""
    sites: Counter[str] = Counter()

    def record(*_: object, **__: object) -> None:
        ours = [f for f in traceback.extract_stack() if f.filename.startswith(str(source))]
        where = ours[-1] if ours else None
        sites[f"{Path(where.filename).relative_to(source)}:{where.lineno} {(where.line or '').strip()}"
              if where else "(outside the source)"] += 1

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown


def section_syncs(args, placement: Placement) -> dict:
    """Where the host waits for the GPU: a few steps of the real trainer per preset (--max-batches, default 5,
    resident features, then its validation on 100 dev images), each synchronising call counted at the line of
    itmatch's source that made it (`counted_syncs`). At batch 128 a step is bound by the host's kernel launches
    (docs/gpu.md, "Training throughput"): a sync inside the step stops the host from queueing the next launches
    while the GPU drains, so these lines are where a step's time goes to waiting."""
    if placement.device.type != "cuda":
        print("syncs: needs a CUDA device (torch.cuda.set_sync_debug_mode); skipped", flush=True)
        return {"skipped": "no CUDA device"}
    if not args.data:
        raise SystemExit("syncs: pass --data (a precomp directory to train on)")
    rows = []
    for preset in args.presets:
        with counted_syncs(ROOT / "src") as sites:
            cfg, _ = trainer_epoch(args, placement, preset, Path(args.runs) / f"{preset}_syncs",
                                   max_batches=args.max_batches or 5, resident="on")
        rows.append({"preset": preset, "steps": cfg.train.max_batches, "sites": dict(sites.most_common())})
        print(f"syncs {preset:<16} {sum(sites.values())} in {cfg.train.max_batches} steps and a validation:",
              flush=True)
        for site, count in sites.most_common():
            print(f"    {count:6d}  {site}", flush=True)
    return {"rows": rows}


def section_profile(args, placement: Placement) -> dict:
    """Where a step of the real trainer goes (docs/gpu.md, "The sixth GPU session": on an H200 the trainer ran
    2.4-2.7x below `train`'s model step alone). Per preset, --max-batches steps (default 30) of
    `itmatch.engine.train.train` on --data, resident features, bucketed batches, three times after a warm-up run:
    plain (the ms a step, from the epoch's train_seconds), under cProfile (the Python functions that take the host's
    time, by their own time) and under torch.profiler (the torch ops by their own host time and, on a GPU, by their
    device time). The one-off work (the model's upload, the vocabulary, the validation on 100 dev images) is in the
    two profiles too: an op or function called about once a step (`calls` against the steps) is per step."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    if not args.data:
        raise SystemExit("profile: pass --data (a precomp directory to train on)")
    steps = args.max_batches or 30
    cuda = placement.device.type == "cuda"
    rows = []
    for preset in args.presets:
        def run(name: str, preset=preset) -> float:
            _, epoch = trainer_epoch(args, placement, preset, Path(args.runs) / f"{preset}_profile_{name}",
                                     max_batches=steps, resident="on")
            return 1000 * epoch["train_seconds"] / steps

        run("warmup")  # (the CUDA context, cuDNN and the allocator warm before anything is timed)
        ms = run("plain")
        host = cProfile.Profile()
        host.runcall(run, "cprofile")
        functions = sorted(pstats.Stats(host).stats.items(), key=lambda kv: -kv[1][2])[:args.top]
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        with profile(activities=activities) as prof:
            run("torch")
        averages = prof.key_averages()
        by_host = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:args.top]
        by_device = sorted(averages, key=lambda e: -getattr(e, "self_device_time_total", 0))[:args.top] if cuda else []
        row = {"preset": preset, "steps": steps, "ms_a_step": ms,
               "python": [{"function": f"{Path(f).name}:{line}({name})", "calls": stat[1],
                           "own_seconds": stat[2], "cumulative_seconds": stat[3]}
                          for (f, line, name), stat in functions],
               "ops_by_host": [{"op": e.key, "calls": e.count, "self_host_ms": e.self_cpu_time_total / 1000}
                               for e in by_host],
               "ops_by_device": [{"op": e.key, "calls": e.count,
                                  "self_device_ms": getattr(e, "self_device_time_total", 0) / 1000}
                                 for e in by_device]}
        rows.append(row)
        print(f"profile {preset:<16} {ms:.1f} ms a step over {steps} steps (plain run)", flush=True)
        print("    python, by own time:", flush=True)
        for r in row["python"]:
            print(f"      {r['own_seconds']:8.3f} s own {r['cumulative_seconds']:8.3f} s cum {r['calls']:8d} calls  "
                  f"{r['function']}", flush=True)
        print("    torch ops, by own host time:", flush=True)
        for r in row["ops_by_host"]:
            print(f"      {r['self_host_ms']:10.1f} ms {r['calls']:8d} calls  {r['op']}", flush=True)
        if cuda:
            print("    torch ops, by own device time:", flush=True)
            for r in row["ops_by_device"]:
                print(f"      {r['self_device_ms']:10.1f} ms {r['calls']:8d} calls  {r['op']}", flush=True)
    return {"rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sections", nargs="+", choices=["eval", "blocks", "train", "resident", "syncs", "profile"])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--smoke", action="store_true", help="small sizes (the CPU check: seconds)")
    p.add_argument("--images", type=int, help="images scored (default 1000; --smoke 4)")
    p.add_argument("--captions", type=int, help="F30K test captions (default all 5000; --smoke 100)")
    p.add_argument("--reference-images", type=int, help=argparse.SUPPRESS)  # (gone: whole shards are timed now)
    p.add_argument("--reference-captions", type=int, default=0,
                   help="captions the public loop is timed on, evenly spaced, its time extrapolated to all by caption "
                        "count (default 0: all, nothing extrapolated); the loop always runs whole 128-image shards")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (the best is kept)")
    p.add_argument("--cells", default="4194304,16777216,67108864,268435456",
                   help="`blocks`: comma list of caps on a block's region-word cells (default 4M to 256M; --smoke: "
                        "1K, 4K)")
    p.add_argument("--presets", default="vsepp,scan_t2i_avg,scan_i2t_lse,oan,sman,save_dsa,mmca",
                   help="comma list of presets for `train`")
    p.add_argument("--embed", type=int, default=1024, help="joint dimension D for `train` (--smoke 32)")
    p.add_argument("--img-dim", type=int, default=1280, help="region feature size (Lite0: 1280)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="timed training steps (best kept)")
    p.add_argument("--data", help="precomp directory: also train both precisions and compare their recall")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--max-batches", type=int, default=0, help="cap batches per epoch of the recall runs")
    p.add_argument("--runs", default="runs/bench_gpu", help="run directories of the recall and resident runs")
    p.add_argument("--workers", type=int, default=0, help="train.workers of the `resident` runs")
    p.add_argument("--top", type=int, default=15, help="`profile`: functions and ops listed per preset")
    p.add_argument("--out", help="JSON report (default runs/bench_gpu/<device>.json)")
    args = p.parse_args()
    placement = resolve(args.device, "fp32")
    if args.smoke:
        args.images, args.captions = args.images or 4, args.captions or 100
        args.embed, args.batch, args.steps, args.repeats = 32, 16, 1, 1
        if args.presets == p.get_default("presets"):
            args.presets = "vsepp,scan_t2i_avg"
        if args.cells == p.get_default("cells"):
            args.cells = "1024,4096"
    args.images, args.captions = args.images or 1000, args.captions or 5000
    if args.reference_images:
        print("--reference-images is ignored: the public loop is timed on whole 128-image shards (its cost is per "
              "caption per shard, so a few images scaled up misstated it); --reference-captions samples captions",
              flush=True)
    args.presets = [s for s in args.presets.split(",") if s]
    args.cells = [int(c) for c in args.cells.split(",") if c]
    device = placement.device
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(sys.argv), "smoke": args.smoke}
    torch.manual_seed(0)
    np.random.seed(0)
    for section in args.sections:
        report[section] = {"eval": section_eval, "blocks": section_blocks, "train": section_train,
                           "resident": section_resident, "syncs": section_syncs,
                           "profile": section_profile}[section](args, placement)
    out = Path(args.out or ROOT / "runs" / "bench_gpu" / f"{device.type}{'_smoke' if args.smoke else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
