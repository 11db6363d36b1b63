"""Import the original SCAN / VSE++ `.pth.tar` checkpoints without executing code (`itmatch convert`): read with
weights_only=True and only `argparse.Namespace` allow-listed, their parameter names and `opt` fields mapped to
ours. The file format, why reading it runs no code, and the mapping tables: docs/reliability.md, "Converting
SCAN / VSE++ checkpoints".
"""

from __future__ import annotations

import argparse
import functools
import warnings
from pathlib import Path
from typing import Any

import torch

from itmatch.config import Config
from itmatch.data.vocab import Vocab
from itmatch.engine.checkpoint import safe_torch_load, save_checkpoint, weight_mismatch
from itmatch.errors import CheckpointError, ConfigError, refuse_overwrite
from itmatch.models.registry import build_model


class ConversionWarning(UserWarning):
    """Something in the original checkpoint was ignored or guessed."""


# opt field -> (our config key, converter). SCAN and VSE++ share the names they have in common.
OPT_TO_CONFIG: dict[str, tuple[str, Any]] = {
    "img_dim": ("model.img_dim", int),
    "vocab_size": ("model.vocab_size", int),
    "embed_size": ("model.embed_size", int),
    "word_dim": ("model.word_dim", int),
    "num_layers": ("model.text_layers", int),
    "bi_gru": ("model.bidirectional", bool),
    "no_imgnorm": ("model.img_norm", lambda v: not v),
    "no_txtnorm": ("model.txt_norm", lambda v: not v),
    "cross_attn": ("model.direction", str),
    "agg_func": ("model.pool", lambda v: {"LogSumExp": "lse", "Mean": "avg", "Max": "max", "Sum": "sum"}[v]),
    "lambda_softmax": ("model.scan.lambda_softmax", float),
    "lambda_lse": ("model.scan.lambda_lse", float),
    "raw_feature_norm": ("model.scan.raw_feature_norm", str),
    "margin": ("loss.margin", float),
    "max_violation": ("loss.hardest", bool),
    "num_epochs": ("train.epochs", int),
    "batch_size": ("train.batch_size", int),
    "grad_clip": ("train.grad_clip", float),
    "learning_rate": ("train.lr", float),
    "lr_update": ("train.lr_update", int),
}
# Fields of their training scripts that do not change the model (paths, logging, loaders).
IGNORED_OPT = {"data_path", "data_name", "vocab_path", "workers", "log_step", "val_step", "logger_name",
               "model_name", "resume", "crop_size", "use_restval", "reset_train", "cnn_type"}
# Fields that change the model: supported only with these values.
REQUIRED_OPT = {"precomp_enc_type": ("basic", "weight_norm"), "measure": ("cosine",), "use_abs": (False,),
                "finetune": (False,)}


def read_original_checkpoint(path: str | Path) -> dict[str, Any]:
    """The dict of a SCAN/VSE++ .pth.tar, read without executing code (docs/reliability.md, "Converting SCAN /
    VSE++ checkpoints")."""
    path = Path(path)
    data = safe_torch_load(path, allow=(argparse.Namespace,))
    if not isinstance(data, dict) or "model" not in data or "opt" not in data:
        raise CheckpointError("not a SCAN/VSE++ checkpoint (expected a dict with 'model' and 'opt')", path=path)
    model, opt = data["model"], data["opt"]
    if not (isinstance(model, list | tuple) and len(model) == 2 and all(isinstance(m, dict) for m in model)):
        raise CheckpointError("'model' must be [img_enc state dict, txt_enc state dict]", path=path)
    if not isinstance(opt, argparse.Namespace | dict):
        raise CheckpointError(f"'opt' is a {type(opt).__name__}, expected argparse.Namespace", path=path)
    return data


def _image_weights(sd: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """EncoderImagePrecomp (`fc`) or EncoderImageWeightNormPrecomp (`fc.weight_g`, `fc.weight_v`,
    weight_norm with dim=None: W = g * V / ||V||_F) -> our RegionEncoder.fc."""
    if "fc.weight" in sd:
        weight = sd["fc.weight"]
    elif "fc.weight_g" in sd and "fc.weight_v" in sd:
        v = sd["fc.weight_v"].float()
        weight = sd["fc.weight_g"].float() * v / torch.linalg.vector_norm(v)
    else:
        raise CheckpointError(f"image encoder has no fc weights (keys: {sorted(sd)[:6]})", path=path)
    if "fc.bias" not in sd:
        raise CheckpointError("image encoder has no fc.bias", path=path)
    return {"image_encoder.fc.weight": weight, "image_encoder.fc.bias": sd["fc.bias"]}


def _text_weights(sd: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """EncoderText (`embed`, `rnn` GRU) -> our RNNTextEncoder (same submodule names)."""
    out = {}
    for key, value in sd.items():
        if key == "embed.weight" or key.startswith("rnn."):
            out[f"text_encoder.{key}"] = value
        else:
            raise CheckpointError(f"unknown text encoder parameter {key!r}", path=path,
                                  hint="only SCAN/VSE++ EncoderText (embed + GRU) checkpoints are supported")
    return out


def config_from_opt(opt: dict[str, Any], path: Path) -> tuple[Config, list[str]]:
    """Our config for their `opt`, and the warnings about fields that were not mapped."""
    notes: list[str] = []
    cfg = Config()
    arch = "scan" if "cross_attn" in opt else "vsepp"
    cfg.model.arch = arch
    if arch == "vsepp":
        # VSE++: unidirectional GRU, last state, image and text l2-normalised in the joint space.
        cfg.model.bidirectional = False
    for key, value in opt.items():
        if key in OPT_TO_CONFIG:
            target, convert = OPT_TO_CONFIG[key]
            try:
                converted = convert(value)
            except (KeyError, ValueError, TypeError):
                raise CheckpointError(f"opt.{key}={value!r} has no equivalent here", path=path,
                                      hint="see docs/reliability.md for the supported options") from None
            *sections, name = target.split(".")
            setattr(functools.reduce(getattr, sections, cfg), name, converted)
        elif key in REQUIRED_OPT:
            if value not in REQUIRED_OPT[key]:
                raise CheckpointError(f"opt.{key}={value!r} is not supported (only {REQUIRED_OPT[key]})", path=path)
        elif key not in IGNORED_OPT:
            notes.append(f"opt.{key}={value!r} is unknown to the converter and was ignored")
    if "data_name" in opt:
        cfg.name = f"converted_{opt['data_name']}"
    return cfg, notes


def convert_original(source: str | Path, out: str | Path, *, vocab_path: str | Path | None = None,
                     force: bool = False) -> dict[str, Any]:
    """Convert a SCAN/VSE++ .pth.tar into an itmatch checkpoint directory `out`. Returns a summary
    (arch, epoch, best_rsum, warnings). Warnings are also issued as ConversionWarning."""
    source, out = Path(source), Path(out)
    refuse_overwrite(out, force)
    data = read_original_checkpoint(source)
    opt = vars(data["opt"]) if isinstance(data["opt"], argparse.Namespace) else dict(data["opt"])
    cfg, notes = config_from_opt(opt, source)
    weights = {**_image_weights(data["model"][0], source), **_text_weights(data["model"][1], source)}
    if not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise CheckpointError("a parameter is not a tensor", path=source)
    emb = weights["text_encoder.embed.weight"]
    cfg.model.img_dim = int(weights["image_encoder.fc.weight"].shape[1])
    cfg.model.vocab_size, cfg.model.word_dim = int(emb.shape[0]), int(emb.shape[1])
    cfg.model.embed_size = int(weights["image_encoder.fc.weight"].shape[0])

    if vocab_path is None and opt.get("vocab_path") and opt.get("data_name"):
        guess = Path(str(opt["vocab_path"])) / f"{opt['data_name']}_vocab.json"
        if guess.is_file():
            vocab_path = guess
    if vocab_path is None:
        raise CheckpointError("the checkpoint holds no vocabulary and none was given", path=source,
                              hint=f"pass --vocab with the SCAN vocabulary it was trained with, e.g. "
                                   f"vocab/{opt.get('data_name', 'f30k_precomp')}_vocab.json")
    vocab = Vocab.load(vocab_path)
    if len(vocab) != cfg.model.vocab_size:
        raise CheckpointError(f"the vocabulary has {len(vocab)} words but the word embedding has "
                              f"{cfg.model.vocab_size} rows", path=vocab_path,
                              hint="pass the vocabulary file the model was trained with")
    try:
        model = build_model(cfg.model)
    except ConfigError as exc:
        raise CheckpointError(f"cannot build the model described by opt: {exc.message}", path=source) from None
    missing, unexpected, wrong = weight_mismatch(model.state_dict(), weights)
    if missing or unexpected or wrong:
        raise CheckpointError(f"weights do not fit the model described by opt (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}, wrong shape {wrong[:3]})", path=source)
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    if cfg.model.arch == "vsepp":
        notes.append("VSE++ l2-normalises without an epsilon; itmatch adds 1e-8 (differences ~1e-8)")
    for note in notes:
        warnings.warn(f"{source}: {note}", ConversionWarning, stacklevel=2)
    epoch, best_rsum = data.get("epoch", -1), data.get("best_rsum", -1.0)
    state = {"converted_from": str(source),
             "epoch": int(epoch) + 1 if isinstance(epoch, int) else 0,  # they store the last finished epoch
             "best_rsum": float(best_rsum) if isinstance(best_rsum, int | float) else -1.0, "warnings": notes}
    save_checkpoint(out, model, cfg, vocab, state=state)
    return {"arch": cfg.model.arch, "out": str(out), **state}
