"""Results tables: docs/results/<dataset>.csv with the header of DESIGN.md section 3, one row per
evaluated configuration, rendered to markdown by scripts/render_results.py. Numbers are never typed."""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from itmatch.errors import DataError, OverwriteError
from itmatch.io import write_text_atomic

HEADER = ["name", "model", "dataset", "protocol", "image_to_text_r1", "image_to_text_r5", "image_to_text_r10",
          "text_to_image_r1", "text_to_image_r5", "text_to_image_r10", "rsum", "eval_seconds", "command"]
#: the same plus the accelerator that trained and evaluated the row (docs/results/<dataset>_gpu.csv)
DEVICE_HEADER = [*HEADER, "device"]
RESULTS_HEADERS = (HEADER, DEVICE_HEADER)


def result_row(name: str, model: str, dataset: str, result: dict, command: str, device: str = "") -> dict[str, str]:
    """A results row; with `device`, a row of a table that has the device column."""
    row = {"name": name, "model": model, "dataset": dataset, "protocol": result["protocol"]}
    for d in ("image_to_text", "text_to_image"):
        for k in (1, 5, 10):
            row[f"{d}_r{k}"] = f"{result[d][f'r{k}']:.1f}"
    row.update(rsum=f"{result['rsum']:.1f}", eval_seconds=f"{result['eval_seconds']:.1f}", command=command)
    if device:
        row["device"] = device
    return row


def read_rows(path: str | Path, header: list[str] | tuple[list[str], ...] = RESULTS_HEADERS
              ) -> list[dict[str, str]]:
    """The rows of a CSV whose header is `header` (or one of a tuple of headers)."""
    path = Path(path)
    if not path.exists():
        return []
    accepted = (header,) if isinstance(header, list) else header
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        if reader.fieldnames not in accepted:
            raise DataError(f"unexpected header {reader.fieldnames}", path=path, line=1,
                            hint=" or ".join(f"this file starts with: {','.join(h)}" for h in accepted))
        return list(reader)


def read_header(path: str | Path) -> list[str]:
    """The first line of a CSV as its column names ([] for a missing or empty file)."""
    path = Path(path)
    if not path.is_file():
        return []
    with path.open(newline="", encoding="utf-8") as fh:
        return next(csv.reader(fh), [])


def _row_header(path: Path, row: dict[str, str]) -> list[str]:
    """The header `row` is written with: the file's, which a row with (or without) a device must match."""
    header = DEVICE_HEADER if "device" in row else HEADER
    if read_header(path) not in ([], header):
        raise DataError(f"row {row['name']!r} {'has' if 'device' in row else 'lacks'} a device, the rows of this "
                        f"file do not", path=path, line=1,
                        hint="GPU rows go to docs/results/<dataset>_gpu.csv, CPU rows to <dataset>.csv")
    return header


def write_rows(path: str | Path, header: list[str], rows: list[dict[str, str]]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=header, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, buf.getvalue())


@contextmanager
def exclusive(path: str | Path) -> Iterator[None]:
    """Hold the lock of a results file (`.NAME.lock` beside it) for a read-modify-write. Two evaluations
    finishing at once (two bench jobs, one a core) would otherwise each write back the rows they read, and
    the row of one would be lost; the atomic rename only keeps the file whole, not both rows."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path.with_name(f".{path.name}.lock")):
        yield


def upsert_row(path: str | Path, row: dict[str, str], force: bool = False) -> None:
    """Add `row`; a row with the same name is replaced only with force."""
    with exclusive(path):
        rows = read_rows(path)
        header = _row_header(Path(path), row)
        names = [r["name"] for r in rows]
        if row["name"] in names:
            if not force:
                raise OverwriteError(f"row {row['name']!r} already exists", path=path,
                                     hint="pass --force to replace it, or choose another --name")
            rows[names.index(row["name"])] = row
        else:
            rows.append(row)
        write_rows(path, header, rows)


#: docs/results/training/<dataset>.csv: one row per (run, epoch), read from the run's metrics.jsonl, so that
#: epoch times and dev curves are quoted from a file too. `selected` marks the epoch kept as `best`.
HISTORY_HEADER = ["name", "epoch", "hardest", "lr", "batches", "train_seconds", "train_cpu_seconds", "dev_rsum",
                  "selected"]


def history_rows(name: str, metrics: str | Path) -> list[dict[str, str]]:
    """The epoch records of a run's metrics.jsonl as history rows (the last record of an epoch wins, as a
    resumed run rewrites its log from its checkpoint; the first best dev rsum is selected, as in training)."""
    epochs: dict[int, dict] = {}
    with Path(metrics).open(encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            if "val_rsum" in record:
                epochs[int(record["epoch"])] = record
    best = max(epochs, key=lambda e: (epochs[e]["val_rsum"], -e), default=None)
    return [{"name": name, "epoch": str(e), "hardest": str(r["hardest"]).lower(), "lr": f"{r['lr']:g}",
             "batches": str(r["batches"]), "train_seconds": f"{r['train_seconds']:.0f}",
             # runs trained before this field existed have no CPU time: left empty, not guessed
             "train_cpu_seconds": f"{r['train_cpu_seconds']:.0f}" if "train_cpu_seconds" in r else "",
             "dev_rsum": f"{r['val_rsum']:.1f}", "selected": "yes" if e == best else ""}
            for e, r in sorted(epochs.items())]


def replace_history(path: str | Path, name: str, rows: list[dict[str, str]]) -> None:
    """Put `rows` in place of every history row of run `name` (a retrained run replaces its history)."""
    with exclusive(path):
        old = read_rows(path, HISTORY_HEADER)
        names = list(dict.fromkeys([r["name"] for r in old] + [name]))  # file order; a new run goes last
        kept = [r for r in old if r["name"] != name]
        write_rows(path, HISTORY_HEADER,
                   sorted(kept + rows, key=lambda r: (names.index(r["name"]), int(r["epoch"]))))


TABLE_HEAD = ["| name | protocol | i2t R@1 | R@5 | R@10 | t2i R@1 | R@5 | R@10 | rsum | mR | eval s |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]


def table_head(device: bool = False) -> list[str]:
    """The results table's header lines, with the device column when asked."""
    return [TABLE_HEAD[0] + " device |", TABLE_HEAD[1] + "---|"] if device else TABLE_HEAD


def row_line(r: dict[str, str], device: bool = False) -> str:
    """One row of the results table (mR = rsum / 6), with the device column when asked."""
    return (f"| {r['name']} | {r['protocol']} | {r['image_to_text_r1']} | {r['image_to_text_r5']} | "
            f"{r['image_to_text_r10']} | {r['text_to_image_r1']} | {r['text_to_image_r5']} | "
            f"{r['text_to_image_r10']} | {r['rsum']} | {float(r['rsum']) / 6:.1f} | {r['eval_seconds']} |"
            + (f" {r['device']} |" if device else ""))


HISTORY_HEAD = ["| run | epoch | loss | lr | batches | train s | train CPU s | dev rsum | kept |",
                "|---|---:|---|---:|---:|---:|---:|---:|---|"]


def history_line(r: dict[str, str]) -> str:
    """One row of the training-history table."""
    loss = "hardest" if r["hardest"] == "true" else "sum"
    return (f"| {r['name']} | {r['epoch']} | {loss} | {r['lr']} | {r['batches']} | {r['train_seconds']} | "
            f"{r['train_cpu_seconds'] or '-'} | {r['dev_rsum']} | {'best' if r['selected'] else ''} |")


SEED_ROW = re.compile(r"(?P<base>.+)_seed(?P<seed>\d+)")  # `<row>_seed1`: <row> trained again with another seed


def seed_groups(rows: list[dict[str, str]]) -> list[list[dict[str, str]]]:
    """Each row that has rows of other seeds (`<row>_seedN` of the same protocol), followed by them, in the
    table's order: how far two trainings of one configuration land apart."""
    by_name = {r["name"]: r for r in rows}
    groups: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        match = SEED_ROW.fullmatch(r["name"])
        base = by_name.get(match["base"]) if match else None
        if base is not None and base["protocol"] == r["protocol"]:
            groups.setdefault(base["name"], [base]).append(r)
    return list(groups.values())


SEEDS_HEAD = ["| row | seeds | rsum of each | mean | spread |", "|---|---:|---|---:|---:|"]


def seed_spread(group: list[dict[str, str]]) -> float:
    """How far the rsums of a row's seeds lie apart: largest minus smallest."""
    rsums = [float(r["rsum"]) for r in group]
    return max(rsums) - min(rsums)


def seeds_line(group: list[dict[str, str]]) -> str:
    """A row and its other seeds: the rsum of each, their mean and spread (seed_spread)."""
    mean = sum(float(r["rsum"]) for r in group) / len(group)
    return (f"| {group[0]['name']} | {len(group)} | {' / '.join(r['rsum'] for r in group)} | "
            f"{mean:.1f} | {seed_spread(group):.1f} |")


#: beside a results CSV, the prose a reader needs before its numbers (what its rows are, what to read them with):
#: `<name>.about.md`, written by hand, placed under the title of the rendered page (no numbers: those are the CSV's)
ABOUT_SUFFIX = ".about.md"


def kept_last_epoch(history: list[dict[str, str]]) -> dict[str, int]:
    """Runs of a training history whose kept (`best`) epoch is the last they trained, with that epoch: their dev
    rsum was still rising when training ended, so they may not have converged."""
    last = {r["name"]: int(r["epoch"]) for r in history}  # (the rows are in epoch order per run)
    return {r["name"]: last[r["name"]] for r in history if r["selected"] and int(r["epoch"]) == last[r["name"]]}


def runs_kept_last(results_csv: Path) -> dict[str, int]:
    """kept_last_epoch of the training history beside a results table (training/<same name>.csv; none without)."""
    return kept_last_epoch(read_rows(results_csv.parent / VIEW_KINDS["training"].folder / results_csv.name,
                                     HISTORY_HEADER))


def _still_rising(path: Path, rows: list[dict[str, str]]) -> list[str]:
    """The notice under a results table naming its rows whose run kept its last epoch; none where no history is
    there or every run peaked before its end."""
    kept = runs_kept_last(path)
    named = [f"`{r['name']}` (epoch {kept[r['name']]})" for r in rows if r["name"] in kept]
    return ["**Kept their last epoch** (their dev rsum was still rising when training ended, so they may not have "
            "converged: read them as what their schedule reached, not as their method's level): "
            + ", ".join(named) + ".", ""] if named else []


def render_markdown(path: str | Path) -> str:
    rows = read_rows(path)
    title = Path(path).stem
    device = read_header(path) == DEVICE_HEADER
    about = Path(path).with_name(title + ABOUT_SUFFIX)
    lines = [f"# Results: {title}", "", f"Generated from `{Path(path).name}` by `scripts/render_results.py`; "
             "do not edit by hand.", "",
             *([about.read_text(encoding="utf-8").strip(), ""] if about.is_file() else []),
             "mR = rsum / 6, the mean of the six recalls (the figure SMAN's tables report).", "",
             *table_head(device), *(row_line(r, device) for r in rows), "", *_still_rising(Path(path), rows)]
    groups = seed_groups(rows)
    if groups:
        lines += ["## Seeds", "", "Rows trained again with another seed (`<row>_seedN`, every other setting the same; "
                  "for an ensemble, with members of another seed): a difference between two rows within the spread "
                  "is one that training again alone can make.", "", *SEEDS_HEAD,
                  *map(seeds_line, groups), ""]
    lines += ["Commands that produced each row:", ""]
    lines += [f"- `{r['name']}`: `{r['command']}`" for r in rows]
    return "\n".join(lines) + "\n"


def render_history_markdown(path: str | Path) -> str:
    rows = read_rows(path, HISTORY_HEADER)
    lines = [f"# Training history: {Path(path).stem}", "",
             f"Generated from `{Path(path).name}` (each run's `metrics.jsonl`, copied by the bench that trained it) "
             "by `scripts/render_results.py`; do not edit by hand.", "",
             "One line per epoch: the loss it trained on (the sum over negatives in a warm-up epoch, else the "
             "hardest), wall and process-CPU seconds of its training batches (CPU: empty for runs trained before it "
             "was logged; on a shared machine the CPU time is the cost on one free core, the wall time is not), the "
             "dev rsum after it, and the epoch kept as the run's `best` checkpoint.", "",
             *HISTORY_HEAD, *map(history_line, rows)]
    return "\n".join(lines) + "\n"


RECALLS = ["image_to_text_r1", "image_to_text_r5", "image_to_text_r10", "text_to_image_r1", "text_to_image_r5",
           "text_to_image_r10", "rsum"]
VERSUS_HEAD = ["| name | i2t R@1 | R@5 | R@10 | t2i R@1 | R@5 | R@10 | rsum | eval s | speed-up |",
               "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]


def versus_line(r: dict[str, str], reference: dict[str, str] | None) -> str:
    """A row against the view's first row (e.g. re-ranked vs exhaustive scoring): the first row's own values,
    then each other row's difference from it and how many times faster it was evaluated."""
    if reference is None or r is reference:  # (no reference yet: the row's own values, no speed-up)
        return (f"| {r['name']} | " + " | ".join(r[k] for k in RECALLS)
                + f" | {r['eval_seconds']} | {'1×' if r is reference else '–'} |")
    deltas = [float(r[k]) - float(reference[k]) for k in RECALLS]
    speed_up = float(reference["eval_seconds"]) / float(r["eval_seconds"])
    return (f"| {r['name']} | " + " | ".join(f"{d:+.1f}".replace("-", "−") for d in deltas)
            + f" | {r['eval_seconds']} | {speed_up:.1f}× |")


CLAIMS_HEAD = ["| claim | left | right | margin | verdict |", "|---|---:|---:|---:|---|"]
CLAIM = re.compile(r"(?P<left>[\w.+-]+?)(?P<op>>=|>)(?P<right>[\w.+-]+)")


def _signed(x: float) -> str:
    return f"{x:+.1f}".replace("-", "−")


def claim_lines(claims: list[str], rows: list[dict[str, str]], kept_last: dict[str, int] | None = None
                ) -> list[str]:
    """A paper's ordering or a goal checked against the table: `a>b` or `a>=b` between two rows' rsum, or a row
    against a number (`scan_i2t_lse>=300`). A claim decided by less than the seed spread of either side
    (seed_groups) says so; a side trained with one seed only is named, and its spread taken as the largest the
    table measured between converged runs (a margin of one-seed rows is no firmer than one between seeds; a group
    with a run that kept its last epoch measures a run still moving, not the seeds); a side whose run kept its last
    epoch (`kept_last`, runs_kept_last), or one of its other seeds', is named as maybe not converged; a claim with
    a row not in the table yet says that instead."""
    kept_last = kept_last or {}
    by_name = {r["name"]: r for r in rows}
    groups = seed_groups(rows)
    spread = {r["name"]: seed_spread(group) for group in groups for r in group}
    seeds_of = {r["name"]: [m["name"] for m in group] for group in groups for r in group}
    largest = max((seed_spread(group) for group in groups if not any(r["name"] in kept_last for r in group)),
                  default=0.0)
    lines = []
    for claim in claims:
        match = CLAIM.fullmatch(claim)
        if match is None:
            raise DataError(f"claim {claim!r} is not ROW>ROW or ROW>=ROW (the right side may be a number)",
                            hint="e.g. scan_i2t_lse>vsepp or oan>=275.2, without spaces")
        left, op, right = match["left"], match["op"], match["right"]
        goal = re.fullmatch(r"\d+(\.\d+)?", right) is not None
        shown = f"| {left} {op.replace('>=', '≥')} {right} |"
        missing = [n for n in (left, *(() if goal else (right,))) if n not in by_name]
        if missing:
            lines.append(f"{shown} | | | {', '.join(missing)} not run yet |")
            continue
        a, b = float(by_name[left]["rsum"]), float(right) if goal else float(by_name[right]["rsum"])
        holds = a >= b if op == ">=" else a > b
        sides = (left,) if goal else (left, right)
        one_seed = [n for n in sides if n not in spread]
        # (a side's other seeds too: their spread is the yardstick, and a run still rising widens it)
        rising = list(dict.fromkeys(m for n in sides for m in seeds_of.get(n, [n]) if m in kept_last))
        own = max((spread[n] for n in sides if n in spread), default=0.0)
        noise = max(own, largest if one_seed else 0.0)
        # (named after where the yardstick came from: a side's own seeds, or the table's widest for a one-seed side)
        within = "the table's largest seed spread" if one_seed and largest > own else "the seed spread"
        verdict = ("holds" if holds else "does not hold") + (
            f", within {within} ({noise:.1f})" if noise and abs(a - b) <= noise else "") + (
            f"; one seed: {', '.join(one_seed)}" if one_seed else "") + (
            f"; kept its last epoch (maybe not converged): {', '.join(rising)}" if rising else "")
        lines.append(f"{shown} {a:.1f} | {b:.1f}{' (goal)' if goal else ''} | {_signed(a - b)} | {verdict} |")
    return lines


@dataclass(frozen=True)
class _ViewKind:
    folder: str  # below the results directory
    header: list[str] | tuple[list[str], ...]  # (or any of several)
    head: Callable[[bool], list[str]]  # (whether the CSV has a device column)
    # one line per named row (row, the view's first row, device), or (body) the whole view from its names, the
    # CSV's rows and the CSV's path, where its lines are not one per row (claims)
    line: Callable[[dict[str, str], dict[str, str] | None, bool], str] | None = None
    body: Callable[[list[str], list[dict[str, str]], Path], list[str]] | None = None


#: Views inside any markdown page: `<!-- results: flickr8k row_a row_b ... -->`, the table, then
#: `<!-- results: end -->` (a row of docs/results/flickr8k.csv each), or the same with `training:` (every epoch
#: of each run in docs/results/training/flickr8k.csv). render_views fills them in the order named; a name not in
#: the CSV yet is listed as "not run yet", so a page can name the rows it is waiting for. `versus:` shows the
#: first named row of docs/results/<csv>.csv and every other row as its difference from it (versus_line).
#: `claims:` names orderings and goals instead of rows (`scan_i2t_lse>vsepp oan>=275.2`), checked by claim_lines.
#: (`curves:` views, a figure of dev rsum per epoch drawn from a training history: analysis/curves.py.)
VIEW_KINDS = {"results": _ViewKind("", RESULTS_HEADERS, table_head, lambda r, _, device: row_line(r, device)),
              "training": _ViewKind("training", HISTORY_HEADER, lambda _: HISTORY_HEAD,
                                    lambda r, _, __: history_line(r)),
              "versus": _ViewKind("", RESULTS_HEADERS, lambda _: VERSUS_HEAD,
                                  lambda r, first, _: versus_line(r, first)),
              "claims": _ViewKind("", RESULTS_HEADERS, lambda _: CLAIMS_HEAD,
                                  body=lambda names, rows, path: claim_lines(names, rows, runs_kept_last(path)))}


def view_pattern(*kinds: str) -> re.Pattern:
    """A view of one of `kinds` in a page: its opening comment (groups kind, csv, rows), what is between, its end."""
    return re.compile(rf"^<!-- (?P<kind>{'|'.join(kinds)}): (?P<csv>[\w.-]+) (?P<rows>[\w.+ =>-]+?) -->\n(?:.*?\n)??"
                      r"<!-- (?P=kind): end -->$", re.MULTILINE | re.DOTALL)


def view_csv(folder: Path, match: re.Match, text: str, page: Path) -> Path:
    """The CSV a view `match` of `text` (the page `page`) names in `folder`; a missing one is an error naming the
    page's line and the CSVs there."""
    csv_path = folder / f"{match['csv']}.csv"
    if not csv_path.is_file():
        line = text.count("\n", 0, match.start()) + 1
        raise DataError(f"{match['kind']} view names {csv_path.name}, which does not exist", path=page, line=line,
                        hint=f"one of: {', '.join(sorted(p.stem for p in folder.glob('*.csv')))}")
    return csv_path


VIEW = view_pattern(*VIEW_KINDS)


def markdown_tables(results_dir: str | Path) -> list[tuple[Path, Callable[[str | Path], str]]]:
    """Every CSV under `results_dir` that is rendered to a markdown file beside it, with its renderer: the
    results tables (*.csv) and the training histories (training/*.csv)."""
    root = Path(results_dir)
    return ([(p, render_markdown) for p in sorted(root.glob("*.csv"))]
            + [(p, render_history_markdown) for p in sorted((root / VIEW_KINDS["training"].folder).glob("*.csv"))])


def view_pages(docs: str | Path) -> list[Path]:
    """The pages whose results and training views scripts/render_results.py renders: docs/*.md and the README
    beside docs/."""
    docs = Path(docs)
    return [*sorted(docs.glob("*.md")), docs.parent / "README.md"]


def render_views(page: str | Path, results_dir: str | Path) -> str:
    """The page with every results and training view re-rendered from its CSV (the page is not written)."""
    page = Path(page)
    text = page.read_text(encoding="utf-8")

    def fill(match: re.Match) -> str:
        kind = VIEW_KINDS[match["kind"]]
        csv_path = view_csv(Path(results_dir) / kind.folder, match, text, page)
        rows = read_rows(csv_path, kind.header)
        by_name: dict[str, list[dict[str, str]]] = {}
        for r in rows:
            by_name.setdefault(r["name"], []).append(r)
        # a results view of a table with a device column (flickr8k_gpu) shows where each row ran
        device = read_header(csv_path) == DEVICE_HEADER
        head = kind.head(device)
        blank = " |" * (head[1].count("|") - 3)  # the empty cells after the first two
        names = match["rows"].split()
        if kind.body is not None:  # (claims: lines of their own, not one per named row)
            try:
                lines = kind.body(names, rows, csv_path)
            except DataError as exc:  # (where in the page)
                raise DataError(exc.message, path=page, line=text.count("\n", 0, match.start()) + 1,
                                hint=exc.hint) from None
        else:
            first = by_name.get(names[0], [None])[0]
            lines = [line for n in names for line in ([kind.line(r, first, device) for r in by_name[n]]
                                                      if n in by_name else [f"| {n} | not run yet |{blank}"])]
        return "\n".join([match.group(0).split("\n", 1)[0], *head, *lines, f"<!-- {match['kind']}: end -->"])

    return VIEW.sub(fill, text)
