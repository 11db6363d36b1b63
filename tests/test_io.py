"""Atomic writes (itmatch.io): the final name only ever holds a complete file, and the temporary files of
writers killed between creating and renaming them are removed by the next write of the same file."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from itmatch.io import atomic_path, write_text_atomic


def _dead_pid() -> int:
    """The PID of a process that has exited (reused only after the PID counter wraps)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(proc.stdout)


def test_a_write_removes_what_killed_writers_of_the_same_file_left(tmp_path):
    host = socket.gethostname()
    target = tmp_path / "results.csv"
    killed = tmp_path / f".results.csv.{host}-{_dead_pid()}.k1ll3d.partial"
    running = tmp_path / f".results.csv.{host}-{os.getpid()}.w0rk1n.partial"  # a writer still at work
    other_host = tmp_path / f".results.csv.elsewhere-{_dead_pid()}.n0tm1n.partial"  # shared file system
    old_form = tmp_path / ".results.csv.a1b2c3.partial"  # before the writer was in the name: unknown
    other_file = tmp_path / f".notes.txt.{host}-{_dead_pid()}.k1ll3d.partial"
    for p in (killed, running, other_host, old_form, other_file):
        p.write_text("half")
    write_text_atomic(target, "a,b\n")
    assert target.read_text() == "a,b\n"
    assert not killed.exists()
    assert running.exists() and other_host.exists() and old_form.exists() and other_file.exists()


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "state.json"
    write_text_atomic(target, "old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
