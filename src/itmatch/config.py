"""Run configuration: a plain dataclass tree, loaded from YAML, overridable with `--set a.b=c`.
Unknown keys are errors; the resolved config is saved with every run and checkpoint."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from itmatch.errors import ConfigError


@dataclass
class SaveConfig:
    """SAVE (docs/save.md): CNN grid candidates, self-attention, multi-scale fusion."""

    attention: str = "asa"  # none | dsa (Eq. 1-4) | asa (Eq. 5-8)
    scales: str = "c5"  # comma list, finest first: c5 | c4,c5 (ms2) | c3,c4,c5 (ms3)
    fusion: str = "concat"  # concat (Fig. 3: max-pool + concat) | nl (NL-ms2: SA inside the backbone)
    dsa_lambda: float = 1.0  # inverse temperature of the DSA softmax (Eq. 3 has none: 1)
    backbone: str = "lite0"  # the CNN of pixel input and of the NL tail (cached maps name theirs in meta.json)
    pixels: bool = False  # the model reads images (data.images), through its own backbone
    finetune: bool = False  # train the backbone too (needs pixels); its lr is train.lr * backbone_lr_scale
    backbone_lr_scale: float = 0.1
    c3_dim: int = 0  # channels of cached c3 / c4 maps (0: taken from the data)
    c4_dim: int = 0
    i2t_lambda_softmax: float = 4.0  # lambdas of the i-t half when model.direction = both (SCAN F30K i-t)
    i2t_lambda_lse: float = 5.0


@dataclass
class ModelConfig:
    arch: str = "scan"  # vsepp | summax | scan | save
    img_dim: int = 0  # 0: taken from the data's feature dimension
    vocab_size: int = 0  # 0: taken from the vocabulary
    embed_size: int = 1024
    word_dim: int = 300
    text_rnn: str = "gru"  # gru | lstm
    text_layers: int = 1
    bidirectional: bool = True
    img_norm: bool = True  # l2-normalise region embeddings (SCAN's no_imgnorm=False)
    txt_norm: bool = True
    direction: str = "t2i"  # t2i | i2t (SCAN, Sum-Max); both (SAVE: average of t-i and i-t scores)
    pool: str = "avg"  # avg | lse | max | sum (SCAN)
    lambda_softmax: float = 9.0  # lambda_1, inverse softmax temperature
    lambda_lse: float = 6.0  # lambda_2
    raw_feature_norm: str = "clipped_l2norm"  # clipped_l2norm | l2norm | clipped | softmax | no_norm
    clip_slope: float = 0.1  # LeakyReLU slope of the "clipped" norms; 0 gives the paper's ReLU
    save: SaveConfig = field(default_factory=SaveConfig)


@dataclass
class LossConfig:
    margin: float = 0.2
    hardest: bool = True  # hardest negatives (Eq. 12) rather than the sum over negatives (Eq. 11)
    warmup_epochs: int = 0  # epochs with the sum over negatives before switching to the hardest
    # Two captions of one image in a batch are each other's "negatives" in the public code (about one
    # such pair per batch of 128 on Flickr); True excludes them from the negatives.
    mask_same_image: bool = False


@dataclass
class TrainConfig:
    epochs: int = 30
    optimizer: str = "adam"  # adam | adadelta (SMAN)
    lr: float = 2e-4
    weight_decay: float = 0.0  # L2 penalty of the optimizer (OAN 1e-6, SMAN 5e-4)
    lr_update: int = 15  # lr = lr0 * 0.1 ** (epoch // lr_update)
    batch_size: int = 128
    grad_clip: float = 2.0
    seed: int = 0
    bucket_by_length: bool = False  # batches of similar caption length (less padding; see docs/training.md)
    max_batches: int = 0  # >0: cap batches per epoch (quick runs); 0: the whole split
    val_images: int = 1000  # model selection on the first N dev images (SCAN)
    log_every: int = 20
    threads: int = 0  # 0: all cores


@dataclass
class DataConfig:
    path: str = ""  # precomp directory
    images: str = ""  # images folder ({split}_ids.txt name files in it); read by pixel-input models (SAVE e2e)
    vocab: str = ""  # vocabulary JSON; empty: build from the training captions
    backbone: str = ""  # the CNN the features came from (read from the data's meta.json); used by itmatch.load
    train_split: str = "train"
    val_split: str = "dev"


@dataclass
class Config:
    name: str = "run"
    preset: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(value: Any, typ: Any, key: str) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif typ is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif typ is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    elif typ is str and isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{key}: expected {typ.__name__}, got {value!r}")


def update(obj: Any, values: dict[str, Any], prefix: str = "") -> Any:
    """Apply a nested dict onto a dataclass tree in place; unknown keys are errors."""
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in values.items():
        full = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key {full!r}",
                              hint=f"valid keys here: {', '.join(sorted(prefix + n for n in names))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{full}: expected a mapping of its fields, got {value!r}")
            update(current, value, f"{full}.")
        else:
            setattr(obj, key, _coerce(value, hints[key], full))
    return obj


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """["model.embed_size=512", ...] -> nested dict (values parsed as YAML scalars)."""
    nested: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override {pair!r} is not KEY=VALUE", hint="e.g. --set model.embed_size=512")
        key, raw = pair.split("=", 1)
        node = nested
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return nested


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError("config file not found", path=path) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise ConfigError(f"invalid YAML: {getattr(exc, 'problem', exc)}", path=path,
                          line=mark.line + 1 if mark else None) from None
    if not isinstance(data, dict):
        raise ConfigError("a config file must be a mapping", path=path)
    return data


def config_from_dict(data: dict[str, Any]) -> Config:
    return update(Config(), data)
