"""Extract one split in this process: decode, forward, write rows, save progress; resume or finish a stopped run.

Photos are decoded on host threads while the backbone runs on the batch before; rows go into partial arrays
whose progress file is saved every FLUSH_IMAGES images or FLUSH_SECONDS seconds (the state: features/progress.py).
An update copies the rows of unchanged photos from the current arrays instead of recomputing them
(features/updates.py).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from itmatch.data.captions import CaptionTable
from itmatch.data.precomp import captions_path, features_path, ids_path, progress_path, scale_path, write_captions
from itmatch.device import Placement, module_device
from itmatch.errors import DataError
from itmatch.features.backbones import Backbone, stage_shapes
from itmatch.features.pipeline import UnreadableImage, decode_image, decode_threads, grid_features
from itmatch.features.progress import (
    PROGRESS_VERSION,
    features_renamed,
    finish_array,
    open_partial,
    partial_path,
    read_progress,
    refuse_other_unfinished,
    renamed_scales,
    run_fingerprint,
)
from itmatch.features.updates import update_record
from itmatch.features.views import view_of
from itmatch.fingerprint import FileRecord, changed_files, file_records, text_sha256
from itmatch.io import file_sha256, fsync_dir, write_json_atomic

log = logging.getLogger("itmatch.features")

# Save progress at least every FLUSH_IMAGES images or FLUSH_SECONDS seconds.
FLUSH_IMAGES = 256
FLUSH_SECONDS = 60.0

# Called after every batch with (split, images done, images in split); may raise to stop the run.
BatchHook = Callable[[str, int, int], None]


class _Bad(Exception):
    """An image that is missing or cannot be decoded (internal; becomes DataError or a skip)."""

    def __init__(self, image_id: str, path: Path, reason: str, missing: bool) -> None:
        super().__init__(reason)
        self.image_id, self.path, self.reason, self.missing = image_id, path, reason, missing


def _load_one(bb: Backbone, images_dir: Path, image_id: str, view: int = 0) -> torch.Tensor:
    path = images_dir / image_id
    try:
        return bb.preprocess(view_of(decode_image(path), view, image_id))
    except UnreadableImage as exc:
        raise _Bad(image_id, path, exc.reason, missing=exc.missing) from None


def _collect_batch(decoding: list[Future], skip_bad: bool) -> tuple[list[torch.Tensor], list[_Bad]]:
    """A batch's preprocessed images, in order, from their decoding futures; the first bad image raises unless
    skip_bad (then the bad ones are returned)."""
    tensors: list[torch.Tensor] = []
    bad: list[_Bad] = []
    for future in decoding:
        try:
            tensors.append(future.result())
        except _Bad as b:
            if not skip_bad:
                raise
            bad.append(b)
    return tensors, bad


def _bad_image_error(b: _Bad, table: CaptionTable, images_dir: Path) -> DataError:
    source = table.source or "the caption table"
    if b.missing:
        return DataError(f"image {b.image_id!r} named in {source} is not in {images_dir}", path=b.path,
                         hint="check the images folder (it must hold the files the captions name), "
                              "or pass --skip-bad-images to drop this image and its captions")
    return DataError(f"{b.reason} (image {b.image_id!r} named in {source})", path=b.path,
                     hint="replace or delete the file, or pass --skip-bad-images to drop this image and its "
                          "captions; the run resumes from here when restarted")


def _batch_rows(indices: range, reuse: dict[int, int], bad: set[int]) -> list[tuple[bool, int]]:
    """Where each output row of a batch comes from, in order: (True, row of the earlier arrays) for a
    reused image, (False, k) for the batch's k-th computed image; images in `bad` (skipped) give none."""
    rows, computed = [], 0
    for index in indices:
        if index in reuse:
            rows.append((True, reuse[index]))
        elif index not in bad:
            rows.append((False, computed))
            computed += 1
    return rows


def extract_split(bb: Backbone, images_dir: Path, table: CaptionTable, out_dir: Path, split: str,
                  ids: list[str], caps: list[str], *, batch_size: int, force: bool, skip_bad: bool,
                  progress: bool, on_batch: BatchHook | None, extras: tuple[str, ...] = (),
                  known_files: dict[str, FileRecord | None] | None = None,
                  reuse: dict[int, int] | None = None, reuse_from: dict[str, np.ndarray] | None = None,
                  placement: Placement | None = None, update: dict[str, Any] | None = None,
                  view: int = 0) -> dict[str, Any]:
    """Extract (or resume, or finish) one split (augmented view `view` of its photos, features/views.py).
    `known_files` are earlier fingerprints of the image files (the size + mtime fast path); `reuse` maps the index
    of an image in `ids` to its row in the arrays `reuse_from` ({"c5": main, "c3": ...}) of an earlier extraction,
    copied instead of recomputed.
    `update` (an update of a complete split: what changed, `changes_record`) is kept in the progress file, so
    that a run that finishes the split after a kill returns it too; the info returned holds it as `updated`
    when the split's progress file has it."""
    reuse = reuse or {}
    n = len(ids)
    per = len(caps) // n
    fp = run_fingerprint(bb, ids, extras, view)
    final, partial = features_path(out_dir, split), partial_path(out_dir, split)
    prog = progress_path(out_dir, split)
    shape = (n, bb.grid * bb.grid, bb.out_dim)
    cells = stage_shapes(bb) if extras else {}
    # the extra stage maps: final path, partial path, shape
    extra_files = {s: (scale_path(out_dir, split, s), Path(f"{scale_path(out_dir, split, s)}.partial"),
                       (n, *cells[s])) for s in extras}

    state = read_progress(prog)
    if state is not None and state.get("fingerprint") != fp:
        refuse_other_unfinished(out_dir, split, fp, force)
        state = None
    finishing = state is not None and features_renamed(state, out_dir, split, extras)
    # stopped between the renames of its arrays: those renamed are final, the others are finished from their
    # partial files (every image done)
    renamed = renamed_scales(state, out_dir, split, extras) if state is not None and not finishing else set()
    resume = (state is not None and not finishing and (partial.exists() or "c5" in renamed)
              and all(p.exists() or s in renamed for s, (_, p, _) in extra_files.items()))
    if state is not None and not resume and not finishing:
        state = None
    if state is None:
        state = {"version": PROGRESS_VERSION, "split": split, "fingerprint": fp, "backbone": bb.name,
                 "n_images": n, "batch_size": batch_size, "done": 0, "written": 0, "skipped": [],
                 "features_complete": False}
    elif state.get("batch_size") != batch_size and not finishing:
        log.info("resuming split %s with its recorded batch size %s (not %s) so the features stay "
                 "bit-identical to an uninterrupted run", split, state["batch_size"], batch_size)
    if finishing:
        records = state.get("records") or file_records(images_dir, ids, known_files)
    else:
        # Fingerprints are taken before the images are decoded, so a file replaced during the run is seen
        # as changed by the next one (never the reverse: a record newer than the features it describes).
        records = file_records(images_dir, ids, state.get("records") if resume else known_files)
        done_ids = ids[:int(state["done"])] if resume else []
        moved = changed_files({i: state["records"].get(i) for i in done_ids}, {i: records[i] for i in done_ids})
        if moved:
            log.warning("split %s: %d image file(s) already extracted by the interrupted run changed since "
                        "(e.g. %r); starting the split again", split, len(moved), moved[0])
            resume = False
        if not resume:
            renamed = set()
        state["records"] = records
        if update is not None:  # (a resumed update without it, e.g. killed after the loop, keeps the recorded one)
            state["update"] = update
    bs = int(state["batch_size"])
    started = time.perf_counter()
    done_at_start = int(state["done"])

    if not finishing:
        # (a renamed array is not opened: every image is done, the loop below writes no row)
        arr = open_partial(partial, shape, resume) if "c5" not in renamed else None
        extra_arrs = {s: open_partial(p, shp, resume) for s, (_, p, shp) in extra_files.items() if s not in renamed}
        if not resume:
            state.update(done=0, written=0, skipped=[])
            done_at_start = 0
        write_json_atomic(prog, state)

        def save() -> None:
            if arr is not None:
                arr.flush()
            for a in extra_arrs.values():
                a.flush()
            write_json_atomic(prog, state)

        is_tty = progress and hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
        bar = tqdm(total=n, initial=state["done"], unit="img", desc=f"extract {split}", disable=not progress,
                   mininterval=0.5 if is_tty else 30.0, dynamic_ncols=True)
        pool = ThreadPoolExecutor(decode_threads(module_device(bb)), thread_name_prefix="itmatch-decode")
        starts = list(range(int(state["done"]), n, bs))
        try:
            last_save_images, last_save_time = state["done"], time.monotonic()

            def to_decode(start: int) -> list[str]:
                return [ids[k] for k in range(start, min(start + bs, n)) if k not in reuse]

            def submit(k: int) -> list[Future]:  # each photo its own task: a batch decodes on every thread
                return [pool.submit(_load_one, bb, images_dir, image_id, view) for image_id in to_decode(starts[k])]

            nxt: list[Future] = submit(0) if starts else []
            for j, start in enumerate(starts):
                batch_ids = ids[start:start + bs]
                try:
                    tensors, bad = _collect_batch(nxt, skip_bad)
                except _Bad as b:
                    raise _bad_image_error(b, table, images_dir) from None
                # Decode the next batch while the network runs on this one.
                if j + 1 < len(starts):
                    nxt = submit(j + 1)
                w = int(state["written"])
                if tensors:  # (decoded on the host; one pass gives c5, the main array, and the finer maps)
                    grids = grid_features(bb, torch.stack(tensors), placement, extras)
                    for s, a in extra_arrs.items():
                        a[w:w + len(tensors)] = grids[s].numpy()
                    arr[w:w + len(tensors)] = grids["c5"].numpy()
                rows = _batch_rows(range(start, start + len(batch_ids)), reuse,
                                   {start + batch_ids.index(b.image_id) for b in bad})
                if any(old for old, _ in rows):  # an update: interleave the copied rows with the computed ones
                    for s, target in {"c5": arr, **extra_arrs}.items():
                        new = np.array(target[w:w + len(tensors)])
                        target[w:w + len(rows)] = np.stack([reuse_from[s][r] if old else new[r] for old, r in rows])
                # Rows are in place: now advance the state (never before, so a failure redoes the batch).
                for b in bad:
                    log.warning("skipping image %r and its captions: %s (%s)", b.image_id, b.reason, b.path)
                    index = start + batch_ids.index(b.image_id)
                    state["skipped"].append({"image_id": b.image_id, "index": index, "reason": b.reason})
                state["written"] = w + len(rows)
                state["done"] = start + len(batch_ids)
                bar.update(len(batch_ids))
                now = time.monotonic()
                if state["done"] - last_save_images >= FLUSH_IMAGES or now - last_save_time >= FLUSH_SECONDS:
                    save()
                    last_save_images, last_save_time = state["done"], now
                if on_batch is not None:
                    on_batch(split, int(state["done"]), n)
        except BaseException:
            # Keep everything computed so far: the next run continues from state["done"].
            pool.shutdown(wait=True, cancel_futures=True)
            save()
            bar.close()
            raise
        pool.shutdown(wait=True)
        bar.close()
        save()
        written = int(state["written"])
        if written == 0:
            raise DataError(f"no readable image in split {split!r} ({n} skipped)", path=images_dir,
                            hint="check the images folder")
        # Stale captions/ids of an older extraction must never sit beside the new features.
        for p in (captions_path(out_dir, split), ids_path(out_dir, split)):
            p.unlink(missing_ok=True)
        outputs = ([(final, partial, arr)] if arr is not None else []) + [
            (f, p, extra_arrs[s]) for s, (f, p, _) in extra_files.items() if s not in renamed]
        del arr, extra_arrs
        for out_final, out_partial, out_arr in outputs:
            finish_array(out_final, out_partial, out_arr, written)
        del outputs
        fsync_dir(out_dir)
        state["features_complete"] = True
        write_json_atomic(prog, state)

    skipped_idx = {s["index"] for s in state["skipped"]}
    kept_ids = [i for k, i in enumerate(ids) if k not in skipped_idx]
    kept_caps = [c for k, c in enumerate(caps) if k // per not in skipped_idx]
    write_captions(out_dir, split, kept_ids, kept_caps, per_image=per)
    fsync_dir(out_dir)
    # The progress file is removed by the caller once meta.json records the split (with the size and
    # checksum that read_precomp verifies): meta.json is the manifest, written last.
    seconds = time.perf_counter() - started
    computed = n - done_at_start if not finishing else 0
    recorded = {"updated": update_record(state["update"])} if isinstance(state.get("update"), dict) else {}
    return {**recorded, "images": len(kept_ids), "captions": len(kept_caps), "listed_images": n,
            "features_bytes": final.stat().st_size, "features_sha256": file_sha256(final),
            "captions_sha256": text_sha256(kept_caps), "image_files": records,
            "skipped": [{"image_id": s["image_id"], "reason": s["reason"]} for s in state["skipped"]],
            "batch_size": bs, "num_threads": torch.get_num_threads(),
            "seconds_this_run": round(seconds, 2),
            "images_per_second": round(computed / seconds, 2) if computed and seconds > 0 else None}
