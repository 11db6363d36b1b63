"""What changed in a split's sources since its extraction (photos, captions), and the caption-only update.

A re-run of `itmatch extract` over a complete split compares its photos (size and mtime, or SHA-256 with --rehash)
and captions with what meta.json recorded: edited captions are rewritten in place (the features stay), replaced
photos re-extract their rows only (the others are reused from the current arrays). A caption-only update writes
what it changes to a marker before rewriting the captions, so that a run stopped before meta.json records it
still records it when resumed. docs/reliability.md, row 5c.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from itmatch import distributed as dist
from itmatch.data.precomp import captions_path, ids_path, read_lines, scale_path, split_manifest, write_captions
from itmatch.fingerprint import FileRecord, changed_files, file_records, text_sha256
from itmatch.io import file_sha256, fsync_dir, remove_atomic_leftovers, write_json_atomic

log = logging.getLogger("itmatch.features")


def caption_update_path(root: Path, split: str) -> Path:
    """The marker of a caption-only update: what it changed (meta.json's `updated` record), written before the
    captions are rewritten and removed once meta.json records it."""
    return root / f"{split}.captions-update.json"


@dataclass
class SourceChanges:
    """How the sources of a complete split differ from what its extraction recorded in meta.json."""

    images: list[str]  # ids whose image file changed (other content, appeared or disappeared)
    captions_stale: bool  # the caption text differs from the split's `{split}_caps.txt`
    captions: list[str]  # ids whose captions (the ones the precomp layout keeps) changed
    kept_ids: list[str]  # the split's rows (the listed images less those skipped as unreadable)
    kept_caps: list[str]
    records: dict[str, FileRecord | None] | None  # the image files' fingerprints now; None: none recorded
    pending: PendingUpdate | None = None  # an interrupted caption-only update (its marker)
    # the extraction's captions of each id in `captions`, kept in an update's marker: a run resumed after the
    # update was stopped compares with them, since `{split}_caps.txt` then holds the update's
    captions_before: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class PendingUpdate:
    """A caption-only update stopped after rewriting the split's captions, before meta.json recorded it."""

    record: dict[str, Any]  # its `updated` record, as meta.json would have held it
    before: dict[str, list[str]]  # the extraction's captions of the ids it rewrote (empty: an older marker)


def _pending_caption_update(out_dir: Path, split: str, info: dict[str, Any]) -> PendingUpdate | None:
    """The caption-only update that rewrote the split's captions but was stopped before meta.json recorded it
    (its marker is there and meta.json's entry `info` does not hold its record); a marker meta.json already
    records (stopped before removing it) is removed."""
    marker = caption_update_path(out_dir, split)
    if dist.is_main():  # (under torchrun rank 0 writes and removes it)
        remove_atomic_leftovers(marker)  # (a marker write killed half-way: its captions were not rewritten yet)
    try:
        content = json.loads(marker.read_text(encoding="utf-8")) if marker.exists() else {}
        record, before = content.get("updated"), content.get("captions_before") or {}
    except (OSError, ValueError, AttributeError):
        record, before = None, {}
    if isinstance(record, dict) and record != info.get("updated"):
        return PendingUpdate(record, before if isinstance(before, dict) else {})
    if dist.is_main():
        marker.unlink(missing_ok=True)
    return None


def source_changes(out_dir: Path, split: str, images_dir: Path, ids: list[str], caps: list[str], *,
                    rehash: bool = False) -> SourceChanges:
    info = split_manifest(out_dir, split) or {}
    per = len(caps) // len(ids)
    skipped = {s["image_id"] for s in info.get("skipped", [])}
    kept = [(i, caps[k * per:(k + 1) * per]) for k, i in enumerate(ids) if i not in skipped]
    kept_caps = [c for _, group in kept for c in group]
    # the extraction's captions of every id whose captions may differ from them (None: not known any more)
    before: dict[str, list[str] | None] = {}
    # compared with the file itself: edited captions, and a caption file changed by hand, are both seen
    stale = text_sha256(kept_caps) != file_sha256(captions_path(out_dir, split))
    if stale:
        # the lines write_captions wrote, one caption each ("\n" after each; it refuses a caption holding a break)
        old = captions_path(out_dir, split).read_text(encoding="utf-8").split("\n")
        written = {i: old[r * per:(r + 1) * per] for r, (i, _) in enumerate(kept)}
        before = {i: written[i] for i, group in kept if written[i] != group}
    pending = _pending_caption_update(out_dir, split, info)
    if pending is not None:  # the file holds the stopped update's captions of these ids, its marker the extraction's
        before |= {i: pending.before.get(i) for i in pending.record.get("captions_changed") or ()}
    # changed since meta.json's extraction: an edit reverted after a stopped update is not a change
    captions = [i for i, group in kept if i in before and before[i] != group]
    known = {i: before[i] for i in captions if before[i] is not None}
    old_files = info.get("image_files")
    if not isinstance(old_files, dict):
        log.warning("split %s in %s was extracted by an itmatch that did not record its image files' "
                    "fingerprints: whether a photo changed since cannot be told; pass --force to re-extract "
                    "it (the new manifest records them)", split, out_dir)
        return SourceChanges([], stale, captions, [i for i, _ in kept], kept_caps, None, pending, known)
    records = file_records(images_dir, ids, None if rehash else old_files)
    return SourceChanges(changed_files(old_files, records), stale, captions, [i for i, _ in kept], kept_caps,
                          records, pending, known)


#: the keys of a split's meta.json entry that report captions the precomp layout does not hold (extract.py
#: `_left_out_captions`): recomputed by every run from the captions, so an update drops them before
CAPTION_REPORT_KEYS = ("extra_captions", "duplicate_captions")


def refreshed_info(out_dir: Path, split: str, old: dict[str, Any], ch: SourceChanges) -> dict[str, Any]:
    """A split whose features are current: rewrite its captions if they changed and return its updated
    meta.json entry (new fingerprints, e.g. touched files' mtimes; extra captions left to the caller).
    What changed is written to the split's marker (`caption_update_path`) before the captions are rewritten:
    a run stopped before meta.json records it finds the captions current, and takes the record from there
    (`_pending_caption_update`; the caller removes the marker after writing meta.json)."""
    info = {k: v for k, v in old.items() if k not in CAPTION_REPORT_KEYS}
    info["captions_sha256"] = text_sha256(ch.kept_caps)
    if ch.records is not None:
        info["image_files"] = ch.records
    record = ch.pending.record if ch.pending is not None and ch.captions else None
    if ch.captions_stale:
        log_caption_changes(out_dir, split, ch)
        record = update_record(changes_record(ch)) if ch.captions else None
        if record is not None:
            write_json_atomic(caption_update_path(out_dir, split),
                              {"split": split, "updated": record, "captions_before": ch.captions_before})
            fsync_dir(out_dir)
        write_captions(out_dir, split, ch.kept_ids, ch.kept_caps, per_image=len(ch.kept_caps) // len(ch.kept_ids))
    if record is not None:
        info["updated"] = record
    return info


def log_caption_changes(out_dir: Path, split: str, ch: SourceChanges) -> None:
    name = captions_path(out_dir, split).name
    if ch.captions:
        log.warning("split %s: the captions of %d image(s) changed since the extraction (%s): rewrote %s", split,
                    len(ch.captions), examples(ch.captions), name)
    else:  # a stopped update's edits, undone in the caption file before this run
        log.warning("split %s: the captions are the extraction's again (the edits of a stopped update were "
                    "reverted): rewrote %s", split, name)


def changes_record(ch: SourceChanges) -> dict[str, Any]:
    """What changed since the extraction, as meta.json's `updated` records it (also kept in an update's
    progress file until meta.json records the update)."""
    return {"image_files_changed": ch.images, "captions_changed": ch.captions}


def update_record(changes: dict[str, Any]) -> dict[str, Any]:
    return {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **changes}


def reuse_rows(out_dir: Path, split: str, ids: list[str], changed: list[str], extras: tuple[str, ...]
                ) -> dict[str, Any]:
    """`extract_split`'s reuse arguments for an update: the row of every unchanged image in the split's
    current arrays (opened memory-mapped; they are replaced only when the new ones are complete)."""
    old_rows = {image_id: r for r, image_id in enumerate(read_lines(ids_path(out_dir, split)))}
    stale = set(changed)
    reuse = {k: old_rows[i] for k, i in enumerate(ids) if i in old_rows and i not in stale}
    arrays = {s: np.load(scale_path(out_dir, split, s), mmap_mode="r") for s in ("c5", *extras)}
    return {"reuse": reuse, "reuse_from": arrays}


def examples(names: list[str], shown: int = 3) -> str:
    text = ", ".join(repr(n) for n in names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")
