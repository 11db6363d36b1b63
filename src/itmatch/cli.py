"""`itmatch <verb>`: models, synth, extract, train, evaluate, analyze, convert, demo, index, search, serve."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import shlex
import sys
import warnings
from pathlib import Path
from typing import NoReturn

from itmatch.argtypes import (
    allowed_host,
    checkpoint_ref,
    device_name,
    existing_dir,
    existing_file,
    figure_file,
    host,
    int_in,
    non_negative_int,
    output_dir,
    output_file,
    port,
    positive_float,
    positive_int,
)
from itmatch.errors import ConfigError, ItmatchError, TrainingStopped
from itmatch.retrieval.limits import MAX_K

split_size = int_in(0, 99999)  # synth: image file names have five digits


def _placement(args: argparse.Namespace):
    """--device / --precision resolved (ConfigError naming the flag and what is available), before any work."""
    from itmatch.device import resolve

    return resolve(args.device or "auto", args.precision or "fp32")


def _cmd_models(args: argparse.Namespace) -> int:
    from itmatch.models.registry import PAPER_ROWS, PRESETS, describes, list_models, preset_config

    if args.pretrained:
        if args.paper is not None or args.settings:
            raise ConfigError("--paper and --settings list presets, not the shipped models of --pretrained")
        return _list_pretrained()

    names = [name for name in list_models() if describes(name, args.paper or "")]
    if not names:
        raise ConfigError(f"no preset's name or paper row contains every word of {args.paper!r}",
                          hint="e.g. --paper save, --paper 'scan table 3'; `itmatch models` lists them all")
    for name in names:
        m, t = PRESETS[name]["model"], preset_config(name).train
        line = f"{name:<22} {m['arch']:<9}{PAPER_ROWS.get(name, '-')}  (epochs {t.epochs}, lr {t.lr:g})"
        if args.settings:
            line += "  " + " ".join(f"{k}={v}" for k, v in m.items() if k != "arch")
        print(line)
    return 0


def _list_pretrained() -> int:
    from itmatch.pretrained import shipped

    models = shipped()
    if not models:
        print("no pretrained model is shipped yet; load a checkpoint directory instead, e.g. itmatch.load('RUN/best')")
    width = max((len(name) for name in models), default=0)  # (one column however long the longest name)
    for model in models.values():
        print(model.describe(name_width=width))
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    from itmatch.data.synth import render_synthetic

    out = render_synthetic(Path(args.out), n_train=args.train, n_dev=args.dev, n_test=args.test,
                           image_size=args.size, seed=args.seed, force=args.force)
    print(f"wrote {out}")
    return 0


SKIPPED_SHOWN = 20  # skipped caption rows printed by `itmatch extract` (meta.json lists every one)


def _cmd_extract(args: argparse.Namespace) -> int:
    from itmatch.data.captions import SkippedRowsWarning, read_captions
    from itmatch.features.extract import extract_precomp

    placement = _placement(args)
    images = Path(args.images)
    with warnings.catch_warnings():  # (its one-line summary warning: each skipped row is printed below)
        warnings.simplefilter("ignore", SkippedRowsWarning)
        table = read_captions(args.captions, images_dir=images, fmt=args.format, default_split=args.default_split)
    meta = extract_precomp(images, table, Path(args.out), backbone=args.backbone, splits=args.splits,
                           extra_captions=args.extra_captions, rehash=args.rehash,
                           batch_size=args.batch_size, force=args.force, skip_bad_images=args.skip_bad_images,
                           scales=args.scales, device=placement.device, precision=placement.precision,
                           progress=not args.quiet, view=args.view)
    from itmatch.distributed import is_main

    if is_main():  # (under torchrun: rank 0 reports; what changed since an earlier run was logged)
        # the skipped rows after the extraction, not before: a refused one (photos of a split missing, e.g. the wrong
        # folder) said its one error under 40,000 "skipped" lines of rows it then did not skip
        for problem in table.skipped[:SKIPPED_SHOWN]:
            print(f"skipped: {problem}", file=sys.stderr)
        if len(table.skipped) > SKIPPED_SHOWN:
            print(f"skipped: ... and {len(table.skipped) - SKIPPED_SHOWN} more caption rows (meta.json "
                  "skipped_captions lists them all)", file=sys.stderr)
        print(json.dumps(_without_file_records(meta), indent=2) if args.json else _extraction_summary(meta, args.out))
    return 0


def _extraction_summary(meta: dict, out: str) -> str:
    """What `itmatch extract` made, a line a split (the whole record is meta.json; --json prints it)."""
    lines = [f"{out}: {meta.get('backbone', '?')} features, {meta.get('regions', '?')} regions x {meta.get('dim', '?')}"
             f" channels an image"]
    for name, info in meta.get("splits", {}).items():
        seconds = info.get("seconds_this_run")
        lines.append(f"  {name:<8} {info.get('images', 0):>7} images {info.get('captions', 0):>8} captions"
                     + (f"  (extracted in {seconds:.0f} s)" if seconds is not None else ""))
    lines.append(f"every detail (sources' digests, skipped rows, timings): {Path(out) / 'meta.json'}; --json prints it")
    return "\n".join(lines)


def _without_file_records(meta: dict) -> dict:
    """meta.json for printing: its per-image and per-row lists (file fingerprints, captions left out or dropped as
    repeats, skipped caption rows, each printed as it was met) replaced by their length (meta.json has them in
    full)."""
    def counted(record: dict, *keys: str) -> dict:
        return {**record, **{k: len(record[k]) for k in keys if isinstance(record.get(k), (dict, list))}}

    def short(info: dict) -> dict:
        info = counted(info, "image_files")
        for key in ("extra_captions", "duplicate_captions"):  # {"left_out": N, "images": {id: n}, "captions": ...}
            if isinstance(info.get(key), dict):
                info[key] = counted(info[key], "images", "captions")
        return info

    return {**counted(meta, "skipped_captions"),
            "splits": {name: short(info) for name, info in meta.get("splits", {}).items()}}


def _resolve_train_config(args: argparse.Namespace):
    from itmatch.config import load_yaml, parse_overrides
    from itmatch.models.registry import resolve_config

    layers = []
    if args.config:
        layers.append(load_yaml(args.config))
    if args.data:
        layers.append({"data": {"path": args.data}})
    layers.append(parse_overrides(args.set or []))
    cfg = resolve_config(args.preset, *layers)
    if args.name:
        cfg.name = args.name
    if args.device:  # (train passes them to train() instead, which also applies them to a resumed run)
        cfg.train.device = args.device
    if args.precision:
        cfg.train.precision = args.precision
    return cfg


def _resume_overrides(args: argparse.Namespace) -> dict:
    """What `train --resume` applies to the checkpoint's config: the keys of --config's file, --data, --set, then
    --preset, --name, --device and --precision, in the order a new run layers them (the flags last: they win over
    the file and --set there too). They follow the rules of --set on resume
    (engine/train.py apply_resume_overrides): a value equal to the run's is accepted whatever its key (the
    starting command re-run with --resume continues the run), a change outside train.* and the data
    locations, such as another preset, is refused."""
    from itmatch.config import load_yaml, merge_overrides, parse_overrides
    from itmatch.models.registry import preset_of

    from_file = load_yaml(args.config) if args.config else {}
    set_pairs = parse_overrides(args.set or [])
    preset_of(args.preset, from_file, set_pairs)  # (a file or --set naming another preset than --preset: refused,
    # as in a new run)
    named = {key: value for key, value in (("preset", args.preset), ("name", args.name)) if value}
    placed = {key: value for key, value in (("device", args.device), ("precision", args.precision)) if value}
    return merge_overrides(from_file, {"data": {"path": args.data}} if args.data else {}, set_pairs, named,
                           {"train": placed} if placed else {})


def _cmd_train(args: argparse.Namespace) -> int:
    from itmatch import distributed as dist
    from itmatch.engine.train import train

    if args.device or args.precision:
        _placement(args)  # (before any work: reading a checkpoint or data)
    cfg = None if args.resume else _resolve_train_config(args)
    overrides = None
    if args.resume:
        from itmatch.config import Config

        cfg = Config()  # replaced by the checkpoint's config, with the command's settings applied to it
        overrides = _resume_overrides(args)
    result = train(cfg, Path(args.out), resume=args.resume, force=args.force, device=args.device,
                   precision=args.precision, resume_overrides=overrides, trust_modified=args.trust_modified,
                   progress=not args.quiet)
    if not dist.is_main():
        return 0
    print(result.get("note") or f"best dev rsum {result['best_rsum']:.1f} at epoch {result['best_epoch']}; "
                                f"checkpoint {Path(args.out) / 'best'}")
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from itmatch import distributed as dist
    from itmatch.engine.evaluate import evaluate_run
    from itmatch.pretrained import resolve_checkpoint

    placement = _placement(args)  # (an error naming --device / --precision, before any work)
    checkpoints = [resolve_checkpoint(c) for c in args.checkpoints]  # (a shipped model's name: its folder)
    first_stage = resolve_checkpoint(args.first_stage) if args.first_stage else None
    run = evaluate_run(
        checkpoints, split=args.split, data=args.data, images=args.images, protocol=args.protocol,
        budget_gb=args.budget_gb, threads=args.threads, rerank=args.rerank, prune=args.prune,
        first_stage=first_stage, faiss=args.faiss, resume_dir=args.resume_dir, json_path=args.json,
        results=args.results, name=args.name, dataset=args.dataset, force=args.force, progress=not args.quiet,
        command=args.command or "itmatch " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        device=placement.device, precision=placement.precision, trust_modified=args.trust_modified)
    if dist.is_main():
        _print_evaluation(run.metrics)
        if run.row is not None:
            print(f"row {run.row['name']!r} written to {args.results}")
        if args.json:
            print(f"metrics and recall curves written to {args.json} (to draw the curves: itmatch analyze recall "
                  f"{shlex.quote(args.json)} --out recall.png)")
    return 0


def _print_evaluation(result: dict) -> None:
    """The metrics table, and notes on resumed scoring, truncated captions and two-stage scoring."""
    from itmatch.engine.evaluate import format_table

    if "resumed" in result:
        r = result["resumed"]
        print(f"resumed: {r['blocks']} score blocks came from {r['from']} ({r['seconds']:.0f} s of earlier "
              f"scoring, counted in eval_seconds)", file=sys.stderr)
    if result.get("truncated_captions"):
        print(f"note: {result['truncated_captions']} captions were longer than the text encoder's limit and were "
              "truncated", file=sys.stderr)
    print(format_table(result))
    if "two_stage" in result and not isinstance(result["two_stage"], list):
        ts = result["two_stage"]
        how = (f"safe pruning (bound {ts['bound']:g})" if ts.get("pruned")
               else f"two-stage: top {ts['k']} ({ts['index']})")
        print(f"{how}, {ts['pairs_scored']} of {ts['pairs_total']} pairs scored "
              f"({100 * ts['fraction_scored']:.1f}%)")


def _cmd_tags(args: argparse.Namespace) -> int:
    from itmatch.data.perturb import tag_captions
    from itmatch.data.precomp import read_precomp

    captions = read_precomp(args.data, args.split).training_captions
    tag_captions(captions, cache_dir=args.tag_cache, progress=not args.quiet)
    print(f"tagged {len(captions)} {args.split} captions of {args.data} into {args.tag_cache} (pass it to "
          "`analyze perturb --tag-cache` on a machine without spaCy)")
    return 0


#: how `analyze recall` takes labels beside its files (its --labels help and its error without files)
LABELS_ORDER = ("put the files first (itmatch analyze recall A.json B.json --labels a b --out recall.png), or end "
                "the labels with -- and the files last (... --labels a b -- A.json B.json: no option is read after --)")


def _recall_inputs(args: argparse.Namespace) -> tuple[list[str], list[str] | None]:
    """`analyze recall`'s files and labels. --labels takes every word after it, so `--labels a b A.json B.json`
    leaves no file behind it (argparse then said only "the following arguments are required: evaluations"): as
    each file has one label, the first half of its words are the labels and the rest the files. Anything else
    without a file is refused, saying where the files go."""
    files, labels = args.evaluations, args.labels
    if files:
        return files, labels
    if not labels:
        raise ConfigError("no evaluation files given", hint="pass the files `itmatch evaluate --json` wrote: "
                                                            "itmatch analyze recall A.json B.json --out recall.png")
    half, rest = divmod(len(labels), 2)
    if rest:
        raise ConfigError(f"no evaluation files given: --labels took every word after it as a label "
                          f"({' '.join(labels)}), and {len(labels)} words cannot be one label per file",
                          hint=LABELS_ORDER)
    try:
        files = [existing_file(word) for word in labels[half:]]
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"no evaluation files given: the words after --labels were read as labels, then as many "
                          f"files ({' '.join(labels[:half])} | {' '.join(labels[half:])}), but {exc}",
                          hint=LABELS_ORDER) from None
    return files, labels[:half]


def _cmd_recall(args: argparse.Namespace) -> int:
    from itmatch.analysis.recall import curve_table, plot_recall_curves, read_evaluations
    from itmatch.errors import refuse_overwrite

    files, labels = _recall_inputs(args)
    refuse_overwrite(args.out, args.force)
    evaluations = read_evaluations(files, labels)
    plot_recall_curves(evaluations, args.out, args.title or "")
    print(curve_table(evaluations))
    print(f"wrote {args.out}")
    return 0


def _cmd_attention(args: argparse.Namespace) -> int:
    from itmatch.analysis.attention import attention_table, plot_word_attention
    from itmatch.errors import refuse_overwrite
    from itmatch.features.pipeline import decode_image
    from itmatch.pretrained import resolve_checkpoint
    from itmatch.retrieval.matcher import load

    refuse_overwrite(args.out, args.force)
    placement = _placement(args)
    matcher = load(resolve_checkpoint(args.model), device=placement.device, precision=placement.precision,
                   trust_modified=args.trust_modified)
    photo = decode_image(args.photo)  # (upright RGB, as the model reads it)
    attention = matcher.word_attention(photo, args.caption)
    plot_word_attention(photo, attention, args.out, args.title or "")
    print(attention_table(attention))
    print(f"wrote {args.out}")
    return 0


def _cmd_analyze(args: argparse.Namespace) -> int:
    from itmatch.analysis.perturb import run_perturbation_study

    _placement(args)
    cfg = _resolve_train_config(args)
    report = run_perturbation_study(cfg, Path(args.out), args.perturbations, split=args.split,
                                    protocol=args.protocol, seed=args.seed, force=args.force,
                                    tag_cache=args.tag_cache, progress=not args.quiet, jobs=args.jobs,
                                    original=args.original, device=args.device, precision=args.precision)
    print((Path(args.out) / "perturb.md").read_text(encoding="utf-8"))
    empty = {r["perturbation"]: r["empty_captions"] for r in report["rows"] if r["empty_captions"]}
    if empty:
        print("captions left without a word (kept, trained as <start> [punctuation] <end>): "
              + ", ".join(f"{k} {v}" for k, v in empty.items()))
    print(f"wrote {args.out}/perturb.json, .csv, .md, .png")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    import warnings

    from itmatch.engine.convert import convert_original

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = convert_original(args.source, args.out, vocab_path=args.vocab, force=args.force)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    print(f"converted {summary['arch']} checkpoint (epoch {summary['epoch']}, best rsum {summary['best_rsum']:.1f}) "
          f"-> {summary['out']}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from itmatch.demo import run_demo

    placement = _placement(args)
    run_demo(Path(args.out), force=args.force, epochs=args.epochs, device=str(placement.device),
             precision=placement.precision)
    return 0


def _cmd_index(args: argparse.Namespace) -> int:
    from itmatch.pretrained import resolve_checkpoint
    from itmatch.retrieval.index import build_index
    from itmatch.retrieval.names import public_id

    placement = _placement(args)
    summary = build_index(Path(args.images), resolve_checkpoint(args.model), Path(args.out), force=args.force,
                          batch_size=args.batch_size, progress=not args.quiet, device=placement.device,
                          precision=placement.precision, trust_modified=args.trust_modified, rehash=args.rehash,
                          features=args.features)
    from itmatch.distributed import is_main

    if not is_main():  # (under torchrun: rank 0 reports)
        return 0
    # (each skipped file was named, with its reason, as it was met; the manifest lists them under "skipped")
    skipped = f", {len(summary['skipped'])} unreadable file(s) skipped" if summary["skipped"] else ""
    print(f"{summary['images']} images in {public_id(summary['index'])}: {summary['encoded']} encoded, "
          f"{summary['reused']} reused; {len(summary['added'])} added, {len(summary['changed'])} changed, "
          f"{len(summary['renamed'])} renamed or moved, {len(summary['removed'])} removed since the last run"
          f"{skipped} ({summary['seconds']} s)")
    if not summary["images"]:
        from itmatch.features.pipeline import IMAGE_SUFFIXES

        # (a folder of links to photos elsewhere was warned about above; "no image found" read as if there were none)
        print(f"note: no image indexed under {public_id(str(Path(args.images).resolve()))} (recursively; files ending "
              f"in {', '.join(sorted(IMAGE_SUFFIXES))}; hidden ones and links to files outside the folder left out): "
              "searches of this index find nothing", file=sys.stderr)
    return 0


def _add_images_argument(s: argparse.ArgumentParser) -> None:
    """--images of search and serve: where the indexed photos are now, when their folder moved."""
    s.add_argument("--images", type=existing_dir,
                   help="photo folder, if it moved since indexing (default: the indexed one)")


def _cmd_search(args: argparse.Namespace) -> int:
    from itmatch.retrieval.names import public_id
    from itmatch.retrieval.search import Searcher, check_query, read_captions_file

    args.query = " ".join(args.query) if args.query else None  # (its words, given unquoted)
    if (args.query is None) == (args.image is None):
        raise ConfigError("give either a text QUERY or --image PHOTO", hint="itmatch search INDEX 'a dog' -k 10")
    if args.query is not None:
        check_query(args.query)  # (before the model loads: seconds)
    elif not args.captions:  # (before the model loads, as the query's check)
        raise ConfigError("--image finds captions for a photo: give the captions to rank with --captions FILE",
                          hint=f"itmatch search {args.index} --image PHOTO --captions CAPTIONS.txt (one caption a "
                               "line)")
    placement = _placement(args)
    captions = read_captions_file(args.captions) if args.captions else None
    searcher = Searcher(Path(args.index), args.model, ensemble=args.ensemble, images_dir=args.images, captions=captions,
                        shortlist=args.shortlist,
                        shortlist_index=args.faiss, device=placement.device, precision=placement.precision,
                        trust_modified=args.trust_modified)
    # --json prints one document shaped as the HTTP API's answer (docs/search.md), with escaped paths for urls
    if args.image is not None:
        results = searcher.search_image(Path(args.image), args.k)
        _report_unrankable_captions(searcher.captions_without_known_word, args.captions)
        document = {"image": public_id(str(args.image)), "k": args.k,
                    "captions_without_known_word": len(searcher.captions_without_known_word), "results": results}
    else:
        # ids and paths escaped (docs/search.md): a name need not be UTF-8 and may hold a newline
        hits = searcher.search(args.query, args.k)
        paths = [searcher.path_of(h.id) for h in hits]
        results = [{**h.as_dict(), "path": public_id(str(path))} for h, path in zip(hits, paths, strict=True)]
        gone = sum(not path.is_file() for path in paths)
        if gone:  # (deleted or moved since the index was last updated: still ranked, not shown by the server)
            from itmatch.retrieval.index import index_command, moved_folder_hint

            manifest = searcher.index.manifest
            if not searcher.images_root.is_dir():
                print(f"note: the photo folder {public_id(str(searcher.images_root))} is not there; "
                      f"{moved_folder_hint(args.index, manifest)}", file=sys.stderr)
            else:
                print(f"note: {gone} of these {len(hits)} photos are no longer where they were indexed (moved or "
                      f"deleted); update the index: {index_command(args.index, manifest)}", file=sys.stderr)
        if 0 < args.shortlist < min(args.k, len(searcher.ids)):  # (fewer results than asked for, said why)
            print(f"note: --shortlist {args.shortlist} ranks only the first stage's top {args.shortlist} photos: "
                  f"-k {args.k} returns {len(hits)} (raise --shortlist to get more)", file=sys.stderr)
        unknown = searcher.unknown_words(args.query)
        if unknown:  # (stderr as well: a reader of the ranked lines sees it)
            whose = "the model's vocabulary" if len(searcher.members) == 1 else "every model's vocabulary"
            print(f"note: not in {whose}, read as <unk>: {', '.join(unknown)}", file=sys.stderr)
        document = {"query": args.query, "k": args.k, "unknown_words": unknown, "results": results}
    if args.query is not None and not searcher.ids:  # (said when it was indexed too; a search may come much later)
        print(f"note: the index {public_id(args.index)} holds no photo (none was found in "
              f"{public_id(str(searcher.images_root))} when it was indexed): nothing to find", file=sys.stderr)
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        for r in results:
            unknown = f"  [unknown: {', '.join(r['unknown_words'])}]" if r.get("unknown_words") else ""
            print(f"{r['rank']:>3}  {r['score']:.4f}  {r.get('path', r.get('caption'))}{unknown}")
    return 0


def _report_unrankable_captions(captions: list[str], source: str) -> None:
    if captions:
        print(f"note: {len(captions)} caption(s) of {source} have no word in the model's vocabulary and are "
              f"never ranked, e.g. {captions[0]!r}", file=sys.stderr)


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn  # noqa: F401  (imported by `serve` itself: missing, it failed after the model loaded)

        from itmatch.retrieval.service import serve
    except ImportError as exc:
        raise ConfigError(f"`itmatch serve` needs FastAPI and uvicorn ({exc})",
                          hint='pip install "itmatch[serve]"') from None

    placement = _placement(args)
    serve(Path(args.index), host=args.host, port=args.port, checkpoint=args.model, ensemble=args.ensemble,
          captions=args.captions,
          images_dir=args.images, log_level=args.log_level, shortlist=args.shortlist, shortlist_index=args.faiss,
          device=str(placement.device), precision=placement.precision, trust_modified=args.trust_modified,
          allowed_hosts=args.allowed_hosts)
    return 0


def _add_ensemble_argument(s: argparse.ArgumentParser) -> None:
    """--ensemble of search and serve: more indexes of the same photos, each with its own model."""
    s.add_argument("--ensemble", type=existing_dir, action="append", default=[], metavar="INDEX",
                   help="another index of the same photos, built with another model: each photo is ranked by the "
                        "mean of the models' scores, as `itmatch evaluate` scores an ensemble (repeatable; "
                        "docs/search.md, 'Ensembles')")


def _add_shortlist_arguments(s: argparse.ArgumentParser) -> None:
    """--shortlist / --faiss of `search` and `serve` (Searcher's first stage)."""
    s.add_argument("--shortlist", type=non_negative_int, default=0, metavar="N",
                   help="score only the top N photos of a FAISS first stage over the model's global embedding "
                        "(VSE++, OAN, MMCA, SMAN; not SCAN), re-ranked exactly; default 0 = every photo")
    s.add_argument("--faiss", default="flat", choices=["flat", "ivf"],
                   help="first-stage index for --shortlist: flat (exact top N, default) or ivf (approximate)")


def _add_device_arguments(s: argparse.ArgumentParser, default: str = "auto") -> None:
    """--device / --precision of every verb that runs a network (docs/gpu.md)."""
    s.add_argument("--device", type=device_name, default=None, metavar="DEVICE",
                   help=f"auto (the GPU when torch sees one), cpu, cuda or cuda:N (default: {default})")
    s.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16"],
                   help="fp32 (exact, default), bf16 (autocast) or fp16 (autocast, CUDA only)")


def _add_quiet_argument(s: argparse.ArgumentParser, what: str = "no progress bars") -> None:
    """--quiet of every verb with long work: its progress bars off (logs of unattended runs stay readable)."""
    s.add_argument("--quiet", action="store_true", help=what)


def _add_trust_argument(s: argparse.ArgumentParser) -> None:
    """--trust-modified of every verb that loads a checkpoint (engine/checkpoint.py verify_manifest)."""
    s.add_argument("--trust-modified", action="store_true",
                   help="load checkpoints whose files (config.json, vocab.json, weights, ...) differ from their "
                        "manifest.json, e.g. edited on purpose, with a warning naming them (default: refuse)")


class _Parser(argparse.ArgumentParser):
    """argparse's parser with a one-line usage error, the form of every other `itmatch` error; the verbs'
    parsers are of this class too (argparse builds subparsers with the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        # argparse reports arguments no parser knows from the top parser ("itmatch: ... see `itmatch --help`");
        # the innermost verb's parser that was left with them marks itself, so the error names the verb, its
        # --help, and the option a misspelt one is closest to
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and not hasattr(namespace, _LEFT_OVER):
            setattr(namespace, _LEFT_OVER, self)
        return namespace, extras

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = getattr(namespace, _LEFT_OVER)
            parser.error(f"unrecognized arguments: {' '.join(extras)}{parser.closest_option(extras)}")
        return namespace

    def closest_option(self, extras: list[str]) -> str:
        """'; did you mean --x?' for the first unknown option with a close known one (difflib), else ''."""
        known = [o for action in self._actions for o in action.option_strings]
        for word in extras:
            if word.startswith("-"):
                close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.7)
                if close:
                    return f"; did you mean {close[0]}?"
        return ""


_LEFT_OVER = "_itmatch_left_over"  # (the namespace attribute _Parser.parse_known_args marks)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="itmatch", description="Image-text matching: train, evaluate, search.")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    s = sub.add_parser("models", help="list the model presets (paper configurations)",
                       description="One line per preset: its name, arch, the paper row or table it reproduces "
                                   "(\"this toolkit's: ...\" where it is none) and its epochs and lr.")
    s.add_argument("--paper", metavar="TEXT",
                   help="only the presets whose name or paper row contains every word of TEXT (any case; a row "
                        "of 'Tables 1, 3' counts for 'table 3'), e.g. --paper save, --paper 'scan table 3'")
    s.add_argument("--settings", action="store_true",
                   help="also the model settings each preset changes from the defaults")
    s.add_argument("--pretrained", action="store_true",
                   help="list the trained models shipped with itmatch instead (load them by name)")
    s.set_defaults(func=_cmd_models)

    s = sub.add_parser("synth", help="render the embedded captioned-scene dataset (no download)")
    s.add_argument("out", type=output_dir, help="output directory (images/ and dataset_synth.json)")
    s.add_argument("--train", type=split_size, default=1500, help="training images (default 1500)")
    s.add_argument("--dev", type=split_size, default=200, help="dev (validation) images (default 200)")
    s.add_argument("--test", type=split_size, default=200, help="test images (default 200)")
    s.add_argument("--size", type=int_in(32), default=224, help="image side in pixels (>= 32)")
    s.add_argument("--seed", type=non_negative_int, default=0,
                   help="random seed of the scenes and captions (default 0; the same seed, the same dataset)")
    s.add_argument("--force", action="store_true", help="replace an existing output directory")
    s.set_defaults(func=_cmd_synth)

    s = sub.add_parser("extract", help="images + captions -> precomp dataset of CNN grid features")
    s.add_argument("images", type=existing_dir, help="folder of images")
    s.add_argument("captions", type=existing_file,
                   help="caption source: Flickr8k.token.txt, dataset_*.json, captions_*.json, CSV")
    s.add_argument("--out", type=output_dir, required=True, help="precomp output directory")
    s.add_argument("--format", default="auto", choices=["auto", "flickr8k", "karpathy", "coco", "csv"],
                   help="caption file format (default auto: from the file's name and first line; docs/data.md)")
    s.add_argument("--default-split", default="", choices=["train", "dev", "test", "testall"],
                   help="split of the captions whose source names none (a CSV without a split column)")
    s.add_argument("--extra-captions", default="drop", choices=["drop", "keep"],
                   help="captions of an image beyond 5: drop (default; reported) or keep as extra training "
                        "captions ({split}_extra_caps.tsv; evaluation keeps 5 per image)")
    s.add_argument("--rehash", action="store_true",
                   help="check every image's content (SHA-256) against the last extraction (default: only "
                        "images whose size or mtime changed)")
    s.add_argument("--backbone", default="lite0", help="lite0 (7x7, default) or lite2 (9x9)")
    s.add_argument("--splits", nargs="*", default=None, help="splits to extract (default: all)")
    s.add_argument("--batch-size", type=positive_int, default=8, help="images per forward pass (8 is fastest on CPU)")
    s.add_argument("--skip-bad-images", action="store_true",
                   help="report and drop missing or unreadable images with their captions (default: refuse)")
    s.add_argument("--scales", default=None, metavar="LIST",
                   help="also cache the backbone's finer stage maps for multi-scale models (SAVE), e.g. "
                        "c3,c4,c5: writes {split}_ims_c3.npy, {split}_ims_c4.npy beside {split}_ims.npy (c5)")
    s.add_argument("--view", type=non_negative_int, default=0, metavar="K",
                   help="extract augmented view K >= 1 of every photo (a random crop and flip fixed by K and the "
                        "photo's id) instead of the photo itself (0, default): training features for "
                        "data.train_views, into an --out of their own (docs/training.md 'Augmented views')")
    s.add_argument("--force", action="store_true", help="replace existing outputs")
    s.add_argument("--json", action="store_true",
                   help="print meta.json's record (per-file lists counted) instead of a line a split")
    _add_quiet_argument(s)
    _add_device_arguments(s, "auto")
    s.set_defaults(func=_cmd_extract)

    s = sub.add_parser("train", help="train a model on a precomp dataset")
    s.add_argument("--preset", help="model preset, see `itmatch models` (e.g. scan_t2i_avg)")
    s.add_argument("--config", type=existing_file, help="YAML config (may name a preset); --set overrides it")
    s.add_argument("--data", type=existing_dir,
                   help="precomp directory (data.path; with --resume: where the data is now)")
    s.add_argument("--out", type=output_dir, required=True,
                   help="run directory (best/, last/, config.json, metrics.jsonl)")
    s.add_argument("--name", help="run name (default: the preset)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, repeatable")
    s.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last checkpoint; with it, --set changes train.* keys "
                        "(e.g. train.epochs=30) and --data the data location")
    s.add_argument("--force", action="store_true", help="start over in a non-empty --out")
    _add_quiet_argument(s, "no progress bars or epoch lines (RUN/metrics.jsonl records every epoch)")
    _add_device_arguments(s, "train.device, auto")
    _add_trust_argument(s)
    s.set_defaults(func=_cmd_train)

    s = sub.add_parser("evaluate", help="evaluate one checkpoint, or an ensemble of several")
    s.add_argument("checkpoints", nargs="+", type=checkpoint_ref,
                   help="checkpoint directories or shipped models' names (several = ensemble); a shipped model "
                        "reproduces its results row with --data of the features it names (`itmatch models "
                        "--pretrained`)")
    s.add_argument("--data", type=existing_dir, action="append", metavar="DIR",
                   help="precomp directory: once for every checkpoint, or once per checkpoint in their order "
                        "(default: each checkpoint's own, so an ensemble may mix features of the same photos, "
                        "e.g. Lite0 and Lite2)")
    s.add_argument("--split", default="test", help="split to evaluate (default test)")
    s.add_argument("--images", type=existing_dir,
                   help="images folder, for models that read pixels (default: the checkpoint's data.images)")
    s.add_argument("--protocol", default="full", choices=["1k", "full", "coco1k", "coco5k"],
                   help="full: every image of the split at once (default); 1k: the first 1000 images (Flickr8K/30K "
                        "test; needs >= 1000); coco1k: the mean of 5 folds of 1000 (COCO 5K test); coco5k: all 5000")
    s.add_argument("--budget-gb", type=positive_float, default=4.0,
                   help="memory budget of scoring: score matrix + one block's temporaries (default 4); on a GPU "
                        "it bounds the host's score matrix and blocks are sized from the GPU's free memory")
    s.add_argument("--threads", type=non_negative_int, default=0,
                   help="torch threads (default 0: all cores; under torchrun the cores shared among the ranks)")
    s.add_argument("--rerank", type=non_negative_int, default=0, metavar="K",
                   help="two-stage: re-score only the first stage's top K per query, both directions "
                        "(default 0: exhaustive)")
    s.add_argument("--prune", action="store_true",
                   help="safe pruning: the exhaustive metrics, scoring exactly only the pairs whose score the "
                        "head's bound around its global cosine leaves on either side of a query's ground truth "
                        "(MMCA: |S - i0.c0| <= alpha); an ensemble's bound is its members' mean")
    s.add_argument("--first-stage", type=checkpoint_ref, metavar="CKPT",
                   help="checkpoint whose global embedding proposes the candidates (e.g. VSE++ trained on "
                        "the same data); default: the evaluated model's own, if it has one")
    s.add_argument("--faiss", default="flat", choices=["flat", "ivf"],
                   help="first-stage FAISS index: flat (exact inner product) or ivf (approximate)")
    s.add_argument("--resume-dir", type=output_dir, metavar="DIR",
                   help="keep each finished block of exhaustive scoring in DIR, so that this command, killed "
                        "and run again, continues where it stopped (for pair heads such as MMCA, whose test "
                        "scoring takes hours); DIR's blocks are removed once the matrix is complete")
    s.add_argument("--json", type=output_file, help="write the metrics as JSON here")
    s.add_argument("--results", type=output_file, help="results CSV to add a row to (docs/results/<dataset>.csv)")
    s.add_argument("--name", help="row name in --results")
    s.add_argument("--dataset", help="dataset column in --results (default: data directory name)")
    s.add_argument("--command", help="command recorded in --results (default: this command line)")
    s.add_argument("--force", action="store_true",
                   help="replace an existing --json file and an existing --results row of the same name")
    _add_quiet_argument(s)
    _add_device_arguments(s, "auto")
    _add_trust_argument(s)
    s.set_defaults(func=_cmd_evaluate)

    s = sub.add_parser("analyze", help="analyses over trained models (the OAN perturbation study, recall curves, "
                                       "attention maps)")
    analyses = s.add_subparsers(dest="analysis", required=True, metavar="ANALYSIS")
    a = analyses.add_parser("perturb", help="train on perturbed captions (shuffle, drop a part of speech), "
                            "evaluate on unperturbed ones (OAN Table 1); needs the `analysis` extra")
    a.add_argument("--preset", help="model preset, see `itmatch models` (e.g. scan_t2i_avg, vsepp)")
    a.add_argument("--config", type=existing_file,
                   help="YAML config (e.g. configs/flickr8k/cpu.yaml); --set overrides it")
    a.add_argument("--data", type=existing_dir, help="precomp directory (data.path)")
    a.add_argument("--out", type=output_dir, required=True,
                   help="study directory: one run per perturbation, perturb.{json,csv,md,png}")
    a.add_argument("--name", help="run name prefix (default: the preset)")
    a.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, repeatable")
    a.add_argument("--perturbations", nargs="+", default=["original", "shuffle", "numbers", "prepositions",
                                                          "verbs", "adjectives", "nouns"],
                   help="which to run (default: all); 'original' (no perturbation) is always run, as the reference")
    a.add_argument("--split", default="test", help="unperturbed evaluation split (default test)")
    a.add_argument("--protocol", default="1k", choices=["1k", "full", "coco1k", "coco5k"],
                   help="evaluation protocol (default 1k)")
    a.add_argument("--seed", type=non_negative_int, default=0,
                   help="seed of the word shuffling (the shuffle run's word order; the other perturbations drop the "
                        "same words whatever it is; the training's seed is train.seed, set with --set)")
    a.add_argument("--tag-cache", type=output_dir,
                   help="directory caching the POS tags of the training captions (default OUT/cache)")
    a.add_argument("--force", action="store_true",
                   help="retrain every run of the study in OUT (not --original's), from scratch (default: "
                        "reuse finished runs, resume interrupted ones; to retrain one, delete OUT/<perturbation>)")
    a.add_argument("--jobs", type=positive_int, default=1,
                   help="trainings at once, each in its own process (default 1; a GPU fits the whole study)")
    a.add_argument("--original", type=existing_dir, metavar="RUN",
                   help="a finished run of the same preset and settings (e.g. a results table's) to use as the "
                        "unperturbed reference instead of training it again")
    _add_quiet_argument(a)
    _add_device_arguments(a, "train.device, auto")
    a.set_defaults(func=_cmd_analyze, resume=False)
    a = analyses.add_parser("recall", help="recall curves (R@1 ... R@100, both directions) of evaluations side by "
                            "side, from `itmatch evaluate --json` files",
                            usage="%(prog)s evaluations [evaluations ...] --out FIGURE [--labels LABEL [LABEL ...]] "
                                  "[--title TITLE] [--force]")
    # (files: "*", not "+", so that files --labels took are found by _recall_inputs, not an argparse error)
    a.add_argument("evaluations", nargs="*", type=existing_file,
                   help="evaluation files written by `itmatch evaluate --json` (one split and protocol; at least one)")
    a.add_argument("--out", type=figure_file, required=True, metavar="FIGURE",
                   help="the figure, in the format its suffix names (.png, .svg, .pdf, .jpg, ...)")
    a.add_argument("--labels", nargs="+", metavar="LABEL",
                   help="one name per file, in the files' order (default: the file names); " + LABELS_ORDER)
    a.add_argument("--title", help="the figure's title (default: the split, protocol and number of images)")
    a.add_argument("--force", action="store_true", help="replace an existing figure")
    a.set_defaults(func=_cmd_recall)
    a = analyses.add_parser("attention", help="each word's attention over a photo's grid cells, drawn over the "
                            "photo (SCAN Fig. 4/5), for a SCAN, SAVE or OAN model and one caption")
    a.add_argument("model", type=checkpoint_ref, help="checkpoint directory (RUN/best) or a shipped model's name")
    a.add_argument("photo", type=existing_file, help="the photo (JPEG, PNG, ...)")
    a.add_argument("caption", help="the caption whose words' attention is drawn")
    a.add_argument("--out", type=figure_file, required=True, metavar="FIGURE",
                   help="the figure, in the format its suffix names (.png, .svg, .pdf, .jpg, ...)")
    a.add_argument("--title", help="the figure's title (default: the score and what the maps are normalised over)")
    a.add_argument("--force", action="store_true", help="replace an existing figure")
    _add_device_arguments(a, "auto")
    _add_trust_argument(a)
    a.set_defaults(func=_cmd_attention)
    a = analyses.add_parser("tags", help="POS-tag a precomp split's training captions into a tag cache, for "
                            "`analyze perturb --tag-cache` on a machine without spaCy")
    a.add_argument("--data", type=existing_dir, required=True, help="precomp directory")
    a.add_argument("--split", default="train", help="the split whose captions are tagged (default train)")
    a.add_argument("--tag-cache", type=output_dir, required=True, help="directory of the cache")
    _add_quiet_argument(a)
    a.set_defaults(func=_cmd_tags)

    s = sub.add_parser("convert", help="import an original SCAN/VSE++ .pth.tar checkpoint (no code is executed)")
    s.add_argument("source", type=existing_file, help="SCAN or VSE++ checkpoint file (e.g. model_best.pth.tar)")
    s.add_argument("--out", type=output_dir, required=True, help="itmatch checkpoint directory to write")
    s.add_argument("--vocab", type=existing_file, help="the SCAN vocabulary JSON the model was trained with "
                                   "(e.g. vocab/f30k_precomp_vocab.json)")
    s.add_argument("--force", action="store_true", help="replace an existing --out")
    s.set_defaults(func=_cmd_convert)

    s = sub.add_parser("demo", help="the main job: synth -> extract -> train SCAN -> evaluate")
    s.add_argument("--out", type=output_dir, default="runs/demo", help="working directory (default runs/demo)")
    s.add_argument("--epochs", type=positive_int, default=6,
                   help="training epochs (default 6); on a finished demo, more trains it on to that many")
    s.add_argument("--force", action="store_true", help="start over in an existing --out")
    _add_device_arguments(s, "auto")
    s.set_defaults(func=_cmd_demo)

    s = sub.add_parser("index", help="index a photo folder for search (incremental, resumable)")
    s.add_argument("images", type=existing_dir, help="folder of photos (searched recursively)")
    s.add_argument("--model", type=checkpoint_ref, required=True,
                   help="checkpoint directory written by `itmatch train` (e.g. RUN/best), "
                        "or a pretrained model's name (`itmatch models --pretrained`)")
    s.add_argument("--out", type=output_dir, required=True,
                   help="index directory (created; updated in place on later runs)")
    s.add_argument("--batch-size", type=positive_int, default=8, help="images per backbone forward pass")
    s.add_argument("--force", action="store_true", help="replace an index built with another model")
    s.add_argument("--rehash", action="store_true",
                   help="hash every photo (default: only those whose size or mtime changed since the last run)")
    s.add_argument("--features", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the photos' backbone features, so that a new model of the same backbone re-indexes "
                        "them without the CNN; --no-features keeps only what search reads, a fraction of the bytes "
                        "(VSE++: 4 of 255 MB per 1000 photos). Default: as the index has them (a new index keeps "
                        "them)")
    _add_quiet_argument(s)
    _add_device_arguments(s, "auto")
    _add_trust_argument(s)
    s.set_defaults(func=_cmd_index)

    s = sub.add_parser("search", help="query an index: text -> photos, or --image PHOTO -> captions")
    s.add_argument("index", type=existing_dir, help="index directory written by `itmatch index`")
    # (words: an unquoted query, `itmatch search INDEX a dog on the beach`, is read as one; it was refused as
    # "unrecognized arguments: dog on the beach")
    s.add_argument("query", nargs="*", help="text query, e.g. 'a dog jumping over a fence' (quotes optional)")
    s.add_argument("-k", type=int_in(1, MAX_K), default=10, help=f"number of results (1 to {MAX_K}, default 10)")
    s.add_argument("--image", type=existing_file, help="photo to find captions for (image-to-text; needs --captions)")
    s.add_argument("--captions", type=existing_file,
                   help="caption collection for --image: a text file, one caption a line")
    s.add_argument("--model", type=checkpoint_ref,
                   help="checkpoint or pretrained name (default: the one the index was built with; must be the same)")
    s.add_argument("--json", action="store_true",
                   help="print one JSON document, shaped as the HTTP API's answer: the query (or image), k, the "
                        "query's unknown words (or the captions without a known word) and the results")
    _add_ensemble_argument(s)
    _add_images_argument(s)
    _add_shortlist_arguments(s)
    _add_device_arguments(s, "auto")
    _add_trust_argument(s)
    s.set_defaults(func=_cmd_search)

    s = sub.add_parser("serve", help="HTTP API and web page over an index (needs the `serve` extra)")
    s.add_argument("index", type=existing_dir, help="index directory written by `itmatch index`")
    s.add_argument("--host", type=host, default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 or :: every interface: "
                        "there is no authentication, anyone who reaches it sees every indexed photo)")
    s.add_argument("--port", type=port, default=8000, help="port, 1-65535 (default 8000)")
    s.add_argument("--allowed-host", dest="allowed_hosts", type=allowed_host, action="append", default=[],
                   metavar="NAME",
                   help="a host name the server may be reached by (repeatable; *.example.com its sub-domains, * any). "
                        "Always answered: localhost, 127.0.0.1, [::1] and --host; with --host 0.0.0.0 or :: and no "
                        "--allowed-host, any name")
    s.add_argument("--model", type=checkpoint_ref,
                   help="checkpoint or pretrained name (default: the one the index was built with; must be the same)")
    s.add_argument("--captions", type=existing_file,
                   help="caption collection for image-to-text search, one caption a line")
    _add_ensemble_argument(s)
    _add_images_argument(s)
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log level (info logs every request)")
    _add_shortlist_arguments(s)
    _add_device_arguments(s, "auto")
    _add_trust_argument(s)
    s.set_defaults(func=_cmd_serve)
    return p


class _ReaderMayLeave:
    """sys.stdout for the length of a command. When the reader of a pipe leaves early (`itmatch models |
    head -1`), writing raises BrokenPipeError; that is not an error of the command, so the rest of its
    output goes to /dev/null and the command carries on (it still writes its files), exiting as it would."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def _reader_left(self) -> None:
        # fd 1 becomes /dev/null: the interpreter's last flush (of what is still buffered) then succeeds too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.stream.fileno())
        os.close(devnull)

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._reader_left()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._reader_left()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def main(argv: list[str] | None = None) -> int:
    stdout = sys.stdout
    if stdout is not None:
        sys.stdout = _ReaderMayLeave(stdout)
    try:
        return _run(argv)
    finally:
        if stdout is not None:
            # a reader that left shows here (output is block-buffered into a pipe); an OSError (a full disk)
            # was already reported by _run's flush, with what was left in the buffer
            with contextlib.suppress(OSError):
                sys.stdout.flush()
            sys.stdout = stdout


#: what to do about the operating-system errors a user can fix (errno name -> hint)
OS_ERROR_HINTS = {
    "ENOSPC": "free space on that device or write elsewhere",
    "EDQUOT": "free space within your quota or write elsewhere",
    "EACCES": "check the permissions of the path and of its folders",
    "EPERM": "check the permissions of the path and of its folders",
    "EROFS": "the file system is read-only: write elsewhere",
    "EISDIR": "a directory is where a file was expected: give a file path",
    "ENOTDIR": "a file is where a directory was expected: check the path",
    "ENOENT": "check that the path exists and that files can be created there",
}


def describe_os_error(exc: OSError) -> str:
    """One line for an operating-system error: the file(s), the OS reason with its errno name, and what to
    do about it (`OS_ERROR_HINTS`)."""
    import errno

    name = errno.errorcode.get(exc.errno or 0, "")
    reason = exc.strerror or str(exc)
    files = [str(f) for f in (exc.filename, exc.filename2) if f is not None]
    text = f"{' -> '.join(files)}: {reason}" if files else reason
    if name:
        text += f" ({name})"
    if name in OS_ERROR_HINTS:
        text += f"; {OS_ERROR_HINTS[name]}"
    return text


def _how_to_continue(args: argparse.Namespace, saved: bool = False) -> str:
    """What continues an interrupted verb's work, for those that keep it (docs/reliability.md), else ''.
    `saved`: the training saved where it stopped (engine/stop.py), so nothing since its last save is lost."""
    if args.verb == "train":
        if getattr(args, "resume", False):
            return f"; the same command continues from {'there' if saved else 'its last save'}"
        again = "the same command with --resume continues from there"
        return f"; {again}" if saved else f"; its last saved checkpoint is kept: {again}"
    if args.verb in ("extract", "index", "demo") or getattr(args, "analysis", None) == "perturb":
        return "; the same command continues where it stopped"
    if args.verb == "evaluate" and args.resume_dir:
        return "; the same command continues from the finished blocks in --resume-dir"
    return ""


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    finished = False  # the command returned: every rank reaches the final barrier
    try:
        code = args.func(args)
        if sys.stdout is not None:  # (None: started with stdout closed)
            sys.stdout.flush()  # a full disk under redirected output shows here, inside the handlers below
        finished = True
        return code
    except ItmatchError as exc:
        print(f"itmatch {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except TrainingStopped as exc:  # (saved first: engine/stop.py)
        from itmatch.distributed import is_main  # (a training stopped: torch is loaded already)

        if is_main():  # (under torchrun every rank stops at the same step: one says so)
            print(f"itmatch {args.verb}: {exc.message}{_how_to_continue(args, saved=True)}", file=sys.stderr)
        return 128 + exc.signum  # what the signal alone would have made of the exit status
    except KeyboardInterrupt:
        print(f"itmatch {args.verb}: interrupted{_how_to_continue(args)}", file=sys.stderr)
        return 130
    except OSError as exc:  # the environment refused (disk full, permissions, a directory for a file): no bug
        print(f"itmatch {args.verb}: error: {describe_os_error(exc)}", file=sys.stderr)
        return 1
    finally:
        # A torchrun run leaves its process group on every path, errors included: a gloo group still alive
        # when the interpreter finalises can abort the process (SIGABRT, "terminate called without an
        # active exception") after the command itself ended cleanly. After an error the other ranks may be
        # inside another collective, so this rank leaves without waiting for them.
        if "itmatch.distributed" in sys.modules:
            from itmatch.distributed import shutdown

            shutdown(wait=finished)


if __name__ == "__main__":
    sys.exit(main())
