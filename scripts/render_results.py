"""Render every docs/results/*.csv to a markdown table beside it (docs/results/<name>.md), every training
history docs/results/training/*.csv likewise, and the views (`<!-- results: <csv> <rows...> -->`,
`<!-- training: <csv> <runs...> -->`) of the pages in docs/ and of the README."""

from __future__ import annotations

import sys
from pathlib import Path

from itmatch.engine.results import markdown_tables, render_views, view_pages
from itmatch.io import write_text_atomic


def main() -> int:
    docs = Path(__file__).resolve().parents[1] / "docs"
    root = docs / "results"
    for csv_path, render in markdown_tables(root):
        write_text_atomic(csv_path.with_suffix(".md"), render(csv_path))
        print(f"rendered {csv_path.with_suffix('.md')}")
    for page in view_pages(docs):
        text = render_views(page, root)
        if text != page.read_text(encoding="utf-8"):
            write_text_atomic(page, text)
            print(f"rendered the results views of {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
