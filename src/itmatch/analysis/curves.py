"""Dev-rsum curves of training runs, drawn from a training history into the pages that discuss them.

A page names the runs in a view, `<!-- curves: flickr8k_gpu vsepp vsepp_warmup -->` ... `<!-- curves: end -->`;
`scripts/render_results.py` draws them from docs/results/training/<csv>.csv (the bench's copy of each run's
metrics.jsonl) into one figure beside that CSV and puts the figure's link between the two comments. A curve shows
what a table of epochs hides: a stall, a late climb, one run overtaking another. A figure that no view draws any
more (its runs changed) is removed by the same script (`stale_figures`).
"""

from __future__ import annotations

import glob
import hashlib
import io
import os
import re
from collections.abc import Iterable
from pathlib import Path

from itmatch.engine.results import HISTORY_HEADER, read_rows, view_csv, view_pattern

CURVES = view_pattern("curves")  # (its `rows` are the runs drawn)
#: the longest figure name (bytes) kept whole: the atomic writer's temporary file beside it adds
#: `.{name}.{host}-{pid}.{random}.partial`, up to about 90 bytes more, and a file system's names stop at 255
NAME_LIMIT = 150
#: line styles, one per cycle of the 10 colours: past 10 runs a colour comes back, in another style
LINE_STYLES = ("-", "--", "-.", (0, (5, 1, 1, 1, 1, 1)))


def figure_path(history: Path, runs: list[str]) -> Path:
    """Where the figure of `runs` from training history `history` is written: beside it, named by both,
    `<history>__<run>__<run>.png`. A name over NAME_LIMIT bytes (a view of many runs, which failed to write:
    "File name too long") keeps the runs that fit and ends in the number of runs and a hash of their list, so
    that the same runs keep one name and other runs get another."""
    name = f"{history.stem}__{'__'.join(runs)}.png"
    if len(name.encode()) <= NAME_LIMIT:
        return history.with_name(name)
    digest = hashlib.sha256(" ".join(runs).encode()).hexdigest()[:10]
    tail = f"__{len(runs)}_runs_{digest}.png"
    kept = history.stem
    for run in runs:
        if len(f"{kept}__{run}{tail}".encode()) > NAME_LIMIT:
            break
        kept += f"__{run}"
    return history.with_name(kept + tail)


def stale_figures(results_dir: Path, drawn: Iterable[Path]) -> list[Path]:
    """The figures in `results_dir`/training that no curves view draws any more (not among `drawn`): only files
    named as figure_path names them, `<history>__*.png` beside a history there, so no other file is touched."""
    folder = Path(results_dir) / "training"
    keep = {Path(p).resolve() for p in drawn}
    named = {p for history in folder.glob("*.csv") for p in folder.glob(f"{glob.escape(history.stem)}__*.png")}
    return sorted(p for p in named if p.is_file() and p.resolve() not in keep)


def run_style(i: int) -> dict[str, str | tuple]:
    """The colour and line style of the i-th run of a view. A run keeps its style whether or not the runs before
    it are trained yet; past 10 runs the colours come back in the next line style, so that no two of the first 40
    runs look alike (the 11th was drawn as the 1st)."""
    return {"color": f"C{i % 10}", "linestyle": LINE_STYLES[i // 10 % len(LINE_STYLES)]}


def plot_dev_curves(rows: list[dict[str, str]], runs: list[str], title: str) -> bytes:
    """PNG of dev rsum after each epoch, one line per run of `runs` (in that order) from history rows:
    epochs trained on the sum over negatives (a warm-up) hollow, the epoch kept as `best` starred, and a dotted
    line where a run's lr first drops. The same rows give the same bytes (no timestamp in the file)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    drops: set[int] = set()
    for i, run in enumerate(runs):
        epochs = [r for r in rows if r["name"] == run]
        if not epochs:
            continue
        x, y = [int(r["epoch"]) for r in epochs], [float(r["dev_rsum"]) for r in epochs]
        (line,) = ax.plot(x, y, linewidth=1.4, label=run, **run_style(i))
        warm = [(e, v) for e, v, r in zip(x, y, epochs, strict=True) if r["hardest"] != "true"]
        if warm:
            ax.scatter(*zip(*warm, strict=True), s=28, facecolors="white", edgecolors=line.get_color(), zorder=3)
        best = [(e, v) for e, v, r in zip(x, y, epochs, strict=True) if r["selected"]]
        if best:
            ax.scatter(*zip(*best, strict=True), s=90, marker="*", color=line.get_color(), zorder=4)
        drop = next((int(r["epoch"]) for r in epochs if float(r["lr"]) < float(epochs[0]["lr"])), None)
        if drop is not None:
            drops.add(drop)
    for epoch in sorted(drops):
        ax.axvline(epoch - 0.5, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("epoch")
    ax.set_ylabel("dev rsum (1000 images)")
    ax.set_title(f"{title}\nhollow: a warm-up epoch (sum over negatives); star: the epoch kept as best; "
                 "dotted: the lr drop", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()


def render_curve_views(text: str, page: Path, results_dir: Path) -> tuple[str, dict[Path, bytes]]:
    """`text` (of `page`) with every curves view filled with its figure's link, and the figures (path -> PNG
    bytes) for the caller to write. A history that does not exist is an error naming the page's line; runs not
    in it yet are drawn as soon as they are, and listed under the figure meanwhile."""
    figures: dict[Path, bytes] = {}
    folder = Path(results_dir) / "training"

    def fill(match: re.Match) -> str:
        history = view_csv(folder, match, text, page)
        runs = match["rows"].split()
        rows = read_rows(history, HISTORY_HEADER)
        trained = {r["name"] for r in rows}
        png = figure_path(history, runs)
        figures[png] = plot_dev_curves(rows, runs, f"dev rsum per epoch ({history.name})")
        link = os.path.relpath(png, page.parent).replace(os.sep, "/")
        waiting = [r for r in runs if r not in trained]
        lines = [match.group(0).split("\n", 1)[0], f"![dev rsum per epoch: {', '.join(runs)}]({link})"]
        if waiting:
            lines.append(f"(not run yet: {', '.join(waiting)})")
        return "\n".join([*lines, "<!-- curves: end -->"])

    return CURVES.sub(fill, text), figures
