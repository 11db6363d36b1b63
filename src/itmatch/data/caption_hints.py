"""What to tell a user whose caption file cannot be read as given: the encoding of a file that is not UTF-8
(`not_utf8`), and the real file an image name that is not found most likely meant (`missing_image_hint`).
The caption readers (captions.py) raise and report with these."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable
from pathlib import Path

from itmatch.errors import DataError


def not_utf8(path: Path, *, in_place: bool = False) -> DataError:
    """The error for a text file that does not decode as UTF-8: the line and byte of its first bad byte, and
    how to convert the file: into a copy to pass instead, or `in_place` for a file read by its name (a precomp
    directory's {split}_caps.txt). The file is decoded again here because the offset of a UnicodeDecodeError
    raised while reading a stream counts from the decoder's current chunk, not from the start of the file."""
    data = Path(path).read_bytes()
    try:
        data.decode("utf-8")
        return DataError("not UTF-8 text", path=path)  # (the file changed since it failed to decode)
    except UnicodeDecodeError as exc:
        start, reason = exc.start, exc.reason
    line = data.count(b"\n", 0, start) + 1
    text_before = data[:start].decode("utf-8", "replace")
    if any(ord(ch) > 127 and ch not in "\ufffd\ufeff" for ch in text_before):  # (a byte-order mark is no letter)
        # valid UTF-8 letters before the bad byte: converting the whole file would garble them
        hint = (f"the file mixes UTF-8 with another encoding: retype the accented letters of line {line} (and "
                f"of any later line the next run names), or save the file as UTF-8 from the program that wrote it")
    else:
        # Windows programs write windows-1252, a latin1 superset that uses bytes 0x80-0x9f (curly quotes)
        legacy = "windows-1252" if re.search(rb"[\x80-\x9f]", data) and _decodes(data, "cp1252") else "latin1"
        # the converted copy keeps the name's endings (.csv, .token.txt, .json): format detection reads them
        name = Path(path).name
        head, dot, tail = name.partition(".")
        converted = Path(path).with_name(f"{head}-utf8{dot}{tail}")
        convert = f"iconv -f {legacy} -t utf-8 {shlex.quote(str(path))} > {shlex.quote(str(converted))}"
        then = (f" && mv {shlex.quote(str(converted))} {shlex.quote(str(path))}" if in_place
                else f", then pass {converted}")
        hint = f"save the file as UTF-8, or convert it (it looks like {legacy}): {convert}{then}"
    return DataError(f"not UTF-8 text ({reason} at byte {start})", path=path, line=line, hint=hint)


def _decodes(data: bytes, encoding: str) -> bool:
    try:
        data.decode(encoding)
    except UnicodeDecodeError:
        return False
    return True



# Files listed to suggest the closest name of a missing image: enough for COCO's 123k photos in two folders,
# bounded so that a mistaken images folder (a home directory) costs a moment, not a walk of the disk.
MAX_LISTED_FILES = 300_000


def _listing(images_dir: Path) -> list[str]:
    """Paths of the files in `images_dir` and its subfolders (one level down), relative, with '/'."""
    listed: list[str] = []
    for top, dirs, files in os.walk(images_dir):
        rel = Path(top).relative_to(images_dir)
        listed.extend((rel / f).as_posix() for f in sorted(files))
        dirs.sort()
        if rel.parts:
            dirs.clear()
        if len(listed) > MAX_LISTED_FILES:
            break
    return listed


def closest_image_name(images_dir: Path, name: str) -> str | None:
    """A phrase naming the file under `images_dir` that the image name `name` most likely meant and how the
    two differ (case, folder part, extension), or None when no file differs from it in only these ways. (No
    fuzzy match: a near name is another photo as often as a typo, e.g. COCO ids one digit apart.)"""
    listed = _listing(images_dir)
    wanted = name.replace("\\", "/").strip("/")

    def base(f: str) -> str:
        return f.rsplit("/", 1)[-1]

    def stem(f: str) -> str:
        return os.path.splitext(base(f))[0].casefold()

    has_extension = bool(os.path.splitext(base(wanted))[1])
    tests: list[tuple[str, Callable[[str], bool]]] = [
        ("only the case differs", lambda f: f.casefold() == wanted.casefold()),
        ("the folder part differs", lambda f: base(f) == base(wanted)),
        ("the folder part and the case differ", lambda f: base(f).casefold() == base(wanted).casefold()),
        ("the extension differs" if has_extension else "it has an extension", lambda f: stem(f) == stem(wanted)),
    ]
    for how, same in tests:
        found = next((f for f in listed if same(f)), None)
        if found is not None:
            return f"the closest file is {found!r} ({how})"
    return None


def missing_image_hint(images_dir: Path | None, first_missing: str) -> str:
    """The fix for image names that are not found: what they are relative to, and the closest real file
    name of the first missing one when there is one."""
    if images_dir is None:
        return "check the image names of the caption file"
    close = closest_image_name(images_dir, first_missing)
    nearest = f" {first_missing!r} is not there; {close}." if close else ""
    return (f"image names are paths relative to the images folder {images_dir} (the file {images_dir}/NAME "
            f"must exist).{nearest} Correct the names in the caption file, or pass the folder they are "
            f"relative to as the images folder")
