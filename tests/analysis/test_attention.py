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


def test_the_figure_is_written_in_the_format_its_name_says(tmp_path, capsys):
    """fig.svg held PNG bytes, whatever its name said: now the suffix names the format, or is refused before any
    work (by the CLI before the model is loaded)."""
    from itmatch.analysis.attention import plot_word_attention
    from itmatch.errors import ConfigError
    from itmatch.retrieval.matcher import WordAttention

    maps = np.random.default_rng(0).random((3, 7, 7)).astype(np.float32)
    attention = WordAttention(tokens=["<start>", "dog", "<end>"], known=[True, True, True], maps=maps,
                              normalised_over="regions", score=0.5)
    photo = Image.new("RGB", (64, 48), (10, 20, 30))
    for name, start in (("fig.svg", b"<?xml"), ("fig.pdf", b"%PDF"), ("fig.JPEG", b"\xff\xd8\xff"),
                        ("fig.webp", b"RIFF"), ("fig.png", b"\x89PNG")):
        plot_word_attention(photo, attention, tmp_path / name)
        assert (tmp_path / name).read_bytes().startswith(start), name
    with pytest.raises(ConfigError, match="ends in '.bmp', which names no picture format") as err:
        plot_word_attention(photo, attention, tmp_path / "fig.bmp")
    assert ".svg" in err.value.hint and not (tmp_path / "fig.bmp").exists()
    photo.save(tmp_path / "photo.png")
    (tmp_path / "empty").mkdir()  # (no checkpoint in it: loading one would fail otherwise)
    with pytest.raises(SystemExit) as stop:
        main(["analyze", "attention", str(tmp_path / "empty"), str(tmp_path / "photo.png"), "a dog", "--out",
              str(tmp_path / "fig.bmp")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "argument --out" in err and "names no picture format" in err
