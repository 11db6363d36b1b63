"""One split extracted by the ranks of a torchrun group: each rank its share, then rank 0 merges them.

Each rank extracts its share of the images into `.shards-{split}/rank{r}-of-{world}` (a complete precomp split
of its own, resumable like any other); rank 0 concatenates the shares into the split's arrays and finishes it
as a single process would. docs/distributed.md, 'Feature extraction'.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.format import open_memmap

from itmatch import distributed as dist
from itmatch.data.captions import CaptionTable
from itmatch.data.precomp import (
    META_NAME,
    captions_path,
    ids_path,
    progress_path,
    scale_path,
    shards_root,
    split_manifest,
)
from itmatch.device import Placement
from itmatch.features.backbones import Backbone
from itmatch.features.extract_split import BatchHook, extract_split
from itmatch.features.progress import (
    PROGRESS_VERSION,
    finish_array,
    is_finishing,
    run_fingerprint,
    same_run_progress,
    scale_partial,
    split_complete,
)
from itmatch.fingerprint import FileRecord
from itmatch.io import fsync_dir, remove_atomic_leftovers, write_json_atomic


def extract_split_sharded(bb: Backbone, images_dir: Path, table: CaptionTable, out_dir: Path, split: str,
                          ids: list[str], caps: list[str], *, batch_size: int, force: bool, skip_bad: bool,
                          progress: bool, on_batch: BatchHook | None, extras: tuple[str, ...] = (),
                          known_files: dict[str, FileRecord | None] | None = None,
                          placement: Placement | None = None, update: dict[str, Any] | None = None,
                          view: int = 0) -> dict[str, Any] | None:
    """`extract_split` shared by the ranks of a torchrun group (docs/distributed.md). Every rank calls
    it; rank 0 returns the split's info, the others None."""
    n, world = len(ids), dist.world_size()
    per = len(caps) // n
    fp = run_fingerprint(bb, ids, extras, view)
    bounds = [dist.shard_bounds(n, r, world) for r in range(world)]
    shard_dirs = [shards_root(out_dir, split) / f"rank{r}-of-{world}" for r in range(world)]
    if not is_finishing(out_dir, split, fp, extras):
        (start, stop), mine = bounds[dist.rank()], shard_dirs[dist.rank()]
        shard_fp = run_fingerprint(bb, ids[start:stop], extras, view)
        if stop > start and (force or not split_complete(mine, split, shard_fp, extras)):
            mine.mkdir(parents=True, exist_ok=True)
            info = extract_split(bb, images_dir, table, mine, split, ids[start:stop], caps[start * per:stop * per],
                                 batch_size=batch_size, force=force, skip_bad=skip_bad,
                                 progress=progress and dist.is_main(), on_batch=on_batch, extras=extras,
                                 placement=placement, view=view)
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
        info = extract_split(bb, images_dir, table, out_dir, split, ids, caps, batch_size=batch_size, force=force,
                             skip_bad=skip_bad, progress=False, on_batch=None, extras=extras, placement=placement,
                             view=view)
        info["processes"] = world
    dist.barrier()
    return info


def _merge_shards(bb: Backbone, out_dir: Path, split: str, ids: list[str], fp: str,
                  shards: list[tuple[tuple[int, int], Path]], batch_size: int, extras: tuple[str, ...],
                  update: dict[str, Any] | None = None) -> None:
    """Rank 0: concatenate the complete shares into the split's arrays (partial file, fsync, rename) and
    record them in the split's progress file as renamed (with `update`, what an update changed), the state
    `extract_split` finishes from. The progress file is written before anything in `out_dir` is removed or
    replaced (no image done), again once every partial array is filled (every image done: from then on a
    partial file disappears only by its rename), and last as renamed, so that a re-run after a kill at any
    point continues the merge (the pre-checks of `extract_precomp`, `is_finishing`) instead of refusing the split as
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
        state = same_run_progress(out_dir, split, fp)
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
        partial = scale_partial(out_dir, split, scale)
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
        finish_array(final, partial, arr, row)
    del filled, arr
    fsync_dir(out_dir)
    write_json_atomic(prog, {**done, "features_complete": True})
