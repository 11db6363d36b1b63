"""Images folder + CaptionTable -> SCAN precomp layout, with a progress bar, resumable and crash-safe.

A re-run continues an interrupted split, rewrites edited captions and re-extracts only replaced photos (what
changed since the extraction, and the caption-only update: features/updates.py);
`scales` adds SAVE's finer stage maps; under torchrun the ranks share the images. How (partial file, progress
file, meta.json last, what a re-run checks): docs/reliability.md, 'Crash safety in detail' and 'Determinism';
the ranks: docs/distributed.md, 'Feature extraction'; the default batch size: docs/training.md, 'Features'.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.lib.format import open_memmap
from tqdm import tqdm

from itmatch import distributed as dist
from itmatch.data.captions import CaptionTable
from itmatch.data.precomp import (
    captions_path,
    extra_captions_path,
    extra_captions_text,
    features_path,
    ids_path,
    progress_path,
    read_lines,
    scale_path,
    split_manifest,
    write_captions,
)
from itmatch.device import Placement, module_device, resolve
from itmatch.errors import DataError, OverwriteError, refuse_overwrite
from itmatch.features.backbones import STAGE_NAMES, Backbone, load_backbone
from itmatch.features.pipeline import (
    UnreadableImage,
    decode_image,
    decode_threads,
    grid_features,
    strict_decoding,
)
from itmatch.features.updates import (
    SourceChanges,
    caption_update_path,
    changes_record,
    examples,
    log_caption_changes,
    refreshed_info,
    reuse_rows,
    source_changes,
    update_record,
)
from itmatch.fingerprint import FileRecord, changed_files, file_records, text_sha256
from itmatch.io import file_sha256, fsync_dir, fsync_file, remove_atomic_leftovers, write_json_atomic, write_text_atomic

log = logging.getLogger("itmatch.features")

META_NAME = "meta.json"
# 2: the progress file records the source files' fingerprints (older files are started again); an update's
# progress file also records what changed ("update"), so that a resumed update records it in meta.json
PROGRESS_VERSION = 2
# Bump when preprocessing changes in a way that changes the features (invalidates resumable state).
PREPROCESS_VERSION = 1
# Save progress at least every FLUSH_IMAGES images or FLUSH_SECONDS seconds.
FLUSH_IMAGES = 256
FLUSH_SECONDS = 60.0

# Called after every batch with (split, images done, images in split); may raise to stop the run.
BatchHook = Callable[[str, int, int], None]


def partial_path(root: Path, split: str) -> Path:
    return root / f"{split}_ims.npy.partial"


def _scale_partial(root: Path, split: str, scale: str) -> Path:
    """The partial file of stage map `scale` (c5: the main array's)."""
    return partial_path(root, split) if scale == "c5" else Path(f"{scale_path(root, split, scale)}.partial")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("itmatch")
    except Exception:  # not installed (running from a source tree)
        import itmatch

        return str(getattr(itmatch, "__version__", "unknown"))


def _fingerprint(bb: Backbone, ids: list[str], extras: tuple[str, ...] = ()) -> str:
    h = hashlib.sha256()
    head = {"backbone": bb.name, "weights": Path(bb.weights).name, "image_size": bb.image_size,
            "normalisation": bb.normalisation, "preprocess_version": PREPROCESS_VERSION}
    if extras:  # absent for single-scale runs, so their fingerprints (and resumable state) are unchanged
        head["scales"] = list(extras)
    h.update(json.dumps(head, sort_keys=True).encode())
    for image_id in ids:
        h.update(image_id.encode("utf-8") + b"\0")
    return h.hexdigest()


def _backbone_meta(bb: Backbone) -> dict[str, Any]:
    return {"backbone": bb.name, "weights": Path(bb.weights).name, "image_size": bb.image_size,
            "resize": "bilinear to image_size x image_size (aspect ratio not kept), EXIF orientation applied",
            "normalisation": bb.normalisation, "grid": bb.grid, "regions": bb.grid * bb.grid,
            "region_order": "row-major: region r is cell (r // grid, r % grid)", "dim": bb.out_dim}


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


class _Bad(Exception):
    """An image that is missing or cannot be decoded (internal; becomes DataError or a skip)."""

    def __init__(self, image_id: str, path: Path, reason: str, missing: bool) -> None:
        super().__init__(reason)
        self.image_id, self.path, self.reason, self.missing = image_id, path, reason, missing


def _load_one(bb: Backbone, images_dir: Path, image_id: str) -> torch.Tensor:
    path = images_dir / image_id
    try:
        return bb.preprocess(decode_image(path))
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


def _read_progress(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # unreadable progress: treated as absent (the run starts this split again)
    if not isinstance(state, dict) or state.get("version") != PROGRESS_VERSION:
        return None
    return state


def _renamed_scales(state: dict[str, Any], out_dir: Path, split: str, extras: tuple[str, ...] = ()) -> set[str]:
    """The stage maps (c5: the main array) the run of `state` already moved to their final names: every image
    done, the map's partial file gone, its final file there (a partial file disappears only by its rename, and
    a stale final file of an older run can only coexist with its partial one)."""
    if int(state.get("done", -1)) < int(state.get("n_images", -2)):
        return set()
    return {s for s in ("c5", *extras)
            if scale_path(out_dir, split, s).exists() and not _scale_partial(out_dir, split, s).exists()}


def _features_renamed(state: dict[str, Any], out_dir: Path, split: str, extras: tuple[str, ...] = ()) -> bool:
    """Did the run of `state` already move its finished features (and every extra stage map) to their final
    names? Either it recorded so, or it was killed right after the last rename (`_renamed_scales`: all)."""
    finals = [scale_path(out_dir, split, s) for s in ("c5", *extras)]
    if not all(f.exists() for f in finals):
        return False
    if state.get("features_complete"):
        return True
    return len(_renamed_scales(state, out_dir, split, extras)) == len(finals)


def _complete(out_dir: Path, split: str, fingerprint: str, extras: tuple[str, ...] = ()) -> bool:
    """meta.json records `split` as extracted from the same images, backbone and stage maps, and its files
    are there."""
    try:
        info = split_manifest(out_dir, split)
    except DataError:
        return False
    paths = (features_path(out_dir, split), captions_path(out_dir, split), ids_path(out_dir, split),
             *(scale_path(out_dir, split, s) for s in extras))
    return bool(info and info.get("fingerprint") == fingerprint and all(p.is_file() for p in paths)
                and features_path(out_dir, split).stat().st_size == info.get("features_bytes"))


def _same_run_progress(out_dir: Path, split: str, fingerprint: str) -> dict[str, Any] | None:
    """The split's progress file when a run of the same images and backbone wrote it, else None."""
    state = _read_progress(progress_path(out_dir, split))
    return state if state and state.get("fingerprint") == fingerprint else None


def _finishing(out_dir: Path, split: str, fingerprint: str, extras: tuple[str, ...] = ()) -> bool:
    """True when a previous run stopped after renaming the features but before it recorded the split as
    complete in meta.json (captions, ids or meta still to write)."""
    state = _same_run_progress(out_dir, split, fingerprint)
    return state is not None and _features_renamed(state, out_dir, split, extras)


def _refuse_other_unfinished(out_dir: Path, split: str, fingerprint: str, force: bool) -> None:
    """Refuse (without `force`) to start over an unfinished extraction of another image list or backbone:
    its progress file and partial arrays would be replaced."""
    prog = progress_path(out_dir, split)
    state = _read_progress(prog)
    if force or state is None or state.get("fingerprint") == fingerprint:
        return
    raise OverwriteError(
        f"an unfinished extraction of split {split!r} with a different image list or backbone "
        f"({state.get('backbone')}, {state.get('n_images')} images) is in {out_dir}", path=prog,
        hint="resume it with the same captions and backbone, write elsewhere, or pass --force to discard it")


def _refuse_other_extraction(out_dir: Path, split: str, ids: list[str], force: bool) -> None:
    """Refuse (without `force`) to replace features of another image list or backbone, saying how the
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
    raise OverwriteError(f"already exists with features of another image list or backbone{detail}", path=path,
                         hint="pass --force to re-extract the split, or write to another --out")


def _sync_extra_captions(out_dir: Path, split: str, table: CaptionTable, kept_ids: list[str], per_image: int,
                         keep: bool) -> dict[str, Any]:
    """Captions beyond `per_image` of the split's rows `kept_ids`: written to `{split}_extra_caps.tsv`
    (when its content differs) if `keep`, else reported as left out (and an older such file removed, so
    that no stale one sits beside the split). Returns the split's meta.json entry for them."""
    kept = set(kept_ids)
    extra = {i: group[per_image:] for i, group in table.grouped(split).items() if len(group) > per_image and i in kept}
    path = extra_captions_path(out_dir, split)
    counts = {i: len(c) for i, c in extra.items()}
    total = sum(counts.values())
    if not keep or not extra:
        path.unlink(missing_ok=True)
        if not extra:
            return {}
        log.warning("split %s: %d caption(s) of %d image(s) beyond the %d per image the precomp layout holds "
                    "were left out (%s); pass --extra-captions keep to train on them", split, total, len(extra),
                    per_image, examples([f"{i} +{n}" for i, n in counts.items()]))
        return {"extra_captions": {"left_out": total, "images": counts}}
    lines = extra_captions_text(kept_ids, extra)
    digest = text_sha256(lines)
    current = file_sha256(path) if path.exists() else None  # (read once: compared for the log and the write)
    if current is not None and current != digest:
        log.warning("split %s: the extra captions changed since the extraction: rewrote %s", split, path.name)
    if current != digest:
        write_text_atomic(path, "\n".join(lines) + "\n")
    log.info("split %s: %d extra caption(s) of %d image(s) kept in %s", split, total, len(extra), path.name)
    return {"extra_captions": {"kept": total, "images": counts, "file": path.name, "sha256": digest}}


def parse_extract_scales(spec: str | list[str] | None) -> tuple[str, ...]:
    """--scales "c3,c4,c5" -> the extra maps to write, ("c3", "c4") (c5 is always the main array)."""
    if not spec:
        return ()
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    bad = [s for s in names if s not in STAGE_NAMES]
    if bad:
        raise DataError(f"unknown scale(s) {', '.join(bad)}", hint="use names among c3, c4, c5, e.g. c3,c4,c5")
    return tuple(s for s in STAGE_NAMES[:-1] if s in names)


def stage_shapes(bb: Backbone) -> dict[str, tuple[int, int]]:
    """(cells, channels) of every stage map at the backbone's input size (one dummy forward)."""
    with torch.inference_mode():
        maps = bb.stage_maps(torch.zeros(1, 3, bb.image_size, bb.image_size, device=module_device(bb)))
    return {k: (int(v.shape[2] * v.shape[3]), int(v.shape[1])) for k, v in maps.items()}


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


def _open_partial(path: Path, shape: tuple[int, ...], resume: bool) -> np.memmap:
    if resume:
        try:
            arr = open_memmap(path, mode="r+")
        except (OSError, ValueError):
            arr = None
        if arr is not None and arr.shape == shape and arr.dtype == np.float32:
            return arr
        log.warning("%s does not match its progress file; starting this split again", path)
    # open_memmap takes the full path as given (np.save would append ".npy").
    return open_memmap(path, mode="w+", dtype=np.float32, shape=shape)


def _finish_array(final: Path, partial: Path, arr: np.memmap, written: int) -> None:
    """Move a filled partial array to its final name (copying the first `written` rows into an array of
    the right length when images were skipped)."""
    if written < arr.shape[0]:
        compact = Path(f"{final}.compact.partial")
        dst = open_memmap(compact, mode="w+", dtype=np.float32, shape=(written, *arr.shape[1:]))
        for s in range(0, written, 512):
            dst[s:s + 512] = arr[s:min(s + 512, written)]
        dst.flush()
        del dst
        del arr
        fsync_file(compact)
        os.replace(compact, final)
        partial.unlink()
    else:
        arr.flush()
        del arr
        fsync_file(partial)
        os.replace(partial, final)


def _extract_split(bb: Backbone, images_dir: Path, table: CaptionTable, out_dir: Path, split: str,
                   ids: list[str], caps: list[str], *, batch_size: int, force: bool, skip_bad: bool,
                   progress: bool, on_batch: BatchHook | None, extras: tuple[str, ...] = (),
                   known_files: dict[str, FileRecord | None] | None = None,
                   reuse: dict[int, int] | None = None, reuse_from: dict[str, np.ndarray] | None = None,
                   placement: Placement | None = None, update: dict[str, Any] | None = None) -> dict[str, Any]:
    """Extract (or resume, or finish) one split. `known_files` are earlier fingerprints of the image files
    (the size + mtime fast path); `reuse` maps the index of an image in `ids` to its row in the arrays
    `reuse_from` ({"c5": main, "c3": ...}) of an earlier extraction, copied instead of recomputed.
    `update` (an update of a complete split: what changed, `changes_record`) is kept in the progress file, so
    that a run that finishes the split after a kill returns it too; the info returned holds it as `updated`
    when the split's progress file has it."""
    reuse = reuse or {}
    n = len(ids)
    per = len(caps) // n
    fp = _fingerprint(bb, ids, extras)
    final, partial = features_path(out_dir, split), partial_path(out_dir, split)
    prog = progress_path(out_dir, split)
    shape = (n, bb.grid * bb.grid, bb.out_dim)
    cells = stage_shapes(bb) if extras else {}
    # the extra stage maps: final path, partial path, shape
    extra_files = {s: (scale_path(out_dir, split, s), Path(f"{scale_path(out_dir, split, s)}.partial"),
                       (n, *cells[s])) for s in extras}

    state = _read_progress(prog)
    if state is not None and state.get("fingerprint") != fp:
        _refuse_other_unfinished(out_dir, split, fp, force)
        state = None
    finishing = state is not None and _features_renamed(state, out_dir, split, extras)
    # stopped between the renames of its arrays: those renamed are final, the others are finished from their
    # partial files (every image done)
    renamed = _renamed_scales(state, out_dir, split, extras) if state is not None and not finishing else set()
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
        arr = _open_partial(partial, shape, resume) if "c5" not in renamed else None
        extra_arrs = {s: _open_partial(p, shp, resume) for s, (_, p, shp) in extra_files.items() if s not in renamed}
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
                return [pool.submit(_load_one, bb, images_dir, image_id) for image_id in to_decode(starts[k])]

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
            _finish_array(out_final, out_partial, out_arr, written)
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


def shards_root(out_dir: Path, split: str) -> Path:
    return out_dir / f".shards-{split}"


def _extract_split_sharded(bb: Backbone, images_dir: Path, table: CaptionTable, out_dir: Path, split: str,
                           ids: list[str], caps: list[str], *, batch_size: int, force: bool, skip_bad: bool,
                           progress: bool, on_batch: BatchHook | None, extras: tuple[str, ...] = (),
                           known_files: dict[str, FileRecord | None] | None = None,
                           placement: Placement | None = None, update: dict[str, Any] | None = None
                           ) -> dict[str, Any] | None:
    """_extract_split shared by the ranks of a torchrun group (docs/distributed.md). Every rank calls
    it; rank 0 returns the split's info, the others None."""
    n, world = len(ids), dist.world_size()
    per = len(caps) // n
    fp = _fingerprint(bb, ids, extras)
    bounds = [dist.shard_bounds(n, r, world) for r in range(world)]
    shard_dirs = [shards_root(out_dir, split) / f"rank{r}-of-{world}" for r in range(world)]
    if not _finishing(out_dir, split, fp, extras):
        (start, stop), mine = bounds[dist.rank()], shard_dirs[dist.rank()]
        shard_fp = _fingerprint(bb, ids[start:stop], extras)
        if stop > start and (force or not _complete(mine, split, shard_fp, extras)):
            mine.mkdir(parents=True, exist_ok=True)
            info = _extract_split(bb, images_dir, table, mine, split, ids[start:stop], caps[start * per:stop * per],
                                  batch_size=batch_size, force=force, skip_bad=skip_bad,
                                  progress=progress and dist.is_main(), on_batch=on_batch, extras=extras,
                                  placement=placement)
            write_json_atomic(mine / META_NAME, {"format": "itmatch-precomp",
                                                 "splits": {split: {**info, "fingerprint": shard_fp}}})
            progress_path(mine, split).unlink(missing_ok=True)
            remove_atomic_leftovers(progress_path(mine, split))
        dist.barrier()  # every share is complete
        if dist.is_main():
            _merge_shards(bb, out_dir, split, ids, fp, list(zip(bounds, shard_dirs, strict=True)), batch_size, extras,
                          update)
    info = None
    if dist.is_main():  # finishes the merged split: captions and ids without the skipped images, its info
        info = _extract_split(bb, images_dir, table, out_dir, split, ids, caps, batch_size=batch_size, force=force,
                              skip_bad=skip_bad, progress=False, on_batch=None, extras=extras, placement=placement)
        info["processes"] = world
    dist.barrier()
    return info


def _merge_shards(bb: Backbone, out_dir: Path, split: str, ids: list[str], fp: str,
                  shards: list[tuple[tuple[int, int], Path]], batch_size: int, extras: tuple[str, ...],
                  update: dict[str, Any] | None = None) -> None:
    """Rank 0: concatenate the complete shares into the split's arrays (partial file, fsync, rename) and
    record them in the split's progress file as renamed (with `update`, what an update changed), the state
    `_extract_split` finishes from. The progress file is written before anything in `out_dir` is removed or
    replaced (no image done), again once every partial array is filled (every image done: from then on a
    partial file disappears only by its rename), and last as renamed, so that a re-run after a kill at any
    point continues the merge (the pre-checks of `extract_precomp`, `_finishing`) instead of refusing the split as
    another extraction's; a merge continued without `update` keeps the one its progress file recorded."""
    shards = [(b, d) for b, d in shards if b[1] > b[0]]
    skipped, records = [], {}
    for (start, stop), shard in shards:
        info = split_manifest(shard, split)
        records.update(info.get("image_files") or {})  # taken before each share decoded its images
        for s in info["skipped"]:
            skipped.append({"image_id": s["image_id"], "index": start + ids[start:stop].index(s["image_id"]),
                            "reason": s["reason"]})
    prog = progress_path(out_dir, split)
    if update is None:
        state = _same_run_progress(out_dir, split, fp)
        if state is not None and isinstance(state.get("update"), dict):
            update = state["update"]
    base = {"version": PROGRESS_VERSION, "split": split, "fingerprint": fp, "backbone": bb.name, "n_images": len(ids),
            "batch_size": batch_size, "records": records, **({"update": update} if update is not None else {})}
    write_json_atomic(prog, {**base, "done": 0, "written": 0, "skipped": [], "features_complete": False})
    fsync_dir(out_dir)
    for p in (captions_path(out_dir, split), ids_path(out_dir, split)):  # never stale beside new features
        p.unlink(missing_ok=True)
    filled = []
    for scale in ("c5", *extras):
        final = scale_path(out_dir, split, scale)
        partial = _scale_partial(out_dir, split, scale)
        parts = [np.load(scale_path(shard, split, scale), mmap_mode="r") for _, shard in shards]
        arr = open_memmap(partial, mode="w+", dtype=np.float32,
                          shape=(sum(len(a) for a in parts), *parts[0].shape[1:]))
        row = 0
        for part in parts:
            for s in range(0, len(part), 512):
                block = part[s:s + 512]
                arr[row:row + len(block)] = block
                row += len(block)
        del parts
        arr.flush()
        filled.append((final, partial, arr, row))
    fsync_dir(out_dir)
    done = {**base, "done": len(ids), "written": len(ids) - len(skipped), "skipped": skipped}
    write_json_atomic(prog, {**done, "features_complete": False})
    for final, partial, arr, row in filled:
        _finish_array(final, partial, arr, row)
    del filled, arr
    fsync_dir(out_dir)
    write_json_atomic(prog, {**done, "features_complete": True})


def extract_precomp(images_dir: Path, table: CaptionTable, out_dir: Path, *, backbone: str = "lite0",
                    extra_captions: str = "drop", rehash: bool = False,
                    splits: list[str] | None = None, batch_size: int = 8, force: bool = False,
                    skip_bad_images: bool = False, progress: bool = True, num_threads: int | None = None,
                    on_batch: BatchHook | None = None, scales: str | list[str] | None = None,
                    device: str | torch.device = "cpu", precision: str = "fp32") -> dict[str, Any]:
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
    `extra_captions`: what to do with the captions of an image beyond the 5 the precomp layout holds:
    "drop" (reported, listed in meta.json) or "keep" (written to `{split}_extra_caps.tsv`; training pairs
    them with their image, evaluation keeps the protocol's 5 per image).
    A split an earlier run completed is checked against its sources (docs/reliability.md): images
    whose size and mtime are unchanged are trusted without reading them, unless `rehash`.
    Under torchrun every rank calls this with the same arguments and extracts a share of the images
    (docs/distributed.md); the output directory must be on a file system all ranks see.
    The backbone runs on `device` in `precision` (docs/gpu.md); images are decoded on a host thread and the
    features are written as float32 whatever the device. Settings are checked before any work.
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
    if not images_dir.is_dir():
        raise DataError("images folder not found", path=images_dir,
                        hint="pass the folder that holds the image files named in the caption source")
    table.check_disjoint_splits()  # the readers name the lines; this catches tables built in code
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
            source = table.source or "the caption table"
            raise DataError(f"{len(missing)} of {len(ids)} images of split {split!r} named in {source} are "
                            f"not in {images_dir}, e.g. {missing[0]!r}", path=images_dir / missing[0],
                            hint="check the images folder (it must hold the files the captions name), "
                                 "or pass --skip-bad-images to drop them and their captions")

    extras = parse_extract_scales(scales)
    bb = load_backbone(backbone).to(placement.device)
    out_dir.mkdir(parents=True, exist_ok=True)
    fingerprints = {s: _fingerprint(bb, rows[s][0], extras) for s in splits}
    # Splits an earlier run of this same command completed (meta.json records them with the same image
    # list and backbone) are kept: re-running the command is idempotent, so a run killed in a later split
    # (or after its last write, before it exited) resumes instead of refusing to overwrite them. Outputs
    # of other images or another backbone are still only replaced with `force`.
    # A kept split is checked against its sources: meta.json records the fingerprints of its caption text
    # and of every image file (size + mtime, SHA-256 when they differ), so that a re-run after captions
    # were edited or a photo was replaced updates exactly that instead of keeping stale data.
    changes: dict[str, SourceChanges] = {}
    for split in splits:
        state = _same_run_progress(out_dir, split, fingerprints[split])
        # a previous run stopped after all (finishing) or some of its renames: continued, not taken for another
        # extraction's
        if force or (state is not None and (_features_renamed(state, out_dir, split, extras)
                                            or _renamed_scales(state, out_dir, split, extras))):
            continue
        if _complete(out_dir, split, fingerprints[split], extras):
            changes[split] = source_changes(out_dir, split, images_dir, *rows[split], rehash=rehash)
            continue
        if state is not None and isinstance(state.get("update"), dict):
            continue  # an update killed between removing the old captions and ids and renaming its features
        # (checked here, not only where a split starts: under torchrun the shares are extracted elsewhere
        # first, and the merge would replace the other extraction's progress file and partial arrays)
        _refuse_other_unfinished(out_dir, split, fingerprints[split], force)
        _refuse_other_extraction(out_dir, split, rows[split][0], force)
        for p in (captions_path(out_dir, split), ids_path(out_dir, split),
                  *(scale_path(out_dir, split, s) for s in extras)):
            refuse_overwrite(p, force)

    meta_file = out_dir / META_NAME
    bmeta = _backbone_meta(bb)
    meta: dict[str, Any] = {}
    if meta_file.exists():
        try:
            old = json.loads(meta_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = {}
        same = all(old.get(k) == bmeta[k] for k in ("backbone", "image_size", "normalisation"))
        if not same and old:
            others = [s for s in old.get("splits", {}) if s not in splits]
            if others and not force:
                raise OverwriteError(
                    f"{out_dir} holds {old.get('backbone')} features (splits {', '.join(others)}); adding "
                    f"{bb.name} features would mix backbones", path=meta_file,
                    hint="write to another directory or pass --force")
        elif old:
            meta = old
    meta.update({"format": "itmatch-precomp", "itmatch_version": _version(), **bmeta})
    meta.setdefault("splits", {})
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
            run_split = _extract_split_sharded if dist.is_distributed() else _extract_split
            reuse: dict[str, Any] = {}
            ch = changes.get(split)
            if ch is not None:
                old_info = meta["splits"][split]
                if not ch.images:  # same features: the caption text and the manifest are brought up to date
                    if not dist.is_main():
                        continue
                    info = refreshed_info(out_dir, split, old_info, ch)
                    info.update(_sync_extra_captions(out_dir, split, table, ch.kept_ids, per, keep_extra))
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
                             placement=placement, update=changes_record(ch) if ch is not None else None, **reuse)
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
                                     **_sync_extra_captions(out_dir, split, table, kept_ids, per, keep_extra)}
            if updated is not None:
                meta["splits"][split]["updated"] = updated
            write_json_atomic(meta_file, meta)
            fsync_dir(out_dir)
            progress_path(out_dir, split).unlink(missing_ok=True)
            # a kill during one of the split's progress or manifest writes leaves its temporary file behind
            for written in (progress_path(out_dir, split), meta_file):
                remove_atomic_leftovers(written)
            shutil.rmtree(shards_root(out_dir, split), ignore_errors=True)
    return dist.broadcast_object(meta)
