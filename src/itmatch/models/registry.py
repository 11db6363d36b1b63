"""Name -> model. A model family registers itself from its own package (`itmatch/models/<system>/`): its `Arch`
with `@register_arch` (how to build it, and what the engine, the API and the bench ask it), its presets with
`@register_presets` and its options with `@register_options` (itmatch.config: the section `model.<key>`).
This module knows no arch by name; docs/architecture.md walks through adding one."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any, ClassVar

from itmatch.config import ARCH_NAMES, Config, ModelConfig, config_from_dict, locate, update
from itmatch.data.vocab import AnyVocab
from itmatch.errors import ConfigError
from itmatch.models.base import Matcher
from itmatch.models.encoders import read_pixels_through

#: a partial config: {"model": {...}, "train": {...}, ...} applied over the defaults; at registration it may also
#: carry "paper": the paper row or table it reproduces (kept in PAPER_ROWS, not in the config)
Preset = dict[str, Any]


class Arch:
    """One value of model.arch. Subclass it, set `name`, implement `build`, and override what differs from
    the defaults below (a region model reading cached features or, with model.pixels, image files)."""

    name: ClassVar[str] = ""
    #: the image encoder reads pixels through its own CNN (SAVE); otherwise a region encoder is given
    #: model.backbone when model.pixels is set (`read_pixels_through`)
    owns_backbone: ClassVar[bool] = False
    #: the l2-normalisation switches of ModelConfig the model reads; a new run refuses the others switched off, which
    #: it would ignore (check_norm_switches): OAN, MMCA and SMAN score as their papers do, whatever these say
    norm_keys: ClassVar[tuple[str, ...]] = ("img_norm", "txt_norm")

    def build(self, mc: ModelConfig) -> Matcher:  # pragma: no cover - abstract
        raise NotImplementedError

    def backbone(self, mc: ModelConfig) -> str:
        """The ImageNet CNN whose features the model reads (from image files, or cached)."""
        return mc.backbone

    def pixel_backbone(self, mc: ModelConfig) -> str:
        """The CNN through which the model reads image files, "" when it reads cached features."""
        return self.backbone(mc) if mc.pixels else ""

    def image_inputs(self, mc: ModelConfig) -> tuple[str, ...]:
        """What the image encoder reads from a dataset: () the precomp `{split}_ims.npy` array; ("pixels",)
        decoded image files of data.images; or cached stage maps by name, e.g. ("c4", "c5"), where c5 is
        `{split}_ims.npy` and c3/c4 are `{split}_ims_c3.npy`/`_c4.npy`."""
        return ("pixels",) if self.pixel_backbone(mc) else ()

    def feature_dims(self, mc: ModelConfig) -> dict[str, str]:
        """Feature name -> the config key its channel count fills when the trainer reads the data."""
        return {"c5": "model.img_dim"}

    def regions_key(self, mc: ModelConfig) -> str | None:
        """The config key of the number of regions an image must have, which the trainer checks against the data
        before anything is written (SMAN reads its grid in order: model.sman.regions); None: any number."""
        return None

    def tokenizer(self, mc: ModelConfig) -> AnyVocab | None:
        """The tokenizer the model brings (data.tokenizer=wordpiece: MMCA's frozen encoder's), or None: a
        word vocabulary built from the training captions."""
        return None


ARCHS: dict[str, Arch] = {}
PRESETS: dict[str, Preset] = {}
#: preset name -> what it reproduces, e.g. "SCAN Table 1: t-i AVG", or "this toolkit's: ..." where it is no paper row
PAPER_ROWS: dict[str, str] = {}


_ROMAN = ("I", "II", "III", "IV", "V", "VI", "VII", "VIII", "IX", "X")
_TABLE_LIST = re.compile(r"Tables? ((?:\d+|[IVX]+\b)(?:\s*[,/-]\s*(?:\d+|[IVX]+\b))*)")


def describes(name: str, text: str) -> bool:
    """Whether every word of `text` (any case; "table N" one term, a whole number) is in preset `name`'s name or
    paper row, where a row of several tables ("SCAN Tables 1, 3", "Tables 3-5", "Tables I, II, IV") reads as
    each of them ("table 3", "table iv"): "save table 5" finds SAVE's rows of Tables 4, 5 too."""
    row = PAPER_ROWS.get(name, "")
    tables = []
    for listed in _TABLE_LIST.findall(row):
        for item in re.split(r"\s*[,/]\s*", listed):
            first, _, last = item.partition("-")
            roman = first in _ROMAN
            number = (lambda s: _ROMAN.index(s) + 1) if roman else int
            for n in range(number(first), number(last or first) + 1):
                tables.append(f"table {_ROMAN[n - 1] if roman else n}")
    haystack = " ".join([name, row, *tables]).lower()
    return all(re.search(rf"\b{re.escape(term)}\b", haystack) if term.startswith("table ") else term in haystack
               for term in re.findall(r"tables? \S+|\S+", text.lower()))


def register_arch(cls: type[Arch]) -> type[Arch]:
    """Class decorator: model.arch=cls.name builds with cls."""
    if not cls.name or cls.name in ARCHS:
        raise ValueError(f"arch {cls.name!r} is empty or already registered")
    ARCHS[cls.name] = cls()
    ARCH_NAMES.append(cls.name)  # (model.arch's check: the config knows no model package)
    return cls


def register_presets(make: Callable[[], dict[str, Preset]]) -> Callable[[], dict[str, Preset]]:
    """Function decorator: the presets `make()` returns, by name, each a partial config naming its arch: every
    paper configuration worth reproducing, with the paper's hyper-parameters (the CPU schedule of docs/ is
    applied on top). A preset's "paper" key, the row it reproduces, goes to PAPER_ROWS (`itmatch models` shows
    it; config resolution never sees it)."""
    for name, preset in make().items():
        if name in PRESETS:
            raise ValueError(f"preset {name!r} is already registered")
        PRESETS[name] = {key: value for key, value in preset.items() if key != "paper"}
        if preset.get("paper"):
            PAPER_ROWS[name] = str(preset["paper"])
    return make


def arch(mc: ModelConfig | str) -> Arch:
    """The registered Arch of a model config (or of an arch name)."""
    name = mc if isinstance(mc, str) else mc.arch
    if name not in ARCHS:
        raise ConfigError(f"unknown model.arch {name!r}", hint=f"choose one of {', '.join(ARCHS)}")
    return ARCHS[name]


def list_models() -> list[str]:
    """Names of every preset, e.g. scan_t2i_avg, scan_i2t_lse_coco, vsepp, summax_t2i."""
    return sorted(PRESETS)


def check_preset(name: str) -> None:
    """A ConfigError unless `name` is a registered preset's, naming similar ones."""
    if name not in PRESETS:
        close = [p for p in PRESETS if name.split("_")[0] in p][:8]
        raise ConfigError(f"unknown model {name!r}",
                          hint=f"run `itmatch models` for the list; similar: {', '.join(close) or 'none'}")


def preset_config(name: str) -> Config:
    check_preset(name)
    cfg = config_from_dict(copy.deepcopy(PRESETS[name]))
    cfg.preset = cfg.name = name
    return cfg


def resolve_config(preset: str | None, *layers: dict[str, Any]) -> Config:
    """Defaults <- preset <- each layer (YAML file, --data, CLI --set) in order. Errors name where a key was
    written when its layer is a `Layer` (FILE:LINE, the --set pair).

    The preset is `preset` (--preset), else the one the last layer naming one names (`preset: NAME` in a file,
    `--set preset=NAME`; "" names none: the defaults). Every layer applies on top of it, those before the one
    naming it too. A layer naming a preset other than a given `preset` is refused where it names it (`--preset
    vsepp --config FILE` with `preset: scan_t2i_avg` in FILE: which one was meant?); naming the same one is fine."""
    name = preset_of(preset, *layers)
    cfg = preset_config(name) if name else Config()
    for layer in layers:
        update(cfg, layer)  # (a preset a layer names is `name`, or one a later layer replaced: a known one)
    read_pixels_for_finetuning(cfg)
    return cfg


def preset_of(preset: str | None, *layers: dict[str, Any]) -> str:
    """The preset a config is built from (resolve_config): `preset`, else the last layer's that names one ("" for
    none). A layer naming another than a given `preset` is a ConfigError where it names it."""
    name = preset or ""
    for layer in layers:
        named = _named_preset(layer)
        if named is None:
            continue
        if preset and named != preset:
            instead = f", or pass --preset {named} instead" if named else ""
            exc = ConfigError(f"preset {named!r} conflicts with the preset given, {preset!r} (--preset)",
                              hint=f"name one preset: drop this one{instead}")
            locate(exc, getattr(layer, "origins", {}), "preset")
            raise exc
        name = named
    return name


def _named_preset(layer: dict[str, Any]) -> str | None:
    """The preset a config layer names (its `preset` key, as written: `Layer.texts`), None where it names none; a
    ConfigError where it was written when that is no preset's name."""
    if "preset" not in layer:
        return None
    name = getattr(layer, "texts", {}).get("preset", layer["preset"])
    try:
        if not isinstance(name, str):
            raise ConfigError(f"preset: expected a preset's name, got {name!r}",
                              hint="run `itmatch models` for the list")
        if name:
            check_preset(name)
    except ConfigError as exc:
        locate(exc, getattr(layer, "origins", {}), "preset")
        raise
    return name


def pixel_backbone(mc: ModelConfig) -> str:
    """The ImageNet CNN through which the model reads image files, "" when it reads cached features."""
    return arch(mc).pixel_backbone(mc)


def image_inputs(mc: ModelConfig) -> tuple[str, ...]:
    """What the model's image encoder reads from a dataset (Arch.image_inputs)."""
    return arch(mc).image_inputs(mc)


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


def check_norm_switches(mc: ModelConfig) -> None:
    """A ConfigError for model.img_norm / txt_norm switched off where the arch never reads it (Arch.norm_keys): a new
    run would train without the setting it asked for. (Checked where a run starts, not in build_model: a checkpoint
    written before the check loads as it trained.)"""
    family = arch(mc)
    ignored = [key for key in ("img_norm", "txt_norm") if key not in family.norm_keys and not getattr(mc, key)]
    if ignored:
        raise ConfigError(f"model.{ignored[0]}=false does not apply to model.arch={family.name}: it would be ignored "
                          f"({family.name} normalises its embeddings as its paper does)",
                          hint=f"leave model.{ignored[0]} out")


def build_model(mc: ModelConfig) -> Matcher:
    if mc.vocab_size <= 0 or mc.img_dim <= 0:
        raise ConfigError("model.vocab_size and model.img_dim must be set (the trainer fills them from data)")
    family = arch(mc)
    try:
        model = family.build(mc)
    except ValueError as exc:  # an invalid option value the module rejected
        raise ConfigError(str(exc)) from None
    name = family.pixel_backbone(mc)
    if name and not family.owns_backbone:
        from itmatch.features.backbones import load_backbone

        backbone = load_backbone(name)
        if backbone.out_dim != mc.img_dim:
            raise ConfigError(f"model.img_dim={mc.img_dim} but model.backbone {name!r} gives "
                              f"{backbone.out_dim}-d cells", hint="drop the model.img_dim override")
        read_pixels_through(model.image_encoder, backbone)
    return model
