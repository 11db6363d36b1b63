"""Curves views: dev rsum per epoch drawn from a training history into the page that names the runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_script

from itmatch.analysis.curves import CURVES, NAME_LIMIT, figure_path, render_curve_views, run_style, stale_figures
from itmatch.engine.results import HISTORY_HEADER, view_pages, write_rows
from itmatch.errors import DataError

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _history(path: Path, runs: dict[str, list[float]]) -> None:
    """A history CSV: each run's dev rsum per epoch, the first epoch a warm-up, the lr dropped after half."""
    rows = []
    for name, rsums in runs.items():
        best = rsums.index(max(rsums))
        rows += [{"name": name, "epoch": str(e + 1), "hardest": "false" if e == 0 else "true",
                  "lr": "0.0002" if e < len(rsums) // 2 else "2e-05", "batches": "234", "train_seconds": "90",
                  "train_cpu_seconds": "170", "dev_rsum": f"{v:.1f}", "selected": "yes" if e == best else ""}
                 for e, v in enumerate(rsums)]
    write_rows(path, HISTORY_HEADER, rows)


def _page(tmp_path: Path, view: str) -> tuple[Path, Path]:
    results = tmp_path / "docs" / "results"
    (results / "training").mkdir(parents=True)
    page = tmp_path / "docs" / "page.md"
    page.write_text(f"# A page\n\ntext\n\n{view}\n<!-- curves: end -->\n\nmore text\n", encoding="utf-8")
    return page, results


def test_a_curves_view_links_the_figure_of_its_runs_drawn_from_the_history(tmp_path):
    page, results = _page(tmp_path, "<!-- curves: hist a b later -->")
    history = results / "training" / "hist.csv"
    _history(history, {"a": [20.0, 15.0, 80.0, 200.0, 240.0, 238.0], "b": [90.0, 120.0, 200.0, 230.0, 236.0, 235.0]})
    text, figures = render_curve_views(page.read_text(encoding="utf-8"), page, results)
    png = figure_path(history, ["a", "b", "later"])
    assert list(figures) == [png] and figures[png].startswith(b"\x89PNG\r\n\x1a\n")
    assert ("<!-- curves: hist a b later -->\n![dev rsum per epoch: a, b, later]"
            "(results/training/hist__a__b__later.png)\n(not run yet: later)\n<!-- curves: end -->") in text
    assert text.startswith("# A page\n\ntext\n\n") and text.endswith("\n\nmore text\n")
    # rendering again changes nothing: the same text (a fixed point) and the same bytes (no timestamp)
    again, figures_again = render_curve_views(text, page, results)
    assert again == text and figures_again == figures
    # the figure is drawn from the numbers: another dev rsum, another figure
    _history(history, {"a": [20.0, 15.0, 80.0, 200.0, 240.0, 250.0], "b": [90.0, 120.0, 200.0, 230.0, 236.0, 235.0]})
    assert render_curve_views(text, page, results)[1][png] != figures[png]


def test_a_curves_view_of_a_missing_history_names_the_page_and_line(tmp_path):
    page, results = _page(tmp_path, "<!-- curves: nope a -->")
    _history(results / "training" / "hist.csv", {"a": [1.0, 2.0]})
    with pytest.raises(DataError, match="curves view names nope.csv, which does not exist") as err:
        render_curve_views(page.read_text(encoding="utf-8"), page, results)
    assert err.value.path == page and err.value.line == 5 and "hist" in str(err.value)


def test_committed_curves_views_are_filled_and_their_figures_exist():
    """The curves views of docs/*.md and the README link the figure scripts/render_results.py draws (the bytes
    depend on matplotlib's version and fonts, so only the link and the file are checked here)."""
    found = 0
    for page in view_pages(DOCS):
        text = page.read_text(encoding="utf-8")
        for match in CURVES.finditer(text):
            found += 1
            png = figure_path(DOCS / "results" / "training" / f"{match['csv']}.csv", match["rows"].split())
            assert png.is_file(), f"{png} is missing: run python scripts/render_results.py"
            assert f"({png.relative_to(page.parent).as_posix()})" in match.group(0), (
                f"the curves view in {page} is stale: run python scripts/render_results.py")
    assert found


# runs of a view of many: each name as long as the bench's (flickr8k_gpu's mmca_alpha0_lite2_seed1)
MANY = [f"{family}_alpha0_lite2_seed{seed}" for family in ("vsepp", "scan_t2i_avg", "oan", "mmca", "save_dsa",
                                                           "sman", "meanpool") for seed in (0, 1)]


def test_a_view_of_many_runs_gets_a_short_stable_name_and_a_short_one_keeps_its_own(tmp_path):
    """A view of 14 runs was named by all of them: with the atomic writer's `.{name}.{host}-{pid}.{random}.partial`
    the name passed 255 bytes (OSError: File name too long) and render_results stopped halfway."""
    history = tmp_path / "hist.csv"
    png = figure_path(history, MANY)
    assert len(png.name.encode()) <= NAME_LIMIT and png.parent == tmp_path
    assert png.name.startswith("hist__vsepp_alpha0_lite2_seed0__") and "__14_runs_" in png.name
    assert figure_path(history, list(MANY)) == png  # stable: the same runs, the same name
    assert figure_path(history, MANY[:-1]) != png and figure_path(history, MANY[::-1]) != png
    assert figure_path(history, ["a", "b"]).name == "hist__a__b.png"  # (committed figures keep their names)
    from itmatch.io import write_with

    write_with(png, lambda tmp: tmp.write_bytes(b"x"))  # (through the atomic writer's temporary name)
    assert png.read_bytes() == b"x"


def test_runs_past_ten_keep_distinct_styles():
    """Past 10 runs the colour cycle came back: the 11th run was drawn as the 1st."""
    styles = [(s["color"], str(s["linestyle"])) for s in map(run_style, range(40))]
    assert len(set(styles)) == 40
    assert run_style(0) == {"color": "C0", "linestyle": "-"} and run_style(10)["color"] == "C0"


def test_render_results_draws_a_view_of_many_runs_and_removes_figures_no_view_draws(tmp_path, capsys):
    """scripts/render_results.py on a docs tree: a view of 14 runs is drawn (it failed with "File name too long"
    after rewriting some pages), and a figure of the view's former runs is removed, saying so; files not named
    as curve figures stay."""
    page, results = _page(tmp_path, f"<!-- curves: hist {' '.join(MANY)} -->")
    (tmp_path / "README.md").write_text("# readme\n", encoding="utf-8")
    training = results / "training"
    _history(training / "hist.csv", {run: [100.0 + i, 120.0 + i, 130.0 + i] for i, run in enumerate(MANY)})
    _history(training / "other.csv", {"x": [1.0, 2.0]})
    stale = [training / "hist__vsepp_alpha0_lite2_seed0__oan.png", training / "other__x.png"]
    kept = [training / "notes.png", training / "hist.png", training / "histo__x.png", training / "hist__x.svg"]
    for path in stale + kept:
        path.write_bytes(b"old")
    assert stale_figures(results, []) == sorted(stale)
    load_script("scripts/render_results.py").render(tmp_path / "docs")
    printed = capsys.readouterr().out
    png = figure_path(training / "hist.csv", MANY)
    assert png.read_bytes().startswith(b"\x89PNG") and f"drew {png}" in printed
    assert f"(results/training/{png.name})" in page.read_text(encoding="utf-8")
    for path in stale:
        assert not path.exists() and f"removed {path} (no curves view draws it any more)" in printed
    assert all(path.read_bytes() == b"old" for path in kept)
    assert sorted(p.name for p in training.glob("*.png")) == sorted([png.name, "notes.png", "hist.png",
                                                                     "histo__x.png"])
    load_script("scripts/render_results.py").render(tmp_path / "docs")  # again: nothing drawn or removed
    again = capsys.readouterr().out
    assert "drew " not in again and "removed " not in again
