"""Results CSV: exact header, unique names, rendering; the CLI's help and model list."""

from __future__ import annotations

import pytest

from itmatch.cli import main
from itmatch.engine.results import HEADER, read_rows, render_markdown, result_row, upsert_row
from itmatch.errors import DataError, OverwriteError

RESULT = {"protocol": "1k", "rsum": 123.45, "eval_seconds": 1.234,
          "image_to_text": {"r1": 1.0, "r5": 2.0, "r10": 3.0}, "text_to_image": {"r1": 4.0, "r5": 5.0, "r10": 6.0}}


def test_header_is_exactly_the_design(tmp_path):
    path = tmp_path / "flickr8k.csv"
    upsert_row(path, result_row("scan_t2i_avg", "scan_t2i_avg", "flickr8k", RESULT, "itmatch evaluate x"))
    assert path.read_text().splitlines()[0] == ",".join(HEADER) == (
        "name,model,dataset,protocol,image_to_text_r1,image_to_text_r5,image_to_text_r10,text_to_image_r1,"
        "text_to_image_r5,text_to_image_r10,rsum,eval_seconds,command")
    with pytest.raises(OverwriteError):
        upsert_row(path, result_row("scan_t2i_avg", "m", "d", RESULT, "c"))
    upsert_row(path, result_row("scan_t2i_avg", "m", "d", RESULT, "c2"), force=True)
    rows = read_rows(path)
    assert len(rows) == 1 and rows[0]["command"] == "c2" and rows[0]["rsum"] == "123.5"
    md = render_markdown(path)
    assert "| scan_t2i_avg | 1k | 1.0 | 2.0 | 3.0 | 4.0 | 5.0 | 6.0 | 123.5 | 20.6 | 1.2 |" in md  # mR = rsum / 6


def test_foreign_csv_is_rejected(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(DataError, match="x.csv:1: unexpected header"):
        read_rows(path)


def test_cli_help_and_models(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "evaluate" in capsys.readouterr().out
    assert main(["models"]) == 0
    assert "scan_t2i_avg" in capsys.readouterr().out
