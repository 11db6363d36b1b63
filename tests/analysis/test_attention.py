"""`itmatch analyze attention MODEL PHOTO CAPTION --out FIG`: the figure and table of each word's weights over the
photo's grid cells are the model's own (the same maps as the search page's explain, which uses the same function),
and an existing figure is kept without --force."""

from __future__ import annotations

import re

import numpy as np
import pytest
from PIL import Image

from itmatch.cli import main
from itmatch.retrieval.index import build_index
from itmatch.retrieval.search import Searcher


def test_attention_figure_shows_the_maps_the_search_page_explains(tiny_search_setup, tmp_path, capsys):
    photos, checkpoint = tiny_search_setup["photos"], str(tiny_search_setup["checkpoint"])
    photo = sorted(photos.iterdir())[3]
    figure = tmp_path / "attention.png"
    assert main(["analyze", "attention", checkpoint, str(photo), "a big red circle", "--out", str(figure)]) == 0
    printed = capsys.readouterr().out
    row = re.compile(r"(\S+)( \(unknown\))? +(\(\d+, \d+\)) +([\d.]+) +([\d.]+)")
    table = [row.fullmatch(line).groups() for line in printed.splitlines()[2:-1]]
    assert [(word, bool(unknown)) for word, unknown, *_ in table] == [
        ("<start>", False), ("a", False), ("big", True), ("red", False), ("circle", False), ("<end>", False)]
    with Image.open(figure) as image:
        assert image.format == "PNG" and image.width > 600

    build_index(photos, checkpoint, tmp_path / "index", progress=False)
    explained = Searcher(tmp_path / "index").explain("a big red circle", photo.name)
    maps = np.array([word["weights"] for word in explained["words"]])
    top = [f"({int(m.argmax()) // maps.shape[1]}, {int(m.argmax()) % maps.shape[1]})" for m in maps]
    assert [cell for _, _, cell, *_ in table] == top  # the same most-attended cell for every word
    assert [float(weight) for *_, weight, _ in table] == pytest.approx(maps.reshape(len(maps), -1).max(1), abs=6e-4)
    assert [word["known"] for word in explained["words"]] == [not unknown for _, unknown, *_ in table]
    assert f"score {explained['score']:.4f}" in printed

    assert main(["analyze", "attention", checkpoint, str(photo), "a circle", "--out", str(figure)]) != 0
    assert "--force" in capsys.readouterr().err
