"""SMAN's options, `model.sman.*` (paper section IV-A3 as defaults; docs/sman.md)."""

from __future__ import annotations

from dataclasses import dataclass

from itmatch.config import option, register_options

FORMS = ("similarity", "distance")


@register_options("sman")
@dataclass
class SMANConfig:
    """SMAN (Ji et al.) switches and hyper-parameters."""

    regions: int = option(49, min=1)  # M, the grid cells in spatial (row-major) order; other counts are an error
    att_hidden: int = option(512, min=1)  # hidden size of the two-layer attention perceptrons (Eq. 5-6, 9-10, 13-17)
    spatial: bool = True  # v(loc), the GRU over regions in Eq. 3-4 (False: SMAN-IM)
    steps: int = option(2, min=1, max=2)  # 2: intra- then multi-modal attention; 1: intra-modal only (SMAN-IM)
    alpha: float = option(0.9, min=0, max=1)  # fusion gate ratio of Eq. 12 (1.0: SMAN-SIM, stacked intra-modal)
    intra_pair_weight: float = option(1.0, min=0)  # lambda of Eq. 23 (0: SMAN-inter, ranking loss only)
    intra_pair_margin: float = 0.25  # m2 of Eq. 22
    # similarity: [m2 - d]+ ; distance: [(levels - d) - m2]+
    intra_pair_form: str = option("similarity", choices=FORMS)
    divide_by_m: bool = False  # the extra 1/M of Eq. 7/15 around an already-normalised attention sum
    dropout: float = option(0.3, min=0, max=1)  # on the grid features and the word embeddings
