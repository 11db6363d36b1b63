"""Atomic file writes: a reader never sees a half-written file under the final name."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _writer() -> str:
    """The host and process writing a temporary file, in its name: a later writer of the same file can then
    tell a killed writer's leftover from the file of a writer still at work."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # (signal 0: only asks whether the process exists)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_dead_writers_leftovers(final: Path) -> None:
    """Delete `.{name}.{host}-{pid}.{random}.partial` files of `final` left by processes of this host that
    no longer run (killed between creating and renaming them). Files of running processes, of other hosts
    (a shared file system) and of the older unnamed form are left alone."""
    host = socket.gethostname()
    for tmp in final.parent.glob(f".{glob.escape(final.name)}.*.partial"):
        writer = tmp.name[len(final.name) + 2:-len(".partial")].rpartition(".")[0]
        writer_host, _, pid = writer.rpartition("-")
        if writer_host == host and pid.isdigit() and not _running(int(pid)) and tmp.is_file():
            tmp.unlink(missing_ok=True)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds. Temporary
    files of `path` that killed writers left behind are removed first (see _remove_dead_writers_leftovers)."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_writers_leftovers(final)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.{_writer()}.", suffix=".partial", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp creates 0600; give the final file the usual permissions
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, final)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def remove_atomic_leftovers(path: str | Path) -> None:
    """Delete the temporary files that atomic writes of `path` left beside it when the process was killed
    between creating and renaming them (`.{name}.*.partial`). Only for a path no one else is writing now."""
    final = Path(path)
    for tmp in final.parent.glob(f".{glob.escape(final.name)}.*.partial"):
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_with(path: str | Path, writer: Callable[[Path], None]) -> None:
    """Atomically write `path` with a function that writes to a given temporary path."""
    with atomic_path(path) as tmp:
        writer(tmp)


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """SHA-256 of a file's bytes, read in chunks (manifests of checkpoints, features and indexes)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()
