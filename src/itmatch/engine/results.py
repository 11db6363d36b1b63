"""Results tables: docs/results/<dataset>.csv with the header of DESIGN.md section 3, one row per
evaluated configuration, rendered to markdown by scripts/render_results.py. Numbers are never typed."""

from __future__ import annotations

import csv
import io
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


def render_markdown(path: str | Path) -> str:
    rows = read_rows(path)
    title = Path(path).stem
    lines = [f"# Results: {title}", "", f"Generated from `{Path(path).name}` by `scripts/render_results.py`; "
             "do not edit by hand.", "",
             "mR = rsum / 6, the mean of the six recalls (the figure SMAN's tables report).", "",
             "| name | protocol | i2t R@1 | R@5 | R@10 | t2i R@1 | R@5 | R@10 | rsum | mR | eval s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['protocol']} | {r['image_to_text_r1']} | {r['image_to_text_r5']} | "
                     f"{r['image_to_text_r10']} | {r['text_to_image_r1']} | {r['text_to_image_r5']} | "
                     f"{r['text_to_image_r10']} | {r['rsum']} | {float(r['rsum']) / 6:.1f} | {r['eval_seconds']} |")
    lines += ["", "Commands that produced each row:", ""]
    lines += [f"- `{r['name']}`: `{r['command']}`" for r in rows]
    return "\n".join(lines) + "\n"
