"""SMAN (Ji et al.): a spatial GRU over the grid, stacked intra-modal then multi-modal attention with a fusion
gate, and an intra-pair constraint in the loss. docs/sman.md."""

from __future__ import annotations

from typing import Any

from itmatch.config import ModelConfig
from itmatch.models.base import Matcher
from itmatch.models.registry import Arch, Preset, register_arch, register_presets
from itmatch.models.sman.config import SMANConfig
from itmatch.models.sman.encoders import SMANImageEncoder, SMANTextEncoder
from itmatch.models.sman.head import SMANHead

__all__ = ["SMANConfig", "SMANHead", "SMANImageEncoder", "SMANTextEncoder", "SMAN_VARIANTS"]

# SMAN section IV-A3: Adadelta lr 0.05 -> 0.005 after 50 of 60 epochs, weight decay 5e-4, clipping 0.1,
# batch 128, m1 = 0.2; every hidden size (word embedding, GRU, BiLSTM, attention, common space) 512. "Clipping at
# 0.1" is read per coordinate: as a total norm over ~14M parameters it leaves Adadelta steps of ~1e-6 and the model
# at chance (docs/sman.md, "Gradient clipping at 0.1").
SMAN_SCHEDULE = {"epochs": 60, "optimizer": "adadelta", "lr": 0.05, "lr_update": 50, "weight_decay": 5e-4,
                 "grad_clip": 0.1, "grad_clip_mode": "value", "batch_size": 128}
SMAN_MODEL = {"arch": "sman", "embed_size": 512, "word_dim": 512, "text_rnn": "lstm"}
# name -> (the paper's row, model.sman switches, other model fields): SMAN (random words), the pretrained-vector
# variant (spaCy en_core_web_md 300-d in place of GloVe) and the ablations of section IV-A4 / Tables III-V.
SMAN_VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "sman": ("Tables I, II: SMAN (random)", {}, {}),
    "sman_w2v_spacy": ("Tables I-III, V: SMAN (Glove), spaCy's vectors in GloVe's place", {},
                       {"word_vectors": "spacy_md", "word_dim": 300}),
    "sman_im": ("Table III: SMAN-IM", {"steps": 1, "spatial": False}, {}),  # intra-modal attention, no v(loc)
    "sman_im_loc": ("Table III: SMAN-IM-LOC", {"steps": 1}, {}),  # intra-modal attention with v(loc)
    "sman_sim": ("Table III: SMAN-SIM", {"alpha": 1.0}, {}),  # stacked intra-modal attention (gate at alpha = 1)
    # ranking loss only (no Eq. 22 term)
    "sman_inter": ("Tables I, II, IV, V: SMAN-inter (alpha = 0.9)", {"intra_pair_weight": 0.0}, {}),
    # ranking loss only and the gate at alpha = 1; the paper's "approximately equivalent to DAN" also drops v(loc)
    # (`--set model.sman.spatial=false`)
    "sman_inter_alpha1": ("Tables I, II, IV: SMAN-inter (alpha = 1)", {"alpha": 1.0, "intra_pair_weight": 0.0}, {}),
}


@register_arch
class SMAN(Arch):
    name = "sman"
    norm_keys = ()  # (model.img_norm / txt_norm: registry.Arch.norm_keys)

    def build(self, mc: ModelConfig) -> Matcher:
        s = mc.sman
        image = SMANImageEncoder(mc.img_dim, mc.embed_size, s.att_hidden, regions=s.regions, spatial=s.spatial,
                                 divide_by_m=s.divide_by_m, dropout=s.dropout)
        text = SMANTextEncoder(mc.vocab_size, mc.word_dim, mc.embed_size, s.att_hidden, rnn=mc.text_rnn,
                               dropout=s.dropout)
        head = SMANHead(mc.img_dim, mc.embed_size, s.att_hidden, regions=s.regions, steps=s.steps, alpha=s.alpha,
                        divide_by_m=s.divide_by_m, intra_pair_weight=s.intra_pair_weight,
                        intra_pair_margin=s.intra_pair_margin, intra_pair_form=s.intra_pair_form)
        return Matcher(image, text, head)

    def regions_key(self, mc: ModelConfig) -> str | None:
        return "model.sman.regions"


@register_presets
def sman_presets() -> dict[str, Preset]:
    """sman, sman_w2v_spacy and the ablations of section IV-A4, section IV-A3's schedule."""
    return {name: {"model": {**SMAN_MODEL, **fields, "sman": switches}, "loss": {"margin": 0.2},
                   "train": SMAN_SCHEDULE, "paper": f"SMAN {row}"}
            for name, (row, switches, fields) in SMAN_VARIANTS.items()}
