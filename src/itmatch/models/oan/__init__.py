"""OAN (Huang et al.): object-oriented inter- and intra-modal attention over visual objects (tanh FC of
regions, Eq. 3) and textual objects (a TextCNN, Eq. 1-2), with intra-modal hard negatives in the loss.
docs/oan.md."""

from __future__ import annotations

from typing import Any

from torch import nn

from itmatch.config import ModelConfig
from itmatch.errors import ConfigError
from itmatch.models.base import Matcher
from itmatch.models.encoders import RegionEncoder, RNNTextEncoder
from itmatch.models.oan.config import OANConfig, parse_kernels
from itmatch.models.oan.head import OANHead
from itmatch.models.oan.text import TextCNNEncoder
from itmatch.models.registry import Arch, Preset, register_arch, register_presets

__all__ = ["OANConfig", "OANHead", "TextCNNEncoder", "OAN_VARIANTS"]

# OAN section 5.2, the same for Flickr30K and COCO: D = 512, 300-d words, Adam 5e-4 -> 5e-5 after epoch 15,
# weight decay 1e-6, clip 2.0, batch 128, 24 epochs; alpha_inter = 0.2 is loss.margin; the rest is
# OANConfig's defaults (lambda_TT = lambda_VV = 1, lambda_TV = 0.9, lambda_VT = 0.5, alpha_intra = 0.1,
# beta = 0.5, K = 6, gamma = 0.3).
OAN_SCHEDULE = {"epochs": 24, "optimizer": "adam", "lr": 5e-4, "lr_update": 15, "weight_decay": 1e-6,
                "grad_clip": 2.0, "batch_size": 128}
# Table 2 of OAN (ablations): preset suffix -> (its row, model.oan switches). `oan` is the paper's chosen full model
# (Eq. 10 + 12), the model of Tables 3-4.
OAN_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "": ("Full model (Eq. 10 and Eq. 12), OAN of Tables 3-4", {"negatives": "eq12"}),
    "_eq11": ("Full model (Eq. 10 and Eq. 11)", {"negatives": "eq11"}),
    "_no_intra_neg": ("No intra-modal hard negatives", {"negatives": "none"}),  # Eq. 9 in every term
    "_no_inter_attn": ("No inter-modal attention", {"inter": False}),
    "_no_intra_attn": ("No intra-modal attention", {"intra": "none"}),
    "_no_attn": ("No attention", {"inter": False, "intra": "mean"}),  # mean pooling in each modality
    "_bilstm": ("No object-oriented textual encoder", {"text_encoder": "bilstm"}),  # a BiLSTM for the TextCNN
}


@register_arch
class OAN(Arch):
    """tanh(FC) visual objects (Eq. 3), TextCNN textual objects (Eq. 1-2) or a BiLSTM (Table 2), and the OAN
    head. Object embeddings are not l2-normalised (model.img_norm / txt_norm do not apply)."""

    name = "oan"
    norm_keys = ()  # (model.img_norm / txt_norm: registry.Arch.norm_keys)

    def build(self, mc: ModelConfig) -> Matcher:
        o = mc.oan
        image = RegionEncoder(mc.img_dim, mc.embed_size, norm=False, activation="tanh")
        if o.text_encoder == "cnn":
            text: nn.Module = TextCNNEncoder(mc.vocab_size, mc.word_dim, mc.embed_size,
                                             kernels=parse_kernels(o.kernels), channels=o.cnn_channels)
        elif o.text_encoder == "bilstm":
            text = RNNTextEncoder(mc.vocab_size, mc.word_dim, mc.embed_size, num_layers=mc.text_layers,
                                  bidirectional=True, rnn="lstm", norm=False)
        else:
            raise ConfigError(f"unknown model.oan.text_encoder {o.text_encoder!r}", hint="choose cnn or bilstm")
        head = OANHead(k_heads=o.k_heads, embed_size=mc.embed_size, lambda_tt=o.lambda_tt, lambda_vv=o.lambda_vv,
                       lambda_tv=o.lambda_tv, lambda_vt=o.lambda_vt, gamma=o.gamma, inter=o.inter, intra=o.intra,
                       negatives=o.negatives, alpha_intra=o.alpha_intra, beta=o.beta)
        return Matcher(image, text, head)


@register_presets
def oan_presets() -> dict[str, Preset]:
    """oan and its Table 2 ablations (oan_eq11, oan_no_intra_neg, ...), section 5.2's schedule."""
    return {f"oan{suffix}": {"model": {"arch": "oan", "embed_size": 512, "word_dim": 300, "oan": switches},
                             "loss": {"margin": 0.2}, "train": OAN_SCHEDULE, "paper": f"OAN Table 2: {row}"}
            for suffix, (row, switches) in OAN_VARIANTS.items()}
