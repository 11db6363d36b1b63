"""SAVE's options, `model.save.*` (docs/save.md)."""

from __future__ import annotations

from dataclasses import dataclass

from itmatch.config import option, register_options
from itmatch.models.save.encoder import ATTENTIONS, FUSIONS, SCALE_NORMS, parse_scales


@register_options("save")
@dataclass
class SaveConfig:
    """SAVE: CNN grid candidates, self-attention, multi-scale fusion. Its i-t head's lambdas are SCAN's
    (`model.scan.i2t_lambda_*`)."""

    attention: str = option("asa", choices=ATTENTIONS)  # none | dsa (Eq. 1-4) | asa (Eq. 5-8)
    scales: str = option("c5", check=parse_scales)  # comma list, finest first: c5 | c4,c5 (ms2) | c3,c4,c5 (ms3)
    # concat (Fig. 3: max-pool + concat) | nl (NL-ms2: self-attention inside the backbone)
    fusion: str = option("concat", choices=FUSIONS)
    dsa_lambda: float = option(1.0, above=0)  # inverse temperature of the DSA softmax (Eq. 3 has none: 1)
    # ASA's theta, phi, g with biases (the non-local block's 1x1 convolutions; every SAVE run so far) or without,
    # as Eq. 6-7 write them (false); only theta's bias changes the attention (docs/save.md)
    asa_bias: bool = True
    # Eq. 6's logits divided by sqrt(C/2), the transformer's scaling (true); not in the paper, whose unscaled logits
    # make ASA's attention nearly one-hot on raw Lite0 c5; scaled, it collapses there all the same (docs/save.md,
    # "How it collapses")
    asa_scaled: bool = False
    # theta, phi, g and W_z spectrally normalised, as SAGAN (cited at Eq. 8) normalises every convolution (true); not
    # in SAVE: a bound on the gated branch that collapses ASA on raw c5 (docs/save.md, "How it collapses")
    asa_spectral_norm: bool = False
    # none (the paper: raw maps) | layernorm: each stage map is standardised per cell over its channels (no
    # affine) before its self-attention, so that no fused scale outweighs the others by magnitude alone
    # (EfficientNet's c3/c4 are linear-bottleneck outputs, larger in norm than c5's cells; the ms2/ms3 presets);
    # on one scale, the control that separates standardising from fusing (docs/save.md, "Decisions where the
    # paper is silent or ambiguous")
    scale_norm: str = option("none", choices=SCALE_NORMS)
    # the CNN of pixel input and of the NL tail (cached maps name theirs in meta.json)
    backbone: str = option("lite0", choices=("lite0", "lite2", "resnet50", "resnet152"))
    pixels: bool = False  # the model reads images (data.images), through its own backbone
    finetune: bool = False  # train the backbone too (needs pixels); its lr is train.lr * backbone_lr_scale
    backbone_lr_scale: float = option(0.1, min=0)
    c3_dim: int = option(0, min=0)  # channels of cached c3 / c4 maps (0: taken from the data)
    c4_dim: int = option(0, min=0)
