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

from itmatch.errors import ConfigError

#: what a figure's file name may end in -> the format matplotlib's savefig writes for it: the picture formats its
#: Agg backend writes everywhere (not pgf, which needs LaTeX, nor raw RGBA bytes, which no viewer opens)
FIGURE_FORMATS = {".png": "png", ".svg": "svg", ".svgz": "svgz", ".pdf": "pdf", ".eps": "eps", ".ps": "ps",
                  ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp", ".tif": "tiff", ".tiff": "tiff"}


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


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds. Temporary
    files of `path` that killed writers left behind are removed first (remove_atomic_leftovers)."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_atomic_leftovers(final, only_dead_writers=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.{_writer()}.", suffix=".partial", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp creates 0600; give the final file the usual permissions
    try:
        yield tmp_path
        fsync_file(tmp_path)
        os.replace(tmp_path, final)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def remove_atomic_leftovers(path: str | Path, only_dead_writers: bool = False) -> None:
    """Delete the temporary files (`.{name}.{host}-{pid}.{random}.partial`) that atomic writes of `path` left
    beside it when their process was killed between creating and renaming them. All of them: only for a path
    no one else is writing now. `only_dead_writers`: those of processes of this host that no longer run;
    files of running processes, of other hosts (a shared file system) and of the older unnamed form stay."""
    final = Path(path)
    host = socket.gethostname()
    for tmp in final.parent.glob(f".{glob.escape(final.name)}.*.partial"):
        if only_dead_writers:
            writer = tmp.name[len(final.name) + 2:-len(".partial")].rpartition(".")[0]
            writer_host, _, pid = writer.rpartition("-")
            if writer_host != host or not pid.isdigit() or _running(int(pid)) or not tmp.is_file():
                continue
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


def figure_format(path: str | Path) -> str:
    """The format a figure written to `path` takes, named by its suffix (r.svg: SVG); a ConfigError for a suffix
    of no picture format (or none), before a figure is drawn: a file's bytes must be what its name says."""
    suffix = Path(path).suffix.lower()
    if suffix not in FIGURE_FORMATS:
        said = f"ends in {suffix!r}" if suffix else "has no suffix"
        raise ConfigError(f"the figure's file name {said}, which names no picture format it can be written in",
                          path=path, hint=f"end it in one of {', '.join(FIGURE_FORMATS)} (e.g. fig.png, fig.svg)")
    return FIGURE_FORMATS[suffix]


def write_figure(path: str | Path, figure: Any, **savefig: Any) -> None:
    """Atomically write a matplotlib figure to `path` in the format its suffix names (figure_format), with
    savefig's other arguments (dpi=...)."""
    fmt = figure_format(path)
    write_with(path, lambda tmp: figure.savefig(tmp, format=fmt, **savefig))


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """SHA-256 of a file's bytes, read in chunks (manifests of checkpoints, features and indexes)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_file(path: str | Path) -> None:
    """Flush a written file's bytes to disk before it is renamed into place (an error here is a real one)."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: str | Path) -> None:
    """Make a directory's entries (a rename, a new file) durable; a file system that cannot fsync a directory, or
    a directory that cannot be opened, is let be (the rename itself is atomic either way)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
