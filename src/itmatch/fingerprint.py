"""Content fingerprints of source files (photos, caption text) recorded in extraction and index manifests.

A file's record is its size, modification time (ns) and SHA-256; a file whose size and mtime are unchanged is
trusted after one `stat` and only the others are hashed, so re-running over a large, unchanged collection costs
no reading. What this fast path cannot see: docs/reliability.md, 'Crash safety in detail' (Extraction).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from itmatch.io import file_sha256

FileRecord = dict[str, Any]  # {"bytes": int, "mtime_ns": int, "sha256": str}


def file_record(path: Path, known: FileRecord | None = None) -> FileRecord:
    """The record of `path` (OSError when it cannot be read); `known` (an earlier record of the same
    path) is returned as it is when size and mtime still match, without reading the file."""
    st = path.stat()
    if known and known.get("bytes") == st.st_size and known.get("mtime_ns") == st.st_mtime_ns:
        return known
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": file_sha256(path)}


def file_records(root: Path, names: list[str], known: dict[str, FileRecord | None] | None = None
                 ) -> dict[str, FileRecord | None]:
    """{name: record of root/name, None when it cannot be read} for every name, with the size + mtime
    fast path against `known`."""
    known = known or {}
    return {name: _record_or_none(root / name, known.get(name)) for name in names}


def _record_or_none(path: Path, known: FileRecord | None) -> FileRecord | None:
    try:
        return file_record(path, known)
    except (OSError, ValueError):  # missing, unreadable, or a name no file can have (a NUL byte)
        return None


def changed_files(old: dict[str, FileRecord | None], new: dict[str, FileRecord | None]) -> list[str]:
    """Names present in both whose content differs (another SHA-256, or the file appeared/disappeared);
    a file only touched (same SHA-256, new mtime) is not a change."""
    return [name for name in new if name in old and _sha(old[name]) != _sha(new[name])]


def _sha(record: FileRecord | None) -> str | None:
    return record.get("sha256") if record else None


def text_sha256(lines: list[str]) -> str:
    """SHA-256 of lines written one per line (equals the SHA-256 of a precomp `{split}_caps.txt`)."""
    return hashlib.sha256(("\n".join(lines) + "\n").encode("utf-8")).hexdigest()
