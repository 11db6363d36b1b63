"""Attention maps of one photo and one caption: each word's weights over the grid cells drawn over the photo, as
SCAN's Fig. 4 and 5 draw them and the search page shows them (`itmatch analyze attention MODEL PHOTO "caption"
--out fig.png`; the weights are `ImageTextMatcher.word_attention`'s, the function the score uses).

The model sees the whole photo squashed to the backbone's square input (no crop), so grid cell (r, c) covers the
same share of the photo at any aspect ratio: each map is stretched over the photo at its own aspect."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image

from itmatch.io import figure_format, write_figure
from itmatch.retrieval.matcher import WordAttention

COLUMNS = 6  # panels a row: the photo, then one per time step


def attention_table(attention: WordAttention) -> str:
    """One line per time step: its most attended cell (row, column from the top left), that cell's weight, and
    how concentrated the map is (the share of the weight in its top 5 cells)."""
    grid = attention.maps.shape[1]
    lines = [f"score {attention.score:.4f}; each map normalised over {attention.normalised_over}; "
             f"cells (row, column) of a {grid} x {grid} grid",
             f"{'word':<16} {'top cell':>9} {'weight':>7} {'top-5 share':>12}"]
    for token, known, weights in zip(attention.tokens, attention.known, attention.maps, strict=True):
        flat = weights.reshape(-1)
        top = int(flat.argmax())
        total = float(flat.sum())
        share = float(np.sort(flat)[-5:].sum())
        label = token if known else f"{token} (unknown)"
        lines.append(f"{label:<16} {f'({top // grid}, {top % grid})':>9} {float(flat[top]):7.3f} "
                     f"{(share / total if total > 0 else 0.0):12.2f}")
    return "\n".join(lines)


def plot_word_attention(photo: Image.Image, attention: WordAttention, path: str | Path, title: str = "") -> None:
    """The photo, then one panel per time step: its weights (bilinear between cell centres) over the photo, each
    scaled to its own maximum (display only; attention_table prints the weights). Written in the format the
    path's suffix names (.png, .svg, .pdf, ...: itmatch.io.FIGURE_FORMATS; another is refused before drawing)."""
    figure_format(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width, height = photo.size
    panels = 1 + len(attention.tokens)
    columns = min(COLUMNS, panels)
    rows = math.ceil(panels / columns)
    side = 2.4
    fig, axes = plt.subplots(rows, columns, figsize=(side * columns, side * rows * height / width + 0.8),
                             squeeze=False)
    extent = (0, width, height, 0)  # (the grid stretched over the photo, as the backbone squashed the photo)
    axes[0][0].imshow(photo, extent=extent)
    axes[0][0].set_title("photo", fontsize=9)
    for ax, token, known, weights in zip(axes.flat[1:], attention.tokens, attention.known, attention.maps,
                                         strict=False):
        ax.imshow(photo, extent=extent)
        ax.imshow(weights, extent=extent, cmap="inferno", alpha=0.65, interpolation="bilinear", vmin=0.0,
                  vmax=max(float(weights.max()), 1e-12))
        ax.set_title(f"{token}{'' if known else ' (unknown)'}  max {float(weights.max()):.2f}", fontsize=9,
                     color="black" if known else "firebrick")
    for ax in axes.flat:
        ax.axis("off")
    fig.suptitle(title or f"score {attention.score:.3f}; each word's weights over the "
                          f"{attention.maps.shape[1]} x {attention.maps.shape[2]} cells "
                          f"(normalised over {attention.normalised_over})", fontsize=10)
    fig.tight_layout()
    write_figure(path, fig, dpi=110)
    plt.close(fig)
