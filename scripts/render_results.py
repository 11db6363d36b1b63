"""Render every docs/results/*.csv to a markdown table beside it (docs/results/<name>.md)."""

from __future__ import annotations

import sys
from pathlib import Path

from itmatch.engine.results import render_markdown
from itmatch.io import write_text_atomic


def main() -> int:
    root = Path(__file__).resolve().parents[1] / "docs" / "results"
    for csv_path in sorted(root.glob("*.csv")):
        write_text_atomic(csv_path.with_suffix(".md"), render_markdown(csv_path))
        print(f"rendered {csv_path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
