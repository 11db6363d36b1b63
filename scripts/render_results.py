"""Render every docs/results/*.csv to a markdown table beside it (docs/results/<name>.md), every training
history docs/results/training/*.csv likewise, and the views (`<!-- results: <csv> <rows...> -->`,
`<!-- training: <csv> <runs...> -->`, and `<!-- curves: <csv> <runs...> -->`, whose figures of dev rsum per
epoch are drawn beside the training history) of the pages in docs/ and of the README."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from itmatch.analysis.curves import render_curve_views
from itmatch.engine.results import markdown_tables, render_views, view_pages
from itmatch.io import write_text_atomic, write_with


def main() -> int:
    # (no options: the parser gives `--help` its meaning, instead of rendering, and refuses unknown arguments)
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    docs = Path(__file__).resolve().parents[1] / "docs"
    root = docs / "results"
    for csv_path, render in markdown_tables(root):
        write_text_atomic(csv_path.with_suffix(".md"), render(csv_path))
        print(f"rendered {csv_path.with_suffix('.md')}")
    for page in view_pages(docs):
        text, figures = render_curve_views(render_views(page, root), page, root)
        for path, png in figures.items():
            if not path.is_file() or path.read_bytes() != png:  # (unchanged figures keep their files)
                write_with(path, lambda tmp, png=png: tmp.write_bytes(png))
                print(f"drew {path}")
        if text != page.read_text(encoding="utf-8"):
            write_text_atomic(page, text)
            print(f"rendered the results views of {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
