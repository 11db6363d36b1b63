"""Evaluation: encode every image and caption once, fill the score matrix in memory-bounded blocks,
then apply the protocol of DESIGN.md section 3 (1K, COCO 5-fold 1K, COCO 5K, any split; ensembles)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from itmatch import distributed as dist
from itmatch.data.precomp import PrecompSplit, split_manifest
from itmatch.data.vocab import AnyVocab, unknown_word_report
from itmatch.device import Placement, check_precision, module_device, resolve
from itmatch.engine.checkpoint import Checkpoint, load_checkpoint
from itmatch.engine.inputs import check_image_features, open_split
from itmatch.engine.metrics import average_folds, retrieval_metrics
from itmatch.engine.results import result_row, upsert_row
from itmatch.errors import ConfigError, DataError, refuse_overwrite
from itmatch.inference import (  # noqa: F401 (the inference core, also importable from here as before)
    CAPTIONS_PER_BLOCK,
    DEFAULT_BUDGET,
    MAX_BLOCK_CELLS,
    TextBuckets,
    bucket_texts,
    encode_caption_buckets,
    encode_captions,
    encode_images,
    images_per_block,
    item_bytes,
    score_blocks,
    score_pairs,
    unbucket_texts,
)
from itmatch.inference import score_matrix as _score_matrix
from itmatch.inference import sharded_score_matrix as _sharded_score_matrix
from itmatch.inference.score_cache import ScoreCache
from itmatch.io import write_json_atomic
from itmatch.models.base import ImageEmb, Matcher, TextEmb
from itmatch.models.registry import image_inputs
from itmatch.retrieval.two_stage import TwoStageResult, first_stage_vectors, pruned_scores, two_stage_scores

PROTOCOLS = ("1k", "full", "coco1k", "coco5k")

ADVICE_AFTER_SECONDS = 60.0  # of scoring, before estimating the whole matrix's time
LONG_SCORING_SECONDS = 900.0  # estimated scoring time from which a run without --resume-dir is told about it


class _LongScoringAdvice:
    """Says once, after a minute of scoring without a cache, when the whole matrix will take long enough
    that losing it to a kill would hurt, and how to avoid that."""

    def __init__(self, pairs: int) -> None:
        self.pairs, self.after, self.long = pairs, ADVICE_AFTER_SECONDS, LONG_SCORING_SECONDS
        self.start, self.done, self.said = time.perf_counter(), 0, False

    def __call__(self, scored: int) -> None:
        self.done += scored
        elapsed = time.perf_counter() - self.start
        if self.said or elapsed < self.after:
            return
        self.said = True
        total = elapsed * self.pairs / self.done
        if total >= self.long and dist.is_main():
            warnings.warn(f"scoring {self.pairs:,} pairs will take about {total / 60:.0f} min at this rate; "
                          "nothing is kept if it is killed: `itmatch evaluate --resume-dir DIR` (resume_dir=) "
                          "keeps finished blocks so that a rerun continues, `--rerank K` scores only a first "
                          "stage's top K", stacklevel=4)


def _advice(model: Matcher, img: ImageEmb, txt: TextEmb | TextBuckets, cache: ScoreCache | None):
    """The long-run advice for an exhaustive pair-head scoring kept nowhere (None otherwise)."""
    if cache is not None or model.head.pair_independent:
        return None
    m = len(txt) if isinstance(txt, TextEmb) else sum(len(c) for c, _ in txt)
    return _LongScoringAdvice(len(img) * m)


def score_matrix(model: Matcher, img: ImageEmb, txt: TextEmb | TextBuckets,
                 budget_bytes: float = DEFAULT_BUDGET, progress: bool = False,
                 captions_per_block: int = CAPTIONS_PER_BLOCK, max_cells: int | None = None,
                 cache: ScoreCache | None = None) -> torch.Tensor:
    """inference.score_matrix, with the evaluator's advice when scoring without a cache will take long."""
    return _score_matrix(model, img, txt, budget_bytes, progress, captions_per_block, max_cells, cache,
                         on_block=_advice(model, img, txt, cache))


def sharded_score_matrix(model: Matcher, img: ImageEmb, txt: TextEmb | TextBuckets,
                         budget_bytes: float = DEFAULT_BUDGET, progress: bool = False,
                         captions_per_block: int = CAPTIONS_PER_BLOCK, max_cells: int | None = None,
                         cache: ScoreCache | None = None) -> torch.Tensor | None:
    """inference.sharded_score_matrix, with the evaluator's advice (see score_matrix)."""
    return _sharded_score_matrix(model, img, txt, budget_bytes, progress, captions_per_block, max_cells, cache,
                                 on_block=_advice(model, img, txt, cache))


def split_scores(model: Matcher, vocab: AnyVocab, split: PrecompSplit, budget_bytes: float = DEFAULT_BUDGET,
                 progress: bool = False, sharded: bool = False, cache: ScoreCache | None = None
                 ) -> torch.Tensor | None:
    """The split's exhaustive score matrix [n_img, n_txt]; sharded: see sharded_score_matrix (None on
    ranks other than 0). Every rank encodes every item: encoding is a small part of a pair head's cost."""
    img = encode_images(model, split.images, progress=progress)
    buckets = encode_caption_buckets(model, split.captions, vocab, progress=progress)
    scorer = sharded_score_matrix if sharded else score_matrix
    return scorer(model, img, buckets, budget_bytes, progress, cache=cache)


def protocol_folds(split: PrecompSplit, protocol: str) -> list[PrecompSplit]:
    if protocol not in PROTOCOLS:
        raise DataError(f"unknown protocol {protocol!r}", hint=f"choose one of {', '.join(PROTOCOLS)}")
    n = split.n_images
    if protocol == "full":
        return [split]
    if protocol == "1k":
        if n < 1000:
            raise DataError(f"the 1K protocol needs 1000 images, split {split.split!r} has {n}",
                            path=split.root, hint="use --protocol full for a smaller split")
        if n == 5000:  # (COCO's testall: its 1K protocol is the mean over five folds, not the first one)
            warnings.warn(f"--protocol 1k scores the first 1000 of split {split.split!r}'s 5000 images, one fold; "
                          "COCO's 1K results average all five: --protocol coco1k", stacklevel=2)
        return [split.head(1000)]
    if n != 5000:
        raise DataError(f"the {protocol} protocol needs the 5000-image COCO testall split, found {n} images",
                        path=split.root, hint="use --split testall on a COCO precomp directory")
    if protocol == "coco5k":
        return [split]
    return [split.slice(1000 * f, 1000 * (f + 1)) for f in range(5)]


def rerank_split_scores(model: Matcher, vocab: AnyVocab, split: PrecompSplit, k: int,
                        first_stage: tuple[Matcher, AnyVocab] | None = None, index: str = "flat",
                        progress: bool = False) -> tuple[torch.Tensor, dict]:
    """Two-stage scores of a split (retrieval.two_stage): the first stage is `model`'s own global
    embedding (VSE++) or that of a separate `first_stage` model (for SCAN and other pair heads)."""
    img = encode_images(model, split.images, progress=progress)
    txt = encode_captions(model, split.captions, vocab, progress=progress)
    if first_stage is None:
        img_vec, txt_vec = first_stage_vectors(img, txt)
    else:
        fs_model, fs_vocab = first_stage
        img_vec, txt_vec = first_stage_vectors(encode_images(fs_model.eval(), split.images),
                                               encode_captions(fs_model, split.captions, fs_vocab))
    result = two_stage_scores(model, img, txt, k, img_vec, txt_vec, index, progress)
    return result.scores, {"k": k, "index": index, **_two_stage_info(result)}


def pruned_split_scores(models: Sequence[tuple[Matcher, AnyVocab]], splits: Sequence[PrecompSplit],
                        progress: bool = False, precision: str = "fp32") -> tuple[torch.Tensor, dict]:
    """Safe-pruned scores of a split by one model or an ensemble (retrieval.two_stage.pruned_scores): the
    exhaustive ranks, fewer pairs. Each model reads its own copy of the split (`splits`, in the models' order: the
    same items, perhaps other features), and encodes and scores where it lives, in `precision`."""
    with ExitStack() as arithmetic:
        for model, _ in models:
            arithmetic.enter_context(Placement(module_device(model), precision).arithmetic())
        members = [(model.eval(), encode_images(model, split.images, progress=progress),
                    encode_captions(model, split.captions, vocab, progress=progress))
                   for (model, vocab), split in zip(models, splits, strict=True)]
        result = pruned_scores(members, splits[0].per_image, progress)
    bounds = [model.head.score_bound for model, _ in models]
    return result.scores, {"pruned": True, "bound": sum(bounds) / len(bounds), **_two_stage_info(result)}


def _two_stage_info(result: TwoStageResult) -> dict:
    return {"pairs_scored": result.pairs_scored, "pairs_total": result.pairs_total,
            "fraction_scored": round(result.fraction, 5),
            "seconds": {key: round(v, 3) for key, v in result.timings.items()}}


def evaluate_models(models: Sequence[tuple[Matcher, AnyVocab]], split: PrecompSplit | Sequence[PrecompSplit],
                    protocol: str = "full",
                    budget_bytes: float = DEFAULT_BUDGET, progress: bool = False, rerank: int = 0,
                    first_stage: tuple[Matcher, AnyVocab] | None = None, index: str = "flat",
                    resume_dir: str | Path | None = None, prune: bool = False, precision: str = "fp32",
                    curve: bool = False) -> dict:
    """Metrics of one model, or of an ensemble (score matrices averaged before ranking), on `split`: one for every
    model, or one per model in their order (the same items, each model's own features: check_same_items). With
    `rerank` K > 0: two-stage scoring (top K of a global first stage, re-scored exactly), one model.
    With `prune`: safe pruning (exhaustive metrics, only the pairs the head's score bound leaves open), of one
    model or an ensemble.

    With `resume_dir`, exhaustive scoring keeps its finished blocks there and continues from those an
    interrupted run over the same inputs left (inference.score_cache); `eval_seconds` then adds the scoring
    seconds the earlier runs spent on them, and `resumed` says how many blocks came from disk.

    Under torchrun every rank calls this: exhaustive scoring is sharded across the ranks (see
    sharded_score_matrix), rank 0 computes the metrics (two-stage scoring runs on rank 0 alone) and every
    rank returns rank 0's result.

    Each model encodes and scores on its own device (where its parameters are; the caller places it), in
    `precision` (fp32: exact, no autocast; bf16 / fp16: autocast, scores kept in float32 on the host).
    With `curve`, the result also holds each direction's recall curve, R@1 ... R@100 ("recall_curve")."""
    for model, _ in models:  # (before any work)
        check_precision(precision, module_device(model))
    splits = [split] * len(models) if isinstance(split, PrecompSplit) else list(split)
    if len(splits) != len(models):
        raise ConfigError(f"{len(splits)} splits for {len(models)} models", hint="pass one split, or one per model")
    check_same_items(splits)
    if rerank and prune:
        raise ConfigError("--rerank K and --prune are two different scorings", hint="choose one of them")
    two_staged = bool(rerank or prune)
    if rerank and len(models) != 1:
        raise ConfigError("two-stage re-ranking takes one model, not an ensemble",
                          hint="evaluate one checkpoint with --rerank, or score the ensemble exhaustively (or with "
                               "--prune, where every member's head has a score bound)")
    sharded = dist.is_distributed()
    if sharded and (two_staged or not dist.is_main()):
        progress = False
    start = time.perf_counter()
    cache = ScoreCache(resume_dir) if resume_dir is not None and not two_staged else None
    folds, two_stage = [], []
    for member_folds in zip(*(protocol_folds(s, protocol) for s in splits), strict=True):
        if prune:  # (the ensemble's members together: the bound is on their mean score)
            if dist.is_main():
                scores, info = pruned_split_scores(models, member_folds, progress, precision)
                two_stage.append(info)
                folds.append(retrieval_metrics(scores, member_folds[0].per_image, curve))
            continue
        total = None
        for (model, vocab), fold in zip(models, member_folds, strict=True):
            model.eval()
            if two_staged and not dist.is_main():
                continue
            with Placement(module_device(model), precision).arithmetic():
                if two_staged:
                    scores, info = rerank_split_scores(model, vocab, fold, rerank, first_stage, index, progress)
                    two_stage.append(info)
                else:
                    scores = split_scores(model, vocab, fold, budget_bytes, progress, sharded=sharded, cache=cache)
            if scores is not None:  # (None: a rank other than 0 of a sharded evaluation)
                total = scores if total is None else total + scores
        if total is not None:
            folds.append(retrieval_metrics(total / len(models), member_folds[0].per_image, curve))
    resumed = (cache.resumed_blocks, cache.resumed_seconds) if cache is not None else (0, 0.0)
    if sharded:  # each rank resumed its share of the blocks (their seconds are already wall-time shares)
        per_rank = dist.gather_objects(resumed)
        resumed = (sum(b for b, _ in per_rank), sum(s for _, s in per_rank)) if per_rank is not None else resumed
    if not dist.is_main():
        return dist.broadcast_object(None)
    result = dict(folds[0] if len(folds) == 1 else average_folds(folds))
    if rerank > 0:
        result["rerank"] = rerank
    result.update(protocol=protocol, split=splits[0].split, folds=len(folds),
                  n_images=protocol_folds(splits[0], protocol)[0].n_images,
                  eval_seconds=round(time.perf_counter() - start + resumed[1], 2))
    if resumed[0]:
        result["resumed"] = {"blocks": resumed[0], "seconds": round(resumed[1], 2), "from": str(resume_dir)}
    if two_stage:
        result["two_stage"] = two_stage[0] if len(two_stage) == 1 else two_stage
    # after eval_seconds (comparable with earlier rows); the metrics are those of the model's own input
    captions = [c for fold in protocol_folds(splits[0], protocol) for c in fold.captions]  # (the same in every split)
    reports = [unknown_word_report(vocab, captions) for _, vocab in models]
    result["unknown_words"] = reports[0] if len(reports) == 1 else reports
    return dist.broadcast_object(result)


def check_same_items(splits: Sequence[PrecompSplit]) -> None:
    """An ensemble's members may read different features (another backbone's extraction of the same photos), but
    their splits must hold the same images and captions in the same order, or the averaged scores would pair
    one model's image i with another's image j. A DataError names the two directories and the first difference."""
    first = splits[0]
    for other in splits[1:]:
        for what, a, b in (("image", first.ids, other.ids), ("caption", first.captions, other.captions)):
            if a == b:
                continue
            at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            differ = (f"{what} {at + 1} is {a[at]!r} in one and {b[at]!r} in the other" if at < min(len(a), len(b))
                      else f"one has {len(a)} {what}s and the other {len(b)}")
            raise DataError(f"the ensemble's members read different {first.split!r} splits: {differ}",
                            path=f"{first.root} and {other.root}",
                            hint="evaluate models whose data directories were extracted from the same photos and "
                                 "captions (the same split files), or pass one --data for all of them")


def format_table(result: dict) -> str:
    """A readable two-direction table."""
    rows = ["direction        R@1    R@5   R@10   medr   meanr"]
    for d in ("image_to_text", "text_to_image"):
        m = result[d]
        rows.append(f"{d:<15} {m['r1']:5.1f}  {m['r5']:5.1f}  {m['r10']:5.1f}  {m['medr']:5.1f}  {m['meanr']:6.1f}")
    rows.append(f"rsum {result['rsum']:.1f}   mR {result['mR']:.2f}   "
                f"({result.get('protocol', '')}, {result.get('n_images', '?')} images, "
                f"{result.get('eval_seconds', 0):.1f} s)")
    reports = result.get("unknown_words", [])
    reports = [reports] if isinstance(reports, dict) else reports
    for n, report in enumerate(reports):
        rows.append(format_unknown_words(report, f"model {n + 1}: " if len(reports) > 1 else ""))
    return "\n".join(rows)


def format_unknown_words(report: dict, prefix: str = "") -> str:
    """One line on the caption words the model could not read (unknown_word_report)."""
    line = (f"{prefix}unknown words: {report['unknown']:,} of {report['words']:,} caption words "
            f"({report['unknown_percent']:.2f}%) read as unknown (not in the vocabulary)")
    if report["captions_without_known_word"]:
        line += f", {report['captions_without_known_word']:,} captions without a known word"
    if report["top_unknown"]:
        line += "; most frequent: " + ", ".join(f"{w} {c}" for w, c in report["top_unknown"])
    return line



# -- one evaluation run from checkpoint directories (what `itmatch evaluate` does) -----------------------------

@dataclass
class EvaluationRun:
    """The outcome of `evaluate_run`: `metrics` (what --json writes) and the results row written, if any."""

    metrics: dict
    row: dict[str, str] | None = None


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` within the block (0: leave torch's setting), restored after."""
    previous = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _open_eval_split(checkpoint: Checkpoint, split: str, data: str | Path | None, images: str | Path | None
                     ) -> tuple[PrecompSplit, str]:
    """The split a checkpoint's model reads (features, or image files for a pixel model), from `data`
    (default: the checkpoint's own data directory) and `images`; and the data directory it came from."""
    root = str(data) if data else checkpoint.data_path()  # (an error saying where it looked, if found nowhere)
    cfg = checkpoint.config
    if images:
        cfg.data.images = str(images)
    elif image_inputs(cfg.model) == ("pixels",):
        cfg.data.images = checkpoint.data_path("images")
    opened = open_split(cfg, split, data_path=root)
    check_image_features(cfg, opened)  # (before a shape error deep in the image encoder, or a silent misfit)
    return opened, root


def _split_digests(root: Path, split: str) -> dict[str, str] | None:
    """The SHA-256 of a split's feature and caption files as meta.json records them (None for data `itmatch
    extract` did not write, e.g. SCAN's own precomp files)."""
    manifest = split_manifest(root, split)
    if manifest is None:
        return None
    return {k: manifest[f"{k}_sha256"] for k in ("features", "captions") if f"{k}_sha256" in manifest}


def per_member(data: str | Path | Sequence[str | Path] | None, n: int) -> list[str | Path | None]:
    """`--data` for each of an ensemble's n checkpoints: none (each its own), one for all, or one each."""
    if data is None or isinstance(data, (str, Path)):
        return [data] * n
    if len(data) not in (1, n):
        raise ConfigError(f"{len(data)} data directories for {n} checkpoints",
                          hint="give --data once (every checkpoint reads it) or once per checkpoint, in their order")
    return list(data) if len(data) == n else [data[0]] * n


def evaluate_run(checkpoints: Sequence[str | Path], *, split: str = "test",
                 data: str | Path | Sequence[str | Path] | None = None,
                 images: str | Path | None = None, protocol: str = "full", budget_gb: float = 4.0,
                 threads: int = 0, rerank: int = 0, prune: bool = False, first_stage: str | Path | None = None,
                 faiss: str = "flat", resume_dir: str | Path | None = None, json_path: str | Path | None = None,
                 results: str | Path | None = None, name: str | None = None, dataset: str | None = None,
                 command: str | None = None, force: bool = False, progress: bool = True,
                 device: str | torch.device = "auto", precision: str = "fp32", trust_modified: bool = False
                 ) -> EvaluationRun:
    """Evaluate one checkpoint directory, or an ensemble of several, as `itmatch evaluate` does (the verb only
    parses its arguments and calls this; docs/architecture.md).

    Loads the checkpoints onto `device` (in `precision`; both checked before any work), opens `split` of `data`
    (one directory for every checkpoint, or one per checkpoint in their order; default: each checkpoint's own
    data directory, so an ensemble's members may read different features of the same photos, e.g. Lite0 and
    Lite2; `images` for models that read pixels), scores it
    exhaustively (or two-stage with `rerank` K and `first_stage`'s global embedding, or with safe `prune`-ing;
    `resume_dir` keeps finished score blocks so that a killed run continues) under `protocol`, and returns the
    metrics with both directions' recall curves (R@1 ... R@100, for `itmatch analyze recall`).
    With `json_path` they are also written there (an existing file is replaced only with `force`);
    with `results`, a row named `name` (default: the checkpoints' run names joined by '+') is added to that
    results CSV (an existing row is replaced only with `force`), recording `command`, which is then required:
    the command line that reproduces the row.
    Under torchrun every rank calls this; rank 0 writes the outputs and every rank returns its metrics.
    """
    placement = resolve(device, precision, device_setting="device=", precision_setting="precision=")
    if results and not command:
        raise ConfigError("a results row records the command that reproduces it",
                          hint="pass command='itmatch evaluate ...' (the CLI records its own command line)")
    if first_stage and not rerank:
        raise ConfigError("--first-stage is used only with --rerank K", hint="add --rerank 100")
    if (rerank or prune) and dist.env_world_size() > 1:
        raise ConfigError(f"--{'rerank' if rerank else 'prune'} scores on rank 0 alone: under torchrun the other "
                          f"{dist.env_world_size() - 1} processes would only wait for it (and give up after "
                          f"{dist.timeout_minutes():g} minutes, ending the evaluation)",
                          hint="run this evaluation in one process (without torchrun); exhaustive evaluation is "
                               "the one torchrun shares among processes")
    if json_path:  # refused before the scoring, which may take hours
        refuse_overwrite(json_path, force)
    loaded = [load_checkpoint(p, trust_modified=trust_modified) for p in checkpoints]
    if not loaded:
        raise ConfigError("no checkpoint to evaluate", hint="name one checkpoint directory, or several (an ensemble)")
    for c in loaded:
        c.model.to(placement.device)
    opened = [_open_eval_split(c, split, member_data, images)
              for c, member_data in zip(loaded, per_member(data, len(loaded)), strict=True)]
    eval_splits, root = [s for s, _ in opened], opened[0][1]
    proposer = None
    if first_stage:
        fs = load_checkpoint(first_stage, trust_modified=trust_modified)
        proposer = (fs.model.to(placement.device), fs.vocab)
    dist.init_from_env()  # under torchrun: the ranks share the scoring (docs/distributed.md)
    with _torch_threads(dist.cpu_threads(threads)):
        metrics = evaluate_models([(c.model, c.vocab) for c in loaded], eval_splits, protocol, budget_gb * 1024**3,
                                  progress=progress, rerank=rerank, first_stage=proposer, index=faiss,
                                  resume_dir=resume_dir, prune=prune, precision=placement.precision, curve=True)
    metrics["checkpoints"] = [str(p) for p in checkpoints]
    metrics["precision"] = placement.precision  # (bf16 scores tie where fp32's do not: docs/gpu.md, "bf16 ...")
    # which data the figures are of: the directory, and the digests `itmatch extract` recorded of the split's
    # features and captions (so two evaluations can be told to be of the same split, wherever it was copied)
    roots = list(dict.fromkeys(r for _, r in opened))
    digests = [_split_digests(Path(r), split) for r in roots]
    metrics["data"], metrics["data_sha256"] = (roots[0], digests[0]) if len(roots) == 1 else (roots, digests)
    if first_stage:
        metrics["first_stage"] = str(first_stage)
    truncated = sum(getattr(c.vocab, "truncated", 0) for c in loaded)
    if truncated:
        metrics["truncated_captions"] = truncated
    run = EvaluationRun(metrics)
    if not dist.is_main():
        return run
    if json_path:
        write_json_atomic(json_path, metrics)
    if results:
        row_name = name or "+".join(c.config.name for c in loaded)
        model = "+".join(c.config.preset or c.config.model.arch for c in loaded)
        run.row = result_row(row_name, model, dataset or Path(root).name, metrics, command or "")
        upsert_row(results, run.row, force=force)
    return run
