"""Images folder + CaptionTable -> SCAN precomp layout, with a progress bar, resumable and crash-safe.

This is the driver: it checks the settings and the output folder, decides per split whether to keep it, update
it or extract it, and writes meta.json. A re-run continues an interrupted split, rewrites edited captions and
re-extracts only replaced photos (what changed since the extraction, and the caption-only update:
features/updates.py); `scales` adds SAVE's finer stage maps; under torchrun the ranks share the images
(features/sharded.py). One split's extraction is features/extract_split.py, the state it leaves on disk and
what a re-run reads from it features/progress.py. How (partial file, progress file, meta.json last, what a
re-run checks): docs/reliability.md, 'Crash safety in detail' and 'Determinism'; the ranks:
docs/distributed.md, 'Feature extraction'; the default batch size: docs/training.md, 'Features'.
"""

from __future__ import annotations

import json
import logging
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from itmatch import distributed as dist
from itmatch.data.captions import TRAINING_SPLITS, CaptionTable, missing_image_hint
from itmatch.data.precomp import (
    META_NAME,
    captions_path,
    extra_captions_path,
    extra_captions_text,
    features_path,
    ids_path,
    progress_path,
    read_lines,
    scale_path,
    shards_root,
)
from itmatch.device import resolve
from itmatch.errors import DataError, OverwriteError, refuse_overwrite
from itmatch.features.backbones import STAGE_NAMES, Backbone, load_backbone, stage_shapes
from itmatch.features.extract_split import BatchHook, extract_split
from itmatch.features.pipeline import strict_decoding
from itmatch.features.progress import (
    features_renamed,
    refuse_other_unfinished,
    renamed_scales,
    run_fingerprint,
    same_run_progress,
    split_complete,
)
from itmatch.features.sharded import extract_split_sharded
from itmatch.features.updates import (
    SourceChanges,
    caption_update_path,
    changes_record,
    examples,
    log_caption_changes,
    refreshed_info,
    reuse_rows,
    source_changes,
)
from itmatch.features.views import view_meta
from itmatch.fingerprint import text_sha256
from itmatch.io import file_sha256, fsync_dir, remove_atomic_leftovers, write_json_atomic, write_text_atomic

log = logging.getLogger("itmatch.features")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("itmatch")
    except Exception:  # not installed (running from a source tree)
        import itmatch

        return str(getattr(itmatch, "__version__", "unknown"))


def _backbone_meta(bb: Backbone) -> dict[str, Any]:
    return {"backbone": bb.name, "weights": Path(bb.weights).name, "image_size": bb.image_size,
            "resize": "bilinear to image_size x image_size (aspect ratio not kept), EXIF orientation applied",
            "normalisation": bb.normalisation, "grid": bb.grid, "regions": bb.grid * bb.grid,
            "region_order": "row-major: region r is cell (r // grid, r % grid)", "dim": bb.out_dim}


def _view_name(view: int) -> str:
    return "the photos themselves" if view == 0 else f"augmented view {view}"


@contextmanager
def _torch_threads(n: int | None):
    previous = torch.get_num_threads()
    if n is not None:
        if n < 1:
            raise ValueError(f"num_threads must be >= 1, got {n}")
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _refuse_other_extraction(out_dir: Path, split: str, ids: list[str], force: bool) -> None:
    """Refuse (without `force`) to replace features of another image list, backbone or view, saying how the
    image lists differ."""
    path = features_path(out_dir, split)
    if force or not path.exists():
        return
    detail = ""
    try:
        before = read_lines(ids_path(out_dir, split))
    except DataError:
        before = None
    if before is not None:
        old, new = set(before), set(ids)
        added, removed = [i for i in ids if i not in old], [i for i in before if i not in new]
        if added or removed:
            detail = (f": the captions now list {len(added)} image(s) it does not hold ({examples(added)}) "
                      f"and not {len(removed)} of its {len(before)} ({examples(removed)})")
    raise OverwriteError(f"already exists with features of another image list, backbone or view{detail}", path=path,
                         hint="pass --force to re-extract the split, or write to another --out")


def _kept_splits_sharing_images(out_dir: Path, rows: dict[str, tuple[list[str], list[str]]]
                                ) -> dict[str, tuple[str, str]]:
    """The splits of out_dir's meta.json that this extraction does not write and that hold an image it puts in a
    split on the other side of training (a training split against an evaluation one): {kept split: (an image, the
    split it goes to now)}. Two extractions into one folder could otherwise leave a dev or test split of images that
    the new training split holds. (Evaluation splits may share images: COCO's test is part of its testall.)"""
    try:
        kept = [s for s in json.loads((out_dir / META_NAME).read_text(encoding="utf-8")).get("splits", {})
                if s not in rows]
    except (OSError, ValueError, AttributeError):
        return {}
    now = {image: split for split, (ids, _) in rows.items() for image in ids}
    clashes = {}
    for split in kept:
        training = split in TRAINING_SPLITS
        try:
            shared = next((i for i in read_lines(ids_path(out_dir, split))
                           if i in now and (now[i] in TRAINING_SPLITS) != training), None)
        except DataError:  # (no ids file: nothing to compare)
            continue
        if shared is not None:
            clashes[split] = (shared, now[shared])
    return clashes


def _drop_split(out_dir: Path, split: str) -> None:
    """Remove a split's files (features at every scale, captions, ids): --force over a split that shares images."""
    for path in (features_path(out_dir, split), *(scale_path(out_dir, split, s) for s in STAGE_NAMES),
                 captions_path(out_dir, split), extra_captions_path(out_dir, split), ids_path(out_dir, split)):
        path.unlink(missing_ok=True)


def _left_out_captions(out_dir: Path, split: str, table: CaptionTable, kept_ids: list[str], per_image: int,
                       keep: bool) -> dict[str, Any]:
    """The captions of the split's rows `kept_ids` that the precomp layout does not hold (`CaptionTable.select`),
    reported and recorded, never dropped silently: repeats of a caption an image already has are dropped
    (meta.json `duplicate_captions`: how many, of which images); distinct captions beyond `per_image` are
    written to `{split}_extra_caps.tsv` (when its content differs) if `keep`, else recorded with their text
    as left out (`extra_captions`; an older such file is removed, so that no stale one sits beside the
    split). Returns the split's meta.json entries for them."""
    kept = set(kept_ids)
    chosen = {i: rows for i, rows in table.select(split, per_image).items() if i in kept}
    entry: dict[str, Any] = {}
    repeats = {i: len(rows.duplicates) for i, rows in chosen.items() if rows.duplicates}
    if repeats:
        dropped = sum(repeats.values())
        # (a training split drops them before its cut to per_image; an evaluation split keeps its first per_image
        # captions as the papers' protocol does, repeats included, and drops repeats only among the rest)
        log.warning("split %s: %d repeated caption(s) of %d image(s) dropped (the same text as another caption of "
                    "the image, ignoring case and spacing; docs/data.md) (%s)", split, dropped, len(repeats),
                    examples([f"{i} x{n}" for i, n in repeats.items()]))
        entry["duplicate_captions"] = {"dropped": dropped, "images": repeats}
    extra = {i: [table.captions[r] for r in rows.extra] for i, rows in chosen.items() if rows.extra}
    path = extra_captions_path(out_dir, split)
    counts = {i: len(c) for i, c in extra.items()}
    total = sum(counts.values())
    if not keep or not extra:
        path.unlink(missing_ok=True)
        if not extra:
            return entry
        log.warning("split %s: %d caption(s) of %d image(s) beyond the %d per image the precomp layout holds "
                    "were left out (%s; their text is in %s); pass --extra-captions keep to train on them", split,
                    total, len(extra), per_image, examples([f"{i} +{n}" for i, n in counts.items()]), META_NAME)
        return {**entry, "extra_captions": {"left_out": total, "images": counts, "captions": extra}}
    lines = extra_captions_text(kept_ids, extra)
    digest = text_sha256(lines)
    current = file_sha256(path) if path.exists() else None  # (read once: compared for the log and the write)
    if current is not None and current != digest:
        log.warning("split %s: the extra captions changed since the extraction: rewrote %s", split, path.name)
    if current != digest:
        write_text_atomic(path, "\n".join(lines) + "\n")
    log.info("split %s: %d extra caption(s) of %d image(s) kept in %s", split, total, len(extra), path.name)
    return {**entry, "extra_captions": {"kept": total, "images": counts, "file": path.name, "sha256": digest}}


def parse_extract_scales(spec: str | list[str] | None) -> tuple[str, ...]:
    """--scales "c3,c4,c5" -> the extra maps to write, ("c3", "c4") (c5 is always the main array)."""
    if not spec:
        return ()
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    bad = [s for s in names if s not in STAGE_NAMES]
    if bad:
        raise DataError(f"unknown scale(s) {', '.join(bad)}", hint="use names among c3, c4, c5, e.g. c3,c4,c5")
    return tuple(s for s in STAGE_NAMES[:-1] if s in names)


def _refuse_images_the_reader_dropped(table: CaptionTable, images_dir: Path, splits: list[str] | None,
                                      skip_bad_images: bool) -> None:
    """A caption reader given the images folder drops the rows of a photo that is not there
    (`table.missing_images`); without `skip_bad_images` a split that lost photos that way is refused as one
    whose photos are missing here would be: a test split of 998 images would otherwise be evaluated, and
    compared with 1000-image results, with exit status 0."""
    lost = {split: ids for split, ids in table.missing_images.items() if ids and (splits is None or split in splits)}
    if not lost or skip_bad_images:
        return
    split, ids = next(iter(lost.items()))
    kept = len(table.grouped(split)) if split in table.split_names() else 0
    raise _missing_photos(table, images_dir, split, ids, len(ids) + kept)


def _missing_photos(table: CaptionTable, images_dir: Path, split: str, missing: list[str], total: int) -> DataError:
    """The refusal of a split `missing` photos of whose `total` are not in `images_dir`."""
    source = table.source or "the caption table"
    return DataError(f"{len(missing)} of {total} images of split {split!r} named in {source} are not in "
                     f"{images_dir}, e.g. {missing[0]!r}", path=images_dir / missing[0],
                     hint=f"{missing_image_hint(images_dir, missing[0])}; or pass --skip-bad-images to drop them and "
                          "their captions")


def extract_precomp(images_dir: Path, table: CaptionTable, out_dir: Path, *, backbone: str = "lite0",
                    extra_captions: str = "drop", rehash: bool = False,
                    splits: list[str] | None = None, batch_size: int = 8, force: bool = False,
                    skip_bad_images: bool = False, progress: bool = True, num_threads: int | None = None,
                    on_batch: BatchHook | None = None, scales: str | list[str] | None = None,
                    device: str | torch.device = "cpu", precision: str = "fp32", view: int = 0) -> dict[str, Any]:
    """Extract backbone grid features of every image of `table` into the precomp layout in `out_dir`.

    Writes, per split (default: every non-empty split name of the table), `{split}_ims.npy` float32
    [N, grid*grid, dim], `{split}_caps.txt` and `{split}_ids.txt`, and `out_dir/meta.json`. The image
    of id `x` is `images_dir / x`. Resumable (docs/reliability.md); existing outputs are replaced
    only with `force`. With `skip_bad_images`, missing or unreadable images are dropped with their
    captions, logged and listed in meta.json; otherwise the first one raises DataError.
    `on_batch(split, done, total)` is called after every batch (it may raise to stop the run).
    `batch_size` 8 is the default because it was the fastest on a 2-core CPU: larger batches spill the
    activations out of cache (figures: docs/training.md, 'Features').
    `num_threads` sets torch's intra-op threads for the run (default: leave torch's setting).
    `scales` ("c3,c4,c5" or a list) also writes the finer stage maps (SAVE's c3/c4) beside the main
    array, from the same forward pass (docs/save.md).
    `extra_captions`: what to do with the distinct captions of an image beyond the 5 the precomp layout holds
    (repeats of one of its captions are dropped first, reported and counted in meta.json):
    "drop" (reported, listed with their text in meta.json) or "keep" (written to `{split}_extra_caps.tsv`;
    training pairs them with their image, evaluation keeps the protocol's 5 per image).
    The caption rows the reader skipped (`table.skipped`, e.g. naming a photo that is not there) are
    listed in meta.json `skipped_captions`; photos of a split the reader dropped because they are not in
    `images_dir` (`table.missing_images`) are refused as missing ones are, unless `skip_bad_images`.
    A split an earlier run completed is checked against its sources (docs/reliability.md): images
    whose size and mtime are unchanged are trusted without reading them, unless `rehash`.
    Under torchrun every rank calls this with the same arguments and extracts a share of the images
    (docs/distributed.md); the output directory must be on a file system all ranks see.
    The backbone runs on `device` in `precision` (docs/gpu.md); images are decoded on a host thread and the
    features are written as float32 whatever the device. Settings are checked before any work.
    `view` K >= 1 extracts the K-th augmented view of every photo (a random crop and flip fixed by K and the photo's
    id, features/views.py) instead of the photo itself: a directory of training features that `data.train_views`
    draws from; meta.json records it, and a directory keeps the features of one view only.
    Returns the metadata written to meta.json.
    """
    placement = resolve(device, precision)
    dist.init_from_env("gloo")
    images_dir, out_dir = Path(images_dir), Path(out_dir)
    if extra_captions not in ("drop", "keep"):
        raise ValueError(f"extra_captions must be 'drop' or 'keep', got {extra_captions!r}")
    keep_extra = extra_captions == "keep"
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if view < 0:
        raise ValueError(f"view must be >= 0 (0: the photos themselves), got {view}")
    if not images_dir.is_dir():
        raise DataError("images folder not found", path=images_dir,
                        hint="pass the folder that holds the image files named in the caption source")
    table.check_disjoint_splits()  # the readers name the lines; this catches tables built in code
    _refuse_images_the_reader_dropped(table, images_dir, splits, skip_bad_images)
    available = [s for s in table.split_names() if s]
    if splits is None:
        splits = available
        if not splits:
            raise DataError("the caption table assigns no image to a split", path=table.source or None,
                            hint="name the split of captions that have none, e.g. `itmatch extract ... "
                                 "--default-split train` for a CSV without a split column, or give the "
                                 "captions a split column (train/dev/test)")
    unknown = [s for s in splits if s not in available]
    if unknown:
        raise DataError(f"split(s) {', '.join(map(repr, unknown))} not in the caption table",
                        path=table.source or None, hint=f"available splits: {', '.join(available) or 'none'}")
    rows = {s: table.precomp_rows(s) for s in splits}  # caption-count errors surface before any work

    # Missing files are the common mistake (wrong folder): find them all now, it costs one stat each.
    for split, (ids, _) in rows.items():
        missing = [i for i in ids if not (images_dir / i).is_file()]
        if missing and not skip_bad_images:
            raise _missing_photos(table, images_dir, split, missing, len(ids))

    clashes = _kept_splits_sharing_images(out_dir, rows)
    if clashes and not force:
        kept, (image, now) = next(iter(clashes.items()))
        raise OverwriteError(
            f"{out_dir} keeps split {kept!r} from an earlier extraction, and it holds {image!r}, which this one puts "
            f"in {now!r}: a model would be selected or tested on images it trained on", path=ids_path(out_dir, kept),
            hint=f"extract every split from one caption source (its split lists or split column) into its own --out, "
                 f"or pass --force to drop the earlier split(s) {', '.join(map(repr, clashes))} (it also extracts "
                 "this command's splits again from scratch)")

    extras = parse_extract_scales(scales)
    bb = load_backbone(backbone).to(placement.device)
    out_dir.mkdir(parents=True, exist_ok=True)
    fingerprints = {s: run_fingerprint(bb, rows[s][0], extras, view) for s in splits}
    # Splits an earlier run of this same command completed (meta.json records them with the same image
    # list and backbone) are kept: re-running the command is idempotent, so a run killed in a later split
    # (or after its last write, before it exited) resumes instead of refusing to overwrite them. Outputs
    # of other images or another backbone are still only replaced with `force`.
    # A kept split is checked against its sources: meta.json records the fingerprints of its caption text
    # and of every image file (size + mtime, SHA-256 when they differ), so that a re-run after captions
    # were edited or a photo was replaced updates exactly that instead of keeping stale data.
    changes: dict[str, SourceChanges] = {}
    for split in splits:
        state = same_run_progress(out_dir, split, fingerprints[split])
        # a previous run stopped after all (finishing) or some of its renames: continued, not taken for another
        # extraction's
        if force or (state is not None and (features_renamed(state, out_dir, split, extras)
                                            or renamed_scales(state, out_dir, split, extras))):
            continue
        if split_complete(out_dir, split, fingerprints[split], extras):
            changes[split] = source_changes(out_dir, split, images_dir, *rows[split], rehash=rehash)
            continue
        if state is not None and isinstance(state.get("update"), dict):
            continue  # an update killed between removing the old captions and ids and renaming its features
        # (checked here, not only where a split starts: under torchrun the shares are extracted elsewhere
        # first, and the merge would replace the other extraction's progress file and partial arrays)
        refuse_other_unfinished(out_dir, split, fingerprints[split], force)
        _refuse_other_extraction(out_dir, split, rows[split][0], force)
        for p in (captions_path(out_dir, split), ids_path(out_dir, split),
                  *(scale_path(out_dir, split, s) for s in extras)):
            refuse_overwrite(p, force)

    meta_file = out_dir / META_NAME
    bmeta = {**_backbone_meta(bb), **view_meta(view)}
    meta: dict[str, Any] = {}
    if meta_file.exists():
        try:
            old = json.loads(meta_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = {}
        same = all(old.get(k) == bmeta[k] for k in ("backbone", "image_size", "normalisation"))
        same_view = old.get("view", 0) == view
        if not (same and same_view) and old:
            others = [s for s in old.get("splits", {}) if s not in splits]
            if others and not force:
                mixed = (f"{old.get('backbone')} features (splits {', '.join(others)}); adding {bb.name} features "
                         "would mix backbones" if not same else
                         f"features of {_view_name(old.get('view', 0))} (splits {', '.join(others)}); adding "
                         f"{_view_name(view)} would mix views")
                raise OverwriteError(f"{out_dir} holds {mixed}", path=meta_file,
                                     hint="write to another directory (one a view) or pass --force")
        elif old:
            meta = old
    meta.update({"format": "itmatch-precomp", "itmatch_version": _version(), **bmeta})
    meta.setdefault("splits", {})
    for kept in clashes:  # (--force: refused above otherwise)
        if dist.is_main():
            log.warning("dropping split %s of %s: it held %s, which this extraction puts in %s", kept, out_dir,
                        *clashes[kept])
            _drop_split(out_dir, kept)
            meta["splits"].pop(kept, None)
            write_json_atomic(meta_file, meta)
    # the rows of the caption source read this time that name no usable image: recorded beside the splits
    # (meta.json of the last run describes the last caption source), never only printed
    meta.pop("skipped_captions", None)
    if table.skipped:
        meta["skipped_captions"] = list(table.skipped)
    if extras:
        shapes = stage_shapes(bb)
        meta["scales"] = {s: {"file": f"{{split}}_ims_{s}.npy" if s != "c5" else "{split}_ims.npy",
                              "regions": shapes[s][0], "dim": shapes[s][1],
                              "grid": int(round(shapes[s][0] ** 0.5)), "stride": 8 * 2 ** i}
                          for i, s in enumerate(STAGE_NAMES) if s in extras or s == "c5"}

    with strict_decoding(), _torch_threads(num_threads):
        for split in splits:
            ids, caps = rows[split]
            per = len(caps) // len(ids)
            run_split = extract_split_sharded if dist.is_distributed() else extract_split
            reuse: dict[str, Any] = {}
            ch = changes.get(split)
            if ch is not None:
                old_info = meta["splits"][split]
                if not ch.images:  # same features: the caption text and the manifest are brought up to date
                    if not dist.is_main():
                        continue
                    info = refreshed_info(out_dir, split, old_info, ch)
                    info.update(_left_out_captions(out_dir, split, table, ch.kept_ids, per, keep_extra))
                    if info == old_info:
                        log.info("split %s is complete and its sources are unchanged; kept", split)
                        caption_update_path(out_dir, split).unlink(missing_ok=True)  # a reverted update's
                        continue
                    meta["splits"][split] = info
                    write_json_atomic(meta_file, meta)
                    remove_atomic_leftovers(meta_file)
                    caption_update_path(out_dir, split).unlink(missing_ok=True)  # recorded: meta.json holds it
                    continue
                log.warning("split %s: %d image file(s) changed since the extraction (%s): re-extracting %s",
                            split, len(ch.images), examples(ch.images), "their rows, keeping the others"
                            if not dist.is_distributed() else "the split (torchrun re-extracts whole splits)")
                if ch.captions_stale:
                    log_caption_changes(out_dir, split, ch)
                if not dist.is_distributed():
                    reuse = reuse_rows(out_dir, split, ids, ch.images, extras)
            info = run_split(bb, images_dir, table, out_dir, split, ids, caps, batch_size=batch_size,
                             force=force, skip_bad=skip_bad_images, progress=progress, on_batch=on_batch,
                             extras=extras, known_files=ch.records if ch is not None else None,
                             placement=placement, update=changes_record(ch) if ch is not None else None, view=view,
                             **reuse)
            if info is None:  # a rank other than 0: rank 0 writes the manifest
                continue
            # a stopped caption-only update's marker: its record is in this update's (progress file), or the
            # split was extracted again
            caption_update_path(out_dir, split).unlink(missing_ok=True)
            remove_atomic_leftovers(caption_update_path(out_dir, split))
            skipped = {s["image_id"] for s in info["skipped"]}
            kept_ids = [i for i in ids if i not in skipped]
            # `updated`: from the split's progress file, where the update recorded what changed when it started
            # (a run resumed after the kill of an update cannot tell it any more: the captions may be rewritten,
            # and meta.json may already record the new image files)
            updated = info.pop("updated", None)
            meta["splits"][split] = {**info, "fingerprint": fingerprints[split],
                                     **_left_out_captions(out_dir, split, table, kept_ids, per, keep_extra)}
            if updated is not None:
                meta["splits"][split]["updated"] = updated
            write_json_atomic(meta_file, meta)
            fsync_dir(out_dir)
            progress_path(out_dir, split).unlink(missing_ok=True)
            # a kill during one of the split's progress or manifest writes leaves its temporary file behind
            for written in (progress_path(out_dir, split), meta_file):
                remove_atomic_leftovers(written)
            shutil.rmtree(shards_root(out_dir, split), ignore_errors=True)
    if dist.is_main() and meta["splits"]:
        # when every split was kept as it was nothing above wrote meta.json, but the skipped rows may have changed
        try:
            recorded = json.loads(meta_file.read_text(encoding="utf-8")).get("skipped_captions")
        except (OSError, ValueError, AttributeError):
            recorded = ()  # (unreadable: written anew)
        if recorded != meta.get("skipped_captions"):
            write_json_atomic(meta_file, meta)
    return dist.broadcast_object(meta)
