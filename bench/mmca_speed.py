"""MMCA scoring cost: exhaustive vs two-stage re-ranking vs safe pruning on a slice of Flickr8K, side by side.

    python bench/mmca_speed.py --images 40 --threads 1          # docs/mmca.md's figures (untrained model)
    python bench/mmca_speed.py --images 40 --block-plans        # the head's block cap vs the default
    python bench/mmca_speed.py --checkpoint runs/flickr8k/mmca/best --split test --images 200 --ks --skip-train
                                                                # safe pruning on a trained model

Prints JSON (CPU seconds of one thread): encode times, pairs scored and pairs/s of exhaustive and re-ranked
scoring (K = 20, 50, 100), safe pruning's pairs and its speed-up over exhaustive scoring (whose metrics it must
equal), the extrapolation to the 1000 x 5000 test split, and the cost of a training step (every pair vs
model.mmca.train_negatives) with the frozen text encoder's share of it. How much safe pruning saves depends on
how far a trained model spreads its global cosines; an untrained model leaves nearly every pair undecided.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from itmatch.data.datasets import pad_tokens
from itmatch.data.precomp import read_precomp
from itmatch.data.vocab import WordPieceVocab
from itmatch.engine.checkpoint import load_checkpoint
from itmatch.engine.evaluate import (
    MAX_BLOCK_CELLS,
    encode_caption_buckets,
    encode_captions,
    encode_images,
    score_blocks,
    score_matrix,
)
from itmatch.engine.metrics import retrieval_metrics
from itmatch.models.registry import build_model, preset_config
from itmatch.retrieval.two_stage import pruned_scores, two_stage_scores

ROOT = Path(__file__).resolve().parents[1]


def timed(fn):
    """(result, seconds). Process CPU time, not wall time: the machine is shared and this script runs one
    torch thread, so CPU seconds are what one dedicated core would take."""
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def evaluation_costs(model, vocab, split, ks: list[int]) -> dict:
    img, t_img = timed(lambda: encode_images(model, split.images))
    txt, t_txt = timed(lambda: encode_captions(model, split.captions, vocab))
    n, m = len(img), len(txt)
    out: dict = {"images": n, "captions": m,
                 "encode_images_s": round(t_img, 2), "encode_captions_s": round(t_txt, 2)}
    full, t_full = timed(lambda: score_matrix(model, img, txt))
    out["exhaustive"] = {"pairs": n * m, "seconds": round(t_full, 1), "pairs_per_s": round(n * m / t_full, 1)}
    for k in ks:
        result, t_k = timed(lambda k=k: two_stage_scores(model, img, txt, k, img.vector, txt.vector))
        scores, pairs = result.scores, result.pairs_scored
        same = bool(torch.allclose(scores[torch.isfinite(scores)], full[torch.isfinite(scores)], atol=1e-5))
        # the test split: each image keeps its top-K captions, each caption its top-K images; at most
        # 1000 K + 5000 K candidate pairs (fewer where the two lists overlap)
        test_pairs = 1000 * k + 5000 * k
        out[f"rerank_{k}"] = {"pairs": pairs, "seconds": round(t_k, 1), "pairs_per_s": round(pairs / t_k, 1),
                              "matches_exhaustive": same,
                              "test_1000x5000_hours_upper_bound": round(test_pairs / (pairs / t_k) / 3600, 2)}
    out["test_1000x5000_exhaustive_hours"] = round(1000 * 5000 / (n * m / t_full) / 3600, 1)
    pruned, t_pruned = timed(lambda: pruned_scores([(model, img, txt)], split.per_image))
    out["pruned"] = {"pairs": pruned.pairs_scored, "fraction_scored": round(pruned.fraction, 4),
                     "seconds": round(t_pruned, 1), "speed_up": round(t_full / t_pruned, 2),
                     "same_metrics": retrieval_metrics(pruned.scores, split.per_image)
                     == retrieval_metrics(full, split.per_image),
                     "rsum": round(retrieval_metrics(full, split.per_image)["rsum"], 2)}
    return out


def block_plan_costs(model, vocab, data: str, images: int, captions: int, rounds: int) -> dict:
    """Exhaustive scoring with the evaluator's default block plan (blocks up to MAX_BLOCK_CELLS cells) and
    with the head's own cap (`max_block_cells`), alternated `rounds` times so that the shared machine's
    load falls on both alike; captions sampled across the dev split, so the length buckets are realistic."""
    dev = read_precomp(data, "dev")
    img = encode_images(model, dev.head(images).images)
    buckets = encode_caption_buckets(model, dev.captions[:: max(1, len(dev.captions) // captions)][:captions], vocab)
    cap = model.head.max_block_cells
    plans = {"evaluator_default": 0, "head_cap": cap}
    seconds: dict[str, list[float]] = {name: [] for name in plans}
    scores = {}
    for _ in range(rounds):
        for name, cells in plans.items():
            model.head.max_block_cells = cells
            scores[name], t = timed(lambda: score_matrix(model, img, buckets))
            seconds[name].append(t)
    out: dict = {"images": len(img), "captions": sum(len(c) for c, _ in buckets), "rounds": rounds}
    for name, cells in plans.items():
        model.head.max_block_cells = cells
        median = float(np.median(seconds[name]))
        out[name] = {"max_block_cells": cells or MAX_BLOCK_CELLS, "blocks": len(score_blocks(model, img, buckets)),
                     "median_seconds": round(median, 2), "pairs_per_s": round(scores[name].numel() / median, 1)}
    model.head.max_block_cells = cap
    out["speed_up"] = round(out["head_cap"]["pairs_per_s"] / out["evaluator_default"]["pairs_per_s"], 2)
    out["max_abs_difference"] = float((scores["head_cap"] - scores["evaluator_default"]).abs().max())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "runs" / "data" / "flickr8k_lite0"),
                        help="precomp directory (default: the Flickr8K features of README's extract command)")
    parser.add_argument("--preset", default="mmca", help="mmca, mmca_h512, ... (an untrained model)")
    parser.add_argument("--checkpoint", help="a trained MMCA checkpoint instead of an untrained --preset")
    parser.add_argument("--split", default="dev", help="split whose first --images images are scored")
    parser.add_argument("--images", type=int, default=100, help="images (5 captions each)")
    parser.add_argument("--ks", type=int, nargs="*", default=[20, 50, 100], help="re-rank depths")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--batch", type=int, default=64, help="training batch for the encoder-share measurement")
    parser.add_argument("--train-negatives", type=int, nargs="*", default=[0, 8],
                        help="model.mmca.train_negatives values of the training-step measurement")
    parser.add_argument("--skip-eval", action="store_true", help="only the training-step measurement")
    parser.add_argument("--skip-train", action="store_true", help="only the evaluation measurements")
    parser.add_argument("--block-plans", action="store_true",
                        help="only compare exhaustive scoring with the evaluator's default blocks and the head's "
                             "cap (--images images x 500 dev captions, 3 alternated rounds)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    split = read_precomp(args.data, args.split).head(args.images)
    if args.checkpoint:
        ckpt = load_checkpoint(args.checkpoint)
        cfg, vocab, model = ckpt.config, ckpt.vocab, ckpt.model.eval()
    else:
        cfg = preset_config(args.preset)
        vocab = WordPieceVocab.from_pretrained(cfg.model.mmca.text_model, cfg.model.mmca.max_tokens)
        cfg.model.vocab_size, cfg.model.img_dim = len(vocab), int(split.images.shape[2])
        model = build_model(cfg.model).eval()
    out: dict = {"model": args.checkpoint or f"{args.preset} (untrained)", "split": args.split,
                 "threads": args.threads}
    if args.block_plans:
        out["block_plans"] = block_plan_costs(model, vocab, args.data, args.images, captions=500, rounds=3)
        print(json.dumps(out, indent=2))
        return 0
    if not args.skip_eval:
        out.update(evaluation_costs(model, vocab, split, args.ks))
    if args.skip_train:
        print(json.dumps(out, indent=2))
        return 0

    # a training step (forward + backward of a batch): cost with every pair vs train_negatives, and the
    # frozen encoder's share (is caching its outputs per caption worth it?)
    model.train()
    caps = pad_tokens([vocab.encode(c) for c in split.captions[: args.batch]])
    feats = torch.from_numpy(np.array(split.images[: args.batch // 5 + 1])).repeat_interleave(5, 0)[: args.batch]
    _, t_bert = timed(lambda: model.text_encoder.encoder(caps.tokens, caps.lengths))
    for h in args.train_negatives:
        model.head.train_negatives = h

        def step() -> None:
            img, txt = model.encode_images(feats), model.encode_texts(caps.tokens, caps.lengths)
            model.training_loss(img, txt, cfg.loss.margin, True).backward()

        _, t_step = timed(step)
        out[f"train_step_negatives_{h}"] = {"batch": args.batch, "seconds": round(t_step, 2),
                                            "frozen_encoder_s": round(t_bert, 3),
                                            "encoder_share": round(t_bert / t_step, 4)}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
