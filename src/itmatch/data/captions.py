"""Caption sources -> one CaptionTable (image_id, caption, split).

Readers for Flickr8K, Karpathy JSON, COCO captions JSON and a plain CSV live below the table.
"""

from __future__ import annotations

import csv
import json
import re
import sys
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from itmatch.data.caption_hints import missing_image_hint, not_utf8
from itmatch.errors import DataError

CAPTIONS_PER_IMAGE = 5
# Splits trained on: they may drop an image's repeated captions before the cut to CAPTIONS_PER_IMAGE, since a
# repeat is one example twice; evaluation splits keep the protocol's captions as they are (`select`). restval
# is read as train (KARPATHY_SPLITS) and named here for tables built in code.
TRAINING_SPLITS = frozenset({"train", "restval"})


@dataclass
class ImageRows:
    """How the precomp layout uses the caption rows of one image (indices into the CaptionTable):
    `kept` fill its `per_image` slots, `extra` are the distinct captions beyond them (left out, or kept for
    training with --extra-captions keep), `duplicates` repeat a caption the image already has and are dropped.
    An image with `per_image` rows or fewer keeps them all, repeats included: dropping one would leave it
    short of the layout's count."""

    kept: list[int]
    extra: list[int] = field(default_factory=list)
    duplicates: list[int] = field(default_factory=list)


def caption_key(caption: str) -> str:
    """What makes two captions of one image the same caption: equal after whitespace is collapsed and case
    folded. Case is ignored because every text encoder itmatch ships reads lower case (the word vocabularies
    lower-case before tokenizing, MMCA's MiniLM WordPiece is uncased), so two captions that differ only in
    case are one training example twice, and would take the slot of a distinct caption."""
    return " ".join(caption.split()).casefold()


@dataclass
class CaptionTable:
    """Column-oriented caption table: row r says caption `captions[r]` describes `image_ids[r]`,
    which belongs to split `splits[r]` (train/dev/test/testall, or "" when the source has none)."""

    image_ids: list[str] = field(default_factory=list)
    captions: list[str] = field(default_factory=list)
    splits: list[str] = field(default_factory=list)
    source: str = ""
    # Problems that were reported and skipped (e.g. a caption naming a missing image).
    skipped: list[str] = field(default_factory=list)
    # Of those, the images that a split names but that are not in the images folder, per split (in the order
    # met): the table no longer holds them, so extraction would shrink that split unsaid; it refuses instead.
    missing_images: dict[str, list[str]] = field(default_factory=dict)
    # Where each row comes from, so that an error about an image can point at its rows: its line in a text
    # source, its entry in a JSON one ("images[3].sentences[0]"), None when unknown; `location` joins it with
    # `source`. Not "source:line" per row: the path repeated on Karpathy COCO's 616k rows cost 70 MB.
    locations: list[int | str | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._align_locations()

    def _align_locations(self) -> None:
        """Pad `locations` with None (unknown) up to the rows: a table built in code from lists has none, and a
        row added after them must get its own index, not another row's."""
        self.locations.extend([None] * (len(self.captions) - len(self.locations)))

    def __len__(self) -> int:
        return len(self.captions)

    def add(self, image_id: str, caption: str, split: str = "", location: int | str | None = None) -> None:
        """Add one row; `location`: its line in `source`, or its entry there (JSON)."""
        self._align_locations()  # (rows may have been appended to the lists directly)
        self.image_ids.append(image_id)
        self.captions.append(caption)
        self.splits.append(split)
        self.locations.append(location)

    def location(self, row: int) -> str:
        """Where row `row` is ("file:line", "file (entry)"), or the table's source when its place is not known."""
        where = self.locations[row] if row < len(self.locations) else None
        if where is None or where == "":
            return self.source or f"row {row}"
        if isinstance(where, int):
            return f"{self.source}:{where}" if self.source else f"line {where}"
        return f"{self.source} ({where})" if self.source else where

    def split_names(self) -> list[str]:
        return list(OrderedDict.fromkeys(self.splits))

    def _rows(self, split: str | None = None) -> OrderedDict[str, list[int]]:
        """Row indices per image, images in first-appearance order, optionally one split only."""
        groups: OrderedDict[str, list[int]] = OrderedDict()
        for row, (image_id, s) in enumerate(zip(self.image_ids, self.splits, strict=True)):
            if split is None or s == split:
                groups.setdefault(image_id, []).append(row)
        return groups

    def grouped(self, split: str | None = None) -> OrderedDict[str, list[str]]:
        """Captions per image, images in first-appearance order, optionally one split only."""
        return OrderedDict((image_id, [self.captions[r] for r in rows]) for image_id, rows in self._rows(split).items())

    def check_disjoint_splits(self) -> None:
        """Raise DataError naming the first image whose captions sit in two splits (test data would leak
        into training). The readers catch this with line numbers; this catches tables built in code."""
        split_of: dict[str, tuple[str, int]] = {}
        for row, (image_id, split) in enumerate(zip(self.image_ids, self.splits, strict=True)):
            first_split, first_row = split_of.setdefault(image_id, (split, row))
            if first_split != split:
                raise DataError(f"image {image_id!r} is in both the {first_split or '(none)'} split (row "
                                f"{first_row}) and the {split or '(none)'} split (row {row})",
                                path=self.source or None, hint=SPLIT_LEAK_HINT)

    def select(self, split: str, per_image: int = CAPTIONS_PER_IMAGE) -> OrderedDict[str, ImageRows]:
        """Which rows of each image of `split` the precomp layout holds (`ImageRows`).

        Evaluation splits (every split but TRAINING_SPLITS) keep an image's first `per_image` rows in file
        order, repeats included, as SCAN's precomp files do: the scored captions are the papers' (COCO and
        Karpathy images have up to 7), so results stay comparable. In a training split an image with more than
        `per_image` rows drops its repeated captions (`caption_key`) first, so that the cut never keeps a
        repeat while leaving out a distinct caption: it keeps its first `per_image` distinct captions in file
        order (repeats fill the slots only when it has fewer distinct ones). In both, the rows after the kept
        ones that repeat a caption of the image are `duplicates`, the others `extra`. Without repeats this is
        the first `per_image` everywhere."""
        training = split in TRAINING_SPLITS
        chosen: OrderedDict[str, ImageRows] = OrderedDict()
        for image_id, rows in self._rows(split).items():
            if len(rows) <= per_image:
                chosen[image_id] = ImageRows(kept=rows)
                continue
            seen: set[str] = set()
            distinct, repeats = [], []
            for r in rows:
                key = caption_key(self.captions[r])
                (repeats if key in seen else distinct).append(r)
                seen.add(key)
            if training:
                fill = repeats[:max(0, per_image - len(distinct))]
                kept = sorted(distinct[:per_image] + fill)
            else:
                kept = rows[:per_image]
            taken = set(kept)
            chosen[image_id] = ImageRows(kept=kept, extra=[r for r in distinct if r not in taken],
                                         duplicates=[r for r in repeats if r not in taken])
        return chosen

    def precomp_rows(self, split: str, per_image: int = CAPTIONS_PER_IMAGE) -> tuple[list[str], list[str]]:
        """(image ids, captions) in the precomp order: captions per_image*i .. per_image*i+per_image-1
        belong to image i. Images with more captions keep `per_image` of them (`select` says which, and the
        extractor reports the others); images with fewer are an error naming how many there are and where
        the first ones are."""
        ids: list[str] = []
        caps: list[str] = []
        short: list[tuple[str, list[int]]] = []
        for image_id, rows in self.select(split, per_image).items():
            if len(rows.kept) < per_image:
                short.append((image_id, rows.kept))
                continue
            ids.append(image_id)
            caps.extend(self.captions[r] for r in rows.kept)
        if short:
            shown = "; ".join(f"{image_id!r} has {len(kept)} ({self.location(kept[0])})"
                              for image_id, kept in short[:3])
            more = f"; and {len(short) - 3} more" if len(short) > 3 else ""
            raise DataError(f"{len(short)} of {len(short) + len(ids)} images of split {split!r} have fewer than "
                            f"{per_image} captions: {shown}{more}", path=self.source or None,
                            hint=f"give every image {per_image} captions (the precomp layout and the evaluation "
                                 f"protocol hold exactly {per_image} per image; itmatch has no option for fewer), "
                                 f"or remove the rows of these images; captions beyond {per_image} are fine "
                                 f"(reported, or trained on with --extra-captions keep)")
        if not ids:
            raise DataError(f"split {split!r} has no images", path=self.source or None,
                            hint=f"available splits: {', '.join(self.split_names()) or 'none'}")
        return ids, caps


# ----------------------------------------------------------------------------------------------------
# Readers. Every reader returns a CaptionTable whose rows are grouped per image (an image's captions are
# consecutive, images in first-appearance order), raises DataError (file, line, fix) on malformed input,
# and *reports and skips* rows that name an image that cannot exist, so that one bad id in a 40k-line
# file costs a warning, not a crash. Nothing is ever written next to the source: the shared data is
# read-only.
# ----------------------------------------------------------------------------------------------------

FORMATS = ("flickr8k", "karpathy", "coco", "csv")

FLICKR8K_TOKEN_FILE = "Flickr8k.token.txt"
FLICKR8K_SPLIT_FILES = {"train": "Flickr_8k.trainImages.txt", "dev": "Flickr_8k.devImages.txt",
                        "test": "Flickr_8k.testImages.txt"}
# Image folders found beside the token file when images_dir is not given: ours, and the official
# (misspelled) folder name of the Flickr8K distribution.
FLICKR8K_IMAGE_DIRS = ("images", "Flicker8k_Dataset", "Flickr8k_Dataset")

# Karpathy split names -> ours. "restval" (the COCO validation images outside the 5K dev/test) is
# training data, as in SCAN's precomp files; "val" is our "dev".
KARPATHY_SPLITS = {"train": "train", "restval": "train", "val": "dev", "test": "test"}
CSV_SPLITS = ("train", "dev", "test", "testall", "")
CSV_HEADER = "image,caption[,split]"
SPLIT_LEAK_HINT = ("an image must belong to one split only (else test data leaks into training): "
                   "remove or rename the other rows")


class SkippedRowsWarning(UserWarning):
    """Some caption rows were reported and skipped (see CaptionTable.skipped for each one)."""


def read_captions(source: str | Path, *, images_dir: Path | None = None, fmt: str = "auto",
                  default_split: str = "") -> CaptionTable:
    """Read any supported caption source into a CaptionTable.

    `source` is a file, or a directory holding `Flickr8k.token.txt` or a single `dataset_*.json`.
    `fmt="auto"` detects the format from the file name, then the content, so that one command works for
    every dataset; pass `fmt` ("flickr8k", "karpathy", "coco", "csv") when detection guesses wrong.
    `images_dir`, when given, is where image ids are looked up; captions of images that are missing
    there are reported in `table.skipped` and dropped (features cannot be extracted for them).
    `default_split` is the split of the rows whose source names none (a CSV without a split column, a
    COCO file whose name says no split, Flickr8K images in no split list, or every image of a token file
    that has no split files beside it); "" leaves them unassigned.
    """
    _check_split_name(default_split, Path(source))
    table = _read_any(Path(source), images_dir, fmt, default_split)
    if default_split:
        table.splits = [s or default_split for s in table.splits]
    return table


def _read_any(path: Path, images_dir: Path | None, fmt: str, default_split: str) -> CaptionTable:
    # the readers whose rows may name no split see the default: CSV checks it, Flickr8K accepts a token file
    # without split files when there is one
    read_csv_here = partial(read_csv, default_split=default_split)
    read_token_here = partial(read_flickr8k, default_split=default_split)
    if fmt not in ("auto", *FORMATS):
        raise DataError(f"unknown caption format {fmt!r}", path=path,
                        hint=f"use one of: auto, {', '.join(FORMATS)}")
    if not path.exists():
        raise DataError("caption source not found", path=path,
                        hint="check the path; it may be a caption file or a dataset directory")
    if path.is_dir():
        path, detected = _resolve_directory(path)
        fmt = detected if fmt == "auto" else fmt
    if fmt == "flickr8k":
        return read_token_here(path, images_dir=images_dir)
    if fmt == "csv":
        return read_csv_here(path, images_dir=images_dir)
    if fmt == "karpathy":
        return read_karpathy(path, images_dir=images_dir)
    if fmt == "coco":
        return read_coco(path, images_dir=images_dir)
    # auto, on a file
    name = path.name.lower()
    if name.endswith(".csv"):
        return read_csv_here(path, images_dir=images_dir)
    if name.endswith((".token.txt", ".token")):
        return read_token_here(path, images_dir=images_dir)
    if name.endswith(".json"):
        data = _load_json(path)  # parsed once: COCO/Karpathy files are up to ~150 MB
        if isinstance(data, dict) and "annotations" in data:
            return _coco_from_json(data, path, images_dir=images_dir, split=None)
        if isinstance(data, dict) and "images" in data:
            return _karpathy_from_json(data, path, images_dir=images_dir)
        raise DataError("JSON file is neither Karpathy ('images' with 'sentences') nor COCO captions "
                        "('images' and 'annotations')", path=path,
                        hint=f"if the file is one of them, say which: {_format_option('karpathy')} or "
                             f"{_format_option('coco')}")
    first = _first_line(path)
    if "\t" in first and "#" in first.split("\t", 1)[0]:
        return read_token_here(path, images_dir=images_dir)
    if first.strip().lower().startswith("image,caption"):
        return read_csv_here(path, images_dir=images_dir)
    raise DataError("cannot tell the caption format of this file", path=path,
                    hint=f"say which it is: --format one of {', '.join(FORMATS)} (Python: fmt=); a CSV's "
                         f"first line is {CSV_HEADER}")


def _format_option(fmt: str) -> str:
    """How a hint names a format: the CLI option, with the Python API's keyword beside it (both read hints)."""
    return f"--format {fmt} (Python: fmt={fmt!r})"


def _resolve_directory(directory: Path) -> tuple[Path, str]:
    """The caption file inside a dataset directory, and its format."""
    token = directory / FLICKR8K_TOKEN_FILE
    if token.is_file():
        return token, "flickr8k"
    karpathy = sorted(directory.glob("dataset_*.json"))
    if len(karpathy) == 1:
        return karpathy[0], "karpathy"
    if len(karpathy) > 1:
        raise DataError(f"several Karpathy files: {', '.join(p.name for p in karpathy)}", path=directory,
                        hint="pass the one you want as the source file")
    raise DataError("no caption file found in this directory", path=directory,
                    hint=f"expected {FLICKR8K_TOKEN_FILE} or one dataset_*.json; or pass the caption file")


def _first_line(path: Path) -> str:
    try:
        with open(path, encoding="utf-8-sig") as fh:
            return fh.readline()
    except UnicodeDecodeError:
        raise not_utf8(path) from None


def _read_text_lines(path: Path, what: str, hint: str | None = None) -> list[str]:
    """Lines of a UTF-8 text file without line endings. Split at '\\n' only, a CRLF's '\\r' dropped (CRLF files
    exist: Flickr_8k.trainImages.txt), so that line numbers are an editor's and not_utf8's: str.splitlines (and
    universal newlines) also break at a lone '\\r', U+2028, \\x85, \\x0c and \\x1c-\\x1e, which a caption may hold
    (the readers read them as a space, one_line), and every line after one was numbered wrong."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as fh:
            return [line.removesuffix("\r") for line in fh.read().split("\n")]
    except FileNotFoundError:
        raise DataError(f"{what} not found", path=path, hint=hint) from None
    except UnicodeDecodeError:
        raise not_utf8(path) from None


def _load_json(path: Path) -> object:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise DataError("file not found", path=path) from None
    except UnicodeDecodeError:
        raise not_utf8(path) from None
    except json.JSONDecodeError as exc:
        raise DataError(f"invalid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})", path=path,
                        line=exc.lineno, hint="the file is truncated or not JSON; fetch it again") from None
    except RecursionError:
        raise DataError("JSON nested too deeply", path=path) from None
    except IsADirectoryError:
        raise DataError("expected a JSON file, found a directory", path=path) from None


class _ImageCheck:
    """Is an image id present under images_dir? (Always yes when there is no directory to look in.)"""

    def __init__(self, images_dir: Path | None) -> None:
        self.images_dir = Path(images_dir) if images_dir is not None else None
        if self.images_dir is not None and not self.images_dir.is_dir():
            raise DataError("image directory not found", path=self.images_dir,
                            hint="pass the folder that holds the images, or leave images_dir unset")
        self._cache: dict[str, bool] = {}

    def __call__(self, image_id: str) -> bool:
        if self.images_dir is None:
            return True
        if image_id not in self._cache:
            try:
                self._cache[image_id] = (self.images_dir / image_id).is_file()
            except (OSError, ValueError):  # a name no file can have (NUL byte, too long)
                self._cache[image_id] = False
        return self._cache[image_id]


def _caller_level() -> int:
    """The `stacklevel` that points a warning raised in this module at the code that called the reader: the
    readers call each other (read_captions -> read_csv -> _Builder.table), so no fixed level is right."""
    frame, level = sys._getframe(1), 1  # the frame that calls warnings.warn
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


class _Builder:
    """Collects rows per image in first-appearance order, then emits them grouped."""

    def __init__(self, source: Path, images_dir: Path | None = None) -> None:
        self.source = source
        self.images_dir = images_dir  # (named in the error when every row is skipped)
        # image id -> (caption, split, line or entry)
        self.groups: OrderedDict[str, list[tuple[str, str, int | str | None]]] = OrderedDict()
        self.skipped: list[str] = []
        self.first_missing: str | None = None  # the first image name not found in images_dir
        self.missing_images: dict[str, list[str]] = {}  # split -> images of it not found in images_dir
        self.first_seen: dict[str, tuple[str, str]] = {}  # image id -> (split, where its first row is)

    def add(self, image_id: str, caption: str, split: str, *, line: int | None = None, entry: str = "") -> None:
        """Add one row, found on `line` of a text source or at `entry` of a JSON one (e.g.
        "images[3].sentences[0]"): the table records where, and an image in two splits names both rows."""
        where = f"line {line}" if line is not None else entry
        first_split, first_where = self.first_seen.setdefault(image_id, (split, where))
        if first_split != split:
            raise DataError(f"image {image_id!r} is in both the {first_split or '(none)'} split ({first_where}) "
                            f"and the {split or '(none)'} split ({where})", path=self.source, line=line,
                            hint=SPLIT_LEAK_HINT)
        self.groups.setdefault(image_id, []).append((caption, split, line if line is not None else entry or None))

    def skip(self, where: str, message: str, missing: str | None = None, split: str = "") -> None:
        """Report and drop a row; `missing`: the image name it gives, when the reason is that the image
        file is not there (the first one is matched against the folder for the error's fix), and `split`
        the split the source puts that image in ("" for none)."""
        self.skipped.append(f"{where}: {message}")
        if missing is not None and self.first_missing is None:
            self.first_missing = missing
        if missing is not None and split:
            images = self.missing_images.setdefault(split, [])
            if missing not in images:
                images.append(missing)

    def table(self) -> CaptionTable:
        if self.skipped and not self.groups:  # nothing left to use: an error, not a warning and an empty table
            shown = "; ".join(self.skipped[:3]) + ("; ..." if len(self.skipped) > 3 else "")
            hint = (missing_image_hint(self.images_dir, self.first_missing) if self.first_missing is not None
                    else "check that the images folder is the one the file's image names refer to, and that the "
                         "images are there")
            raise DataError(f"all {len(self.skipped)} caption row(s) were skipped, none is left: {shown}",
                            path=self.source, hint=hint)
        table = CaptionTable(source=str(self.source), skipped=list(self.skipped),
                             missing_images={split: list(ids) for split, ids in self.missing_images.items()})
        for image_id, rows in self.groups.items():
            for caption, split, location in rows:
                table.add(image_id, caption, split, location)
        if self.skipped:
            shown = "\n  ".join(self.skipped[:3])
            more = f"\n  ... and {len(self.skipped) - 3} more" if len(self.skipped) > 3 else ""
            warnings.warn(f"{self.source}: skipped {len(self.skipped)} caption row(s):\n  {shown}{more}",
                          SkippedRowsWarning, stacklevel=_caller_level())
        return table


# A line that begins as a token-file row does (IMAGE.jpg#k<TAB>): met after a break inside a caption, it is the next
# row, so the file's lines end with a break other than '\n' (a lone '\r': old Mac files), not a caption's break.
TOKEN_ROW_START = re.compile(r"[^\t]*#\d+\t")
LINE_ENDINGS_HINT = ("the file's line endings must be '\\n' or '\\r\\n': convert a file whose lines end with a lone "
                     "'\\r' (old Mac files) first, e.g. tr '\\r' '\\n' < FILE > FIXED")


def read_flickr8k(source: str | Path, *, images_dir: Path | None = None, default_split: str = "") -> CaptionTable:
    """Read the official Flickr8K captions (`IMAGE.jpg#k<TAB>caption`) with the official splits.

    `source` is `Flickr8k.token.txt` or its directory. The split lists `Flickr_8k.{train,dev,test}Images.txt`
    must sit beside it (they *are* the benchmark: without them test numbers are not comparable). Images
    in no split list get split `default_split` ("" by default). Captions of one's own in this format may
    come without split lists: when none of the three is there and `default_split` is given
    (`itmatch extract ... --default-split train`), every image gets that split; one list missing beside
    the others is still an error (a partial benchmark split). `images_dir` defaults to an `images/` (or
    the official `Flicker8k_Dataset/`) folder beside the token file when one exists.

    A row whose image is in no split list and not on disk (or, with no image folder at all, in no split
    list) cannot be used, so it is reported in `table.skipped` and dropped: the official file has one,
    `2258277193_586949ec62.jpg.1`. A row that cannot be parsed is an error, not a skip: it means the file
    is not what we think it is.
    """
    path = Path(source)
    if path.is_dir():
        path = path / FLICKR8K_TOKEN_FILE
    root = path.parent
    if images_dir is None:
        images_dir = next((root / d for d in FLICKR8K_IMAGE_DIRS if (root / d).is_dir()), None)
    on_disk = _ImageCheck(images_dir)

    _check_split_name(default_split, path)
    split_of: dict[str, str] = {}
    present = [name for name in FLICKR8K_SPLIT_FILES.values() if (root / name).is_file()]
    for split, name in FLICKR8K_SPLIT_FILES.items():
        split_path = root / name
        if not present and default_split:
            break  # captions of one's own in the token format: every image gets the default split
        if not split_path.is_file():
            files = ", ".join(FLICKR8K_SPLIT_FILES.values())
            own = (f"for captions of your own without split lists, remove {', '.join(present)} and name the split: "
                   if present else "for captions of your own without split lists, name the split: ")
            raise DataError(f"Flickr8K split file {name} is missing", path=split_path,
                            hint=f"put {files} (from Flickr8k_text.zip) beside {path.name} for the official "
                                 f"splits; {own}itmatch extract IMAGES {path} --out DIR --default-split train; "
                                 f"or use the Karpathy file: itmatch extract IMAGES dataset_flickr8k.json --out DIR")
        for lineno, line in enumerate(_read_text_lines(split_path, "split file"), 1):
            image = line.strip()
            if not image:
                continue
            if one_line(image) != image:
                raise DataError(f"line break inside the image name {image[:60]!r}", path=split_path, line=lineno,
                                hint=LINE_ENDINGS_HINT)
            if split_of.setdefault(image, split) != split:
                raise DataError(f"image {image!r} is in both the {split_of[image]} and {split} splits",
                                path=split_path, line=lineno, hint="the split lists must be disjoint")

    lines = _read_text_lines(path, "Flickr8K caption file",
                             hint=f"pass the path of {FLICKR8K_TOKEN_FILE} or the directory holding it")
    builder = _Builder(path, images_dir)
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        key, tab, caption = line.partition("\t")
        if not tab:
            raise DataError("no tab between image and caption", path=path, line=lineno,
                            hint="each line must be IMAGE.jpg#k<TAB>caption")
        image, hash_, k = key.strip().rpartition("#")
        if not hash_ or not image or not k.isdigit():
            raise DataError(f"expected IMAGE.jpg#k before the tab, found {key!r}", path=path, line=lineno,
                            hint="each line must be IMAGE.jpg#k<TAB>caption, k = 0..4")
        if any(TOKEN_ROW_START.match(piece) for piece in caption.splitlines()[1:]):
            raise DataError("line break inside the caption, followed by what looks like the next row "
                            "(IMAGE.jpg#k<TAB>...)", path=path, line=lineno, hint=LINE_ENDINGS_HINT)
        caption = one_line(caption).strip()
        if not caption:
            raise DataError(f"empty caption for {image}#{k}", path=path, line=lineno,
                            hint="remove the line or write the caption")
        # the default applies before the check below: without split lists it is every image's split
        split = split_of.get(image) or default_split or None
        if images_dir is None and split is None:
            builder.skip(f"{path}:{lineno}", f"skipped caption of {image!r}: the image is in no split "
                                             f"file and there is no image folder to find it in")
            continue
        if not on_disk(image):
            where = "in no split file and" if split is None else f"in the {split} split but"
            builder.skip(f"{path}:{lineno}", f"skipped caption of {image!r}: the image is {where} "
                                             f"not in {images_dir}", missing=image,
                         split=split_of.get(image, ""))  # (a split list's: not --default-split's guess for an orphan)
            continue
        builder.add(image, caption, split or "", line=lineno)
    return builder.table()


OPEN_QUOTE_HINT = ('close the quote on that line, at the end of its caption ("a dog, running"); write a quote '
                   'that is part of a caption twice ("a ""big"" dog")')
# A line that begins as a CSV row does (IMAGE.ext,): met inside a field that spans lines, it is the next row,
# read into the field by a quote left open, not the rest of a caption.
ROW_START = re.compile(r'\s*[^\s,"]+\.[A-Za-z0-9]{2,5}\s*,')


def _refuse_open_quote(row: list[str], raw: str, path: Path, lineno: int, end: int) -> None:
    """A quote left open makes the csv module read on, through the next rows, to the next quote character,
    and what comes out (one caption swallowing several rows, a wrong column count, an image short of
    captions) hides the cause. A field that spans lines is one caption written over lines (spreadsheets write
    them: "a dog\r\nrunning"), unless it swallowed what looks like a further row (a line of it begins as a
    row does, ROW_START) or runs to the end of the file unclosed (the row's text `raw` holds an odd number of
    quote characters): then it is refused here, naming the line the quote opens on."""
    for field_text in row:
        lines = field_text.splitlines()
        if len(lines) > 1 and (any(ROW_START.match(line) for line in lines[1:]) or raw.count('"') % 2):
            opening = lines[0].strip()[:40]
            raise DataError(f"unterminated quote: the quoted field that starts on this line ({opening!r}) is not "
                            f"closed on it, so the lines after it, up to line {end}, were read into it",
                            path=path, line=lineno, hint=OPEN_QUOTE_HINT)


def _check_split_name(split: str, path: Path) -> None:
    if split not in CSV_SPLITS:
        raise DataError(f"unknown default split {split!r}", path=path,
                        hint="use train, dev, test or testall (dev is the validation split)")


def _where(path: Path, location: str) -> str:
    return f"{path} ({location})"


def _expect(value: object, kind: type | tuple[type, ...], path: Path, location: str, what: str) -> None:
    if not isinstance(value, kind):
        raise DataError(f"{location}: expected {what}, found {type(value).__name__}", path=path,
                        hint="the file does not have the expected structure; check the format")


def one_line(caption: str) -> str:
    """A caption as one line: each line break inside it (any str.splitlines breaks at: '\\n', '\\r', U+2028, \\x85,
    \\x0c, ...) is read as the space it stands for. Every reader passes its captions through this, since the
    precomp layout holds one caption a line (write_captions refuses any break: there it failed late, without a
    file or line) and the tokenizer reads any break as a space."""
    return " ".join(caption.splitlines())


def _caption_text(value: object, path: Path, location: str) -> str:
    _expect(value, str, path, location, "a caption string")
    text = one_line(str(value)).strip()
    if not text:
        raise DataError(f"{location}: empty caption", path=path, hint="remove the caption or write it")
    return text


def read_karpathy(source: str | Path, *, images_dir: Path | None = None) -> CaptionTable:
    """Read Karpathy's split files (`dataset_flickr30k.json`, `dataset_coco.json`, `dataset_flickr8k.json`):
    the splits every paper in the field (SCAN included) reports on.

    Split names are mapped to ours: `val` -> `dev`, `restval` -> `train` (SCAN's precomp training set
    is train + restval), `train` and `test` unchanged. The image id is `filepath/filename` when the entry
    has a `filepath` (COCO: `val2014/COCO_val2014_....jpg`, so `images_dir` is the COCO root), else
    `filename`. JSON has no useful line numbers after parsing, so errors name the entry, e.g.
    `images[12].sentences[3]`.
    """
    path = Path(source)
    return _karpathy_from_json(_load_json(path), path, images_dir=images_dir)


def _karpathy_from_json(data: object, path: Path, *, images_dir: Path | None) -> CaptionTable:
    _expect(data, dict, path, "top level", "an object with an 'images' list")
    assert isinstance(data, dict)
    images = data.get("images")
    _expect(images, list, path, "'images'", "a list of images")
    assert isinstance(images, list)
    on_disk = _ImageCheck(images_dir)
    builder = _Builder(path, images_dir)
    seen: set[str] = set()
    for i, entry in enumerate(images):
        loc = f"images[{i}]"
        _expect(entry, dict, path, loc, "an object")
        filename = entry.get("filename")
        if not isinstance(filename, str) or not filename:
            raise DataError(f"{loc}: missing 'filename'", path=path,
                            hint="Karpathy entries need filename, split and sentences")
        filepath = entry.get("filepath")
        image_id = filename
        if isinstance(filepath, str) and filepath:
            image_id = f"{filepath.rstrip('/')}/{filename}"
        raw_split = entry.get("split")
        if not isinstance(raw_split, str) or raw_split not in KARPATHY_SPLITS:
            raise DataError(f"{loc} ({image_id}): unknown split {raw_split!r}", path=path,
                            hint=f"Karpathy splits are {', '.join(KARPATHY_SPLITS)}")
        sentences = entry.get("sentences")
        _expect(sentences, list, path, f"{loc}.sentences", "a list of sentences")
        if image_id in seen:
            raise DataError(f"{loc}: image {image_id!r} is listed twice", path=path,
                            hint="each image must appear once in 'images'")
        seen.add(image_id)
        if not on_disk(image_id):
            builder.skip(_where(path, loc), f"skipped {len(sentences)} caption(s) of {image_id!r}: "
                                            f"image not found in {images_dir}", missing=image_id,
                         split=KARPATHY_SPLITS[raw_split])
            continue
        for j, sentence in enumerate(sentences):
            sloc = f"{loc}.sentences[{j}]"
            _expect(sentence, dict, path, sloc, "an object with 'raw'")
            if "raw" not in sentence:
                raise DataError(f"{sloc}: no 'raw' caption", path=path,
                                hint="Karpathy sentences are {\"raw\": \"...\", \"tokens\": [...]}")
            builder.add(image_id, _caption_text(sentence["raw"], path, f"{sloc}.raw"),
                        KARPATHY_SPLITS[raw_split], entry=sloc)
    return builder.table()


def coco_split_from_name(path: str | Path) -> str:
    """`captions_train2014.json` -> train, `captions_val2014.json` -> dev, `..test..` -> test, else ""."""
    name = Path(path).name.lower()
    for key, split in (("train", "train"), ("val", "dev"), ("test", "test")):
        if key in name:
            return split
    return ""


def read_coco(source: str | Path, *, images_dir: Path | None = None,
              split: str | None = None) -> CaptionTable:
    """Read an MS-COCO captions file (`captions_*.json`: 'images' with id/file_name, 'annotations' with
    image_id/caption).

    These files carry no split, and the benchmark splits (Karpathy 5K dev/test) cut across them, so the
    caller sets `split`; left as None it is guessed from the file name (train -> "train", val -> "dev",
    test -> "test", otherwise ""). Images are in the order of the 'images' list; an annotation naming an
    image id that is not in 'images' (or whose file is missing from `images_dir`) is reported and skipped.
    """
    path = Path(source)
    return _coco_from_json(_load_json(path), path, images_dir=images_dir, split=split)


def _coco_from_json(data: object, path: Path, *, images_dir: Path | None, split: str | None) -> CaptionTable:
    split = coco_split_from_name(path) if split is None else split
    _expect(data, dict, path, "top level", "an object with 'images' and 'annotations'")
    assert isinstance(data, dict)
    images, annotations = data.get("images"), data.get("annotations")
    _expect(images, list, path, "'images'", "a list of images")
    _expect(annotations, list, path, "'annotations'", "a list of annotations")
    assert isinstance(images, list) and isinstance(annotations, list)
    file_of: dict[object, str] = {}
    for i, entry in enumerate(images):
        loc = f"images[{i}]"
        _expect(entry, dict, path, loc, "an object with 'id' and 'file_name'")
        if not isinstance(entry.get("id"), int | str) or not isinstance(entry.get("file_name"), str):
            raise DataError(f"{loc}: needs 'id' and 'file_name' (the id a number or a string)", path=path,
                            hint="COCO images look like {\"id\": 391895, \"file_name\": \"COCO_..jpg\"}")
        if entry["id"] in file_of:
            raise DataError(f"{loc}: image id {entry['id']!r} is listed twice", path=path)
        file_of[entry["id"]] = entry["file_name"]

    per_image: dict[object, list[tuple[str, str]]] = {}  # image id -> (caption, its annotation's location)
    on_disk = _ImageCheck(images_dir)
    builder = _Builder(path, images_dir)
    for j, ann in enumerate(annotations):
        loc = f"annotations[{j}]"
        _expect(ann, dict, path, loc, "an object with 'image_id' and 'caption'")
        if "image_id" not in ann or "caption" not in ann:
            raise DataError(f"{loc}: needs 'image_id' and 'caption'", path=path)
        caption = _caption_text(ann["caption"], path, f"{loc}.caption")
        image = ann["image_id"]
        if not isinstance(image, int | str) or image not in file_of:
            builder.skip(_where(path, loc), f"skipped caption of image id {image!r}: not in 'images'")
            continue
        if not on_disk(file_of[image]):
            builder.skip(_where(path, loc), f"skipped caption of {file_of[image]!r}: "
                                            f"image not found in {images_dir}", missing=file_of[image], split=split)
            continue
        per_image.setdefault(image, []).append((caption, loc))
    for image, file_name in file_of.items():
        for caption, loc in per_image.get(image, ()):
            builder.add(file_name, caption, split, entry=loc)
    return builder.table()


def read_csv(source: str | Path, *, images_dir: Path | None = None, default_split: str = "") -> CaptionTable:
    """Read a plain CSV with header `image,caption` and an optional third column `split`: the simplest
    way to bring one's own photos. Quoting follows the csv module (captions may contain commas).

    `split` values must be train, dev, test, testall or empty; rows without one (an empty cell, or a file
    without the column) get `default_split` (`itmatch extract --default-split train`), by default "" (no
    split: such rows cannot be extracted). All rows of one image must be in the same split: an image in
    two splits is an error naming both lines. A UTF-8 byte-order mark (spreadsheet exports) is accepted.
    """
    path = Path(source)
    _check_split_name(default_split, path)
    if not path.is_file():
        raise DataError("CSV file not found", path=path)
    on_disk = _ImageCheck(images_dir)
    builder = _Builder(path, images_dir)
    raw: list[str] = []  # the lines of the row being read (the open-quote check counts its quotes)

    def recorded(lines: Iterable[str]) -> Iterator[str]:
        for line in lines:
            raw.append(line)
            yield line

    with open(path, encoding="utf-8-sig", newline="") as fh:
        reader = csv.reader(recorded(fh))
        try:
            header = next(reader, None)
            if header is None:
                raise DataError("empty CSV file", path=path, line=1,
                                hint=f"the first line must be {CSV_HEADER}")
            names = [h.strip().lower() for h in header]
            if names not in (["image", "caption"], ["image", "caption", "split"]):
                raise DataError(f"unexpected header {','.join(header)!r}", path=path, line=1,
                                hint=f"the first line must be exactly {CSV_HEADER}, "
                                     f"e.g. 'image,caption,split'")
            ncols = len(names)
            prev_end = reader.line_num
            raw.clear()
            for row in reader:
                lineno, prev_end = prev_end + 1, reader.line_num
                text = "".join(raw)
                raw.clear()
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                _refuse_open_quote(row, text, path, lineno, reader.line_num)
                if len(row) != ncols:
                    raise DataError(f"expected {ncols} columns ({','.join(names)}), found {len(row)}",
                                    path=path, line=lineno,
                                    hint="quote captions that contain commas: \"a dog, running\"")
                image = row[0].strip()
                if not image:
                    raise DataError("empty image name", path=path, line=lineno)
                if one_line(image) != image:
                    raise DataError(f"line break inside the image name {image!r}", path=path, line=lineno,
                                    hint="an image name is one line: remove the break (and the quotes around it)")
                caption = one_line(row[1]).strip()
                if not caption:
                    raise DataError(f"empty caption for {image}", path=path, line=lineno,
                                    hint="remove the row or write the caption")
                split = row[2].strip() if ncols == 3 else ""
                if split not in CSV_SPLITS:
                    raise DataError(f"unknown split {split!r}", path=path, line=lineno,
                                    hint="use train, dev, test, testall or leave it empty "
                                         "(dev is the validation split)")
                if not on_disk(image):
                    builder.skip(f"{path}:{lineno}", f"skipped caption of {image!r}: "
                                                     f"image not found in {images_dir}", missing=image,
                                 split=split or default_split)
                    continue
                builder.add(image, caption, split or default_split, line=lineno)
        except csv.Error as exc:
            raise DataError(f"malformed CSV: {exc}", path=path, line=reader.line_num) from None
        except UnicodeDecodeError:
            raise not_utf8(path) from None
    return builder.table()
