"""Recall curves: R@K against K = 1 ... 100 for several evaluations side by side, both directions.

R@1, R@5 and R@10 are three points of each curve; the curve shows the rest: where two models that tie on rsum part
(one sharper at the top, one that rarely misses by far), and how far down the ranking a user scrolls for the match.
`itmatch analyze recall A.json B.json --out recall.png` draws the curves that `itmatch evaluate --json` records
("recall_curve", engine/metrics.recall_curve).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from itmatch.engine.metrics import DIRECTIONS
from itmatch.errors import ConfigError, DataError
from itmatch.io import figure_format, write_figure

LABELS = {"image_to_text": "image → text", "text_to_image": "text → image"}
SHOWN_K = (1, 5, 10, 20, 50, 100)  # the printed table's columns
SAME_TEST = ("split", "protocol", "n_images")  # curves over different test sets do not compare


def read_evaluations(paths: Sequence[str | Path], labels: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """label -> evaluation JSON (as `itmatch evaluate --json` writes it) of each file; labels default to the file
    names without `.json` (and a bench's `.test`). Every file must hold recall curves, of the same test set."""
    if labels is not None and len(labels) != len(paths):
        raise ConfigError(f"{len(labels)} labels for {len(paths)} evaluations", hint="give one label per file")
    names = list(labels) if labels is not None else [_default_label(Path(p)) for p in paths]
    if len(set(names)) != len(names):
        raise ConfigError(f"two evaluations would be drawn as one label ({', '.join(names)})",
                          hint="name each with --labels")
    evaluations: dict[str, dict[str, Any]] = {}
    first: tuple[Path, dict[str, Any]] | None = None
    for name, path in zip(names, map(Path, paths), strict=True):
        result = _read(path)
        if first is None:
            first = (path, result)
        differ = [f"{key} {result.get(key)!r} (in {first[0]}: {first[1].get(key)!r})" for key in SAME_TEST
                  if result.get(key) != first[1].get(key)]
        if differ:
            raise DataError(f"evaluated on another test set than the first file: {', '.join(differ)}", path=path,
                            hint="compare evaluations of one split and protocol (e.g. --split test --protocol 1k)")
        evaluations[name] = result
    return evaluations


def _default_label(path: Path) -> str:
    name = path.name.removesuffix(".json")
    return name.removesuffix(".test")


def _read(path: Path) -> dict[str, Any]:
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        line = getattr(exc, "lineno", None)
        raise DataError(f"not an evaluation JSON ({exc})", path=path, line=line,
                        hint="pass files written by `itmatch evaluate --json`") from None
    if not isinstance(result, dict) or not all(isinstance(result.get(d), dict) for d in DIRECTIONS):
        raise DataError("not an evaluation JSON (no image_to_text / text_to_image metrics)", path=path,
                        hint="pass files written by `itmatch evaluate --json`")
    curves = result.get("recall_curve")
    if not isinstance(curves, dict) or not all(isinstance(curves.get(d), list) and curves[d] for d in DIRECTIONS):
        raise DataError("this evaluation has no recall curve (written by an itmatch from before curves were "
                        "recorded)", path=path, hint="evaluate the checkpoint again with `itmatch evaluate CKPT "
                                                     "--json FILE` (same split and protocol)")
    return result


def curve_table(evaluations: Mapping[str, dict[str, Any]]) -> str:
    """A markdown table of each evaluation's R@K at SHOWN_K, per direction."""
    lines = ["| evaluation | direction | " + " | ".join(f"R@{k}" for k in SHOWN_K) + " |",
             "|---|---|" + "---:|" * len(SHOWN_K)]
    for name, result in evaluations.items():
        for d in DIRECTIONS:
            curve = result["recall_curve"][d]
            cells = [f"{curve[k - 1]:.1f}" if k <= len(curve) else "" for k in SHOWN_K]
            lines.append(f"| {name} | {LABELS[d]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _legend(name: str, result: dict[str, Any]) -> str:
    """The evaluation's name and rsum; a two-stage one says where its curve stops being the model's own ranking
    (past the re-ranked top K it is the first stage's order)."""
    rerank = f", top {result['rerank']} re-ranked" if result.get("rerank") else ""
    return f"{name} (rsum {result['rsum']:.1f}{rerank})"


def plot_recall_curves(evaluations: Mapping[str, dict[str, Any]], path: str | Path, title: str = "") -> None:
    """Two panels (image → text, text → image): R@K over K on a log axis, one line per evaluation, its rsum in
    the legend; dotted lines at K = 1, 5, 10 (the table's three points). Written in the format the path's suffix
    names (.png, .svg, .pdf, ...: itmatch.io.FIGURE_FORMATS; another is refused before drawing)."""
    figure_format(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, d in zip(axes, DIRECTIONS, strict=True):
        for name, result in evaluations.items():
            curve = result["recall_curve"][d]
            ax.plot(range(1, len(curve) + 1), curve, label=_legend(name, result), linewidth=1.4)
        for k in (1, 5, 10):
            ax.axvline(k, color="grey", linestyle=":", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("K")
        ax.set_title(LABELS[d])
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("R@K (%)")
    axes[0].set_ylim(0, 100)
    axes[1].legend(fontsize=8, loc="lower right")
    first = next(iter(evaluations.values()))
    fig.suptitle(title or f"recall curves: {first.get('split')} split, {first.get('protocol')} protocol, "
                          f"{first.get('n_images')} images")
    fig.tight_layout()
    write_figure(path, fig, dpi=110)
    plt.close(fig)
