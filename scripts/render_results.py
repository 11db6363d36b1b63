"""Render every docs/results/*.csv to a markdown table beside it (docs/results/<name>.md), and the results
views (`<!-- results: <csv> <rows...> -->`) of the pages in docs/."""

from __future__ import annotations

import sys
from pathlib import Path

from itmatch.engine.results import render_markdown, render_views
from itmatch.io import write_text_atomic


def main() -> int:
    docs = Path(__file__).resolve().parents[1] / "docs"
    root = docs / "results"
    for csv_path in sorted(root.glob("*.csv")):
        write_text_atomic(csv_path.with_suffix(".md"), render_markdown(csv_path))
        print(f"rendered {csv_path.with_suffix('.md')}")
    for page in sorted(docs.glob("*.md")):
        text = render_views(page, root)
        if text != page.read_text(encoding="utf-8"):
            write_text_atomic(page, text)
            print(f"rendered the results views of {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
