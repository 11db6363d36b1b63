"""Checkpoints: a directory with model.safetensors, config.json, vocab.json, optionally
optimizer.pt (tensors only, loaded with weights_only=True) and state.json. No pickled objects.
A checkpoint is written to a temporary directory and renamed into place, so it is never half-written."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from itmatch.config import Config, config_from_dict
from itmatch.data.vocab import AnyVocab, load_vocab
from itmatch.errors import CheckpointError, ConfigError
from itmatch.models.base import Matcher
from itmatch.models.registry import build_model

WEIGHTS, CONFIG, VOCAB, OPTIMIZER, STATE = (
    "model.safetensors", "config.json", "vocab.json", "optimizer.pt", "state.json")


@dataclass
class Checkpoint:
    path: Path
    model: Matcher
    config: Config
    vocab: AnyVocab
    state: dict[str, Any]


def save_checkpoint(path: str | Path, model: Matcher, config: Config, vocab: AnyVocab,
                    optimizer: torch.optim.Optimizer | None = None, state: dict[str, Any] | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    try:
        weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt", "arch": config.model.arch})
        (tmp / CONFIG).write_text(json.dumps(config.to_dict(), indent=2) + "\n", encoding="utf-8")
        vocab.save(tmp / VOCAB)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER)
        (tmp / STATE).write_text(json.dumps(state or {}, indent=2) + "\n", encoding="utf-8")
        old = path.with_name(f".{path.name}.old")
        if old.exists():
            shutil.rmtree(old)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        if old.exists():
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def load_checkpoint(path: str | Path, *, expect_arch: str | None = None) -> Checkpoint:
    path = Path(path)
    for name in (WEIGHTS, CONFIG, VOCAB):
        if not (path / name).is_file():
            raise CheckpointError(f"not a checkpoint: {name} is missing", path=path,
                                  hint="pass a directory written by `itmatch train` (e.g. RUN/best)")
    try:
        config = config_from_dict(json.loads((path / CONFIG).read_text(encoding="utf-8")))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"corrupt config: {exc.msg}", path=path / CONFIG, line=exc.lineno) from None
    except ConfigError as exc:
        raise CheckpointError(f"config does not match this itmatch version: {exc.message}",
                              path=path / CONFIG) from None
    if expect_arch and config.model.arch != expect_arch:
        raise CheckpointError(f"checkpoint holds a {config.model.arch!r} model, expected {expect_arch!r}",
                              path=path, hint="pass a checkpoint of the expected model")
    vocab = load_vocab(path / VOCAB, config.data.tokenizer)
    model = build_model(config.model)
    try:
        weights = load_file(str(path / WEIGHTS))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"unreadable weights ({exc})", path=path / WEIGHTS,
                              hint="the file is truncated or corrupt; use another checkpoint") from None
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(expected) & set(weights) if expected[k].shape != weights[k].shape)
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"weights do not fit the {config.model.arch!r} model of config.json "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}, wrong shape {wrong[:3]})",
            path=path / WEIGHTS, hint="the checkpoint's files come from different models; retrain or re-save it")
    model.load_state_dict(weights)
    model.eval()
    state = {}
    if (path / STATE).is_file():
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
    return Checkpoint(path, model, config, vocab, state)


def load_optimizer_state(path: str | Path, optimizer: torch.optim.Optimizer) -> None:
    file = Path(path) / OPTIMIZER
    if not file.is_file():
        raise CheckpointError("optimizer state missing; cannot resume exactly", path=file)
    optimizer.load_state_dict(torch.load(file, weights_only=True, map_location="cpu"))
