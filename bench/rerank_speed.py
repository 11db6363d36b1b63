"""Re-ranking engine vs exhaustive scoring vs the per-query loop, side by side in one process.

    python bench/rerank_speed.py --preset scan_t2i_avg --k 100      # one row of docs/performance.md

Random-initialised models (only timing and exactness matter): the pair head `--preset` and an untrained VSE++
as the first stage, on the first `--images` images and 5x as many captions of the Flickr8K test features.
Prints JSON with pairs/s of
  - exhaustive: score_matrix on the first `--fraction` of the images x all captions (pairs/s extrapolated
    to the whole matrix);
  - rerank: two_stage_scores (score_pairs: the union of candidates, blocks of 1 image x its candidates);
  - loop: the previous re-ranker (one head call per query: 1 image x its K captions, then K images x 1
    caption), timed on the first `--fraction` of the queries of each direction;
and the max abs diff of both re-rankers against the exhaustive scores on the candidate pairs of the images
scored exhaustively. Speed-up = exhaustive seconds for n x m pairs / re-ranking seconds, the first stage
included: its encoding of the images and captions (the VSE++ encoders: work exhaustive scoring does not do),
its index and its search (`rerank`; `rerank_only`: score_pairs's stage alone, as the loop is timed) =
(pairs/s ratio) x (fewer pairs). The exhaustive side scores captions already cut into the evaluator's length
buckets (as it encodes them), so no bucketing is timed there. Times are wall and process CPU seconds (one
torch thread by default): on a shared machine CPU seconds are closer to what a dedicated core takes, but they miss the
time the kernel spends faulting in fresh pages of large allocations, which wall time shows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from itmatch.data.precomp import read_precomp
from itmatch.data.vocab import build_vocab
from itmatch.engine.evaluate import bucket_texts, encode_captions, encode_images, score_matrix
from itmatch.models.base import ImageEmb, Matcher, TextEmb
from itmatch.models.registry import build_model, preset_config
from itmatch.retrieval.first_stage import FirstStageIndex
from itmatch.retrieval.two_stage import two_stage_scores

ROOT = Path(__file__).resolve().parents[1]


@torch.inference_mode()
def per_query_loop(model: Matcher, img: ImageEmb, txt: TextEmb, txt_of_img: torch.Tensor,
                   img_of_txt: torch.Tensor, image_queries: int, caption_queries: int) -> tuple[torch.Tensor, int]:
    """The re-ranker before score_pairs (commit a1c24e9), on the first queries of each direction:
    one head call per query. Returns its [n, m] scores (-inf where not scored) and the pairs scored."""
    n, m = len(img), len(txt)
    scores = torch.full((n, m), float("-inf"))
    scored = torch.zeros(n, m, dtype=torch.bool)
    for i in range(image_queries):
        cand = txt_of_img[i][txt_of_img[i] >= 0]
        scores[i, cand] = model.score(img.take(slice(i, i + 1)), txt.take(cand).trimmed())[0].float()
        scored[i, cand] = True
    for j in range(caption_queries):
        cand = img_of_txt[j][img_of_txt[j] >= 0]
        cand = cand[~scored[cand, j]]
        if len(cand):
            scores[cand, j] = model.score(img.take(cand), txt.take(slice(j, j + 1)).trimmed())[:, 0].float()
            scored[cand, j] = True
    return scores, int(scored.sum())


def make(preset: str, vocab_size: int, embed: int) -> Matcher:
    cfg = preset_config(preset)
    cfg.model.embed_size, cfg.model.img_dim, cfg.model.vocab_size = embed, 1280, vocab_size
    torch.manual_seed(0)
    return build_model(cfg.model).eval()


def max_diff(scores: torch.Tensor, reference: torch.Tensor) -> float:
    """Max abs diff on the pairs both matrices have (finite in `scores`, rows of `reference`)."""
    part = scores[:len(reference)]
    finite = torch.isfinite(part)
    return float((part[finite] - reference[finite]).abs().max()) if bool(finite.any()) else float("nan")


def timed(fn):
    """(result, wall seconds, process CPU seconds)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def rates(pps: dict[str, float], exhaustive: dict[str, float] | None = None) -> dict:
    """pairs/s by clock; with the exhaustive rates: the ratio of pairs/s and the speed-up over scoring all
    n x m pairs exhaustively (= ratio x fewer pairs)."""
    out: dict = {"pairs_per_s": {c: round(v) for c, v in pps.items()}}
    if exhaustive is not None:
        out["vs_exhaustive_pairs_per_s"] = {c: round(v / exhaustive[c], 2) for c, v in pps.items()}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "runs" / "data" / "flickr8k_lite0"),
                        help="precomp directory (default: the Flickr8K features of README's extract command)")
    parser.add_argument("--split", default="test", help="split of --data to read")
    parser.add_argument("--preset", default="scan_t2i_avg", help="the pair head's preset")
    parser.add_argument("--images", type=int, default=300, help="first N images (and their 5 N captions)")
    parser.add_argument("--k", type=int, nargs="+", default=[100], help="re-ranking depths K")
    parser.add_argument("--embed", type=int, default=512, help="embedding size D of the random models")
    parser.add_argument("--fraction", type=float, default=0.1,
                        help="share of the images scored exhaustively and of the queries the loop runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--markdown", action="store_true",
                        help="also print docs/performance.md's table rows of this run (stderr)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    split = read_precomp(args.data, args.split)
    feats = np.asarray(split.images[:args.images])
    captions = split.captions[:5 * args.images]
    vocab = build_vocab(captions)
    model, first = make(args.preset, len(vocab), args.embed), make("vsepp", len(vocab), args.embed)
    img, txt = encode_images(model, feats), encode_captions(model, captions, vocab)
    buckets = bucket_texts(txt)  # (as the evaluator encodes them: no bucketing inside the exhaustive timing)
    encode_captions(first, captions[:8], vocab)  # warm-up
    # the first stage's encoding: two-stage work the exhaustive path does not do, timed with the re-ranker
    (fs_img, fs_txt), fs_wall, fs_cpu = timed(lambda: (encode_images(first, feats).vector,
                                                       encode_captions(first, captions, vocab).vector))
    n, m = len(img), len(txt)
    rows = max(1, round(args.fraction * n))
    exhaustive, ex_wall, ex_cpu = timed(lambda: score_matrix(model, img.take(slice(0, rows)), buckets))
    ex_pps = {"wall": rows * m / ex_wall, "cpu": rows * m / ex_cpu}
    out: dict = {"preset": args.preset, "images": n, "captions": m, "embed": args.embed, "threads": args.threads,
                 "exhaustive": {"pairs_timed": rows * m, **rates(ex_pps),
                                "seconds_full_extrapolated": {c: round(n * m / v, 1) for c, v in ex_pps.items()}},
                 "first_stage_encoding_seconds": {"wall": round(fs_wall, 2), "cpu": round(fs_cpu, 2)}}
    for k in args.k:
        result, wall, cpu = timed(lambda k=k: two_stage_scores(model, img, txt, k, fs_img, fs_txt))
        only = result.timings["rerank"]  # score_pairs's stage alone (wall)
        wall, cpu = wall + fs_wall, cpu + fs_cpu  # the whole first stage: encoding, index, search
        rerank_pps = {"wall": result.pairs_scored / wall, "cpu": result.pairs_scored / cpu}
        _, txt_of_img = FirstStageIndex("flat").build(fs_txt).search(fs_img, k)
        _, img_of_txt = FirstStageIndex("flat").build(fs_img).search(fs_txt, k)
        queries = max(1, round(args.fraction * n)), max(1, round(args.fraction * m))
        (loop_scores, loop_pairs), loop_wall, loop_cpu = timed(
            lambda t=txt_of_img, i=img_of_txt, q=queries: per_query_loop(model, img, txt, t, i, *q))
        loop_pps = {"wall": loop_pairs / loop_wall, "cpu": loop_pairs / loop_cpu}
        out[f"k{k}"] = {
            "pairs_scored": result.pairs_scored, "fewer_pairs": round(n * m / result.pairs_scored, 2),
            "rerank": {"seconds": {"wall": round(wall, 2), "cpu": round(cpu, 2)}, **rates(rerank_pps, ex_pps),
                       "wall_seconds_by_stage": {"first_stage_encoding": round(fs_wall, 2),
                                                 **{s: round(v, 2) for s, v in result.timings.items()}},
                       "rerank_only": rates({"wall": result.pairs_scored / only}, {"wall": ex_pps["wall"]}),
                       "max_abs_diff": max_diff(result.scores, exhaustive)},
            "loop": {"pairs_timed": loop_pairs, **rates(loop_pps, ex_pps),
                     "max_abs_diff": max_diff(loop_scores, exhaustive)}}
        print(json.dumps(out[f"k{k}"]), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))
    if args.markdown:
        for k in args.k:
            print(markdown_row(out, k), file=sys.stderr)
    return 0


def markdown_row(out: dict, k: int) -> str:
    """One row of docs/performance.md's "Re-ranking engine" table: each cell wall / CPU."""
    r, ex = out[f"k{k}"], out["exhaustive"]["pairs_per_s"]

    def both(d: dict, fmt: str = "{:.0f}") -> str:
        return f"{fmt.format(d['wall'])} / {fmt.format(d['cpu'])}"

    def speedup(d: dict) -> str:
        return f"{d['wall'] * r['fewer_pairs']:.1f}x / {d['cpu'] * r['fewer_pairs']:.1f}x"

    new, loop = r["rerank"], r["loop"]
    return (f"| {out['preset']} | {k} | {r['pairs_scored']} | {r['fewer_pairs']:.2f}x | {both(ex)} | "
            f"{both(loop['pairs_per_s'])} | {both(loop['vs_exhaustive_pairs_per_s'], '{:.2f}')} | "
            f"{speedup(loop['vs_exhaustive_pairs_per_s'])} | {both(new['pairs_per_s'])} | "
            f"**{both(new['vs_exhaustive_pairs_per_s'], '{:.2f}')}** | "
            f"**{speedup(new['vs_exhaustive_pairs_per_s'])}** | "
            f"{new['rerank_only']['vs_exhaustive_pairs_per_s']['wall']:.2f} | {both(new['seconds'], '{:.1f}')} | "
            f"{new['max_abs_diff']:.1e} |")


if __name__ == "__main__":
    raise SystemExit(main())
