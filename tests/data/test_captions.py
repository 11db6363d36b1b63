"""Caption readers: each format on small files, the errors users will hit, and the real Flickr8K file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from itmatch.data.captions import (
    CaptionTable,
    SkippedRowsWarning,
    coco_split_from_name,
    read_captions,
    read_coco,
    read_csv,
    read_flickr8k,
    read_karpathy,
)
from itmatch.errors import DataError

SHARED_FLICKR8K = Path(__file__).resolve().parents[2].parent / "shared/data/flickr8k"


# ------------------------------------------------------------------------------------------ Flickr8K

def _flickr_dir(tmp_path: Path, token_lines: list[str], splits: dict[str, list[str]] | None = None,
                images: list[str] | None = None, crlf: bool = False) -> Path:
    root = tmp_path / "f8k"
    root.mkdir()
    (root / "Flickr8k.token.txt").write_text("\n".join(token_lines) + "\n", encoding="utf-8")
    splits = {"train": ["a.jpg", "b.jpg"], "dev": ["c.jpg"], "test": ["d.jpg"]} if splits is None else splits
    names = {"train": "Flickr_8k.trainImages.txt", "dev": "Flickr_8k.devImages.txt",
             "test": "Flickr_8k.testImages.txt"}
    for split, ids in splits.items():
        sep = "\r\n" if crlf else "\n"
        (root / names[split]).write_bytes(sep.join(ids).encode())  # no final newline, like the real files
    if images is not None:
        (root / "images").mkdir()
        for name in images:
            (root / "images" / name).write_bytes(b"")
    return root


def _five(image: str, text: str = "a caption") -> list[str]:
    return [f"{image}#{k}\t{text} {k} ." for k in range(5)]


def test_flickr8k_splits_grouping_and_order(tmp_path: Path) -> None:
    # captions of a.jpg and b.jpg interleaved: the table must group them, keeping first-appearance order
    lines = _five("b.jpg")[:2] + _five("a.jpg") + _five("b.jpg")[2:] + _five("c.jpg") + _five("d.jpg")
    root = _flickr_dir(tmp_path, lines, crlf=True)
    table = read_flickr8k(root / "Flickr8k.token.txt")
    assert list(table.grouped()) == ["b.jpg", "a.jpg", "c.jpg", "d.jpg"]
    assert table.image_ids[:5] == ["b.jpg"] * 5
    assert table.captions[:2] == ["a caption 0 .", "a caption 1 ."]
    assert {s: list(table.grouped(s)) for s in table.split_names()} == {
        "train": ["b.jpg", "a.jpg"], "dev": ["c.jpg"], "test": ["d.jpg"]}
    assert table.skipped == []
    assert table.source.endswith("Flickr8k.token.txt")


def test_flickr8k_strips_whitespace(tmp_path: Path) -> None:
    root = _flickr_dir(tmp_path, ["a.jpg#0\t  A dog runs .  \t", "a.jpg#1\tA cat ."], images=["a.jpg"])
    assert read_captions(root).captions == ["A dog runs .", "A cat ."]


def test_flickr8k_bogus_id_reported_and_skipped(tmp_path: Path) -> None:
    lines = _five("a.jpg") + _five("x.jpg.1") + _five("e.jpg")
    root = _flickr_dir(tmp_path, lines, images=["a.jpg", "b.jpg", "c.jpg", "d.jpg", "e.jpg"])
    with pytest.warns(SkippedRowsWarning, match="skipped 5 caption row"):
        table = read_captions(root)  # images/ beside the token file is found on its own
    # e.jpg is in no split but on disk: kept, split ""
    assert list(table.grouped()) == ["a.jpg", "e.jpg"]
    assert table.splits[-1] == ""
    assert len(table.skipped) == 5
    token = root / "Flickr8k.token.txt"
    assert table.skipped[0].startswith(f"{token}:6: ")
    assert "x.jpg.1" in table.skipped[0] and "no split" in table.skipped[0]
    assert table.skipped[-1].startswith(f"{token}:10: ")
    assert table.missing_images == {}  # (in no split: no split shrinks)
    with pytest.warns(SkippedRowsWarning):  # (--default-split gives the orphan a split, not a split list's)
        assert read_flickr8k(root, default_split="train").missing_images == {}


def test_flickr8k_without_image_folder_skips_images_in_no_split(tmp_path: Path) -> None:
    root = _flickr_dir(tmp_path, _five("a.jpg") + _five("e.jpg"))
    with pytest.warns(SkippedRowsWarning):
        table = read_flickr8k(root)
    assert list(table.grouped()) == ["a.jpg"]
    assert "no image folder" in table.skipped[0]


def test_flickr8k_image_of_a_split_missing_on_disk_is_skipped(tmp_path: Path) -> None:
    root = _flickr_dir(tmp_path, _five("a.jpg") + _five("b.jpg"), images=["a.jpg"])
    with pytest.warns(SkippedRowsWarning):
        table = read_flickr8k(root, images_dir=root / "images")
    assert list(table.grouped()) == ["a.jpg"]
    assert "train split" in table.skipped[0] and "b.jpg" in table.skipped[0]
    assert table.missing_images == {"train": ["b.jpg"]}  # once, for its five rows


@pytest.mark.parametrize(("bad", "words"), [
    ("a.jpg#1 no tab here", "no tab"),
    ("a.jpg\tno hash", "IMAGE.jpg#k"),
    ("a.jpg#x\tbad index", "IMAGE.jpg#k"),
    ("a.jpg#1\t   ", "empty caption"),
])
def test_flickr8k_malformed_line_names_file_and_line(tmp_path: Path, bad: str, words: str) -> None:
    root = _flickr_dir(tmp_path, ["a.jpg#0\tfine .", bad, "a.jpg#2\tfine ."])
    with pytest.raises(DataError, match=words) as err:
        read_flickr8k(root)
    assert err.value.line == 2
    assert str(err.value).startswith(f"{root / 'Flickr8k.token.txt'}:2: ")


def test_flickr8k_missing_split_file(tmp_path: Path) -> None:
    root = _flickr_dir(tmp_path, _five("a.jpg"), splits={"train": ["a.jpg"], "test": ["d.jpg"]})
    with pytest.raises(DataError, match="Flickr_8k.devImages.txt is missing") as err:
        read_flickr8k(root)
    assert err.value.path == root / "Flickr_8k.devImages.txt"
    assert "dataset_flickr8k.json" in (err.value.hint or "")
    # one list missing beside the others is a partial benchmark split: --default-split does not paper over it
    with pytest.raises(DataError, match="Flickr_8k.devImages.txt is missing"):
        read_captions(root, default_split="train")


def test_flickr8k_token_file_without_split_files_takes_the_default_split(tmp_path: Path) -> None:
    """The fix spoke the Python API (fmt='karpathy'), and --default-split did not apply to a token file."""
    root = _flickr_dir(tmp_path, _five("a.jpg") + _five("b.jpg"), splits={}, images=["a.jpg", "b.jpg"])
    token = root / "Flickr8k.token.txt"
    with pytest.raises(DataError, match="Flickr_8k.trainImages.txt is missing") as err:
        read_captions(token)
    hint = err.value.hint or ""
    assert f"itmatch extract IMAGES {token} --out DIR --default-split train" in hint
    assert "itmatch extract IMAGES dataset_flickr8k.json --out DIR" in hint and "fmt=" not in hint
    table = read_captions(token, default_split="train")
    assert table.splits == ["train"] * 10 and list(table.grouped("train")) == ["a.jpg", "b.jpg"]
    assert read_flickr8k(root, default_split="dev").splits == ["dev"] * 10


def test_flickr8k_overlapping_splits(tmp_path: Path) -> None:
    root = _flickr_dir(tmp_path, _five("a.jpg"), splits={"train": ["a.jpg"], "dev": ["a.jpg"], "test": []})
    with pytest.raises(DataError, match="both the train and dev"):
        read_flickr8k(root)


@pytest.mark.shared
def test_real_flickr8k() -> None:
    if not SHARED_FLICKR8K.is_dir():
        pytest.skip(f"real Flickr8K data not found at {SHARED_FLICKR8K} (../shared/data/flickr8k)")
    with pytest.warns(SkippedRowsWarning):
        table = read_captions(SHARED_FLICKR8K)
    groups = table.grouped()
    assert len(groups) == 8091
    assert all(len(caps) == 5 for caps in groups.values())
    sizes = {s: len(table.grouped(s)) for s in ("train", "dev", "test", "")}
    assert sizes == {"train": 6000, "dev": 1000, "test": 1000, "": 91}
    assert len(table.skipped) == 5
    assert all("2258277193_586949ec62.jpg.1" in s and "Flickr8k.token.txt:" in s for s in table.skipped)
    ids, caps = table.precomp_rows("test")
    assert len(ids) == 1000 and len(caps) == 5000
    # Flickr8K has 10 captions that repeat another of their image's 5 exactly (14 images when case is ignored):
    # an image with 5 keeps them all, so the precomp rows are the file's own, in its order
    for split in ("train", "dev", "test"):
        ids, caps = table.precomp_rows(split)
        assert caps == [c for i in ids for c in groups[i]]
    assert sum(len(c) - len(set(c)) for c in groups.values()) == 10


# ------------------------------------------------------------------------------------------ Karpathy

def _karpathy(tmp_path: Path, images: list[dict], name: str = "dataset_flickr30k.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"images": images, "dataset": "x"}), encoding="utf-8")
    return path


def _kimg(filename: str, split: str, n: int = 5, filepath: str | None = None) -> dict:
    entry = {"filename": filename, "split": split, "imgid": 0,
             "sentences": [{"raw": f" {filename} caption {k} ", "tokens": []} for k in range(n)]}
    if filepath is not None:
        entry["filepath"] = filepath
    return entry


def test_karpathy_split_mapping_and_ids(tmp_path: Path) -> None:
    path = _karpathy(tmp_path, [_kimg("a.jpg", "train"), _kimg("b.jpg", "restval", filepath="val2014/"),
                                _kimg("c.jpg", "val"), _kimg("d.jpg", "test", filepath="val2014")])
    table = read_captions(path)
    assert list(table.grouped()) == ["a.jpg", "val2014/b.jpg", "c.jpg", "val2014/d.jpg"]
    assert [table.splits[5 * i] for i in range(4)] == ["train", "train", "dev", "test"]
    assert table.captions[0] == "a.jpg caption 0"
    assert read_karpathy(path).captions == table.captions


def test_karpathy_directory_autodetect_and_missing_images(tmp_path: Path) -> None:
    _karpathy(tmp_path, [_kimg("a.jpg", "train"), _kimg("b.jpg", "test")], name="dataset_flickr8k.json")
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.jpg").write_bytes(b"")
    with pytest.warns(SkippedRowsWarning):
        table = read_captions(tmp_path, images_dir=tmp_path / "images")
    assert list(table.grouped()) == ["a.jpg"]
    assert "images[1]" in table.skipped[0] and "b.jpg" in table.skipped[0]
    assert table.missing_images == {"test": ["b.jpg"]}


def test_karpathy_invalid_json_has_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "dataset_coco.json"
    path.write_text('{"images": [\n  {"filename": "a.jpg",\n  "split": }\n]}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"line 3, column") as err:
        read_captions(path)
    assert err.value.line == 3
    assert str(err.value).startswith(f"{path}:3: invalid JSON")


@pytest.mark.parametrize(("entry", "words"), [
    (_kimg("a.jpg", "holdout"), "unknown split 'holdout'"),
    ({"split": "train", "sentences": []}, "missing 'filename'"),
    ({"filename": "a.jpg", "split": "train", "sentences": [{"tokens": ["a"]}]}, r"sentences\[0\]: no 'raw'"),
    ({"filename": "a.jpg", "split": "train", "sentences": [{"raw": "  "}]}, "empty caption"),
])
def test_karpathy_bad_entries(tmp_path: Path, entry: dict, words: str) -> None:
    path = _karpathy(tmp_path, [_kimg("z.jpg", "train"), entry])
    with pytest.raises(DataError, match=words) as err:
        read_karpathy(path)
    assert "images[1]" in str(err.value) and str(path) in str(err.value)


def test_karpathy_duplicate_image(tmp_path: Path) -> None:
    path = _karpathy(tmp_path, [_kimg("a.jpg", "train"), _kimg("a.jpg", "test")])
    with pytest.raises(DataError, match="listed twice"):
        read_karpathy(path)


# ---------------------------------------------------------------------------------------------- COCO

def _coco(tmp_path: Path, name: str = "captions_val2014.json") -> Path:
    data = {
        "info": {}, "licenses": [],
        "images": [{"id": 7, "file_name": "COCO_val2014_7.jpg"},
                   {"id": 3, "file_name": "COCO_val2014_3.jpg"}],
        "annotations": [
            {"id": 1, "image_id": 3, "caption": "three one"},
            {"id": 2, "image_id": 7, "caption": "seven one\n"},
            {"id": 3, "image_id": 99, "caption": "orphan"},
            {"id": 4, "image_id": 3, "caption": "three\ntwo\u2028too"},
        ],
    }
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_coco_groups_in_image_order_and_skips_unknown_ids(tmp_path: Path) -> None:
    path = _coco(tmp_path)
    with pytest.warns(SkippedRowsWarning):
        table = read_captions(path)
    assert table.image_ids == ["COCO_val2014_7.jpg", "COCO_val2014_3.jpg", "COCO_val2014_3.jpg"]
    # a line break inside a caption is a space (one caption a line in the precomp layout; U+2028 split it in two)
    assert table.captions == ["seven one", "three one", "three two too"]
    assert set(table.splits) == {"dev"}
    assert len(table.skipped) == 1 and "annotations[2]" in table.skipped[0] and "99" in table.skipped[0]
    assert table.missing_images == {}  # (an unknown id is not a photo missing from a split)
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "COCO_val2014_7.jpg").write_bytes(b"")
    with pytest.warns(SkippedRowsWarning):
        assert read_captions(path, images_dir=tmp_path / "imgs").missing_images == {"dev": ["COCO_val2014_3.jpg"]}


def test_coco_explicit_split_and_name_inference(tmp_path: Path) -> None:
    path = _coco(tmp_path, "captions_train2014.json")
    with pytest.warns(SkippedRowsWarning):
        assert set(read_coco(path).splits) == {"train"}
    with pytest.warns(SkippedRowsWarning):
        assert set(read_coco(path, split="testall").splits) == {"testall"}
    assert coco_split_from_name("captions_val2017.json") == "dev"
    assert coco_split_from_name("captions_test2015.json") == "test"
    assert coco_split_from_name("mine.json") == ""


def test_coco_structure_errors(tmp_path: Path) -> None:
    path = tmp_path / "captions_x.json"
    path.write_text(json.dumps({"images": [{"id": 1}], "annotations": []}), encoding="utf-8")
    with pytest.raises(DataError, match=r"images\[0\]: needs 'id' and 'file_name'"):
        read_captions(path, fmt="coco")
    path.write_text(json.dumps({"images": [], "annotations": {}}), encoding="utf-8")
    with pytest.raises(DataError, match="'annotations': expected a list"):
        read_captions(path)


# ----------------------------------------------------------------------------------------------- CSV

def test_csv_with_and_without_split(tmp_path: Path) -> None:
    path = tmp_path / "mine.csv"
    path.write_text('\ufeffimage,caption,split\n'
                    'b.jpg,"a dog, running",train\n'
                    'a.jpg,  a cat  ,test\n'
                    '\n'
                    'b.jpg,a dog again,train\n', encoding="utf-8")
    table = read_captions(path)
    assert table.image_ids == ["b.jpg", "b.jpg", "a.jpg"]
    assert table.captions == ["a dog, running", "a dog again", "a cat"]
    assert table.splits == ["train", "train", "test"]
    plain = tmp_path / "plain.txt"
    plain.write_text("image,caption\nx.jpg,hello\n", encoding="utf-8")
    table = read_captions(plain)  # detected from the header
    assert table.splits == [""] and table.captions == ["hello"]


def test_csv_wrong_header_shows_expected(tmp_path: Path) -> None:
    path = tmp_path / "mine.csv"
    path.write_text("file,text\na.jpg,hi\n", encoding="utf-8")
    with pytest.raises(DataError, match="unexpected header") as err:
        read_csv(path)
    assert err.value.line == 1
    assert "image,caption" in (err.value.hint or "")
    assert str(err.value).startswith(f"{path}:1: ")


def test_csv_wrong_column_count_names_line(tmp_path: Path) -> None:
    path = tmp_path / "mine.csv"
    path.write_text('image,caption\na.jpg,"a dog, quoted"\nb.jpg,fine\nc.jpg,a dog, running\n', encoding="utf-8")
    with pytest.raises(DataError, match="expected 2 columns") as err:
        read_csv(path)
    assert err.value.line == 4
    assert str(err.value).startswith(f"{path}:4: ")
    assert "quote captions that contain commas" in (err.value.hint or "")


@pytest.mark.parametrize("rest", [
    'a.jpg,"a dog, running\nb.jpg,"A cat",train\nb.jpg,c2,train\n',  # the next quote closes it: 3 columns
    'a.jpg,"a dog, running\nb.jpg,"A cat, sitting",train\n',  # ... 4 columns ("found 4": the wrong fix)
    'a.jpg,"a dog, running,train\nb.jpg,A cat,train\n',  # open to the end of the file: 2 columns
    'a.jpg,"a dog\nrunning\n',  # open to the end of the file, no row swallowed
])
def test_csv_unterminated_quote_is_named_at_its_line(tmp_path: Path, rest: str) -> None:
    """A quote left open made the csv module read the next rows into one field: the error was a column
    count (with 'quote captions that contain commas' as its fix) or an image short of captions."""
    path = tmp_path / "mine.csv"
    path.write_text("image,caption,split\n" + "a.jpg,fine,train\n" * 3 + rest, encoding="utf-8")
    with pytest.raises(DataError, match="unterminated quote") as err:
        read_csv(path)
    assert err.value.line == 5 and str(err.value).startswith(f"{path}:5: ")
    assert "close the quote" in (err.value.hint or "") and "contain commas" not in (err.value.hint or "")


@pytest.mark.parametrize(("row", "words"), [("a.jpg,hi,validation", "unknown split"),
                                            ("a.jpg,  ,train", "empty caption"),
                                            (",hi,train", "empty image")])
def test_csv_bad_values(tmp_path: Path, row: str, words: str) -> None:
    path = tmp_path / "mine.csv"
    path.write_text(f"image,caption,split\nok.jpg,fine,train\n{row}\n", encoding="utf-8")
    with pytest.raises(DataError, match=words) as err:
        read_csv(path)
    assert err.value.line == 3


def test_csv_missing_images_skipped(tmp_path: Path) -> None:
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.jpg").write_bytes(b"")
    path = tmp_path / "mine.csv"
    path.write_text("image,caption\na.jpg,one\nb.jpg,two\n", encoding="utf-8")
    with pytest.warns(SkippedRowsWarning):
        table = read_csv(path, images_dir=tmp_path / "imgs")
    assert table.captions == ["one"]
    assert table.skipped[0].startswith(f"{path}:3: ")
    assert table.missing_images == {}  # (no split column, no default: no split shrinks)
    with pytest.warns(SkippedRowsWarning):
        assert read_csv(path, images_dir=tmp_path / "imgs", default_split="dev").missing_images == {"dev": ["b.jpg"]}



def test_every_row_skipped_is_an_error_saying_so(tmp_path: Path, capsys) -> None:
    """It used to end in "the caption table assigns no image to a split", which sent users to the split column."""
    from itmatch.cli import main

    (tmp_path / "imgs").mkdir()
    path = tmp_path / "mine.csv"
    path.write_text("image,caption,split\n" + "".join(f"p{i}.jpg,a dog,train\n" for i in range(5)), encoding="utf-8")
    with pytest.raises(DataError, match=r"all 5 caption row\(s\) were skipped") as err:
        read_csv(path, images_dir=tmp_path / "imgs")
    assert f"{path}:2: skipped caption of 'p0.jpg': image not found in {tmp_path / 'imgs'}" in str(err.value)
    assert "p2.jpg" in str(err.value) and "p3.jpg" not in str(err.value)  # the first three reasons
    assert main(["extract", str(tmp_path / "imgs"), str(path), "--out", str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err
    assert "all 5 caption row(s) were skipped" in message and "assigns no image to a split" not in message


# ---------------------------------------------------------------------------------------- encodings

def _latin1_sources(tmp_path: Path) -> dict[str, tuple[Path, int]]:
    """One caption file per format, with a Latin-1 'é' on a known line, after more than a read buffer of
    UTF-8 text (the offset of a streaming decoder's error counts from its chunk)."""
    filler = [f"p{i}.jpg,a caption long enough to fill the decoder's buffer number {i},train" for i in range(200)]
    csv_path = tmp_path / "mine.csv"
    text = "image,caption,split\n" + "\n".join(filler) + "\n"
    csv_path.write_bytes(text.encode() + "q.jpg,un café,train\n".encode("latin-1"))
    token_root = _flickr_dir(tmp_path, _five("a.jpg") + ["b.jpg#0\tun café ."])
    token = token_root / "Flickr8k.token.txt"
    token.write_bytes(token.read_bytes().replace("café".encode(), "café".encode("latin-1")))
    json_path = tmp_path / "dataset_mine.json"
    entries = [_kimg(f"p{i}.jpg", "train") for i in range(40)] + [_kimg("q.jpg", "train")]
    entries[-1]["sentences"][0]["raw"] = "un café"
    text = json.dumps({"images": entries}, indent=1, ensure_ascii=False)
    json_path.write_bytes(text.encode("latin-1"))
    json_line = text[:text.index("café")].count("\n") + 1
    return {"csv": (csv_path, 202), "flickr8k": (token, 6), "karpathy": (json_path, json_line)}


@pytest.mark.parametrize("fmt", ["csv", "flickr8k", "karpathy"])
def test_latin1_captions_name_the_line_and_the_conversion(tmp_path: Path, fmt: str) -> None:
    """It said 'not UTF-8 text (invalid continuation byte at byte 307)': no line, no fix."""
    path, line = _latin1_sources(tmp_path)[fmt]
    with pytest.raises(DataError, match="not UTF-8 text") as err:
        read_captions(path, default_split="train")
    assert err.value.line == line and str(err.value).startswith(f"{path}:{line}: ")
    hint = err.value.hint or ""
    assert f"iconv -f latin1 -t utf-8 {path} > " in hint
    converted = Path(hint.rsplit("then pass ", 1)[1])
    assert converted.parent == path.parent and "-utf8" in converted.name
    assert converted.name.endswith({"csv": ".csv", "flickr8k": ".token.txt", "karpathy": ".json"}[fmt])


# ----------------------------------------------------------------------------------- missing photos

@pytest.mark.parametrize(("name", "closest"), [
    ("p/a.jpg", "'a.jpg' (the folder part differs)"),
    ("A.JPG", "'a.jpg' (only the case differs)"),
    ("a", "'a.jpg' (it has an extension)"),
    ("a.png", "'a.jpg' (the extension differs)"),
    ("sub/b.jpg", "'b.jpg'"),
])
def test_every_name_wrong_says_what_names_are_relative_to_and_the_closest_file(
        tmp_path: Path, name: str, closest: str) -> None:
    """The fix only said to check the folder: the names were right but for a prefix, the case or the extension."""
    (tmp_path / "imgs").mkdir()
    for real in ("a.jpg", "b.jpg", "zzz.jpg"):
        (tmp_path / "imgs" / real).write_bytes(b"")
    path = tmp_path / "mine.csv"
    path.write_text("image,caption,split\n" + f"{name},a dog,train\n" * 5, encoding="utf-8")
    with pytest.raises(DataError, match="all 5 caption row") as err:
        read_csv(path, images_dir=tmp_path / "imgs")
    hint = err.value.hint or ""
    assert f"relative to the images folder {tmp_path / 'imgs'}" in hint
    assert f"{name!r} is not there; the closest file is {closest}" in hint


def test_closest_name_is_looked_for_in_subfolders(tmp_path: Path) -> None:
    from itmatch.data.caption_hints import closest_image_name

    (tmp_path / "imgs" / "2014").mkdir(parents=True)
    (tmp_path / "imgs" / "2014" / "a.jpg").write_bytes(b"")
    found = closest_image_name(tmp_path / "imgs", "a.jpg")
    assert found == "the closest file is '2014/a.jpg' (the folder part differs)"
    assert closest_image_name(tmp_path / "imgs", "nothing-like-it.gif") is None


def test_skipped_rows_warning_points_at_the_caller(tmp_path: Path) -> None:
    """The warning named a line inside the readers (`return read_csv_here(...)`), not the caller's."""
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.jpg").write_bytes(b"")
    path = tmp_path / "mine.csv"
    path.write_text("image,caption\na.jpg,one\nb.jpg,two\n", encoding="utf-8")
    for read in (read_captions, read_csv):
        with pytest.warns(SkippedRowsWarning) as caught:
            read(path, images_dir=tmp_path / "imgs")
        assert caught[0].filename == __file__


# ---------------------------------------------------------------------------------------- dispatching

def test_read_captions_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        read_captions(tmp_path / "nope.txt")
    with pytest.raises(DataError, match="unknown caption format"):
        read_captions(tmp_path, fmt="flickr30k")
    with pytest.raises(DataError, match="no caption file"):
        read_captions(tmp_path)
    odd = tmp_path / "notes.txt"
    odd.write_text("hello world\n", encoding="utf-8")
    with pytest.raises(DataError, match="cannot tell"):
        read_captions(odd)
    other = tmp_path / "other.json"
    other.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(DataError, match="neither Karpathy"):
        read_captions(other)
    with pytest.raises(DataError, match="top level: expected an object"):
        read_captions(other, fmt="karpathy")
    good = _karpathy(tmp_path, [_kimg("a.jpg", "train")])
    with pytest.raises(DataError, match="image directory not found"):
        read_captions(good, images_dir=tmp_path / "missing")


def test_forced_format_overrides_detection(tmp_path: Path) -> None:
    path = tmp_path / "captions.data"
    path.write_text("a.jpg#0\tone .\n", encoding="utf-8")
    for split, ids in (("train", "a.jpg\n"), ("dev", ""), ("test", "")):
        (tmp_path / f"Flickr_8k.{split}Images.txt").write_text(ids, encoding="utf-8")
    table = read_captions(path, fmt="flickr8k")
    assert table.captions == ["one ."] and table.splits == ["train"]


# ------------------------------------------------------------------------------------- split hygiene

def test_csv_image_in_two_splits_names_the_image_and_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "mine.csv"
    path.write_text("image,caption,split\na.jpg,one,train\nb.jpg,two,test\na.jpg,three,test\n", encoding="utf-8")
    with pytest.raises(DataError, match="'a.jpg' is in both the train split") as err:
        read_csv(path)
    assert err.value.line == 4 and "line 2" in str(err.value) and "leaks" in (err.value.hint or "")


def test_table_built_in_code_with_an_image_in_two_splits_is_refused() -> None:
    table = CaptionTable(source="made-in-code")
    table.add("a.jpg", "one", "train")
    table.add("b.jpg", "two", "test")
    table.check_disjoint_splits()
    table.add("b.jpg", "three", "train")
    with pytest.raises(DataError, match=r"'b.jpg' is in both the test split \(row 1\) and the train split \(row 2\)"):
        table.check_disjoint_splits()


def test_csv_without_split_column_gets_the_default_split(tmp_path: Path) -> None:
    path = tmp_path / "mine.csv"
    path.write_text("image,caption\na.jpg,one\nb.jpg,two\n", encoding="utf-8")
    assert read_captions(path, default_split="train").splits == ["train", "train"]
    assert read_csv(path, default_split="dev").splits == ["dev", "dev"]
    # an empty cell takes the default too; a named split stays
    mixed = tmp_path / "mixed.csv"
    mixed.write_text("image,caption,split\na.jpg,one,\na.jpg,two,train\nb.jpg,three,test\n", encoding="utf-8")
    assert read_captions(mixed, default_split="train").splits == ["train", "train", "test"]
    with pytest.raises(DataError, match="in both the \\(none\\) split"):
        read_captions(mixed)
    with pytest.raises(DataError, match="unknown default split 'validation'"):
        read_captions(path, default_split="validation")


def test_images_short_of_captions_are_counted_and_located(tmp_path: Path) -> None:
    """Only the first short image was named, without its line, and the fix did not say the rule."""
    path = tmp_path / "mine.csv"
    rows = [f"{name}.jpg,caption {c} of {name},train" for name in "abcdef" for c in range(1 if name in "bcdf" else 5)]
    path.write_text("image,caption,split\n" + "\n".join(rows) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"4 of 6 images of split 'train' have fewer than 5 captions") as err:
        read_csv(path).precomp_rows("train")
    text = str(err.value)
    assert f"'b.jpg' has 1 ({path}:7)" in text and f"'c.jpg' has 1 ({path}:8)" in text
    assert f"'d.jpg' has 1 ({path}:9)" in text and "and 1 more" in text and "f.jpg" not in text
    assert "give every image 5 captions" in (err.value.hint or "") and "no option for fewer" in err.value.hint


def test_repeated_captions_are_dropped_before_the_cut_to_five() -> None:
    """7 rows with one caption three times kept the repeat three times and left 2 distinct captions out."""
    table = CaptionTable()
    for caption in ("a dog", "a dog", "A  dog ", "one", "two", "three", "four", "five"):
        table.add("seven.jpg", caption, "train")
    for caption in ("x", "x", "y", "z", "w"):  # 5 with a repeat (Flickr8K has 10 such): all kept
        table.add("five.jpg", caption, "train")
    for caption in ("p", "p", "p", "q", "q", "r"):  # 3 distinct of 6: repeats fill the slots, in file order
        table.add("six.jpg", caption, "train")
    ids, caps = table.precomp_rows("train")
    assert ids == ["seven.jpg", "five.jpg", "six.jpg"]
    assert caps[:5] == ["a dog", "one", "two", "three", "four"]
    assert caps[5:10] == ["x", "x", "y", "z", "w"] and caps[10:] == ["p", "p", "p", "q", "r"]
    chosen = table.select("train")
    assert [table.captions[r] for r in chosen["seven.jpg"].duplicates] == ["a dog", "A  dog "]
    assert [table.captions[r] for r in chosen["seven.jpg"].extra] == ["five"]
    assert chosen["five.jpg"].duplicates == [] and len(chosen["six.jpg"].duplicates) == 1
    assert [image for image, rows in chosen.items() if rows.extra] == ["seven.jpg"]


def test_extra_captions_are_counted_per_image() -> None:
    table = CaptionTable()
    for c in range(7):
        table.add("seven.jpg", f"c{c}", "train")
    for c in range(5):
        table.add("five.jpg", f"c{c}", "train")
    assert {image: len(rows.extra) for image, rows in table.select("train").items()} == {"seven.jpg": 2, "five.jpg": 0}
    ids, caps = table.precomp_rows("train")
    assert ids == ["seven.jpg", "five.jpg"] and caps[:5] == [f"c{c}" for c in range(5)]


def test_evaluation_splits_keep_their_first_five_in_file_order() -> None:
    """Repeats were dropped before the cut in every split: a COCO test image with 6-7 captions was scored on
    other captions than SCAN's first 5, so results stopped being comparable with the papers'."""
    captions = ("a dog", "A  dog", "one", "two", "three", "four", "three")
    table = CaptionTable()
    for split in ("train", "dev", "test", "testall"):
        for caption in captions:
            table.add(f"{split}.jpg", caption, split)
    assert table.precomp_rows("train")[1] == ["a dog", "one", "two", "three", "four"]
    for split in ("dev", "test", "testall"):
        assert table.precomp_rows(split)[1] == list(captions[:5])
        rows = table.select(split)[f"{split}.jpg"]
        assert [table.captions[r] for r in rows.extra] == ["four"]
        assert [table.captions[r] for r in rows.duplicates] == ["three"]


@pytest.mark.parametrize("caption", ['"a dog\r\nrunning on grass"', '"a dog\nrunning on grass"',
                                     "a dog\u2028running on grass", "a dog\x85running on grass",
                                     "a dog\x0crunning on grass"])
def test_csv_caption_with_a_line_break_is_one_caption(tmp_path: Path, caption: str) -> None:
    """A closed multi-line cell (spreadsheets write them) was called an unterminated quote; a U+2028, \\x85 or
    \\x0c passed the reader and failed later, in write_captions, without a file or line."""
    path = tmp_path / "mine.csv"
    path.write_text("image,caption,split\n" + f"a.jpg,{caption},train\n" + "a.jpg,fine,train\n" * 4,
                    encoding="utf-8", newline="")
    table = read_csv(path)
    assert table.captions[0] == "a dog running on grass" and len(table) == 5
    assert table.location(1).endswith(":3" if "\n" not in caption else ":4")


def test_flickr8k_default_split_without_split_lists_or_images(tmp_path: Path) -> None:
    """Every row was skipped ('all 5 caption row(s) were skipped'): the default split came after the check."""
    root = _flickr_dir(tmp_path, _five("a.jpg"), splits={})
    table = read_flickr8k(root / "Flickr8k.token.txt", default_split="train")
    assert table.splits == ["train"] * 5 and not table.skipped


def test_closest_name_is_an_exact_variant_only(tmp_path: Path) -> None:
    """A fuzzy match suggested another photo (one digit less), and took seconds on a large folder."""
    from itmatch.data.caption_hints import closest_image_name

    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "COCO_val2014_000000013456.jpg").write_bytes(b"")
    assert closest_image_name(tmp_path / "imgs", "COCO_val2014_000000123456.png") is None
    assert closest_image_name(tmp_path / "imgs", "COCO_val2014_000000013456.png") == (
        "the closest file is 'COCO_val2014_000000013456.jpg' (the extension differs)")


@pytest.mark.parametrize("brk", ["\u2028", "\x0c", "\x85", "\x1c", "\x1d", "\x1e", "\r"])
def test_token_file_line_numbers_count_newlines_only(tmp_path: Path, brk: str) -> None:
    """str.splitlines() also broke at U+2028, \\x0c, \\x85 and \\x1c-\\x1e: the lines after one were numbered
    wrong (and the caption split in two), unlike not_utf8's, which count newlines."""
    lines = _five("a.jpg")
    lines[1] = f"a.jpg#1\ta dog{brk}running ."
    root = _flickr_dir(tmp_path, lines + ["b.jpg#0 no tab"])
    with pytest.raises(DataError, match="no tab") as err:
        read_flickr8k(root)
    assert err.value.line == 6
    root.joinpath("Flickr8k.token.txt").write_text("\n".join(lines) + "\n", encoding="utf-8", newline="")
    table = read_flickr8k(root)
    assert table.captions[1] == "a dog running ." and table.location(4) == f"{root / 'Flickr8k.token.txt'}:5"


def test_token_file_with_carriage_return_line_endings_is_refused(tmp_path: Path) -> None:
    """Split on newlines only, a file ending its lines with a lone CR would be one row holding every caption."""
    root = _flickr_dir(tmp_path, [])
    root.joinpath("Flickr8k.token.txt").write_bytes("\r".join(_five("a.jpg")).encode() + b"\r")
    with pytest.raises(DataError, match="line break inside the caption") as err:
        read_flickr8k(root)
    assert err.value.line == 1 and "line endings" in (err.value.hint or "")


def test_rows_store_their_line_or_entry_not_the_source_path(tmp_path: Path) -> None:
    """Each row held '<source path>:<line>': +70 MB on Karpathy COCO's 616k rows."""
    path = tmp_path / "mine.csv"
    path.write_text("image,caption,split\n" + "a.jpg,fine,train\n" * 5, encoding="utf-8")
    table = read_csv(path)
    assert table.locations == [2, 3, 4, 5, 6] and table.location(0) == f"{path}:2"
    kp = tmp_path / "dataset_x.json"
    kp.write_text(json.dumps({"images": [{"filename": "a.jpg", "split": "test",
                                          "sentences": [{"raw": f"c{k}"} for k in range(5)]}]}))
    table = read_karpathy(kp)
    assert table.locations[1] == "images[0].sentences[1]"
    assert table.location(1) == f"{kp} (images[0].sentences[1])"


def test_table_built_from_lists_then_added_to_keeps_locations_aligned() -> None:
    """locations stayed shorter than captions, so location(row) returned another row's place."""
    table = CaptionTable(image_ids=["a.jpg", "a.jpg"], captions=["c1", "c2"], splits=["train"] * 2,
                         source="mine.csv")
    table.add("b.jpg", "c3", "train", location=7)
    assert table.location(0) == "mine.csv" and table.location(2) == "mine.csv:7"
    assert len(table.locations) == len(table.captions)
