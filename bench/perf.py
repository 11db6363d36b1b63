"""Performance benchmark of the evaluator, the pair heads, training and two-stage retrieval.

    python bench/perf.py --quick     # reduced scale, ~2-4 minutes on a quiet 2-core machine
    python bench/perf.py             # the report's scale (timed fractions, extrapolated and stated so)
    python bench/perf.py --sections reference,synthetic    # some sections: the page keeps the others

Writes runs/bench/perf-<time>.json and the generated part of docs/performance.md (between the markers).
Sections: machine (dense-matmul peak), kernel (one block per head), blocks (bucket size x cell cap),
scoring (Flickr30K and COCO 5K scale, every pair head of the registry), reference (the SCAN heads against the
public per-caption loop, same images and embeddings, in float32 - the engine's precision, the target's
baseline - and in float64 as SCAN's evaluation.py runs it), memory (peak RSS against the budget, one
subprocess per measurement; COCO 5K: the largest block of the 5000-image plan), training (pairs/s at batch
128), two_stage (Flickr8K test with trained checkpoints, the first stage's encoding timed), synthetic (a
caption query at 10x / 100x galleries: search + score_pairs re-ranking vs exhaustive). A section this run
neither measures nor merges stays on the page as it was, with the run that measured it (read_generated).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from itmatch.config import parse_overrides  # noqa: E402
from itmatch.engine.evaluate import (  # noqa: E402
    TextBuckets,
    bucket_texts,
    encode_caption_buckets,
    encode_images,
    item_bytes,
    score_matrix,
    unbucket_texts,
)
from itmatch.engine.vocabulary import make_vocab  # noqa: E402
from itmatch.models.base import ImageEmb, TextEmb, l2norm  # noqa: E402
from itmatch.models.registry import PRESETS, build_model, image_inputs, preset_config, resolve_config  # noqa: E402
from itmatch.models.scan.head import ScanHead  # noqa: E402

# ../shared beside the checkout, or beside a folder above it (a worktree of /work/wt/<name>); nothing absolute, so
# the bench finds the captions on a GPU machine too (/root/device/shared beside /root/device/itmatch)
SHARED = next((folder / "shared" / "data" / "precomp-captions" for folder in ROOT.parents
               if (folder / "shared" / "data" / "precomp-captions").is_dir()),
              ROOT.parent / "shared" / "data" / "precomp-captions")
F30K = (SHARED / "f30k_precomp" / "test_caps.txt", SHARED / "vocab" / "f30k_precomp_vocab.json")
COCO = (SHARED / "coco_precomp" / "testall_caps.txt", SHARED / "vocab" / "coco_precomp_vocab.json")
FLICKR8K_DATA = ROOT / "runs" / "data" / "flickr8k_lite0"  # bench/flickr8k.py's features and runs
FLICKR8K_RUNS = ROOT / "runs" / "flickr8k"
K_REGIONS, FEAT_DIM = 36, 1024
SECTIONS = "kernel,blocks,scoring,reference,memory,training,two_stage,synthetic"  # all, in the order they run
MARK_BEGIN, MARK_END = "<!-- bench:begin -->", "<!-- bench:end -->"


# ----------------------------------------------------------------------------------------------- helpers
def rss() -> tuple[int, int]:
    """(current, peak) resident set size in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS", "VmHWM")):
            fields[line.split(":")[0]] = int(line.split()[1]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS


def matmul_peak_gflops(size: int = 2048, reps: int = 6) -> float:
    """Best of `reps` float32 GEMMs of size^3: the machine's dense-matmul peak with torch's threads."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


def read_captions(path: Path, limit: int | None) -> list[str]:
    lines = [x.strip() for x in path.read_text(encoding="utf-8").splitlines()]
    return lines[:limit] if limit else lines


def pair_head_presets(selection: str) -> list[str]:
    """Every preset whose head is pair-dependent (bytes_per_cell > 0), from the registry. `issue`: the
    issue's list (SCAN t-i/i-t AVG/LSE, Sum-Max) plus one preset of every other pair-head arch."""
    chosen = []
    for name in sorted(PRESETS):
        if name.endswith("_coco"):
            continue
        if image_inputs(preset_config(name).model):
            continue  # multi-scale or pixel input (SAVE): its head is SCAN's, measured through the scan presets
        if make_model(name, embed=64)[0].head.pair_independent:  # VSE++, MMCA with alpha = 0
            continue
        arch = PRESETS[name]["model"].get("arch")
        if selection == "issue" and arch == "scan" and PRESETS[name]["model"].get("pool") not in ("avg", "lse"):
            continue
        if selection == "issue" and arch not in ("scan", "summax") and any(
                PRESETS[c]["model"].get("arch") == arch for c in chosen):
            continue
        chosen.append(name)
    return chosen


# What a training step is timed with beyond the preset, as the Flickr8K bench trains it (bench/flickr8k.py): MMCA
# scores only each item's 8 hardest i0.c0 negatives, because all B^2 pairs through its cross-attention transformer
# keep 3-5 MB of activations each (64 GB at B = 128; docs/mmca.md)
TRAINING_BUDGET = {"mmca": ["model.mmca.train_negatives=8"]}


def make_model(preset: str, vocab_file: Path = F30K[1], embed: int | None = None, img_dim: int = FEAT_DIM,
               training: bool = False, regions: int = K_REGIONS):
    """A preset's untrained model (seed 0) on 1024-d region features, at its own joint dimension D unless
    `embed` is given, with the tokenizer it trains with: the dataset's word vocabulary, or the WordPiece of its
    frozen pretrained text encoder (MMCA). `training`: with the bench's TRAINING_BUDGET for its arch. `regions`: the
    grid SMAN checks its images against (the other heads take any number of regions)."""
    cfg = resolve_config(preset)  # (an unknown preset: the registry's error, naming the presets there are)
    if training and cfg.model.arch in TRAINING_BUDGET:
        cfg = resolve_config(preset, parse_overrides(TRAINING_BUDGET[cfg.model.arch]))
    if cfg.data.tokenizer == "word":
        cfg.data.vocab = str(vocab_file)
    vocab = make_vocab(cfg, [])
    if cfg.model.arch == "sman":  # its grid check: every head of a bench sees the same regions per image
        cfg.model.sman.regions = regions
    cfg.model.vocab_size, cfg.model.img_dim = len(vocab), img_dim
    cfg.model.embed_size = embed or cfg.model.embed_size
    torch.manual_seed(0)
    return build_model(cfg.model).eval(), cfg, vocab


def counted_flops(fn) -> float:
    """FLOPs of `fn()` as torch executes them (torch.utils.flop_counter: matmuls, batched matmuls,
    convolutions, attention; padding cells included, elementwise work not counted): the same count for
    every head, SCAN's GEMM + Gram product as MMCA's transformer."""
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        fn()
    return float(counter.get_total_flops())


def random_features(n: int, seed: int = 0, k: int = K_REGIONS, dim: int = FEAT_DIM) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, k, dim), dtype=np.float32)


def encoded(model, vocab, n_img: int, caption_file: Path, limit: int | None = None, seed: int = 0
            ) -> tuple[ImageEmb, TextBuckets]:
    """What the scoring engine sees: the model's own encoding (not timed) of random region features
    [n_img, 36, 1024] and of the real captions in its tokenization, in the evaluator's length buckets.
    Every head gets the inputs it needs (SCAN's Gram matrices, SMAN's graph features, MMCA's tokens)."""
    with torch.inference_mode():
        img = encode_images(model, random_features(n_img, seed))
        return img, encode_caption_buckets(model, read_captions(caption_file, limit), vocab)


def one_image(model, img: ImageEmb, buckets: TextBuckets) -> tuple[float, float]:
    """Seconds (with the counter's overhead: a rough figure) and FLOPs of scoring one image against every
    caption: every image costs the same, so the FLOPs of n images are n times these."""
    t0 = time.perf_counter()
    flops = counted_flops(lambda: score_matrix(model, img.take(torch.arange(1)), buckets))
    return time.perf_counter() - t0, flops


# ----------------------------------------------------------------------------------------------- sections
def section_scoring(args) -> dict:
    """Engine throughput at Flickr30K scale (timed on up to args.images of 1000 images against all captions;
    fewer for a slow head, about args.head_seconds each) and COCO 5K scale (args.coco_images of 5000 against the 25000
    real testall captions). The public per-caption loop beside the engine: section_reference."""
    rows = []
    for preset in args.presets:
        model, cfg, vocab = make_model(preset)
        img, buckets = encoded(model, vocab, args.images, F30K[0], limit=args.captions)
        probe_seconds, image_flops = one_image(model, img, buckets)
        # every head at the same scale would take hours for the slowest (MMCA): time ~args.head_seconds
        img = img.take(torch.arange(int(min(len(img), max(1, args.head_seconds / probe_seconds)))))
        captions = torch.cat([c for c, _ in buckets])
        reset_peak_rss()
        before, _ = rss()
        local_peak = matmul_peak_gflops(1024, 3)  # the shared machine's load drifts: peak measured beside
        t0 = time.perf_counter()
        scores = score_matrix(model, img, buckets, progress=args.progress)
        seconds = time.perf_counter() - t0
        local_peak = (local_peak + matmul_peak_gflops(1024, 3)) / 2
        _, peak_rss = rss()
        pairs = len(img) * len(captions)
        flops = image_flops * len(img)
        row = {"preset": preset, "embed": cfg.model.embed_size, "images": len(img), "captions": len(captions),
               "seconds": round(seconds, 3),
               "pairs_per_s": pairs / seconds, "gflops": flops / seconds / 1e9,
               "peak_gflops_beside": local_peak, "efficiency": flops / seconds / 1e9 / local_peak,
               "f30k_full_seconds_extrapolated": 1000 * 5000 / (pairs / seconds),
               "scoring_rss_mb": (peak_rss - before) / 2**20}
        rows.append(row)
        print(f"  {preset:<16} {row['pairs_per_s']:>10.0f} pairs/s  {row['gflops']:6.1f} GFLOP/s "
              f"({100 * row['efficiency']:.0f}% of peak)", flush=True)
        del scores, img, buckets
    coco = []
    if args.coco_images:
        for preset in [p for p in args.presets if p.startswith("scan_")][:2] if not args.quick else args.presets[:1]:
            model, _, vocab = make_model(preset, COCO[1])
            img, buckets = encoded(model, vocab, args.coco_images, COCO[0], limit=5000 if args.quick else None)
            captions = torch.cat([c for c, _ in buckets])
            t0 = time.perf_counter()
            score_matrix(model, img, buckets, progress=args.progress)
            seconds = time.perf_counter() - t0
            pps = len(img) * len(captions) / seconds
            coco.append({"preset": preset, "timed_images": len(img), "captions": len(captions),
                         "seconds": round(seconds, 3), "pairs_per_s": pps,
                         "coco5k_seconds_extrapolated": 5000 * 25000 / pps})
            print(f"  COCO 5K {preset}: {pps:.0f} pairs/s on {len(img)} images x {len(captions)} captions -> "
                  f"{5000 * 25000 / pps / 3600:.2f} h extrapolated", flush=True)
    return {"f30k": rows, "coco5k": coco}


REFERENCE_DTYPES = (np.float32, np.float64)  # the fair baseline (the engine's precision) first, then SCAN's own


def section_reference(args) -> list[dict]:
    """The engine against the public code's per-caption loop (bench/scan_reference.py), side by side in one process
    on the same embeddings, for every SCAN-head preset of args.presets: args.ref_images random images (100 at the
    report's scale: the loop's shards hold 128, so the loop runs as at Flickr30K scale, one step per caption per
    shard) x the first args.captions Flickr30K test captions (all 5000 at the report's scale). The engine scores
    every pair; the loop runs in float32 (the engine's precision: the fair baseline, the one the target is read
    against) and in float64 (SCAN's evaluation.py holds its arrays so: a secondary figure), on every k-th caption
    (args.ref_captions of them; 0: all), its seconds for all captions extrapolated by caption count: its cost is a
    sum of independent per-caption steps. Each side is the best of args.ref_repeats runs after a warm-up, with the
    same torch threads. The engine on exactly the loop's sampled pairs is timed too ("same pairs": a small run, its
    buckets nearly empty; one run after a warm-up)."""
    rows = []
    for preset in args.presets:
        model, cfg, vocab = make_model(preset)
        if not isinstance(model.head, ScanHead):
            continue
        img, buckets = encoded(model, vocab, args.ref_images, F30K[0], limit=args.captions)
        score_matrix(model, img.take(slice(0, 1)), buckets)  # warm-up
        seconds = float("inf")
        for _ in range(args.ref_repeats):  # best of, as the loop
            t0 = time.perf_counter()
            scores = score_matrix(model, img, buckets, progress=args.progress)
            seconds = min(seconds, time.perf_counter() - t0)
        m = sum(len(c) for c, _ in buckets)
        row = {"preset": preset, "embed": cfg.model.embed_size, "images": len(img), "captions": m,
               "seconds": round(seconds, 3), "pairs_per_s": len(img) * m / seconds,
               **reference_loop(args, model, img, buckets, scores, seconds)}
        rows.append(row)
        print(f"  reference {preset:<16} engine {seconds:.2f} s for {len(img)} x {m}; the loop's seconds for them "
              f"(timed on {row['reference_captions_timed']} captions, extrapolated): float32 "
              f"{row['reference_seconds_all_captions_extrapolated']:.1f} s -> {row['speedup_vs_reference']:.1f}x, "
              f"float64 {row['reference_float64_seconds_all_captions_extrapolated']:.1f} s -> "
              f"{row['speedup_vs_reference_float64']:.1f}x; max diff {row['max_abs_diff_vs_reference']:.1e}",
              flush=True)
        del scores, img, buckets
    return rows


def reference_loop(args, model, img: ImageEmb, buckets: TextBuckets, scores: torch.Tensor, seconds: float) -> dict:
    """The per-caption loop's figures beside the engine's run that took `seconds` for `scores` [len(img), all
    captions] (section_reference says how it is timed)."""
    from scan_reference import shard_xattn

    txt = unbucket_texts(buckets)
    m = len(txt)
    step = max(1, m // args.ref_captions) if args.ref_captions else 1
    sub = torch.arange(0, m, step)[:args.ref_captions or None]
    sub_txt = txt.take(sub).trimmed()
    sub_buckets = bucket_texts(sub_txt)  # (bucketed before the timer, as the evaluator encodes them)
    head = model.head
    images = img.regions.numpy()

    def loop(dtype, n_captions: int | None = None):
        return shard_xattn(images, sub_txt.words[:n_captions].numpy(), sub_txt.lengths[:n_captions].tolist(),
                           head.direction, head.pool, head.lambda_softmax, head.lambda_lse, dtype=dtype)

    out: dict = {"reference_captions_timed": len(sub), "reference_captions_all": m, "reference_dtype": "float32",
                 "reference_repeats": args.ref_repeats}
    for dtype in REFERENCE_DTYPES:
        loop(dtype, 2)  # warm-up
        ref_seconds = float("inf")
        for _ in range(args.ref_repeats):
            t0 = time.perf_counter()
            ref = loop(dtype)
            ref_seconds = min(ref_seconds, time.perf_counter() - t0)
        diff = float(np.abs(scores[:, sub].double().numpy() - ref.astype(np.float64)).max())
        name = "" if dtype is np.float32 else "_float64"
        out.update({f"reference{name}_seconds": round(ref_seconds, 3),
                    f"reference{name}_pairs_per_s": len(img) * len(sub) / ref_seconds,
                    # the loop's seconds for the engine's pairs (all captions), extrapolated by caption count
                    f"reference{name}_seconds_all_captions_extrapolated": ref_seconds * m / len(sub),
                    f"speedup_vs_reference{name}": ref_seconds * m / len(sub) / seconds,
                    f"max_abs_diff_vs_reference{name}": diff})
        if dtype is np.float32:
            score_matrix(model, img.take(slice(0, 1)), sub_buckets)  # warm-up
            t0 = time.perf_counter()
            engine_sub = score_matrix(model, img, sub_buckets)
            sub_seconds = time.perf_counter() - t0
            out["max_abs_diff_vs_reference"] = max(diff, float(np.abs(engine_sub.double().numpy() - ref).max()))
            out["speedup_vs_reference_same_subset"] = ref_seconds / sub_seconds
    return out


def section_blocks(args) -> list[dict]:
    """Block shape swept on SCAN t-i and i-t AVG, 32 images x the Flickr30K captions: captions per length
    bucket (score_matrix's captions_per_block; a bucket's words are re-read by every block of images) x the
    cap on region-word cells per block (max_cells). pairs/s and % of the matmul peak measured beside. The
    captions are cut into each size's buckets before the timer, as the evaluator encodes them straight into
    buckets: the timed work is the scoring alone."""
    out = []
    for preset in ("scan_t2i_avg", "scan_i2t_avg"):
        model, _, vocab = make_model(preset)
        img, buckets = encoded(model, vocab, 32, F30K[0], limit=args.captions)
        txt = unbucket_texts(buckets)
        flops = one_image(model, img, buckets)[1] * len(img)
        for per_bucket in (64, 128, 256, 1024):
            sized = bucket_texts(txt, per_bucket)
            score_matrix(model, img.take(torch.arange(1)), sized)  # warm-up
            for cells in (1 << 21, 1 << 22, 1 << 23):
                peak = matmul_peak_gflops(1024, 3)
                t0 = time.perf_counter()
                score_matrix(model, img, sized, max_cells=cells)
                seconds = time.perf_counter() - t0
                peak = (peak + matmul_peak_gflops(1024, 3)) / 2
                row = {"preset": preset, "captions_per_block": per_bucket, "max_cells": cells, "captions": len(txt),
                       "pairs_per_s": len(img) * len(txt) / seconds, "gflops": flops / seconds / 1e9,
                       "peak_gflops_beside": peak, "efficiency": flops / seconds / 1e9 / peak}
                out.append(row)
                print(f"  blocks {preset:<14} {per_bucket:>5} captions, cap {cells:>8} cells: "
                      f"{row['pairs_per_s']:8.0f} pairs/s, {100 * row['efficiency']:.0f}% of peak", flush=True)
    return out


def section_kernel(args) -> list[dict]:
    """One block of each head (16 images x 256 captions of 16 words, the engine's block shape), best of
    5, against the matmul peak measured right beside it: the head's efficiency without the evaluator's
    bucket padding or a large gallery's memory traffic."""
    g = torch.Generator().manual_seed(5)
    n, m, length = 16, 256, 16
    out = []
    for preset in args.presets:
        model, cfg, vocab = make_model(preset)
        tokens = torch.randint(4, len(vocab), (m, length), generator=g)  # random non-special ids, 16 each
        with torch.inference_mode():
            img = model.encode_images(torch.from_numpy(random_features(n, seed=5)))
            txt = model.encode_texts(tokens, torch.full((m,), length))
        flops = counted_flops(functools.partial(model.score, img, txt))
        with torch.inference_mode():
            model.score(img, txt)
            peak_before = matmul_peak_gflops(1024, 3)
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                model.score(img, txt)
                best = min(best, time.perf_counter() - t0)
            peak = (peak_before + matmul_peak_gflops(1024, 3)) / 2
        out.append({"preset": preset, "embed": cfg.model.embed_size, "block": [n, K_REGIONS, m, length],
                    "seconds": best,
                    "gflops": flops / best / 1e9, "peak_gflops_beside": peak, "efficiency": flops / best / 1e9 / peak})
        print(f"  kernel {preset:<16} {flops / best / 1e9:6.1f} GFLOP/s, {100 * flops / best / 1e9 / peak:.0f}% of "
              f"the matmul peak beside it ({peak:.1f})", flush=True)
    return out


def memory_child(preset: str, captions_file: str, vocab_file: str, n_img: int, n_captions: int,
                 budget: float, max_cells: int, full_images: int) -> dict:
    """One measurement (run in its own process): peak RSS added by score_matrix over the encoded embeddings.

    With full_images > n_img (COCO 5K: a gallery too large to score here), the block plan is the full gallery's
    (score_blocks over full_images rows: the n_img encoded images repeated, since a plan depends on the gallery's
    size and regions, not on its values), and its largest block (most region-word cells) is actually scored: that
    block's images x its captions through score_matrix, under the budget less the rest of the full score matrix,
    which is charged to the measured peak (4 bytes a pair). The plan's other blocks are not run."""
    from itmatch.engine.evaluate import MAX_BLOCK_CELLS, score_blocks

    model, _, vocab = make_model(preset, Path(vocab_file))
    img, buckets = encoded(model, vocab, n_img, Path(captions_file), limit=n_captions or None)
    m = sum(len(c) for c, _ in buckets)
    cap = max_cells or MAX_BLOCK_CELLS
    extra: dict = {}
    if full_images > n_img:
        gallery = img.take(torch.arange(full_images) % n_img)  # (the embeddings: outside the budget)
        blocks = score_blocks(model, gallery, buckets, budget, cap)
        rows, _, block_txt = max(blocks, key=lambda b: (b[0].stop - b[0].start) * len(b[2]) * b[2].words.shape[1])
        scored_img, scored = gallery.take(rows), [(torch.arange(len(block_txt)), block_txt)]
        missing = 4.0 * (full_images * m - len(scored_img) * len(block_txt))
        emb_bytes = item_bytes(gallery) * len(gallery) + sum(item_bytes(t) * len(t) for _, t in buckets)
        del gallery
        # under the budget less the missing rows, the block is planned as it is in the full plan: one block
        again = score_blocks(model, scored_img, scored, budget - missing, cap)
        extra = {"blocks_in_plan": len(blocks), "measured": "the largest block of the full plan",
                 "largest_block_captions": len(block_txt), "largest_block_words": int(block_txt.words.shape[1]),
                 "largest_block_replanned_as_one": len(again) == 1}
        largest_rows = rows.stop - rows.start
    else:
        scored_img, scored, missing = img, buckets, 0.0
        blocks = score_blocks(model, img, buckets, budget, cap)
        emb_bytes = item_bytes(img) * len(img) + sum(item_bytes(t) * len(t) for _, t in buckets)
        largest_rows = max(r.stop - r.start for r, _, _ in blocks)
        extra = {"blocks_in_plan": len(blocks), "measured": "the whole plan"}
    reset_peak_rss()
    before, _ = rss()
    t0 = time.perf_counter()
    score_matrix(model, scored_img, scored, budget - missing, max_cells=cap)
    seconds = time.perf_counter() - t0
    _, peak = rss()
    used = peak - before + missing
    return {"preset": preset, "captions": m, "images_timed": n_img, "images_charged": max(full_images, n_img),
            "budget_mb": budget / 2**20, "scoring_peak_mb": used / 2**20, "within_budget": used <= budget,
            "largest_block_rows": largest_rows, "embeddings_mb": emb_bytes / 2**20, "max_cells": max_cells,
            "seconds": round(seconds, 2), **extra}


def section_memory(args, timed_images: dict[str, int]) -> list[dict]:
    """Peak RSS of scoring vs the budget: a tight budget (score matrix + 96 MB, no cache cap: blocks as
    large as the budget allows) and the default 4 GB, at Flickr30K scale, and the largest block of COCO 5K's
    plan (5000 images x 25000 captions, 4 GB, no cache cap), scored here with the full matrix charged."""
    runs = []
    caps, voc = F30K
    coco_caps, coco_voc = COCO
    for preset in args.presets:
        n_img = timed_images.get(preset, args.images)  # the gallery the scoring section timed
        runs.append((preset, caps, voc, n_img, args.captions, 4.0 * n_img * (args.captions or 5000) + 96 * 2**20,
                     1 << 40, 0))
    main = next((p for p in args.presets if p.startswith("scan_")), args.presets[0])
    runs.append((main, caps, voc, args.images, args.captions, 4 * 2**30, 0, 0))
    if not args.quick:
        runs.append((main, coco_caps, coco_voc, 20, 0, 4 * 2**30, 1 << 40, 5000))
    out = []
    for preset, cap_file, voc_file, n_img, n_cap, budget, max_cells, full in runs:
        cmd = [sys.executable, __file__, "--memory-child", json.dumps(
            [preset, str(cap_file), str(voc_file), n_img, n_cap or 0, budget, max_cells, full])]
        # a fixed mmap threshold: every large buffer is its own mapping, returned to the OS when freed, so
        # the peak RSS is what scoring holds (glibc's adaptive threshold would reuse the encoders' freed heap)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            print(res.stderr[-2000:], file=sys.stderr)
            continue
        row = json.loads(res.stdout.strip().splitlines()[-1])
        out.append(row)
        print(f"  memory {preset:<16} budget {row['budget_mb']:8.0f} MB, scoring peak {row['scoring_peak_mb']:8.1f} MB "
              f"({'within' if row['within_budget'] else 'OVER'}; {row['captions']} captions, "
              f"{row['images_charged']} images charged; {row.get('measured', 'the whole plan')}: "
              f"{row['largest_block_rows']} block rows, {row.get('blocks_in_plan', '?')} blocks planned, "
              f"{row.get('seconds', 0):.1f} s)", flush=True)
    return out


def section_training(args) -> list[dict]:
    """Training pairs/s at batch 128 (B^2 pairs scored per step): forward, loss, backward, Adam step."""
    from itmatch.data.datasets import pad_tokens

    captions = read_captions(F30K[0], 128)
    feats = torch.from_numpy(random_features(128, seed=2))
    out = []
    for preset in ["vsepp", *args.presets]:
        model, cfg, vocab = make_model(preset, embed=args.train_embed, training=True)
        batch = pad_tokens([vocab.encode(c) for c in captions])
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=2e-4)
        times = []
        for step in range(1 + args.train_steps):  # train_steps = 0: the first step only (--quick)
            t0 = time.perf_counter()
            loss = model.training_loss(model.encode_images(feats), model.encode_texts(batch.tokens, batch.lengths),
                                       cfg.loss.margin, hardest=True)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step or not args.train_steps:  # the first step warms up allocations
                times.append(time.perf_counter() - t0)
        sec = min(times)
        out.append({"preset": preset, "embed": args.train_embed, "batch": 128, "seconds_per_step": round(sec, 3),
                    "note": " ".join(TRAINING_BUDGET.get(cfg.model.arch, [])),
                    "pairs_per_s": 128 * 128 / sec})
        print(f"  train {preset:<16} {sec:.2f} s/step, {128 * 128 / sec:.0f} pairs/s (D={args.train_embed})",
              flush=True)
    return out


def section_two_stage(args) -> dict:
    """Flickr8K test: exhaustive vs two-stage for K in args.ks (trained checkpoints). The two-stage seconds include
    the first stage's encoding of the test images and captions (the VSE++ encoders: work the exhaustive path does
    not do), except for VSE++ itself, whose first stage is its own embeddings (its exhaustive path encodes the same
    ones); the pair model's own encoding is left out of both sides alike, and the exhaustive side scores captions
    already in the evaluator's length buckets."""
    from itmatch.data.precomp import read_precomp
    from itmatch.engine.checkpoint import load_checkpoint
    from itmatch.engine.evaluate import encode_captions
    from itmatch.engine.metrics import retrieval_metrics
    from itmatch.retrieval.two_stage import first_stage_vectors, two_stage_scores

    result: dict = {"flickr8k": []}
    ckpts = {p: FLICKR8K_RUNS / p / "best" for p in ("vsepp", "scan_t2i_avg", "scan_i2t_lse")}
    if not (ckpts["vsepp"] / "model.safetensors").is_file() or not FLICKR8K_DATA.is_dir():
        result["skipped"] = (f"no trained VSE++ checkpoint at {ckpts['vsepp']} (the first stage) or no features at "
                             f"{FLICKR8K_DATA}: Flickr8K two-stage rows skipped")
        print("  " + result["skipped"], flush=True)
        return result
    split = read_precomp(FLICKR8K_DATA, "test")
    vsepp = load_checkpoint(ckpts["vsepp"])
    vsepp.model.eval()
    encode_images(vsepp.model, split.images[:8])  # warm-up
    t0 = time.perf_counter()
    fs_img, fs_txt = first_stage_vectors(encode_images(vsepp.model, split.images),
                                         encode_captions(vsepp.model, split.captions, vsepp.vocab))
    first_stage_seconds = time.perf_counter() - t0
    result["first_stage_encoding_seconds"] = round(first_stage_seconds, 3)
    for preset, path in ckpts.items():
        if not (path / "model.safetensors").is_file():
            result["flickr8k"].append({"preset": preset, "skipped": f"no checkpoint at {path}"})
            print(f"  two-stage {preset}: no checkpoint at {path}, skipped", flush=True)
            continue
        ck = load_checkpoint(path)
        model = ck.model.eval()
        # the captions in the evaluator's length buckets, as it encodes them (no bucketing inside the timing)
        img, buckets = encode_images(model, split.images), encode_caption_buckets(model, split.captions, ck.vocab)
        txt = unbucket_texts(buckets)
        encoding = 0.0 if preset == "vsepp" else first_stage_seconds  # (VSE++: its own embeddings, on both sides)
        t0 = time.perf_counter()
        exhaustive = score_matrix(model, img, buckets)
        ex_seconds = time.perf_counter() - t0
        ex_metrics = retrieval_metrics(exhaustive, split.per_image)
        for k in args.ks:
            for kind in ("flat", "ivf"):
                t0 = time.perf_counter()
                ts = two_stage_scores(model, img, txt, k, fs_img, fs_txt, kind)
                seconds = time.perf_counter() - t0 + encoding
                m = retrieval_metrics(ts.scores, split.per_image)
                row = {"preset": preset, "k": k, "index": kind, "pairs_scored": ts.pairs_scored,
                       "pairs_total": ts.pairs_total, "fewer_pairs": ts.pairs_total / ts.pairs_scored,
                       "seconds": round(seconds, 3), "first_stage_encoding_seconds": round(encoding, 3),
                       "exhaustive_seconds": round(ex_seconds, 3), "speedup": ex_seconds / seconds}
                for d in ("image_to_text", "text_to_image"):
                    for r in ("r1", "r5", "r10"):
                        row[f"{d}_{r}"] = m[d][r]
                        row[f"{d}_{r}_loss"] = ex_metrics[d][r] - m[d][r]
                result["flickr8k"].append(row)
                print(f"  two-stage {preset} K={k} {kind}: R@1 loss i2t {row['image_to_text_r1_loss']:+.1f} "
                      f"t2i {row['text_to_image_r1_loss']:+.1f}, {row['fewer_pairs']:.1f}x fewer pairs, "
                      f"{row['speedup']:.1f}x faster (first stage's encoding included)", flush=True)
    return result


def section_synthetic(args) -> list[dict]:
    """The cost of one caption query at 10x / 100x larger synthetic galleries (random unit first-stage vectors,
    random SCAN t-i AVG embeddings at args.synthetic_embed): the first stage's search, then the re-ranking of the
    query's K candidate images through score_pairs, as two_stage_scores runs it (1 image x its candidate captions a
    block: K blocks for a caption query whose candidates no other query shares), timed per query after a warm-up;
    against exhaustive scoring of the gallery for that query at the faster of the engine's two score_matrix rates,
    one caption x 10 K images and all the queries x K images, timed after a warm-up and extrapolated to the
    gallery (it is not run end to end: that is exactly what is too slow)."""
    from itmatch.engine.evaluate import score_pairs
    from itmatch.retrieval.first_stage import FirstStageIndex

    model, _, _ = make_model("scan_t2i_avg", embed=args.synthetic_embed)
    g = torch.Generator().manual_seed(4)
    d, k, q = args.synthetic_embed, args.k_synthetic, args.synthetic_queries
    timed_queries = min(q, args.synthetic_rerank_queries)

    def random_images(n: int) -> ImageEmb:
        return model.head.prepare_images(ImageEmb(regions=l2norm(torch.randn(n, K_REGIONS, d, generator=g)),
                                                  mask=torch.ones(n, K_REGIONS, dtype=torch.bool)))

    q_txt = TextEmb(words=l2norm(torch.randn(q, 14, d, generator=g)),
                    lengths=torch.full((q,), 14))  # mean Flickr caption: 14 tokens
    # exhaustive, at the faster of the engine's two rates: one caption query against many images, and all the
    # queries at once (buckets of captions x blocks of images; a gallery's blocks are the same shapes)
    pool = random_images(10 * k)
    score_matrix(model, pool.take(slice(0, k)), q_txt.take(slice(0, 1)))  # warm-up
    t0 = time.perf_counter()
    for j in range(timed_queries):
        score_matrix(model, pool, q_txt.take(slice(j, j + 1)))
    single_pps = len(pool) * timed_queries / (time.perf_counter() - t0)
    q_buckets = bucket_texts(q_txt)
    t0 = time.perf_counter()
    score_matrix(model, pool.take(slice(0, k)), q_buckets)
    batched_pps = k * q / (time.perf_counter() - t0)
    exhaustive_pps = max(single_pps, batched_pps)
    # re-ranking: each query's own K candidate images (no sharing between queries), through score_pairs
    cand = random_images(k)
    every, one = torch.arange(k), torch.zeros(k, dtype=torch.long)
    score_pairs(model, cand, q_txt.take(slice(0, 1)), every, one)  # warm-up
    t0 = time.perf_counter()
    for j in range(timed_queries):
        score_pairs(model, cand, q_txt.take(slice(j, j + 1)), every, one)
    rerank = (time.perf_counter() - t0) / timed_queries
    out = []
    for scale in (10, 100):
        gallery = 1000 * scale
        g_vec = torch.nn.functional.normalize(torch.randn(gallery, d), dim=1)
        q_vec = torch.nn.functional.normalize(torch.randn(q, d), dim=1)
        for kind in ("flat", "ivf"):
            t0 = time.perf_counter()
            index = FirstStageIndex(kind).build(g_vec)
            build = time.perf_counter() - t0
            index.search(q_vec[:1], k)  # warm-up
            t0 = time.perf_counter()
            index.search(q_vec, k)
            search = (time.perf_counter() - t0) / q
            exhaustive = gallery / exhaustive_pps
            out.append({"gallery_images": gallery, "index": kind, "k": k, "embed": d,
                        "build_seconds": round(build, 3), "queries_timed_rerank": timed_queries,
                        "search_ms_per_query": search * 1e3, "rerank_ms_per_query": rerank * 1e3,
                        "rerank_pairs_per_s": k / rerank, "exhaustive_pairs_per_s": exhaustive_pps,
                        "exhaustive_pairs_per_s_one_query": single_pps, "exhaustive_pairs_per_s_batched": batched_pps,
                        "exhaustive_ms_per_query": exhaustive * 1e3, "speedup": exhaustive / (search + rerank)})
            print(f"  synthetic {gallery} images, {kind}: search {search * 1e3:.2f} ms + re-rank {rerank * 1e3:.1f} ms "
                  f"({k / rerank:.0f} pairs/s) per caption query vs exhaustive {exhaustive * 1e3:.0f} ms "
                  f"({exhaustive_pps:.0f} pairs/s) -> {exhaustive / (search + rerank):.0f}x", flush=True)
    return out


# ----------------------------------------------------------------------------------------------- report
def _render_blocks(report: dict) -> list[str]:
    captions = report["blocks"][0].get("captions")
    lines = [f"### Block shape (32 images x {f'the first {captions}' if captions else 'the'} Flickr30K captions; "
             "score_matrix's `captions_per_block`, "
             "`max_cells`; captions cut into each size's buckets before the timer)", "",
             "| head | captions per bucket | max cells per block | pairs/s | % of matmul peak (beside) |",
             "|---|---|---|---|---|"]
    for r in report["blocks"]:
        lines.append(f"| {r['preset']} | {r.get('captions_per_block', 1024)} | {r['max_cells']} | "
                     f"{r['pairs_per_s']:.0f} | {100 * r['efficiency']:.0f}% |")
    return lines


def _table(title: str, columns: list[str], rows: list[list[str]]) -> list[str]:
    """A section of the page: its heading, then a markdown table of `rows` under `columns`."""
    return [f"### {title}", "", f"| {' | '.join(columns)} |", "|" + "---|" * len(columns),
            *(f"| {' | '.join(row)} |" for row in rows)]


def _render_kernel(report: dict) -> list[str]:
    return _table("Head kernels (one 16 x 36 x 256 x 16 block, each preset's D, best of 5)",
                  ["head", "D", "GFLOP/s", "matmul peak beside (GFLOP/s)", "% of peak"],
                  [[r["preset"], str(r.get("embed", 1024)), f"{r['gflops']:.1f}", f"{r['peak_gflops_beside']:.1f}",
                    f"{100 * r['efficiency']:.0f}%"] for r in report["kernel"]])


def _render_scoring(report: dict) -> list[str]:
    sc, lines = report["scoring"], []
    if sc.get("f30k"):
        r0 = sc["f30k"][0]
        lines += [f"### Scoring at Flickr30K scale (up to {r0['images']} of 1000 images x {r0['captions']} real "
                  "captions, 36 regions of 1024-d features, each preset's own D; a slow head is timed on fewer "
                  "images, the full matrix extrapolated)", "",
                  "| head | D | images timed | pairs/s | GFLOP/s | % of matmul peak (measured beside) "
                  "| full 1000 x 5000 (s, extrap.) | RSS growth in process (MB; see memory) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in sc["f30k"]:
            lines.append(f"| {r['preset']} | {r.get('embed', 1024)} | {r['images']} | {r['pairs_per_s']:.0f} | "
                         f"{r['gflops']:.1f} | {100 * r['efficiency']:.0f}% | "
                         f"{r['f30k_full_seconds_extrapolated']:.0f} | {r['scoring_rss_mb']:.0f} |")
        lines.append("")
    for r in sc.get("coco5k", []):
        lines.append(f"COCO 5K scale, {r['preset']}: {r['pairs_per_s']:.0f} pairs/s timed on {r['timed_images']} "
                     f"images x {r['captions']} real testall captions -> "
                     f"**{r['coco5k_seconds_extrapolated'] / 3600:.2f} h extrapolated** for 5000 x 25000 (not measured "
                     "end to end).")
    return lines


def _render_reference(report: dict) -> list[str]:
    rows = report["reference"]
    r0 = rows[0]
    sample = (f"every {r0['reference_captions_all'] // r0['reference_captions_timed']}th caption "
              f"({r0['reference_captions_timed']} of {r0['reference_captions_all']}), its seconds extrapolated to all "
              "of them by caption count (its cost is a sum of per-caption steps)"
              if r0["reference_captions_timed"] < r0["reference_captions_all"] else "every caption")
    lines = [f"### Engine vs the per-caption loop (SCAN heads; {r0['images']} images x {r0['captions']} Flickr30K test "
             "captions, the same embeddings, side by side)", "",
             f"Each side the best of {r0['reference_repeats']} runs after a warm-up, with the same threads: the engine "
             f"scores every pair; the loop (bench/scan_reference.py) the same images and {sample}, in float32 (the "
             "engine's precision: "
             "the fair baseline, the target's) and in float64 (as SCAN's evaluation.py runs it). Speed-up = the loop's "
             "seconds for the engine's pairs / the engine's seconds; 'same pairs': the engine timed on exactly the "
             "loop's sampled pairs (a small run).", "",
             "| head | D | engine s | engine pairs/s | loop f32 pairs/s | **speed-up vs loop f32** | same pairs, f32 | "
             "loop f64 pairs/s | speed-up vs loop f64 | max abs diff (f32 / f64 loop) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['embed']} | {r['seconds']:.2f} | {r['pairs_per_s']:.0f} | "
                     f"{r['reference_pairs_per_s']:.0f} | **{r['speedup_vs_reference']:.1f}x** | "
                     f"{r['speedup_vs_reference_same_subset']:.1f}x | {r['reference_float64_pairs_per_s']:.0f} | "
                     f"{r['speedup_vs_reference_float64']:.1f}x | {r['max_abs_diff_vs_reference']:.1e} / "
                     f"{r['max_abs_diff_vs_reference_float64']:.1e} |")
    return lines


def _render_memory(report: dict) -> list[str]:
    lines = ["### Peak memory of scoring vs the budget", "",
             "| head | captions | images charged | budget (MB) | measured peak (MB) | within | what ran | block rows | "
             "embeddings (MB, outside the budget) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["memory"]:
        ran = ("the whole plan" if r.get("measured", "the whole plan") == "the whole plan" else
               f"the largest of its {r['blocks_in_plan']} blocks ({r['largest_block_captions']} captions of "
               f"{r['largest_block_words']} words; the rest of the matrix charged)")
        lines.append(f"| {r['preset']} | {r['captions']} | {r['images_charged']} | {r['budget_mb']:.0f} | "
                     f"{r['scoring_peak_mb']:.1f} | {'yes' if r['within_budget'] else '**no**'} | {ran} | "
                     f"{r['largest_block_rows']} | {r['embeddings_mb']:.0f} |")
    return lines


def _render_training(report: dict) -> list[str]:
    return _table("Training throughput (batch 128, random 36 x 1024 features, real captions)",
                  ["model", "D", "s / step", "pairs/s (B^2 / step time)", "note"],
                  [[r["preset"], str(r["embed"]), f"{r['seconds_per_step']:.2f}", f"{r['pairs_per_s']:.0f}",
                    r.get("note", "")] for r in report["training"]])


def _render_two_stage(report: dict) -> list[str]:
    ts, lines = report["two_stage"], ["### Two-stage retrieval", ""]
    if ts.get("skipped"):
        lines += [f"Flickr8K: {ts['skipped']}.", ""]
    rows = [r for r in ts.get("flickr8k", []) if "k" in r]
    if rows:
        lines += ["Flickr8K test (1000 images, 5000 captions), first stage: the VSE++ checkpoint. Loss = exhaustive "
                  "minus two-stage (points). Speed-up = exhaustive seconds / two-stage seconds, the first stage's "
                  f"encoding of the test set included ({ts.get('first_stage_encoding_seconds', 0):.1f} s; not for "
                  "VSE++, its own first stage).", "",
                  "| model | K | index | i2t R@1/5/10 loss | t2i R@1/5/10 loss | fewer pairs | speed-up |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            i2t = "/".join(f"{r[f'image_to_text_{x}_loss']:+.1f}" for x in ("r1", "r5", "r10"))
            t2i = "/".join(f"{r[f'text_to_image_{x}_loss']:+.1f}" for x in ("r1", "r5", "r10"))
            lines.append(f"| {r['preset']} | {r['k']} | {r['index']} | {i2t} | {t2i} | {r['fewer_pairs']:.1f}x | "
                         f"{r['speedup']:.1f}x |")
        lines.append("")
    lines += [f"- {r['preset']}: {r['skipped']}" for r in ts.get("flickr8k", []) if "skipped" in r]
    return lines


def _render_synthetic(report: dict) -> list[str]:
    rows = report["synthetic"]
    lines = ["### Two-stage retrieval, synthetic galleries", "",
             "Random unit first-stage vectors; random SCAN t-i AVG embeddings. Re-rank: one caption query's K "
             "candidate images through score_pairs, as two_stage_scores runs them, timed per query after a warm-up "
             f"({rows[0]['queries_timed_rerank']} queries); exhaustive: the gallery at the faster of the engine's "
             "score_matrix rates (one caption x many images, or all queries at once), timed after a warm-up and "
             "extrapolated to the gallery. Recall loss is not measured here: exhaustive scoring of such galleries is "
             "exactly what is too slow.", "",
             "| gallery images | index | K | search ms/query | re-rank ms/query | re-rank pairs/s | "
             "exhaustive ms/query (extrap.) | exhaustive pairs/s | speed-up |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gallery_images']} | {r['index']} | {r['k']} | {r['search_ms_per_query']:.2f} | "
                     f"{r['rerank_ms_per_query']:.1f} | {r['rerank_pairs_per_s']:.0f} | "
                     f"{r['exhaustive_ms_per_query']:.0f} | {r['exhaustive_pairs_per_s']:.0f} | {r['speedup']:.0f}x |")
    return lines


# the page's order of the sections (each rendered only if the report has it, or kept from the page: write_report)
RENDERERS = {"blocks": _render_blocks, "kernel": _render_kernel, "scoring": _render_scoring,
             "reference": _render_reference, "memory": _render_memory, "training": _render_training,
             "two_stage": _render_two_stage, "synthetic": _render_synthetic}
# the headings a section's text starts with on the page (a longer heading before one it extends)
HEADINGS = [("synthetic", "### Two-stage retrieval, synthetic"), ("two_stage", "### Two-stage retrieval"),
            ("blocks", "### Block shape"), ("kernel", "### Head kernels"), ("scoring", "### Scoring at Flickr30K"),
            ("reference", "### Engine vs the per-caption loop"),
            ("memory", "### Peak memory"), ("training", "### Training throughput"), ("targets", "### Targets")]
# the Targets lines each section's figures give (targets())
TARGET_OF = {"reference": ("- >= 20x",), "scoring": ("- >= 50% of the matmul peak on the SCAN heads, full",),
             "kernel": ("- >= 50% of the matmul peak on the SCAN heads, one block",),
             "memory": ("- peak memory",), "two_stage": ("- two-stage K=100",)}


def read_generated(block: str) -> dict[str, dict]:
    """The sections of a generated block (the page's text between the markers), each with its text, its Targets
    lines and the run that measured it (its `Sections ... come from` line, else the block's `Generated by` run).
    What write_report keeps of a section the new run neither measured nor merged: the JSON of an earlier run may
    be gone (runs/ is not kept between sessions), and a partial rerun must not drop the rest of the page. A
    Flickr8K two-stage section in the older layout, synthetic galleries inside it, is read as the two sections."""
    generated = re.search(r"^Generated by `(.+?)` on (\S+) \(.*Raw JSON: `(.+?)`", block, re.M)
    peak = re.search(r"^Dense float32 matmul peak .*?\*\*(\S+) GFLOP/s\*\*", block, re.M)
    default = ({"command": generated[1], "date": generated[2], "json": generated[3],
                "peak_gflops": peak[1] if peak else "?"} if generated else None)
    sources = {}
    for m in re.finditer(r"^Sections (.+?) come from `(.+?)` \((\S+), `(.+?)`, peak then (\S+) GFLOP/s\)", block,
                         re.M):
        for name in m[1].split(", "):
            sources[name] = {"command": m[2], "date": m[3], "json": m[4], "peak_gflops": m[5]}
    chunks: dict[str, list[str]] = {}
    current = None
    for line in block.splitlines():
        if line.startswith("### "):
            current = next((name for name, head in HEADINGS if line.startswith(head)), None)
            if current:
                chunks[current] = []
        elif current == "two_stage" and line.startswith("Synthetic galleries ("):  # the older layout
            current = "synthetic"
            chunks[current] = ["### Two-stage retrieval, synthetic galleries", ""]
            sources.setdefault("synthetic", sources.get("two_stage", default))
        if current:
            chunks[current].append(line)
    goals = [x for x in chunks.pop("targets", []) if x.startswith("- ")]
    out = {}
    for name, text in chunks.items():
        source = sources.get(name, default)
        if source is None:
            continue
        while text and not text[-1].strip():
            text.pop()
        out[name] = {"text": text, "targets": [g for g in goals if g.startswith(TARGET_OF.get(name, ("\0",)))],
                     **source}
    return out


def render(report: dict, kept: dict[str, dict] | None = None) -> str:
    """The generated part of docs/performance.md: the report's sections, and `kept` (read_generated: sections of
    the page this report has no figures for, with the runs that measured them) as the page showed them."""
    kept = {k: v for k, v in (kept or {}).items() if k not in report}
    m = report["machine"]
    lines = [f"Generated by `{report['command']}` on {report['date']} ({m['cpus']} CPUs, torch {m['torch']}, "
             f"{m['threads']} threads; machine shared with other jobs, so absolute figures are noisy, ratios "
             f"measured side by side are what to read). Raw JSON: `{report['json']}`.", ""]
    if m["peak_gflops"] is not None:  # (a run that only re-renders merged sections measures nothing)
        lines += [f"Dense float32 matmul peak (best of 2048^3 GEMMs, {m['threads']} threads): "
                  f"**{m['peak_gflops']:.1f} GFLOP/s**.", ""]
    for e in report.get("merged", []):
        lines += [f"Sections {', '.join(e['sections'])} come from `{e['command']}` ({e['date']}, `{e['json']}`, "
                  f"peak then {e['peak_gflops']:.1f} GFLOP/s).", ""]
    groups: dict[tuple, list[str]] = {}
    for name in RENDERERS:
        if name in kept:
            k = kept[name]
            groups.setdefault((k["command"], k["date"], k["json"], k["peak_gflops"]), []).append(name)
    for (command, date, json_path, peak), names in groups.items():
        lines += [f"Sections {', '.join(names)} come from `{command}` ({date}, `{json_path}`, peak then {peak} "
                  "GFLOP/s); kept as this page showed them: that JSON is not here to re-render them from and this run "
                  "did not measure them (the notes above the block say what changed in the bench since).", ""]
    for name, fn in RENDERERS.items():
        if report.get(name):
            lines += fn(report) + [""]
        elif name in kept:
            lines += kept[name]["text"] + [""]
    goals = [f"- {g}" for g in targets(report, set(kept))] + [g for k in kept.values() for g in k["targets"]]
    lines += ["### Targets", ""] + goals
    return "\n".join(lines) + "\n"


def targets(report: dict, kept: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """The targets the report's own figures settle (a section in `kept` brings its own lines from the page)."""
    out = []
    ref = report.get("reference", [])
    if ref:
        worst = min(ref, key=lambda r: r["speedup_vs_reference"])
        diff = max(max(r["max_abs_diff_vs_reference"], r["max_abs_diff_vs_reference_float64"]) for r in ref)
        out.append(f">= 20x faster than the per-caption loop in the engine's precision (float32) with max abs diff "
                   f"<= 1e-5: {'reached' if worst['speedup_vs_reference'] >= 20 and diff <= 1e-5 else 'NOT reached'} "
                   f"(slowest SCAN head {worst['preset']} {worst['speedup_vs_reference']:.1f}x the float32 loop; "
                   f"{min(r['speedup_vs_reference_float64'] for r in ref):.1f}-"
                   f"{max(r['speedup_vs_reference_float64'] for r in ref):.1f}x the float64 one, SCAN's own precision; "
                   f"{worst['images']} images x {worst['captions']} captions; max diff {diff:.1e})")
    scan = [r for r in report.get("scoring", {}).get("f30k", []) if r["preset"].startswith(("scan_", "save_"))]
    if scan:  # (the SCAN heads: SAVE's is SCAN's on grid cells)
        eff = min(r["efficiency"] for r in scan)
        out.append(f">= 50% of the matmul peak on the SCAN heads, full evaluation: "
                   f"{'reached' if eff >= 0.5 else 'NOT reached'} (lowest {100 * eff:.0f}%, highest "
                   f"{100 * max(r['efficiency'] for r in scan):.0f}%)")
    kern = [r for r in report.get("kernel", []) if r["preset"].startswith("scan_")]
    if kern:
        eff, top = min(r["efficiency"] for r in kern), max(r["efficiency"] for r in kern)
        out.append(f">= 50% of the matmul peak on the SCAN heads, one block: "
                   f"{'reached' if eff >= 0.5 else 'NOT reached'} (lowest {100 * eff:.0f}%, highest {100 * top:.0f}%)")
    if report.get("memory"):
        ok = all(r["within_budget"] for r in report["memory"])
        out.append(f"peak memory within the budget: {'reached' if ok else 'NOT reached'} "
                   f"({sum(r['within_budget'] for r in report['memory'])}/{len(report['memory'])} measurements)")
    rows = [r for r in report.get("two_stage", {}).get("flickr8k", []) if r.get("k") == 100 and r["index"] == "flat"]
    if rows:
        loss = max(max(r["image_to_text_r1_loss"], r["text_to_image_r1_loss"]) for r in rows)
        fewer = min(r["fewer_pairs"] for r in rows)
        out.append(f"two-stage K=100 loses <= 1 point R@1 while scoring >= 10x fewer pairs: "
                   f"{'reached' if loss <= 1 and fewer >= 10 else 'NOT reached'} (worst R@1 loss {loss:.1f}, "
                   f"{fewer:.1f}x fewer pairs)")
    elif "two_stage" in kept:
        pass  # (the page's own line comes with the kept section)
    elif "two_stage" not in report:
        out.append("two-stage K=100 on Flickr8K: section not run (or not completed) in this report")
    else:
        out.append("two-stage K=100 on Flickr8K: not measured in this run (no trained checkpoints)")
    return out


def measured_by(report: dict, name: str) -> dict:
    """The run that measured section `name` of a report: the report's own command if it ran that section,
    else the earlier run it was merged from (followed through that run's JSON while it exists)."""
    words = report["command"].split()
    ran = words[words.index("--sections") + 1].split(",") if "--sections" in words else SECTIONS.split(",")
    if name not in ran:
        for e in report.get("merged", []):
            if name in e["sections"]:
                path = ROOT / e["json"]
                if path.is_file():
                    return measured_by(json.loads(path.read_text(encoding="utf-8")), name)
                return {k: v for k, v in e.items() if k != "sections"}
    return {"command": report["command"], "date": report["date"], "json": report["json"],
            "peak_gflops": report["machine"]["peak_gflops"]}


def provenance(sources: dict[str, dict]) -> list[dict]:
    """Merged sections grouped by the run that measured them."""
    groups: dict[str, dict] = {}
    for name, src in sources.items():
        groups.setdefault(src["json"], {**src, "sections": []})["sections"].append(name)
    return list(groups.values())


def write_report(report: dict, out_json: Path) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from itmatch.io import write_json_atomic, write_text_atomic

    write_json_atomic(out_json, report)
    doc = ROOT / "docs" / "performance.md"
    text = doc.read_text(encoding="utf-8") if doc.is_file() else f"# Performance\n\n{MARK_BEGIN}\n{MARK_END}\n"
    head, rest = text.split(MARK_BEGIN, 1)
    block, tail = rest.split(MARK_END, 1)
    # sections neither measured nor merged now stay as the page showed them, with the run that measured them
    write_text_atomic(doc, f"{head}{MARK_BEGIN}\n{render(report, read_generated(block))}{MARK_END}{tail}")
    print(f"wrote {out_json} and {doc}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="reduced scale for development (~minutes)")
    p.add_argument("--sections", default=SECTIONS,
                   help="comma-separated sections (default: all)")
    p.add_argument("--heads", default="issue", help="'issue' (SCAN AVG/LSE, Sum-Max, one per other pair "
                   "arch), 'all' pair-head presets, or a comma-separated preset list")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--progress", action="store_true", help="progress bars")
    p.add_argument("--images", type=int, help="images timed at Flickr30K scale (default 100; --quick 8)")
    p.add_argument("--captions", type=int, help="Flickr30K test captions used (default all 5000; --quick 1000)")
    p.add_argument("--ref-captions", type=int, help="captions the per-caption loop is timed on, evenly spaced, "
                   "its time extrapolated to all (default 64; --quick 16; 0: all, nothing extrapolated)")
    p.add_argument("--merge", action="append", default=[],
                   help="an earlier runs/bench/perf-*.json whose sections the report keeps (repeatable)")
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps(memory_child(*json.loads(args.memory_child))))
        return 0
    q = args.quick
    images, captions = (8, 1000) if q else (100, None)
    args.images, args.captions = args.images or images, args.captions or captions
    args.ref_captions = args.ref_captions if args.ref_captions is not None else 16 if q else 64
    args.ref_images, args.ref_repeats = (8, 2) if q else (100, 3)
    args.coco_images = 4 if q else 20
    args.train_embed, args.train_steps = (128, 0) if q else (512, 1)
    args.ks = (50, 100) if q else (50, 100, 200)
    args.synthetic_embed, args.synthetic_queries, args.k_synthetic = (256, 64, 100) if q else (1024, 256, 100)
    args.synthetic_rerank_queries = 8 if q else 32  # caption queries whose re-ranking is timed one by one
    args.head_seconds = 20 if q else 90  # scoring time per head at Flickr30K scale (slow heads: fewer images)
    args.presets = (pair_head_presets(args.heads) if args.heads in ("issue", "all")
                    else [h.strip() for h in args.heads.split(",")])
    sections = [s.strip() for s in args.sections.split(",")]
    cmd = "python bench/perf.py" + "".join(f" {a}" for a in sys.argv[1:])
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_json = ROOT / "runs" / "bench" / f"perf-{stamp}.json"
    measuring = any(name in SECTIONS.split(",") for name in sections)  # else: only re-render merged runs
    peak = matmul_peak_gflops() if measuring else None
    report = {"command": cmd, "date": stamp, "json": str(out_json.relative_to(ROOT)),
              "machine": {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "platform": platform.platform(), "peak_gflops": peak}}
    sources: dict[str, dict] = {}  # merged section -> the run that measured it (through earlier merges too)
    for path in args.merge:  # sections of earlier runs (stated in the report), replaced by those run now
        earlier = json.loads(Path(path).read_text(encoding="utf-8"))
        for name in [k for k in earlier if k not in ("command", "date", "json", "machine", "merged")]:
            report[name], sources[name] = earlier[name], measured_by(earlier, name)
    report["merged"] = provenance(sources)
    print(f"matmul peak {peak or 0:.1f} GFLOP/s with {torch.get_num_threads()} threads; heads: "
          f"{', '.join(args.presets)}")
    for name, fn in (("kernel", lambda: section_kernel(args)), ("blocks", lambda: section_blocks(args)),
                     ("scoring", lambda: section_scoring(args)), ("reference", lambda: section_reference(args)),
                     # memory measures the galleries the scoring section timed (this run's or a merged one)
                     ("memory", lambda: section_memory(args, {r["preset"]: r["images"]
                                                              for r in report.get("scoring", {}).get("f30k", [])})),
                     ("training", lambda: section_training(args)), ("two_stage", lambda: section_two_stage(args)),
                     ("synthetic", lambda: section_synthetic(args))):
        if name in sections:
            print(f"[{name}]", flush=True)
            report[name] = fn()
            sources.pop(name, None)
            report["merged"] = provenance(sources)
            write_report(report, out_json)  # after every section: a long run interrupted keeps its figures
    if measuring:  # the machine is shared: did the load change?
        report["machine"]["peak_gflops_end"] = matmul_peak_gflops()
    write_report(report, out_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
