"""SAVE (multi-scale visual semantics aggregation with self-attention): the grid cells of CNN stage maps are the
instance candidates, self-attention (DSA or ASA) aggregates them, finer scales are fused into c5, and SCAN's
i-t head scores the result. Reads cached stage maps, or pixels through its own CNN. docs/save.md."""

from __future__ import annotations

from typing import Any

from itmatch.config import ModelConfig
from itmatch.errors import ConfigError
from itmatch.models.base import Matcher
from itmatch.models.encoders import RNNTextEncoder
from itmatch.models.registry import Arch, Preset, register_arch, register_presets
from itmatch.models.save.config import SaveConfig
from itmatch.models.save.encoder import Borrowed, MultiScaleSelfAttention, SaveImageEncoder, parse_scales
from itmatch.models.scan import COCO_SCHEDULE, F30K_SCHEDULE, SCAN_LAMBDAS, scan_head, two_way_lambdas

__all__ = ["MultiScaleSelfAttention", "SaveConfig", "SaveImageEncoder", "parse_scales"]


@register_arch
class Save(Arch):
    name = "save"
    owns_backbone = True  # SaveImageEncoder reads its backbone's stage maps itself

    def backbone(self, mc: ModelConfig) -> str:
        return mc.save.backbone

    def pixel_backbone(self, mc: ModelConfig) -> str:
        """model.save.backbone when the model reads pixels (model.pixels or model.save.pixels)."""
        return mc.save.backbone if mc.pixels or mc.save.pixels else ""

    def image_inputs(self, mc: ModelConfig) -> tuple[str, ...]:
        if self.pixel_backbone(mc):
            return ("pixels",)
        scales = parse_scales(mc.save.scales)
        return scales if scales != ("c5",) else ()

    def feature_dims(self, mc: ModelConfig) -> dict[str, str]:
        return {"c5": "model.img_dim", "c3": "model.save.c3_dim", "c4": "model.save.c4_dim"}

    def build(self, mc: ModelConfig) -> Matcher:
        sc = mc.save
        scales = parse_scales(sc.scales)
        pixels = bool(self.pixel_backbone(mc))
        # (AdaptiveSelfAttention's switches)
        asa = {"bias": sc.asa_bias, "scaled": sc.asa_scaled, "spectral_norm": sc.asa_spectral_norm}
        changed = [(f"asa_{name}", value) for name, value in asa.items() if value != getattr(SaveConfig, f"asa_{name}")]
        if changed and sc.attention != "asa":  # (it would be ignored: DSA has no weights, none no block)
            key, value = changed[0]
            raise ConfigError(f"model.save.{key}={str(value).lower()} applies to ASA, not to "
                              f"model.save.attention={sc.attention}",
                              hint=f"leave {key} out, or set model.save.attention=asa")
        if sc.finetune and not pixels:
            raise ValueError("model.save.finetune needs model.save.pixels=true (the backbone runs inside the model)")
        backbone = tail = None
        if pixels or sc.fusion == "nl":
            from itmatch.features.backbones import STAGE_NAMES, load_backbone

            net = load_backbone(sc.backbone)
            if sc.finetune:  # SAVE's own switch, as its Flickr8K rows were trained: BatchNorm statistics move
                net.set_trainable(freeze_batchnorm=False)
            dims = dict(zip(STAGE_NAMES, net.stage_dims, strict=True))
            backbone = net if pixels else None
            if sc.fusion == "nl":  # with a backbone in the model, its tail's parameters are already there
                tail = net.tail() if backbone is None else Borrowed(net.tail())
        else:
            dims = {"c3": sc.c3_dim, "c4": sc.c4_dim, "c5": mc.img_dim}
            unset = [s for s in scales if dims[s] <= 0]
            if unset:
                raise ValueError(f"channels of cached scale(s) {unset} unknown: set model.save.c3_dim/c4_dim "
                                 "(the trainer takes them from the data)")
        fusion = MultiScaleSelfAttention(scales, dims, sc.attention, sc.fusion, sc.dsa_lambda, tail, sc.scale_norm,
                                         asa=asa)
        image = SaveImageEncoder(fusion, mc.embed_size, norm=mc.img_norm, backbone=backbone)
        text = RNNTextEncoder(mc.vocab_size, mc.word_dim, mc.embed_size, num_layers=mc.text_layers,
                              bidirectional=mc.bidirectional, rnn=mc.text_rnn, norm=mc.txt_norm)
        model = Matcher(image, text, scan_head(mc, two_way_lambdas(mc)))
        if sc.finetune:
            model.lr_scales["image_encoder.backbone."] = sc.backbone_lr_scale
        return model


# The paper's scoring settings beside its default i-t AVG (SCAN's, each direction with SCAN's lambdas): with
# model.direction=both, model.pool pools the t-i half and model.scan.i2t_pool the i-t half (docs/save.md)
SETTINGS: dict[str, dict[str, Any]] = {
    "t2i_lse": {"direction": "t2i", "pool": "lse"},
    "t2i_avg": {"direction": "t2i"},
    "i2t_lse": {"pool": "lse"},
    "both": {"direction": "both", "pool": "lse", "scan": {"i2t_pool": "avg"}},  # i-t AVG + t-i LSE averaged
}
# The paper's tables of these presets: (the scoring settings it reports, {variant: its row there}); "i2t_avg" is the
# variants' own setting, any other one a preset `{variant}_{setting}` (the label `itmatch models` shows: paper_row)
PAPER_TABLES: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "Table 1": (("both",), {"save_dsa": "DSA", "save_asa": "ASA", "save_asa_ms2": "ASA + ms2",
                            "save_asa_ms3": "ASA + ms3"}),
    "Table 4": (("i2t_avg", "t2i_lse"), {"save_nosa": "no-SA", "save_dsa": "DSA", "save_asa": "ASA"}),
    "Table 5": (("i2t_avg",), {"save_dsa": "DSA", "save_dsa_ms2": "DSA-ms2", "save_asa": "ASA",
                               "save_asa_ms2": "ASA-ms2", "save_asa_ms3": "ASA-ms3", "save_nl_ms2": "NL-ms2"}),
    "Table 6": (("i2t_lse", "i2t_avg", "t2i_lse", "t2i_avg"), {"save_nosa": "no-SA", "save_nosa_ms2": "no-SA-ms2"}),
}
# The same for MS-COCO (`_coco` presets): Table 2 (footnote 1's averaged scores, 1K and 5K), Tables 4 and 5's
# MS-COCO 5K halves (Table 5 has no ASA-ms3 there, Table 6 is Flickr30K only)
COCO_TABLES: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "Table 2": (("both",), {"save_dsa": "DSA", "save_asa": "ASA", "save_asa_ms2": "ASA + ms2"}),
    "Table 4": (("i2t_avg", "t2i_lse"), {"save_nosa": "no-SA", "save_dsa": "DSA", "save_asa": "ASA"}),
    "Table 5": (("i2t_avg",), {"save_dsa": "DSA", "save_dsa_ms2": "DSA-ms2", "save_asa": "ASA",
                               "save_asa_ms2": "ASA-ms2", "save_nl_ms2": "NL-ms2"}),
}
SETTING_NAMES = {"i2t_avg": "i-t AVG", "t2i_lse": "t-i LSE", "t2i_avg": "t-i AVG", "i2t_lse": "i-t LSE",
                 "both": "i-t AVG + t-i LSE averaged, footnote 1"}
# setting -> the variants the paper reports in it: Table 1 (footnote 1: i-t and t-i scores averaged), Table 4's t-i
# LSE rows, Table 6's no-SA and no-SA-ms2 in all four settings
PAPER_SETTINGS = {setting: tuple(dict.fromkeys(name for settings, rows in PAPER_TABLES.values()
                                               if setting in settings for name in rows))
                  for setting in SETTINGS}


def paper_row(name: str, setting: str = "i2t_avg", end_to_end: bool = False, dataset: str = "f30k") -> str:
    """The tables reporting variant `name` in `setting` on `dataset` ("f30k" or "coco"), and its row, e.g. "SAVE
    Tables 4, 5 (i-t AVG): DSA, CNN frozen (the paper trains it end to end)": every row of the paper is trained end
    to end (section 3.5.3), the presets on cached maps are not; for a row no table reports, "this toolkit's: ..."
    (a COCO twin of a Flickr30K-only row), or "" (a Flickr30K variant of no table: only settings that have one
    are presets)."""
    how = ("end to end as the paper trains it, the CNN fine-tuned at lr / 10" if end_to_end
           else "CNN frozen (the paper trains it end to end)")
    coco = dataset == "coco"
    tables = {table: rows[name] for table, (settings, rows) in (COCO_TABLES if coco else PAPER_TABLES).items()
              if setting in settings and name in rows}
    if not tables:
        return f"this toolkit's: {name} ({SETTING_NAMES[setting]}), {how}, with COCO's schedule and lambdas" \
            if coco else ""
    numbers = ", ".join(table.split()[1] for table in tables)
    where = "MS-COCO, " if coco else ""
    return (f"SAVE Table{'s' if len(tables) > 1 else ''} {numbers} ({where}{SETTING_NAMES[setting]}): "
            f"{next(iter(tables.values()))}, {how}")


def _save_presets(dataset: str, schedule: dict[str, Any]) -> dict[str, Preset]:
    """The presets of `dataset` (its SCAN lambdas and `schedule`), by their Flickr30K names."""
    i2t = {f"i2t_{k}": v for k, v in SCAN_LAMBDAS[(dataset, "i2t")].items()}
    model = {"arch": "save", "direction": "i2t", "pool": "avg", "scan": {**SCAN_LAMBDAS[(dataset, "t2i")], **i2t}}
    variants = {
        "save_nosa": {"attention": "none", "scales": "c5"},
        "save_dsa": {"attention": "dsa", "scales": "c5"},
        "save_asa": {"attention": "asa", "scales": "c5"},
        # fused scales are standardised per cell first (model.save.scale_norm): EfficientNet's raw c3/c4 outweigh
        # c5 in norm, and a 2-epoch run fusing them raw did much worse (measured: docs/save.md, "Decisions where
        # the paper is silent or ambiguous")
        "save_asa_ms2": {"attention": "asa", "scales": "c4,c5", "scale_norm": "layernorm"},
        "save_asa_ms3": {"attention": "asa", "scales": "c3,c4,c5", "scale_norm": "layernorm"},
        "save_nl_ms2": {"attention": "asa", "scales": "c4,c5", "fusion": "nl"},
        # the best of Table 1 (ASA-ms3) trained end to end from pixels, backbone fine-tuned at lr / 10
        "save_asa_ms3_ft": {"attention": "asa", "scales": "c3,c4,c5", "scale_norm": "layernorm", "pixels": True,
                            "finetune": True},
        # DSA (the best frozen row on Flickr8K dev, docs/save.md) end to end; the Flickr8K row continues the
        # frozen save_dsa run with train.init_from
        "save_dsa_ft": {"attention": "dsa", "scales": "c5", "pixels": True, "finetune": True},
        # Table 5's DSA-ms2 and Table 6's no-SA-ms2, their fused scales standardised as ASA-ms2's
        "save_dsa_ms2": {"attention": "dsa", "scales": "c4,c5", "scale_norm": "layernorm"},
        "save_nosa_ms2": {"attention": "none", "scales": "c4,c5", "scale_norm": "layernorm"},
    }
    presets = {name: {"model": {**model, "save": save}, "train": schedule,
                      "paper": paper_row(name.removesuffix("_ft"), end_to_end=name.endswith("_ft"), dataset=dataset)}
               for name, save in variants.items()}
    for setting, names in PAPER_SETTINGS.items():
        for name in names:
            base, change = presets[name]["model"], SETTINGS[setting]
            scan = {**base["scan"], **change.get("scan", {})}
            presets[f"{name}_{setting}"] = {"model": {**base, **change, "scan": scan}, "train": schedule,
                                            "paper": paper_row(name, setting, dataset=dataset)}
    return presets


@register_presets
def save_presets() -> dict[str, Preset]:
    """SAVE Tables 4-6 in the i-t AVG setting (self-attention variants on c5, fusion of c4+c5 / c3+c4+c5,
    NL-ms2), and the rows the paper reports in its other settings (PAPER_SETTINGS: `save_dsa_both` for Table 1's
    averaged i-t/t-i scores, footnote 1; `save_dsa_t2i_lse`, ...), each with a `_coco` twin. The paper trains
    "under exactly the same experimental settings" as SCAN (Table 2's note): SCAN's Flickr30K schedule and lambdas,
    and for the twins its COCO ones (20 epochs at 5e-4, i-t LSE lambda 20). Both directions' lambdas are set (SCAN
    Tables 1, 2): t-i in model.scan.lambda_*, i-t in model.scan.i2t_lambda_*, so t-i scores with 9 / 6, not with the
    i-t 4 / 5."""
    presets: dict[str, Preset] = {}
    for dataset, schedule in (("f30k", F30K_SCHEDULE), ("coco", COCO_SCHEDULE)):
        suffix = "" if dataset == "f30k" else "_coco"
        for name, preset in _save_presets(dataset, schedule).items():
            presets[f"{name}{suffix}"] = preset
    return presets

