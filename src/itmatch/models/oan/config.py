"""OAN's options, `model.oan.*` (paper section 5.2 as defaults; docs/oan.md)."""

from __future__ import annotations

from dataclasses import dataclass

from itmatch.config import option, register_options
from itmatch.errors import ConfigError

TEXT_ENCODERS = ("cnn", "bilstm")
INTRA = ("attention", "mean", "none")
NEGATIVES = ("eq12", "eq11", "none")


def parse_kernels(text: str) -> tuple[int, ...]:
    """"1,2,3,5,7" -> (1, 2, 3, 5, 7); a ConfigError otherwise (model.oan.kernels' check, `option(check=...)`)."""
    try:
        kernels = tuple(int(k) for k in str(text).replace(" ", "").split(",") if k)
    except ValueError:
        kernels = ()
    if not kernels or min(kernels) < 1:
        raise ConfigError(f"{text!r} is not a comma list of kernel widths",
                          hint="write whole numbers >= 1 separated by commas, e.g. 1,2,3,5,7")
    return kernels


@register_options("oan")
@dataclass
class OANConfig:
    """OAN (Huang et al.) hyper-parameters. alpha_inter of Eq. 10 is `loss.margin`."""

    # cnn (Eq. 1-2) | bilstm (Table 2, no object-oriented textual encoder)
    text_encoder: str = option("cnn", choices=TEXT_ENCODERS)
    kernels: str = option("1,2,3,5,7", check=parse_kernels)  # TextCNN kernel widths j of Eq. 1
    cnn_channels: int = option(0, min=0)  # output channels per kernel; 0: embed_size
    k_heads: int = option(6, min=1)  # K of Eq. 6-8
    lambda_tt: float = option(1.0, above=0)  # softmax scales of the intra-modal attention (Eq. 7)
    lambda_vv: float = option(1.0, above=0)
    lambda_tv: float = option(0.9, above=0)  # softmax scales of the inter-modal attention (Eq. 4)
    lambda_vt: float = option(0.5, above=0)
    gamma: float = option(0.3, min=0, max=1)  # weight of the intra-modal term in Eq. 13-14
    inter: bool = True  # inter-modal attention terms S(v_VT, e_VT) + S(v_TV, e_TV)
    intra: str = option("attention", choices=INTRA)  # attention (Eq. 6-8) | mean (Table 2 "no attention") | none
    negatives: str = option("eq12", choices=NEGATIVES)  # intra-modal hard negatives: eq12 | eq11 | none
    alpha_intra: float = option(0.1, min=0)  # margin of the intra-modal triplets (Eq. 10)
    beta: float = option(0.5, min=0)  # weight of the intra-modal triplets (Eq. 10)
