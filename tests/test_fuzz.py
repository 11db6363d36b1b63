"""Property-based tests (hypothesis): the caption, vocabulary and precomp readers and the CLI's argument
and config parsing, fed arbitrary bytes and structures, return a correct result or raise a clean
ItmatchError (file, line or key path, message) -- never another exception.

Example counts are modest so the suite stays fast; ITMATCH_FUZZ_EXAMPLES raises them for a longer
campaign (docs/reliability.md reports one)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import string
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from itmatch.cli import main
from itmatch.config import Config, load_yaml, parse_overrides
from itmatch.data.captions import CaptionTable, SkippedRowsWarning, read_captions
from itmatch.data.precomp import read_precomp
from itmatch.data.vocab import SPECIALS, Vocab
from itmatch.errors import ConfigError, DataError, ItmatchError
from itmatch.models.registry import resolve_config

N = int(os.environ.get("ITMATCH_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=N, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=25)


def _in_tmp(write, read):
    """Write a fuzzed input into a fresh directory and read it back."""
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedRowsWarning)
        root = Path(d)
        path = write(root)
        return read(root, path)


def _file(name: str, data: bytes):
    """A writer for _in_tmp: put `data` in `name`."""
    def write(root: Path) -> Path:
        (root / name).write_bytes(data)
        return root / name
    return write


def _check_table(table: CaptionTable) -> None:
    assert len(table.image_ids) == len(table.captions) == len(table.splits)
    assert all(isinstance(c, str) and c and c == c.strip() for c in table.captions)
    assert all(isinstance(i, str) and i for i in table.image_ids)


# ------------------------------------------------------------------------------------------- captions
CAPTION_NAMES = ["captions.csv", "dataset_x.json", "Flickr8k.token.txt", "captions.txt", "captions_val2014.json"]


@FUZZ
@given(data=st.binary(max_size=400), name=st.sampled_from(CAPTION_NAMES),
       fmt=st.sampled_from(["auto", "flickr8k", "karpathy", "coco", "csv"]))
def test_caption_reader_on_arbitrary_bytes(data, name, fmt):
    def write(root):
        for split_file in ("Flickr_8k.trainImages.txt", "Flickr_8k.devImages.txt", "Flickr_8k.testImages.txt"):
            (root / split_file).write_text("a.jpg\n" if "train" in split_file else "")
        (root / name).write_bytes(data)
        return root / name

    def read(root, path):
        with contextlib.suppress(DataError):
            _check_table(read_captions(path, fmt=fmt))

    _in_tmp(write, read)


@FUZZ
@given(doc=st.fixed_dictionaries({"images": st.lists(st.fixed_dictionaries(
    {}, optional={"filename": json_values | st.text(max_size=6), "filepath": json_values,
                  "split": st.sampled_from(["train", "val", "test", "restval", "x"]) | json_values,
                  "sentences": st.lists(st.fixed_dictionaries({}, optional={"raw": json_values | st.text()}),
                                        max_size=3) | json_values,
                  "id": json_values, "file_name": json_values | st.text(max_size=6)}), max_size=4)},
    optional={"annotations": st.lists(st.fixed_dictionaries(
        {}, optional={"image_id": json_values, "caption": json_values | st.text()}), max_size=4) | json_values}))
def test_json_caption_readers_on_arbitrary_structures(doc):
    def write(root):
        (root / "dataset_x.json").write_text(json.dumps(doc))
        return root / "dataset_x.json"

    def read(root, path):
        for fmt in ("auto", "karpathy", "coco"):
            with contextlib.suppress(DataError):
                _check_table(read_captions(path, fmt=fmt, images_dir=root))

    _in_tmp(write, read)


safe_text = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp"), blacklist_characters="\ufeff"),
                    min_size=1, max_size=20).filter(lambda s: s.strip() and s == s.strip())


@FUZZ
@given(rows=st.lists(st.tuples(safe_text, safe_text, st.sampled_from(["train", "dev", "test", ""])),
                     min_size=1, max_size=8))
def test_csv_reader_returns_exactly_the_rows_written(rows):
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["image", "caption", "split"])
    writer.writerows(rows)

    def write(root):
        (root / "c.csv").write_text(buf.getvalue(), encoding="utf-8")
        return root / "c.csv"

    grouped: dict[str, list[tuple[str, str]]] = {}
    for image, caption, split in rows:
        grouped.setdefault(image, []).append((caption, split))
    leaking = [i for i, group in grouped.items() if len({s for _, s in group}) > 1]
    if leaking:  # an image in two splits is refused, naming the first such row's image
        with pytest.raises(DataError, match="is in both the"):
            _in_tmp(write, lambda root, path: read_captions(path))
        return
    table = _in_tmp(write, lambda root, path: read_captions(path))
    expected = [(i, c, s) for i, group in grouped.items() for c, s in group]  # grouped per image
    assert list(zip(table.image_ids, table.captions, table.splits, strict=True)) == expected


# ---------------------------------------------------------------------------------------------- vocab
@FUZZ
@given(data=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_vocab_reader_on_arbitrary_input(data):
    def read(root, path):
        try:
            vocab = Vocab.load(path)
        except DataError:
            return
        assert vocab.idx2word[:4] == list(SPECIALS)
        assert all(vocab.word2idx[w] == i for i, w in enumerate(vocab.idx2word))

    _in_tmp(_file("v.json", data), read)


@FUZZ
@given(words=st.lists(st.text(min_size=1, max_size=10), max_size=30, unique=True), shuffle=st.randoms())
def test_vocab_json_round_trip(words, shuffle):
    words = [w for w in words if w not in SPECIALS]
    doc = Vocab(words).to_json()
    items = list(doc["idx2word"].items())
    shuffle.shuffle(items)  # key order in the file does not matter
    vocab = Vocab.from_json({"idx2word": dict(items)})
    assert vocab.idx2word == [*SPECIALS, *words]
    assert all(0 <= i < len(vocab) for i in vocab.encode(" ".join(words)))


# -------------------------------------------------------------------------------------------- precomp
arrays = st.builds(
    lambda dtype, shape, fill, bad: _array(dtype, shape, fill, bad),
    st.sampled_from(["<f4", ">f4", "<f8", "<f2", "<i4", "|u1"]),
    st.lists(st.integers(0, 4), min_size=0, max_size=4),
    st.floats(-5, 5), st.sampled_from([None, np.nan, np.inf, -np.inf]))


def _array(dtype, shape, fill, bad):
    arr = np.full(shape, fill).astype(dtype)
    if bad is not None and arr.size and arr.dtype.kind == "f":
        arr.reshape(-1)[arr.size // 2] = bad
    return arr


@FUZZ
@given(features=arrays | st.binary(max_size=200), caps=st.lists(st.text(max_size=8), max_size=25),
       ids=st.none() | st.lists(st.text(st.characters(blacklist_categories=("Cs", "Zl", "Zp", "Cc")), max_size=5),
                                max_size=6),
       caps_bytes=st.none() | st.binary(max_size=60))
def test_precomp_reader_on_arbitrary_files(features, caps, ids, caps_bytes):
    def write(root):
        path = root / "train_ims.npy"
        if isinstance(features, bytes):
            path.write_bytes(features)
        else:
            np.save(path, features)
        cap_file = root / "train_caps.txt"
        if caps_bytes is not None:
            cap_file.write_bytes(caps_bytes)
        else:
            cap_file.write_text("\n".join(c.replace("\n", " ") for c in caps) + "\n", encoding="utf-8")
        if ids is not None:
            (root / "train_ids.txt").write_text("\n".join(ids) + "\n", encoding="utf-8")
        return root

    def read(root, _):
        try:
            split = read_precomp(root, "train")
        except DataError:
            return
        images = np.asarray(split.images)
        assert images.dtype == np.float32 and images.ndim == 3 and 0 not in images.shape
        assert np.isfinite(images).all()
        assert len(split.captions) == 5 * images.shape[0] == 5 * len(split.ids)
        assert all(c.strip() for c in split.captions)

    _in_tmp(write, read)


# ------------------------------------------------------------------------------------- config and CLI
KEYS = ["model.embed_size", "model.pool", "model.arch", "train.lr", "train.epochs", "loss.margin", "train.seed",
        "model", "train", "name", "data.path", "train.batch_size", "model.scan.raw_feature_norm", "loss.hardest",
        "nope", "model.nope", "train.lr.x", ""]
values = st.sampled_from(["1", "-1", "0", "2e-4", ".nan", "[1, 2]", "{a: 1}", "true", "avg", "mean", "",
                          "!!python/object:os.system", "'x", "1e999", "2**40"]) | st.text(max_size=10)


@FUZZ
@given(pairs=st.lists(st.tuples(st.sampled_from(KEYS) | st.text(max_size=8), values).map(lambda kv: f"{kv[0]}={kv[1]}")
                      | st.text(max_size=12), max_size=4),
       preset=st.sampled_from([None, "scan_t2i_avg", "vsepp", "nope"]))
def test_config_overrides(pairs, preset):
    try:
        cfg = resolve_config(preset, parse_overrides(pairs))
    except ConfigError as exc:
        assert exc.message
        return
    assert isinstance(cfg, Config)
    assert cfg.train.lr > 0 and cfg.train.epochs >= 1 and cfg.loss.margin >= 0


@FUZZ
@given(doc=st.binary(max_size=200) | json_values.map(lambda v: yaml.safe_dump(v).encode()))
def test_config_file(doc):
    def read(root, path):
        with contextlib.suppress(ConfigError):
            resolve_config(None, load_yaml(path))

    _in_tmp(_file("c.yaml", doc), read)


def _argv_tokens(root: Path) -> st.SearchStrategy:
    garbage = root / "garbage.bin"
    garbage.write_bytes(b"\x80\x02}q\x00.")
    paths = [str(garbage), str(root), str(root / "missing"), str(root / "out")]
    return st.lists(st.sampled_from(["--preset", "--data", "--set", "--resume", "--force", "--split", "--protocol",
                                     "--vocab", "--json", "--help", "-h", "vsepp", "full", "1k", "train.lr=-1",
                                     "model.pool=x", "train.epochs=1"] + paths)
                    | st.text(string.printable, max_size=8), max_size=6)


@pytest.mark.parametrize("verb", ["train", "evaluate", "convert", "models", "nope"])
def test_cli_arguments(verb, tmp_path, capsys):
    out = ["--out", str(tmp_path / "out")] if verb in ("train", "convert") else []

    @FUZZ
    @given(argv=_argv_tokens(tmp_path))
    def run(argv):
        try:
            code = main([verb, *argv, *out])
        except SystemExit as exc:  # argparse: usage error (2) or --help (0), with its own message
            assert exc.code in (0, 2)
            return
        assert code in (0, 2)

    run()
    capsys.readouterr()


def test_errors_are_itmatch_errors():
    """The contract the properties above rely on."""
    assert issubclass(DataError, ItmatchError) and issubclass(ConfigError, ItmatchError)
