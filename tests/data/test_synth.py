"""Synthetic captioned scenes: deterministic, captions true of their images, safe to re-run, readable."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from itmatch.config import MIN_WORD_COUNT
from itmatch.data import synth
from itmatch.data.captions import read_captions
from itmatch.data.synth import (
    COLOURS,
    SHAPES,
    SYNTH_JSON,
    Scene,
    make_scenes,
    render_synthetic,
)
from itmatch.data.vocab import tokenize
from itmatch.errors import ConfigError, OverwriteError

NUM = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4}
COL = "|".join(COLOURS)
SHP = "|".join(SHAPES)
THING = rf"(?:a|an) (?:(small|large) )?({COL}) ({SHP})"
CELLS = {v: k for k, v in synth.CELL_PHRASES.items()}
CELL = "|".join(CELLS)


def _render(out: Path, **kw) -> Path:
    args = {"n_train": 4, "n_dev": 2, "n_test": 2, "image_size": 64, "progress": False} | kw
    return render_synthetic(out, **args)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _match(objs, size: str | None, colour: str, shape: str) -> list:
    return [o for o in objs if o.colour == colour and o.shape == shape and (size is None or o.size == size)]


def check_caption(scene: Scene, caption: str) -> Counter:
    """Assert every checkable claim of `caption` about `scene`; return which kinds of claim were seen."""
    objs, seen, text = scene.objects, Counter(), caption.lower()
    for m in re.finditer(rf"\b(two|three|four) (?:(small|large) )?({COL}) ({SHP})s\b", text):
        group = _match(objs, None, m[3], m[4])
        assert len(group) == NUM[m[1]], (caption, scene)
        assert m[2] is None or all(o.size == m[2] for o in group), (caption, scene)
        seen["count"] += 1
    for m in re.finditer(rf"\b(two|three|four) ({SHP})s\b", text):  # "two circles": colour not said
        assert sum(o.shape == m[2] for o in objs) == NUM[m[1]], (caption, scene)
        seen["shape_count"] += 1
    for m in re.finditer(rf"\b{THING}\b", text):
        assert _match(objs, m[1], m[2], m[3]), (caption, scene)
        seen["thing"] += 1
    if m := re.search(r"\b(one|two|three|four) (?:shapes?|objects?)(?::| in total| on a)", text):
        assert NUM[m[1]] == len(objs), (caption, scene)
        seen["total"] += 1
    if re.match(r"(a single|only one) ", text):
        assert len(objs) == 1, (caption, scene)
    # "two red shapes and a blue shape" lists every colour group: counts add up and match per colour
    counted = rf"(?:a|an|one|two|three|four) (?:{COL}) (?:shape|object)s?"
    if m := re.fullmatch(rf"(?:there (?:is|are) )?((?:{counted}(?:, | and )?)+)\.", text):
        parts = re.findall(rf"(a|an|one|two|three|four) ({COL}) ", m[1])
        assert {c: NUM[n] for n, c in parts} == Counter(o.colour for o in objs), (caption, scene)
        seen["colour_counts"] += 1
    for m in re.finditer(r"\b(a|an|one|two|three|four) (small|large) (?:shape|object)s?\b", text):
        assert sum(o.size == m[2] for o in objs) == NUM[m[1]], (caption, scene)
        seen["size_counts"] += 1
    for m in re.finditer(rf"{THING} (?:is )?(to the left of|to the right of|above|below) {THING}", text):
        firsts, seconds = _match(objs, m[1], m[2], m[3]), _match(objs, m[5], m[6], m[7])
        test = {"to the left of": lambda a, b: a.col < b.col, "to the right of": lambda a, b: a.col > b.col,
                "above": lambda a, b: a.row < b.row, "below": lambda a, b: a.row > b.row}[m[4]]
        assert any(test(a, b) for a in firsts for b in seconds), (caption, scene)
        seen["relation"] += 1
    for m in re.finditer(rf"{THING} ({CELL})|({CELL}) there is {THING}", text):
        size, colour, shape, cell = (m[1], m[2], m[3], m[4]) if m[4] else (m[6], m[7], m[8], m[5])
        assert any((o.row, o.col) == CELLS[cell] for o in _match(objs, size, colour, shape)), (caption, scene)
        seen["position"] += 1
    if m := re.search(r"on a (dark|light) background", text):
        assert m[1] == scene.background, (caption, scene)
        seen["background"] += 1
    return seen


def test_captions_are_true_of_their_scene() -> None:
    seen: Counter = Counter()
    for scene, captions in make_scenes("train", 400, seed=3):
        assert len(captions) == 5 and len(set(captions)) == 5, captions
        assert 1 <= len(scene.objects) <= 4
        assert len({(o.row, o.col) for o in scene.objects}) == len(scene.objects)
        for caption in captions:
            assert caption[0].isupper() and caption.endswith(".")
            seen += check_caption(scene, caption)
    # the checks above must have had real work to do
    kinds = ("count", "shape_count", "thing", "total", "colour_counts", "size_counts", "relation", "position",
             "background")
    for kind in kinds:
        assert seen[kind] >= 50, (kind, seen)


def test_vocabulary_clears_min_count_on_1500_training_images() -> None:
    counts: Counter = Counter()
    for _, captions in make_scenes("train", 1500, seed=0):
        for caption in captions:
            counts.update(tokenize(caption))
    rare = {w: c for w, c in counts.items() if c < MIN_WORD_COUNT}
    assert not rare
    assert len(counts) < 100


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path) -> None:
    a, b, c = _render(tmp_path / "a"), _render(tmp_path / "b"), _render(tmp_path / "c", seed=1)
    assert a.name == SYNTH_JSON
    files_a = _files(tmp_path / "a")
    assert len(files_a) == 9  # 8 images + the JSON
    assert files_a == _files(tmp_path / "b")
    assert files_a != _files(tmp_path / "c")
    # image i of a split does not depend on the size of the other splits
    _render(tmp_path / "d", n_dev=5)
    assert _files(tmp_path / "d")["images/train_00003.png"] == files_a["images/train_00003.png"]
    assert b.exists() and c.exists()


def test_pixels_match_the_scene(tmp_path: Path) -> None:
    json_path = _render(tmp_path / "out", n_train=12, n_dev=0, n_test=0, image_size=96)
    entries = json.loads(json_path.read_text())["images"]
    for entry in entries:
        image = np.asarray(Image.open(tmp_path / "out" / "images" / entry["filename"]).convert("RGB"))
        assert image.shape == (96, 96, 3)
        for o in entry["objects"]:
            x, y = int(o["cx"] * 96), int(o["cy"] * 96)
            assert np.abs(image[y, x].astype(int) - np.array(o["rgb"])).max() <= 2, (entry["filename"], o)
            assert o["row"] == int(o["cy"] * 3) and o["col"] == int(o["cx"] * 3)  # the shape is in its cell


def test_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _render(out, n_train=5)
    with pytest.raises(OverwriteError, match="already exists"):
        _render(out)
    (out / "notes.txt").write_text("mine")
    _render(out, n_train=3, force=True)
    names = sorted(p.name for p in (out / "images").iterdir())
    assert names == ["test_00000.png", "test_00001.png", "train_00000.png", "train_00001.png",
                     "train_00002.png", "val_00000.png", "val_00001.png"]  # stale train_0000{3,4} removed
    assert (out / "notes.txt").read_text() == "mine"  # force removes only what the renderer writes
    empty = tmp_path / "empty"
    empty.mkdir()
    _render(empty)  # an existing empty directory is fine


def test_interrupted_render_leaves_no_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = synth.draw_scene

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(synth, "draw_scene", flaky)
    with pytest.raises(KeyboardInterrupt):
        _render(tmp_path / "out")
    assert not (tmp_path / "out" / SYNTH_JSON).exists()


def test_read_back_with_read_captions(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _render(out, n_train=6, n_dev=3, n_test=2)
    table = read_captions(out, images_dir=out / "images")  # directory -> dataset_synth.json, Karpathy
    assert table.skipped == []
    assert {s: len(table.grouped(s)) for s in table.split_names()} == {"train": 6, "dev": 3, "test": 2}
    ids, caps = table.precomp_rows("dev")
    assert ids == ["val_00000.png", "val_00001.png", "val_00002.png"] and len(caps) == 15
    data = json.loads((out / SYNTH_JSON).read_text())
    assert data["images"][0]["sentences"][0]["raw"] == table.captions[0]


@pytest.mark.parametrize("kw", [{"n_train": -1}, {"image_size": 8}, {"n_train": 0, "n_dev": 0, "n_test": 0},
                                {"seed": -3}])
def test_bad_arguments(tmp_path: Path, kw: dict) -> None:
    with pytest.raises(ConfigError):
        _render(tmp_path / "out", **kw)
