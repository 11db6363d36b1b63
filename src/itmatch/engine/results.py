"""Results tables: docs/results/<dataset>.csv with the header of DESIGN.md section 3, one row per
evaluated configuration, rendered to markdown by scripts/render_results.py. Numbers are never typed."""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

from itmatch.errors import DataError, OverwriteError
from itmatch.io import write_text_atomic

HEADER = ["name", "model", "dataset", "protocol", "image_to_text_r1", "image_to_text_r5", "image_to_text_r10",
          "text_to_image_r1", "text_to_image_r5", "text_to_image_r10", "rsum", "eval_seconds", "command"]


def result_row(name: str, model: str, dataset: str, result: dict, command: str) -> dict[str, str]:
    row = {"name": name, "model": model, "dataset": dataset, "protocol": result["protocol"]}
    for d in ("image_to_text", "text_to_image"):
        for k in (1, 5, 10):
            row[f"{d}_r{k}"] = f"{result[d][f'r{k}']:.1f}"
    row.update(rsum=f"{result['rsum']:.1f}", eval_seconds=f"{result['eval_seconds']:.1f}", command=command)
    return row


def read_rows(path: str | Path) -> list[dict[str, str]]:
    path = Path(path)
    if not path.exists():
        return []
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames != HEADER:
            raise DataError(f"unexpected header {reader.fieldnames}", path=path, line=1,
                            hint=f"a results file starts with: {','.join(HEADER)}")
        return list(reader)


def upsert_row(path: str | Path, row: dict[str, str], force: bool = False) -> None:
    """Add `row`; a row with the same name is replaced only with force."""
    rows = read_rows(path)
    names = [r["name"] for r in rows]
    if row["name"] in names:
        if not force:
            raise OverwriteError(f"row {row['name']!r} already exists", path=path,
                                 hint="pass --force to replace it, or choose another --name")
        rows[names.index(row["name"])] = row
    else:
        rows.append(row)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=HEADER, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(path, buf.getvalue())


TABLE_HEAD = ["| name | protocol | i2t R@1 | R@5 | R@10 | t2i R@1 | R@5 | R@10 | rsum | mR | eval s |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]


def row_line(r: dict[str, str]) -> str:
    """One row of the results table (mR = rsum / 6)."""
    return (f"| {r['name']} | {r['protocol']} | {r['image_to_text_r1']} | {r['image_to_text_r5']} | "
            f"{r['image_to_text_r10']} | {r['text_to_image_r1']} | {r['text_to_image_r5']} | "
            f"{r['text_to_image_r10']} | {r['rsum']} | {float(r['rsum']) / 6:.1f} | {r['eval_seconds']} |")


def render_markdown(path: str | Path) -> str:
    rows = read_rows(path)
    title = Path(path).stem
    lines = [f"# Results: {title}", "", f"Generated from `{Path(path).name}` by `scripts/render_results.py`; "
             "do not edit by hand.", "",
             "mR = rsum / 6, the mean of the six recalls (the figure SMAN's tables report).", "",
             *TABLE_HEAD, *map(row_line, rows), "", "Commands that produced each row:", ""]
    lines += [f"- `{r['name']}`: `{r['command']}`" for r in rows]
    return "\n".join(lines) + "\n"


#: A results view inside any markdown page: `<!-- results: flickr8k row_a row_b ... -->`, the table, then
#: `<!-- results: end -->`. render_views fills it from docs/results/flickr8k.csv, rows in the order named;
#: a row not in the CSV yet is listed as "not run yet", so a page can name the rows it is waiting for.
VIEW = re.compile(r"^<!-- results: (?P<csv>[\w.-]+) (?P<rows>[\w.+ -]+?) -->\n(?:.*?\n)??<!-- results: end -->$",
                  re.MULTILINE | re.DOTALL)


def render_views(page: str | Path, results_dir: str | Path) -> str:
    """The page with every results view re-rendered from its CSV (the page is not written)."""
    page = Path(page)
    text = page.read_text(encoding="utf-8")

    def fill(match: re.Match) -> str:
        csv_path = Path(results_dir) / f"{match['csv']}.csv"
        if not csv_path.is_file():
            line = text.count("\n", 0, match.start()) + 1
            raise DataError(f"results view names {csv_path.name}, which does not exist", path=page, line=line,
                            hint=f"one of: {', '.join(sorted(p.stem for p in Path(results_dir).glob('*.csv')))}")
        by_name = {r["name"]: r for r in read_rows(csv_path)}
        lines = [row_line(by_name[n]) if n in by_name else f"| {n} | not run yet | | | | | | | | | |"
                 for n in match["rows"].split()]
        return "\n".join([match.group(0).split("\n", 1)[0], *TABLE_HEAD, *lines, "<!-- results: end -->"])

    return VIEW.sub(fill, text)
