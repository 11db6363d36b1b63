"""Render every docs/results/*.csv to a markdown table beside it (docs/results/<name>.md), every training
history docs/results/training/*.csv likewise, and the views (`<!-- results: <csv> <rows...> -->`,
`<!-- training: <csv> <runs...> -->`, and `<!-- curves: <csv> <runs...> -->`, whose figures of dev rsum per
epoch are drawn beside the training history) of the pages in docs/ and of the README. Curve figures that no view
draws any more (its runs changed, or it was removed) are deleted."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from itmatch.analysis.curves import render_curve_views, stale_figures
from itmatch.engine.results import markdown_tables, render_views, view_pages
from itmatch.io import write_text_atomic, write_with


def main() -> int:
    # (no options: the parser gives `--help` its meaning, instead of rendering, and refuses unknown arguments)
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    render(Path(__file__).resolve().parents[1] / "docs")
    return 0


def render(docs: Path) -> None:
    """Render the tables, views and figures of `docs` (its results/ and pages, and the README beside it)."""
    root = docs / "results"
    for csv_path, to_markdown in markdown_tables(root):
        write_text_atomic(csv_path.with_suffix(".md"), to_markdown(csv_path))
        print(f"rendered {csv_path.with_suffix('.md')}")
    # every page is rendered before any is written: a view that fails leaves the pages and figures as they were
    rendered = [(page, *render_curve_views(render_views(page, root), page, root)) for page in view_pages(docs)]
    drawn: set[Path] = set()
    for page, text, figures in rendered:
        for path, png in figures.items():
            drawn.add(path)
            if not path.is_file() or path.read_bytes() != png:  # (unchanged figures keep their files)
                write_with(path, lambda tmp, png=png: tmp.write_bytes(png))
                print(f"drew {path}")
        if text != page.read_text(encoding="utf-8"):
            write_text_atomic(page, text)
            print(f"rendered the results views of {page}")
    for path in stale_figures(root, drawn):
        path.unlink()
        print(f"removed {path} (no curves view draws it any more)")


if __name__ == "__main__":
    sys.exit(main())
