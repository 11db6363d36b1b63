"""Name -> model. Every paper configuration worth reproducing is a named preset: a partial config
applied over the defaults (paper hyper-parameters; the CPU schedule of docs/ is applied on top)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from itmatch.config import Config, ModelConfig, config_from_dict, update
from itmatch.errors import ConfigError
from itmatch.models.base import Matcher, SimilarityHead
from itmatch.models.grid import Borrowed, MultiScaleSelfAttention, SaveImageEncoder, parse_scales
from itmatch.models.heads import GlobalCosineHead, ScanHead, SumMaxHead, TwoWayScanHead
from itmatch.models.image import RegionEncoder
from itmatch.models.text import RNNTextEncoder

# SCAN supplementary: Flickr30K lr 2e-4 for 15 epochs then 2e-5 for 15; COCO 5e-4 for 10 then 5e-5 for 10.
F30K_SCHEDULE = {"epochs": 30, "lr": 2e-4, "lr_update": 15}
COCO_SCHEDULE = {"epochs": 20, "lr": 5e-4, "lr_update": 10}
# lambda_1 / lambda_2 of SCAN Table 1 (Flickr30K) and Table 2 (COCO).
SCAN_LAMBDAS = {
    ("f30k", "t2i"): {"lambda_softmax": 9.0, "lambda_lse": 6.0},
    ("f30k", "i2t"): {"lambda_softmax": 4.0, "lambda_lse": 5.0},
    ("coco", "t2i"): {"lambda_softmax": 9.0, "lambda_lse": 6.0},
    ("coco", "i2t"): {"lambda_softmax": 4.0, "lambda_lse": 20.0},
}


def _presets() -> dict[str, dict[str, Any]]:
    presets: dict[str, dict[str, Any]] = {}
    for dataset, schedule in (("f30k", F30K_SCHEDULE), ("coco", COCO_SCHEDULE)):
        suffix = "" if dataset == "f30k" else "_coco"
        presets[f"vsepp{suffix}"] = {"model": {"arch": "vsepp", "bidirectional": False}, "train": schedule}
        for direction in ("t2i", "i2t"):
            presets[f"summax_{direction}{suffix}"] = {
                "model": {"arch": "summax", "direction": direction}, "train": schedule}
            for pool in ("avg", "lse", "max", "sum"):  # MAX / SUM: SCAN Table 4
                presets[f"scan_{direction}_{pool}{suffix}"] = {
                    "model": {"arch": "scan", "direction": direction, "pool": pool,
                              **SCAN_LAMBDAS[(dataset, direction)]},
                    "train": schedule}
    # SAVE Tables 4-5 (the ablations, all in the i-t AVG setting): self-attention variants on c5, fusion of
    # c4+c5 / c3+c4+c5, NL-ms2; the paper gives no schedule beyond SCAN's "same settings": F30K's.
    # model.direction=both gives Table 1's averaged i-t/t-i scores (footnote 1).
    save_i2t = {"arch": "save", "direction": "i2t", "pool": "avg", **SCAN_LAMBDAS[("f30k", "i2t")]}
    save_variants = {
        "save_nosa": {"attention": "none", "scales": "c5"},
        "save_dsa": {"attention": "dsa", "scales": "c5"},
        "save_asa": {"attention": "asa", "scales": "c5"},
        "save_asa_ms2": {"attention": "asa", "scales": "c4,c5"},
        "save_asa_ms3": {"attention": "asa", "scales": "c3,c4,c5"},
        "save_nl_ms2": {"attention": "asa", "scales": "c4,c5", "fusion": "nl"},
        # the best of Table 1 (ASA-ms3) trained end to end from pixels, backbone fine-tuned at lr / 10
        "save_asa_ms3_ft": {"attention": "asa", "scales": "c3,c4,c5", "pixels": True, "finetune": True},
    }
    for name, save in save_variants.items():
        presets[name] = {"model": {**save_i2t, "save": save}, "train": F30K_SCHEDULE}
    return presets


PRESETS = _presets()


def list_models() -> list[str]:
    """Names of every preset, e.g. scan_t2i_avg, scan_i2t_lse_coco, vsepp, summax_t2i."""
    return sorted(PRESETS)


def preset_config(name: str) -> Config:
    if name not in PRESETS:
        close = [p for p in PRESETS if name.split("_")[0] in p][:8]
        raise ConfigError(f"unknown model {name!r}",
                          hint=f"run `itmatch models` for the list; similar: {', '.join(close) or 'none'}")
    cfg = config_from_dict(copy.deepcopy(PRESETS[name]))
    cfg.preset = cfg.name = name
    return cfg


def resolve_config(preset: str | None, *layers: dict[str, Any]) -> Config:
    """Defaults <- preset <- each layer (YAML file, CLI --set) in order."""
    cfg = preset_config(preset) if preset else Config()
    for layer in layers:
        layer = dict(layer)
        if "preset" in layer and layer["preset"] and not preset:
            cfg = preset_config(layer["preset"])
        layer.pop("preset", None)
        update(cfg, layer)
    return cfg


def _region_rnn_matcher(mc: ModelConfig, head: SimilarityHead, is_global: bool = False) -> Matcher:
    """Region FC image side + (Bi)GRU text side, the encoders SCAN and its baselines share."""
    image = RegionEncoder(mc.img_dim, mc.embed_size, norm=mc.img_norm, pool=is_global)
    text = RNNTextEncoder(mc.vocab_size, mc.word_dim, mc.embed_size, num_layers=mc.text_layers,
                          bidirectional=mc.bidirectional, rnn=mc.text_rnn, norm=mc.txt_norm,
                          pool="last" if is_global else "none")
    return Matcher(image, text, head)


def _build_vsepp(mc: ModelConfig) -> Matcher:
    return _region_rnn_matcher(mc, GlobalCosineHead(), is_global=True)


def _build_summax(mc: ModelConfig) -> Matcher:
    return _region_rnn_matcher(mc, SumMaxHead(mc.direction))


def _build_scan(mc: ModelConfig) -> Matcher:
    return _region_rnn_matcher(mc, _scan_head(mc))


def _scan_head(mc: ModelConfig) -> SimilarityHead:
    """SCAN's head in mc.direction; "both" averages a t-i head (mc.lambda_*) and an i-t head
    (mc.save.i2t_lambda_*)."""
    if mc.direction == "both":
        return TwoWayScanHead(
            ScanHead("t2i", mc.pool, mc.lambda_softmax, mc.lambda_lse, mc.raw_feature_norm, mc.clip_slope),
            ScanHead("i2t", mc.pool, mc.save.i2t_lambda_softmax, mc.save.i2t_lambda_lse, mc.raw_feature_norm,
                     mc.clip_slope))
    return ScanHead(mc.direction, mc.pool, mc.lambda_softmax, mc.lambda_lse, mc.raw_feature_norm, mc.clip_slope)


def _build_save(mc: ModelConfig) -> Matcher:
    sc = mc.save
    scales = parse_scales(sc.scales)
    if sc.finetune and not sc.pixels:
        raise ValueError("model.save.finetune needs model.save.pixels=true (the backbone runs inside the model)")
    backbone = tail = None
    if sc.pixels or sc.fusion == "nl":
        from itmatch.features.backbones import STAGE_NAMES, load_backbone

        net = load_backbone(sc.backbone, frozen=not sc.finetune)
        dims = dict(zip(STAGE_NAMES, net.stage_dims, strict=True))
        backbone = net if sc.pixels else None
        if sc.fusion == "nl":  # with a backbone in the model, its tail's parameters are already there
            tail = net.tail() if backbone is None else Borrowed(net.tail())
    else:
        dims = {"c3": sc.c3_dim, "c4": sc.c4_dim, "c5": mc.img_dim}
        unset = [s for s in scales if dims[s] <= 0]
        if unset:
            raise ValueError(f"channels of cached scale(s) {unset} unknown: set model.save.c3_dim/c4_dim "
                             "(the trainer takes them from the data)")
    fusion = MultiScaleSelfAttention(scales, dims, sc.attention, sc.fusion, sc.dsa_lambda, tail)
    image = SaveImageEncoder(fusion, mc.embed_size, norm=mc.img_norm, backbone=backbone)
    text = RNNTextEncoder(mc.vocab_size, mc.word_dim, mc.embed_size, num_layers=mc.text_layers,
                          bidirectional=mc.bidirectional, rnn=mc.text_rnn, norm=mc.txt_norm)
    model = Matcher(image, text, _scan_head(mc))
    if sc.finetune:
        model.lr_scales = {"image_encoder.backbone.": sc.backbone_lr_scale}
    return model


def image_inputs(mc: ModelConfig) -> tuple[str, ...]:
    """What a model's image encoder reads from a dataset: () the precomp `{split}_ims.npy` array (every
    region model); ("pixels",) decoded image files of data.images; or cached stage maps by name, e.g.
    ("c4", "c5"), where c5 is `{split}_ims.npy` and c3/c4 are `{split}_ims_c3.npy`/`_c4.npy`."""
    if mc.arch != "save":
        return ()
    if mc.save.pixels:
        return ("pixels",)
    scales = parse_scales(mc.save.scales)
    return scales if scales != ("c5",) else ()


#: model.arch -> builder. A new model adds its builder here and its presets to PRESETS.
BUILDERS: dict[str, Callable[[ModelConfig], Matcher]] = {
    "vsepp": _build_vsepp,
    "summax": _build_summax,
    "scan": _build_scan,
    "save": _build_save,
}


def build_model(mc: ModelConfig) -> Matcher:
    if mc.vocab_size <= 0 or mc.img_dim <= 0:
        raise ConfigError("model.vocab_size and model.img_dim must be set (the trainer fills them from data)")
    if mc.arch not in BUILDERS:
        raise ConfigError(f"unknown model.arch {mc.arch!r}", hint=f"choose one of {', '.join(BUILDERS)}")
    try:
        return BUILDERS[mc.arch](mc)
    except ValueError as exc:  # an invalid option value the module rejected
        raise ConfigError(str(exc)) from None
