"""The on-disk state of an unfinished extraction, and what a re-run reads from it.

A split is extracted into partial arrays (`{split}_ims.npy.partial`, one a stage map) beside a progress file
(`{split}.progress.json`: images done, rows written, images skipped, the source files' fingerprints); a finished
array is fsynced and renamed to its final name, and meta.json records the split last. This module reads that
state back: whether a split is complete, was stopped between or after its renames, or belongs to another
extraction. The order of the writes and why: docs/reliability.md, 'Crash safety in detail'.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.format import open_memmap

from itmatch.data.precomp import (
    captions_path,
    features_path,
    ids_path,
    partial_path,
    progress_path,
    scale_path,
    split_manifest,
)
from itmatch.errors import DataError, OverwriteError
from itmatch.features.backbones import Backbone
from itmatch.io import fsync_file

log = logging.getLogger("itmatch.features")

# 2: the progress file records the source files' fingerprints (older files are started again); an update's
# progress file also records what changed ("update"), so that a resumed update records it in meta.json
PROGRESS_VERSION = 2
# Bump when preprocessing changes in a way that changes the features (invalidates resumable state).
PREPROCESS_VERSION = 1


def scale_partial(root: Path, split: str, scale: str) -> Path:
    """The partial file of stage map `scale` (c5: the main array's)."""
    return partial_path(root, split) if scale == "c5" else Path(f"{scale_path(root, split, scale)}.partial")


def run_fingerprint(bb: Backbone, ids: list[str], extras: tuple[str, ...] = (), view: int = 0) -> str:
    """What identifies an extraction of `ids`: backbone, weights, preprocessing, stage maps, the augmented view
    (features/views.py) and the image list in order. A progress file, a share or a meta.json entry of another
    fingerprint is another extraction's."""
    h = hashlib.sha256()
    head = {"backbone": bb.name, "weights": Path(bb.weights).name, "image_size": bb.image_size,
            "normalisation": bb.normalisation, "preprocess_version": PREPROCESS_VERSION}
    if extras:  # absent for single-scale runs, so their fingerprints (and resumable state) are unchanged
        head["scales"] = list(extras)
    if view:  # (likewise absent for the photos themselves, view 0)
        head["view"] = view
    h.update(json.dumps(head, sort_keys=True).encode())
    for image_id in ids:
        h.update(image_id.encode("utf-8") + b"\0")
    return h.hexdigest()


def read_progress(path: Path) -> dict[str, Any] | None:
    """A split's progress file; None when it is absent, unreadable or of another PROGRESS_VERSION."""
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # unreadable progress: treated as absent (the run starts this split again)
    if not isinstance(state, dict) or state.get("version") != PROGRESS_VERSION:
        return None
    return state


def renamed_scales(state: dict[str, Any], out_dir: Path, split: str, extras: tuple[str, ...] = ()) -> set[str]:
    """The stage maps (c5: the main array) the run of `state` already moved to their final names: every image
    done, the map's partial file gone, its final file there (a partial file disappears only by its rename, and
    a stale final file of an older run can only coexist with its partial one)."""
    if int(state.get("done", -1)) < int(state.get("n_images", -2)):
        return set()
    return {s for s in ("c5", *extras)
            if scale_path(out_dir, split, s).exists() and not scale_partial(out_dir, split, s).exists()}


def features_renamed(state: dict[str, Any], out_dir: Path, split: str, extras: tuple[str, ...] = ()) -> bool:
    """Did the run of `state` already move its finished features (and every extra stage map) to their final
    names? Either it recorded so, or it was killed right after the last rename (`renamed_scales`: all)."""
    finals = [scale_path(out_dir, split, s) for s in ("c5", *extras)]
    if not all(f.exists() for f in finals):
        return False
    if state.get("features_complete"):
        return True
    return len(renamed_scales(state, out_dir, split, extras)) == len(finals)


def split_complete(out_dir: Path, split: str, fingerprint: str, extras: tuple[str, ...] = ()) -> bool:
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


def same_run_progress(out_dir: Path, split: str, fingerprint: str) -> dict[str, Any] | None:
    """The split's progress file when a run of the same images and backbone wrote it, else None."""
    state = read_progress(progress_path(out_dir, split))
    return state if state and state.get("fingerprint") == fingerprint else None


def is_finishing(out_dir: Path, split: str, fingerprint: str, extras: tuple[str, ...] = ()) -> bool:
    """True when a previous run stopped after renaming the features but before it recorded the split as
    complete in meta.json (captions, ids or meta still to write)."""
    state = same_run_progress(out_dir, split, fingerprint)
    return state is not None and features_renamed(state, out_dir, split, extras)


def refuse_other_unfinished(out_dir: Path, split: str, fingerprint: str, force: bool) -> None:
    """Refuse (without `force`) to start over an unfinished extraction of another image list, backbone or view:
    its progress file and partial arrays would be replaced."""
    prog = progress_path(out_dir, split)
    state = read_progress(prog)
    if force or state is None or state.get("fingerprint") == fingerprint:
        return
    raise OverwriteError(
        f"an unfinished extraction of split {split!r} with a different image list or backbone "
        f"({state.get('backbone')}, {state.get('n_images')} images) is in {out_dir}", path=prog,
        hint="resume it with the same captions and backbone, write elsewhere, or pass --force to discard it")


def open_partial(path: Path, shape: tuple[int, ...], resume: bool) -> np.memmap:
    """A partial array of `shape`: the one on disk when resuming and it fits, else a new one."""
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


def finish_array(final: Path, partial: Path, arr: np.memmap, written: int) -> None:
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
