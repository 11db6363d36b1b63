"""Name -> model. Every paper configuration worth reproducing is a named preset: a partial config
applied over the defaults (paper hyper-parameters; the CPU schedule of docs/ is applied on top)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from torch import nn

from itmatch.config import Config, ModelConfig, config_from_dict, update
from itmatch.errors import ConfigError
from itmatch.models.base import Matcher, SimilarityHead
from itmatch.models.grid import Borrowed, MultiScaleSelfAttention, SaveImageEncoder, parse_scales
from itmatch.models.heads import GlobalCosineHead, MMCAHead, OANHead, ScanHead, SMANHead, SumMaxHead, TwoWayScanHead
from itmatch.models.image import MMCAImageEncoder, RegionEncoder, SMANImageEncoder, read_pixels_through
from itmatch.models.text import FrozenTransformer, MMCATextEncoder, RNNTextEncoder, SMANTextEncoder, TextCNNEncoder

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

# SMAN section IV-A3: Adadelta lr 0.05 -> 0.005 after 50 of 60 epochs, weight decay 5e-4, clipping 0.1,
# batch 128, m1 = 0.2; every hidden size (word embedding, GRU, BiLSTM, attention, common space) 512.
SMAN_SCHEDULE = {"epochs": 60, "optimizer": "adadelta", "lr": 0.05, "lr_update": 50, "weight_decay": 5e-4,
                 "grad_clip": 0.1, "batch_size": 128}
SMAN_MODEL = {"arch": "sman", "embed_size": 512, "word_dim": 512, "text_rnn": "lstm"}
# name -> (model.sman switches, other model fields): SMAN (random words), the pretrained-vector variant
# (spaCy en_core_web_md 300-d in place of GloVe) and the ablations of section IV-A4 / Table III-V.
SMAN_VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "sman": ({}, {}),
    "sman_w2v_spacy": ({}, {"word_vectors": "spacy_md", "word_dim": 300}),
    "sman_im": ({"steps": 1, "spatial": False}, {}),  # intra-modal attention, no v(loc)
    "sman_im_loc": ({"steps": 1}, {}),  # intra-modal attention with v(loc)
    "sman_sim": ({"alpha": 1.0}, {}),  # stacked intra-modal attention (gate at alpha = 1)
    "sman_inter": ({"intra_pair_weight": 0.0}, {}),  # ranking loss only (no Eq. 22 term)
}

# OAN section 5.2, the same for Flickr30K and COCO: D = 512, 300-d words, Adam 5e-4 -> 5e-5 after epoch 15,
# weight decay 1e-6, clip 2.0, batch 128, 24 epochs; alpha_inter = 0.2 is loss.margin; the rest is
# OANConfig's defaults (lambda_TT = lambda_VV = 1, lambda_TV = 0.9, lambda_VT = 0.5, alpha_intra = 0.1,
# beta = 0.5, K = 6, gamma = 0.3).
OAN_SCHEDULE = {"epochs": 24, "optimizer": "adam", "lr": 5e-4, "lr_update": 15, "weight_decay": 1e-6,
                "grad_clip": 2.0, "batch_size": 128}
# Table 2 of OAN (ablations): preset suffix -> model.oan switches. `oan` is the paper's chosen full model (Eq. 10 + 12).
OAN_VARIANTS: dict[str, dict[str, Any]] = {
    "": {"negatives": "eq12"},  # full model, Eq. 10 with the Eq. 12 intra-modal negatives (the paper's choice)
    "_eq11": {"negatives": "eq11"},  # full model, Eq. 10 with the Eq. 11 intra-modal negatives
    "_no_intra_neg": {"negatives": "none"},  # no intra-modal hard negatives (Eq. 9)
    "_no_inter_attn": {"inter": False},  # no inter-modal attention
    "_no_intra_attn": {"intra": "none"},  # no intra-modal attention
    "_no_attn": {"inter": False, "intra": "mean"},  # no attention: mean pooling in each modality
    "_bilstm": {"text_encoder": "bilstm"},  # no object-oriented textual encoder
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
    for name, (switches, fields) in SMAN_VARIANTS.items():
        presets[name] = {"model": {**SMAN_MODEL, **fields, "sman": switches}, "loss": {"margin": 0.2},
                         "train": SMAN_SCHEDULE}
    for suffix, switches in OAN_VARIANTS.items():
        presets[f"oan{suffix}"] = {"model": {"arch": "oan", "embed_size": 512, "word_dim": 300, "oan": switches},
                                   "loss": {"margin": 0.2}, "train": OAN_SCHEDULE}
    # MMCA section 4.2: hidden size 256 (best in Tables 4/5), Adam 2e-4 for 10 epochs then 2e-5 for 10,
    # batch 64, margin 0.2, alpha 0.2 (Table 6); WordPiece tokens of the frozen text encoder.
    mmca_base = {"train": {"epochs": 20, "lr": 2e-4, "lr_update": 10, "batch_size": 64},
                 "loss": {"margin": 0.2}, "data": {"tokenizer": "wordpiece"}}
    for name, model in (("mmca", {"embed_size": 256, "mmca": {"alpha": 0.2}}),
                        ("mmca_alpha0", {"embed_size": 256, "mmca": {"alpha": 0.0}}),  # self-attention only
                        ("mmca_h512", {"embed_size": 512, "mmca": {"alpha": 0.2}})):  # a larger hidden size
        presets[name] = {"model": {"arch": "mmca", **model}, **copy.deepcopy(mmca_base)}
    # SAVE Tables 4-5 (the ablations, all in the i-t AVG setting): self-attention variants on c5, fusion of
    # c4+c5 / c3+c4+c5, NL-ms2; the paper gives no schedule beyond SCAN's "same settings": F30K's.
    # model.direction=both gives Table 1's averaged i-t/t-i scores (footnote 1). Both directions' lambdas are
    # set (SCAN Table 1): t-i in model.lambda_*, i-t in model.save.i2t_lambda_*, so `--set model.direction=t2i`
    # or `=both` scores t-i with 9 / 6, not with the i-t 4 / 5.
    save_i2t = {"arch": "save", "direction": "i2t", "pool": "avg", **SCAN_LAMBDAS[("f30k", "t2i")]}
    i2t_lambdas = {f"i2t_{k}": v for k, v in SCAN_LAMBDAS[("f30k", "i2t")].items()}
    save_variants = {
        "save_nosa": {"attention": "none", "scales": "c5"},
        "save_dsa": {"attention": "dsa", "scales": "c5"},
        "save_asa": {"attention": "asa", "scales": "c5"},
        # fused scales are standardised per cell first (model.save.scale_norm; docs/save.md): EfficientNet's raw
        # c3/c4 outweigh c5 ~3:1 in norm, and a 2-epoch run fusing them raw fell to half the single-scale rsum
        "save_asa_ms2": {"attention": "asa", "scales": "c4,c5", "scale_norm": "layernorm"},
        "save_asa_ms3": {"attention": "asa", "scales": "c3,c4,c5", "scale_norm": "layernorm"},
        "save_nl_ms2": {"attention": "asa", "scales": "c4,c5", "fusion": "nl"},
        # the best of Table 1 (ASA-ms3) trained end to end from pixels, backbone fine-tuned at lr / 10
        "save_asa_ms3_ft": {"attention": "asa", "scales": "c3,c4,c5", "scale_norm": "layernorm", "pixels": True,
                            "finetune": True},
        # DSA (the best frozen row on Flickr8K dev, docs/save.md) end to end; the Flickr8K row continues the
        # frozen save_dsa run with train.init_from
        "save_dsa_ft": {"attention": "dsa", "scales": "c5", "pixels": True, "finetune": True},
    }
    for name, save in save_variants.items():
        presets[name] = {"model": {**save_i2t, "save": {**save, **i2t_lambdas}}, "train": F30K_SCHEDULE}
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
    read_pixels_for_finetuning(cfg)
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
    """SCAN's head in mc.direction; "both" averages a t-i head and an i-t head (each with its lambdas)."""
    def head(direction: str, lambdas: tuple[float, float]) -> ScanHead:
        return ScanHead(direction, mc.pool, *lambdas, mc.raw_feature_norm, mc.clip_slope)

    t2i_lambdas = (mc.lambda_softmax, mc.lambda_lse)
    if mc.direction == "both":
        return TwoWayScanHead(head("t2i", t2i_lambdas), head("i2t", _i2t_lambdas(mc)))
    return head(mc.direction, t2i_lambdas if mc.direction == "t2i" else _i2t_lambdas(mc))


def _i2t_lambdas(mc: ModelConfig) -> tuple[float, float]:
    """The i-t head's (lambda_1, lambda_2). SAVE and a two-way head hold both directions' lambdas: the i-t
    ones in model.save.i2t_lambda_*, model.lambda_* being the t-i ones. A one-way SCAN model has only its own
    direction's, in model.lambda_* (the scan_i2t_* presets set 4 / 5 there)."""
    if mc.arch == "save" or mc.direction == "both":
        return mc.save.i2t_lambda_softmax, mc.save.i2t_lambda_lse
    return mc.lambda_softmax, mc.lambda_lse


def _build_save(mc: ModelConfig) -> Matcher:
    sc = mc.save
    scales = parse_scales(sc.scales)
    pixels = bool(pixel_backbone(mc))
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
    fusion = MultiScaleSelfAttention(scales, dims, sc.attention, sc.fusion, sc.dsa_lambda, tail, sc.scale_norm)
    image = SaveImageEncoder(fusion, mc.embed_size, norm=mc.img_norm, backbone=backbone)
    text = RNNTextEncoder(mc.vocab_size, mc.word_dim, mc.embed_size, num_layers=mc.text_layers,
                          bidirectional=mc.bidirectional, rnn=mc.text_rnn, norm=mc.txt_norm)
    model = Matcher(image, text, _scan_head(mc))
    if sc.finetune:
        model.lr_scales["image_encoder.backbone."] = sc.backbone_lr_scale
    return model


def pixel_backbone(mc: ModelConfig) -> str:
    """The ImageNet CNN through which the model reads image files (model.pixels; SAVE: model.save.pixels
    with model.save.backbone), "" when it reads cached features."""
    if mc.arch == "save":
        return mc.save.backbone if mc.pixels or mc.save.pixels else ""
    return mc.backbone if mc.pixels else ""


def finetune_backbone(cfg: Config, model: Matcher) -> None:
    """train.finetune_backbone: the model's image CNN trains, at train.lr * train.backbone_lr_scale (its own
    optimizer group), BatchNorm frozen. Applied by the trainer to a new or resumed run alike."""
    if not cfg.train.finetune_backbone:
        return
    backbone = getattr(model.image_encoder, "backbone", None)
    if backbone is None or not pixel_backbone(cfg.model):
        raise ConfigError("train.finetune_backbone: this model does not read pixels",
                          hint="set model.pixels=true and data.images=DIR (the trainer does it for you)")
    backbone.set_trainable(freeze_batchnorm=True)
    model.lr_scales["image_encoder.backbone."] = cfg.train.backbone_lr_scale


def read_pixels_for_finetuning(cfg: Config) -> None:
    """Fine-tuning the CNN needs the model to read pixels: set model.pixels (recorded in the run's config,
    so evaluation reads image files too)."""
    if cfg.train.finetune_backbone:
        cfg.model.pixels = True


def image_inputs(mc: ModelConfig) -> tuple[str, ...]:
    """What a model's image encoder reads from a dataset: () the precomp `{split}_ims.npy` array (every
    region model); ("pixels",) decoded image files of data.images; or cached stage maps by name, e.g.
    ("c4", "c5"), where c5 is `{split}_ims.npy` and c3/c4 are `{split}_ims_c3.npy`/`_c4.npy`."""
    if pixel_backbone(mc):
        return ("pixels",)
    if mc.arch != "save":
        return ()
    scales = parse_scales(mc.save.scales)
    return scales if scales != ("c5",) else ()


def _build_sman(mc: ModelConfig) -> Matcher:
    s = mc.sman
    image = SMANImageEncoder(mc.img_dim, mc.embed_size, s.att_hidden, regions=s.regions, spatial=s.spatial,
                             divide_by_m=s.divide_by_m, dropout=s.dropout)
    text = SMANTextEncoder(mc.vocab_size, mc.word_dim, mc.embed_size, s.att_hidden, rnn=mc.text_rnn,
                           dropout=s.dropout)
    head = SMANHead(mc.img_dim, mc.embed_size, s.att_hidden, regions=s.regions, steps=s.steps, alpha=s.alpha,
                    divide_by_m=s.divide_by_m, intra_pair_weight=s.intra_pair_weight,
                    intra_pair_margin=s.intra_pair_margin, intra_pair_form=s.intra_pair_form)
    return Matcher(image, text, head)


def parse_kernels(text: str) -> tuple[int, ...]:
    """"1,2,3,5,7" -> (1, 2, 3, 5, 7)."""
    try:
        kernels = tuple(int(k) for k in str(text).replace(" ", "").split(",") if k)
    except ValueError:
        kernels = ()
    if not kernels or min(kernels) < 1:
        raise ConfigError(f"model.oan.kernels={text!r} is not a list of kernel widths",
                          hint="e.g. --set model.oan.kernels=1,2,3,5,7")
    return kernels


def _build_oan(mc: ModelConfig) -> Matcher:
    """OAN: tanh(FC) visual objects (Eq. 3), TextCNN textual objects (Eq. 1-2) or a BiLSTM (Table 2),
    and the OAN head. Object embeddings are not l2-normalised (model.img_norm / txt_norm do not apply)."""
    o = mc.oan
    image = RegionEncoder(mc.img_dim, mc.embed_size, norm=False, activation="tanh")
    if o.text_encoder == "cnn":
        text: nn.Module = TextCNNEncoder(mc.vocab_size, mc.word_dim, mc.embed_size, kernels=parse_kernels(o.kernels),
                                         channels=o.cnn_channels)
    elif o.text_encoder == "bilstm":
        text = RNNTextEncoder(mc.vocab_size, mc.word_dim, mc.embed_size, num_layers=mc.text_layers,
                              bidirectional=True, rnn="lstm", norm=False)
    else:
        raise ConfigError(f"unknown model.oan.text_encoder {o.text_encoder!r}", hint="choose cnn or bilstm")
    head = OANHead(k_heads=o.k_heads, embed_size=mc.embed_size, lambda_tt=o.lambda_tt, lambda_vv=o.lambda_vv,
                   lambda_tv=o.lambda_tv, lambda_vt=o.lambda_vt, gamma=o.gamma, inter=o.inter, intra=o.intra,
                   negatives=o.negatives, alpha_intra=o.alpha_intra, beta=o.beta)
    return Matcher(image, text, head)


def _build_mmca(mc: ModelConfig) -> Matcher:
    from itmatch.features.text_backbone import load_pretrained_encoder

    c = mc.mmca
    encoder = FrozenTransformer(load_pretrained_encoder(c.text_model))
    vocab_size = int(encoder.hf.config.vocab_size)
    if mc.vocab_size != vocab_size:
        raise ConfigError(f"model.vocab_size is {mc.vocab_size} but the text encoder {c.text_model!r} has "
                          f"{vocab_size} WordPiece ids",
                          hint="MMCA needs data.tokenizer=wordpiece (the presets set it)")
    image = MMCAImageEncoder(mc.img_dim, mc.embed_size, c.heads, c.ffn_dim, c.dropout)
    text = MMCATextEncoder(encoder, mc.embed_size, c.filters, c.text_layernorm)
    head = MMCAHead(mc.embed_size, c.heads, c.ffn_dim, c.filters, c.dropout, c.alpha, c.text_layernorm,
                    c.three_term, c.train_negatives, c.pair_chunk)
    return Matcher(image, text, head)


#: model.arch -> builder. A new model adds its builder here and its presets to PRESETS.
BUILDERS: dict[str, Callable[[ModelConfig], Matcher]] = {
    "vsepp": _build_vsepp,
    "summax": _build_summax,
    "scan": _build_scan,
    "sman": _build_sman,
    "oan": _build_oan,
    "mmca": _build_mmca,
    "save": _build_save,
}


def build_model(mc: ModelConfig) -> Matcher:
    if mc.vocab_size <= 0 or mc.img_dim <= 0:
        raise ConfigError("model.vocab_size and model.img_dim must be set (the trainer fills them from data)")
    if mc.arch not in BUILDERS:
        raise ConfigError(f"unknown model.arch {mc.arch!r}", hint=f"choose one of {', '.join(BUILDERS)}")
    try:
        model = BUILDERS[mc.arch](mc)
    except ValueError as exc:  # an invalid option value the module rejected
        raise ConfigError(str(exc)) from None
    if mc.arch != "save" and pixel_backbone(mc):  # (SAVE reads its backbone's stage maps itself)
        from itmatch.features.backbones import load_backbone

        backbone = load_backbone(mc.backbone)
        if backbone.out_dim != mc.img_dim:
            raise ConfigError(f"model.img_dim={mc.img_dim} but model.backbone {mc.backbone!r} gives "
                              f"{backbone.out_dim}-d cells", hint="drop the model.img_dim override")
        read_pixels_through(model.image_encoder, backbone)
    return model
