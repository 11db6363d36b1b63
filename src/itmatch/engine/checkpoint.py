"""Checkpoints: a directory (model.safetensors, config.json, vocab.json, optionally optimizer.pt and trainer.pt,
state.json, manifest.json) written atomically and verified against its manifest on load; no pickled object is
ever executed (`safe_torch_load`). The layout, the write sequence, the manifest and how data paths are stored:
docs/reliability.md, "The checkpoint directory"."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from itmatch.config import Config, config_from_dict, without_absent_sections
from itmatch.data.vocab import AnyVocab, load_vocab
from itmatch.device import to_device
from itmatch.errors import CheckpointError, ConfigError, DataError
from itmatch.io import file_sha256, fsync_dir, fsync_file
from itmatch.models.base import Matcher
from itmatch.models.registry import build_model

WEIGHTS, CONFIG, VOCAB, OPTIMIZER, TRAINER, STATE, MANIFEST = (
    "model.safetensors", "config.json", "vocab.json", "optimizer.pt", "trainer.pt", "state.json", "manifest.json")
# 1: binary files only, relative data paths from the working directory of the run; 2: every file, relative
# data paths from the checkpoint directory
MANIFEST_VERSION = 2
CARD = "card.json"  # a shipped model's card (itmatch.pretrained): its results row and the command that trained it
#: config keys (section, key) that name files or directories: stored relative to the checkpoint (or run) directory,
#: so that they resolve wherever it is read from; the data directories, and what a run starts from (a vocabulary
#: file, another run's weights), which a run killed before its first checkpoint is restarted with
DATA_DIR_KEYS = (("data", "path"), ("data", "images"))
PATH_KEYS = (*DATA_DIR_KEYS, ("data", "vocab"), ("train", "init_from"))
TRUST_HINT = ("if you changed it on purpose, pass --trust-modified (Python: trust_modified=True); to continue a "
              "run with other training settings use `itmatch train --out RUN --resume --set train.epochs=N` "
              "instead of editing config.json")

log = logging.getLogger("itmatch.checkpoint")


def safe_torch_load(path: str | Path, *, allow: tuple[type, ...] = ()) -> Any:
    """torch.load with weights_only=True: tensors, numbers, strings and containers only. A file that
    carries any other pickled object (a class, a function: possibly code to run) is refused with a
    CheckpointError, never executed. `allow` adds classes that are safe to rebuild from their fields
    (the converter allows argparse.Namespace)."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        found = re.search(r"(?i)unsupported global:? GLOBAL (\S+)", str(exc))
        # not a pickle at all (a CSV: "Unsupported operand 105"; other bytes: "invalid load key"); every other refusal
        # (a blocked module, a reduce of an unknown function, ...) is of a pickled object and said so below
        if found is None and re.search(r"Unsupported operand|invalid load key", str(exc)):
            raise CheckpointError("not a torch checkpoint file (it does not read as one)", path=path,
                                  hint="pass a checkpoint directory written by `itmatch train`, a shipped model's "
                                       "name, or an original SCAN/VSE++ .pth.tar file") from None
        detail = f"it names {found.group(1)!r}" if found else "it holds objects other than tensors"
        raise CheckpointError(f"refused: the file carries pickled Python objects ({detail}); loading it could "
                              f"run arbitrary code, so it was not loaded", path=path,
                              hint="only load weights you trust through safetensors; for SCAN/VSE++ .pth.tar "
                                   "checkpoints use `itmatch convert`") from None
    except FileNotFoundError:
        raise CheckpointError("file not found", path=path) from None
    except (RuntimeError, OSError, EOFError, ValueError, KeyError, IndexError, TypeError, AttributeError,
            UnicodeDecodeError, MemoryError) as exc:
        raise CheckpointError(f"not a readable torch file ({type(exc).__name__}: {str(exc)[:200]})", path=path,
                              hint="the file is truncated or corrupt") from None


def _write_manifest(directory: Path) -> None:
    """Size and SHA-256 of every file of the checkpoint, the JSON files included: an edited config.json or
    vocab.json makes another model as surely as changed weights do."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"version": MANIFEST_VERSION, "files": files}, indent=2) + "\n",
                                      encoding="utf-8")


def _mismatch(path: Path, size: int, digest: str) -> str | None:
    """Why `path` differs from its manifest entry, or None when it matches."""
    if not path.is_file():
        return "missing"
    actual = path.stat().st_size
    if actual != size:
        return f"truncated or modified: {actual} bytes, the manifest says {size}"
    if file_sha256(path) != digest:
        return "modified: its SHA-256 differs from the manifest's"
    return None


def verify_manifest(directory: str | Path, *, trust_modified: bool = False,
                    files: Collection[str] | None = None) -> int:
    """Check every file listed in manifest.json (size, SHA-256), or only those named in `files` (a reader of the
    small JSON files that does not load the weights), and return the manifest's version (0 when there is none).
    A file that differs is a CheckpointError naming it, or with `trust_modified` a warning. Checkpoints of older
    versions load with a one-line warning saying which files are not covered."""
    directory = Path(directory)
    file = directory / MANIFEST
    manifest, version = _read_manifest(directory)
    if manifest is None:
        log.warning("%s: no manifest.json (written by an older itmatch): its files cannot be checked for damage or "
                    "edits", directory)
        return 0
    try:
        entries = [(str(name), int(e["bytes"]), str(e["sha256"])) for name, e in manifest["files"].items()]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError("corrupt manifest", path=file, hint="the checkpoint is damaged; use another") from None
    changed = [(name, why) for name, size, digest in entries if files is None or name in files
               if (why := _mismatch(directory / name, size, digest)) is not None]
    if changed and not trust_modified:
        name, why = changed[0]
        others = f" (also changed: {', '.join(n for n, _ in changed[1:])})" if len(changed) > 1 else ""
        raise CheckpointError(f"{name} does not match the manifest ({why}){others}", path=directory / name,
                              hint=f"{TRUST_HINT}; otherwise the checkpoint was damaged after it was written: "
                                   f"use another (e.g. RUN/best or an older copy)")
    if changed:
        log.warning("%s: loading despite %s (--trust-modified)", directory,
                    "; ".join(f"{name} {why}" for name, why in changed))
    listed = {name for name, _, _ in entries}
    uncovered = [p.name for p in sorted(directory.iterdir())
                 if p.is_file() and p.name != MANIFEST and p.name not in listed and not p.name.startswith(".")]
    if uncovered and version < MANIFEST_VERSION:
        log.warning("%s: written by an older itmatch: %s not covered by its manifest, so edits to them cannot be "
                    "detected", directory, ", ".join(uncovered))
    return version


def _old(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def recover_checkpoint(path: str | Path) -> None:
    """Finish a replacement that was interrupted: if `path` is missing but its complete predecessor
    `.NAME.old` is there, move it back; drop temporary directories of interrupted writes."""
    path = Path(path)
    if not path.parent.is_dir():
        return
    if not path.exists() and _old(path).is_dir():
        _old(path).rename(path)
    for tmp in path.parent.glob(f".{path.name}.*.partial"):
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class Checkpoint:
    path: Path
    model: Matcher
    config: Config
    vocab: AnyVocab
    state: dict[str, Any]
    # data.<key> -> every place it was looked for when loading ([] when unset); see data_path
    data_searched: dict[str, list[Path]] = field(default_factory=dict)

    def data_path(self, key: str = "path") -> str:
        """The checkpoint's data.<key> (precomp directory, or images folder) as found when loading; a
        DataError naming every place that was looked at when it was found nowhere."""
        value = getattr(self.config.data, key)
        searched = self.data_searched.get(key, [])
        if not value or any(p.is_dir() for p in searched) or not searched:
            return value
        places = "; ".join(str(p) for p in searched)
        option = "--data DIR (the precomp directory)" if key == "path" else "--images DIR (the images folder)"
        hint = f"pass {option}, or put the data back where the checkpoint expects it"
        if key == "path" and (self.path / CARD).is_file():  # (a shipped model brings no features)
            hint = (f"a shipped model comes without features: pass --data DIR of features of its backbone "
                    f"(`itmatch extract PHOTOS CAPTIONS --backbone {self.config.data.backbone} --out DIR`; "
                    f"`--splits test` for its results row's test photos)")
        raise DataError(f"the checkpoint's data.{key} was not found; looked in: {places}", path=self.path / CONFIG,
                        hint=hint)


def save_checkpoint(path: str | Path, model: Matcher, config: Config, vocab: AnyVocab,
                    optimizer: torch.optim.Optimizer | None = None, state: dict[str, Any] | None = None,
                    trainer: dict[str, Any] | None = None) -> None:
    """Write a checkpoint directory atomically. `trainer` (RNG states and the like: tensors and plain
    values only) goes to trainer.pt; `state` (JSON) to state.json."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_checkpoint(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    try:
        weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        # one metadata key: safetensors writes the metadata map in a random order, so with two keys the same
        # weights saved twice made different bytes (another SHA-256: an index refused the identical model)
        save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
        stored = config_for_checkpoint(config, path.parent.resolve() / path.name)
        (tmp / CONFIG).write_text(json.dumps(stored, indent=2) + "\n", encoding="utf-8")
        vocab.save(tmp / VOCAB)
        if optimizer is not None:
            # host copies: a checkpoint written on a GPU loads on a CPU-only machine (and the reverse)
            torch.save(to_device(optimizer.state_dict(), torch.device("cpu")), tmp / OPTIMIZER)
        if trainer is not None:
            torch.save(to_device(trainer, torch.device("cpu")), tmp / TRAINER)
        (tmp / STATE).write_text(json.dumps(state or {}, indent=2) + "\n", encoding="utf-8")
        _write_manifest(tmp)  # last: its presence means every file above is complete
        for p in tmp.iterdir():
            fsync_file(p)
        fsync_dir(tmp)
        old = _old(path)
        if old.exists():
            shutil.rmtree(old)
        if path.exists():
            path.rename(old)
        tmp.rename(path)  # a kill before this line leaves the complete old checkpoint at `old`
        fsync_dir(path.parent)
        if old.exists():
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def config_for_checkpoint(config: Config, directory: Path) -> dict[str, Any]:
    """config as written into the checkpoint `directory`: relative data paths (from the working directory)
    become paths from the checkpoint directory, so that they resolve wherever the checkpoint is read from."""
    data = config.to_dict()
    for section, key in PATH_KEYS:
        value = data[section][key]
        if value and not Path(value).is_absolute():
            data[section][key] = Path(os.path.relpath(Path(value).resolve(), directory)).as_posix()
    return data


def _data_candidates(value: str, directory: Path, version: int) -> list[Path]:
    """Where a stored data path may be: itself when absolute; from the checkpoint directory (manifest
    version 2); for older checkpoints, which stored it from the run's working directory: from the current
    directory and from each parent of the checkpoint (the usual working directories of the run)."""
    if Path(value).is_absolute():
        return [Path(value)]
    if version >= MANIFEST_VERSION:
        return [(directory / value).resolve()]
    places = [Path.cwd() / value, *(parent / value for parent in directory.parents)]
    return list(dict.fromkeys(p.resolve() for p in places))


def _resolve_data_paths(config: Config, directory: Path, *versions: int) -> dict[str, list[Path]]:
    """Set the config's relative data paths to where they were found (as paths from the current directory,
    like any path the user gives), looking where a config written by each of `versions` stores them, in that
    order; return every place looked at, per key."""
    searched = {}
    for section, key in PATH_KEYS:
        value = getattr(getattr(config, section), key)
        if not value:
            continue
        data_directory = (section, key) in DATA_DIR_KEYS
        # (what a run starts from was stored from the working directory until 2026-11-27, in checkpoints of
        # either manifest version: looked for there too)
        tried = versions if data_directory else (*versions, 1)
        candidates = list(dict.fromkeys(place for version in tried
                                        for place in _data_candidates(value, directory.resolve(), version)))
        if data_directory:
            searched[key] = candidates
        if not Path(value).is_absolute():
            found = next((p for p in candidates if p.exists()), candidates[0])
            setattr(getattr(config, section), key, os.path.relpath(found, Path.cwd()))
    return searched


def read_checkpoint_config(path: str | Path) -> Config:
    """The config of checkpoint `path` as `load_checkpoint` gives it (keys of older versions read by their
    current names, data paths resolved from where the checkpoint is, as paths from the current directory),
    without loading its weights or checking its files against the manifest."""
    path = Path(path)
    return _read_config(path, _read_manifest(path)[1])[0]


def _read_manifest(directory: Path) -> tuple[dict[str, Any] | None, int]:
    """manifest.json of a checkpoint directory and the version it records (1 before versions were written);
    (None, 0) when it has none (written by an older itmatch)."""
    file = directory / MANIFEST
    if not file.is_file():
        return None, 0
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
        return manifest, int(manifest.get("version", 1))
    except (ValueError, TypeError, AttributeError, UnicodeDecodeError):
        raise CheckpointError("corrupt manifest", path=file, hint="the checkpoint is damaged; use another") from None


def read_run_config(run_dir: str | Path) -> Config:
    """A run's own config.json (what --resume restarts from when the run was killed before its first checkpoint),
    its data paths as paths from the current directory. They are written like a checkpoint's (from the run
    directory, `config_for_checkpoint`), so a restart from another working directory finds the data; a config.json
    of an older itmatch stored them from the run's working directory, and is read as an old checkpoint is (the run
    folder has no manifest to say which)."""
    return _read_config(Path(run_dir), MANIFEST_VERSION, 1)[0]


def _read_config(path: Path, *versions: int) -> tuple[Config, dict[str, list[Path]]]:
    """config.json of checkpoint `path` (written by a manifest of one of `versions`, tried in that order), with its
    data paths resolved, and every place looked at for them."""
    try:
        data = json.loads((path / CONFIG).read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise CheckpointError("corrupt config: not a JSON object", path=path / CONFIG)
        data, absent = without_absent_sections(data)
        if absent:
            log.warning("%s: ignoring the options of model families not installed here (%s); the %s model does "
                        "not read them", path / CONFIG, ", ".join(absent), data.get("model", {}).get("arch"))
        config = config_from_dict(data)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"corrupt config: {exc.msg}", path=path / CONFIG, line=exc.lineno) from None
    except UnicodeDecodeError:
        raise CheckpointError("corrupt config: not UTF-8 text", path=path / CONFIG) from None
    except ConfigError as exc:
        raise CheckpointError(f"config does not match this itmatch version: {exc.message}",
                              path=path / CONFIG) from None
    return config, _resolve_data_paths(config, path, *versions)


def load_checkpoint(path: str | Path, *, expect_arch: str | None = None, trust_modified: bool = False) -> Checkpoint:
    """Load a checkpoint directory, refusing one whose files differ from its manifest unless
    `trust_modified` (then with a warning). Relative data paths are resolved (Checkpoint.data_path)."""
    path = Path(path)
    if path.is_file():
        raise CheckpointError("a checkpoint is a directory; this is a single file", path=path,
                              hint="for a SCAN/VSE++ .pth.tar run `itmatch convert FILE --out DIR` "
                                   "(reads it without executing code), then pass DIR")
    recover_checkpoint(path)
    for name in (WEIGHTS, CONFIG, VOCAB):
        if not (path / name).is_file():
            raise CheckpointError(f"not a checkpoint: {name} is missing", path=path,
                                  hint="pass a directory written by `itmatch train` (e.g. RUN/best)")
    version = verify_manifest(path, trust_modified=trust_modified)
    config, searched = _read_config(path, version)
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
    missing, unexpected, wrong = weight_mismatch(model.state_dict(), weights)
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"weights do not fit the {config.model.arch!r} model of config.json "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}, wrong shape {wrong[:3]})",
            path=path / WEIGHTS, hint="the checkpoint's files come from different models; retrain or re-save it")
    model.load_state_dict(weights)
    model.eval()
    return Checkpoint(path, model, config, vocab, read_state(path), searched)


def read_state(path: str | Path) -> dict[str, Any]:
    """The training state of checkpoint `path` (state.json: epochs and batches done, best dev rsum, ...); {} when
    it has none (a converted or older checkpoint)."""
    file = Path(path) / STATE
    if not file.is_file():
        return {}
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError("corrupt state.json", path=file) from None
    if not isinstance(state, dict):
        raise CheckpointError("corrupt state.json: not a JSON object", path=file)
    return state


def init_weights_from(model: Matcher, source: Checkpoint) -> dict[str, Any]:
    """Copy the weights of checkpoint `source` into `model` (built for a new run, `train.init_from`). Every
    checkpoint tensor must exist in `model` with its shape; model parameters the checkpoint lacks keep their
    initialisation and are counted (by top-level prefix) in the returned summary for the run's log."""
    weights = source.model.state_dict()
    kept, unexpected, wrong = weight_mismatch(model.state_dict(), weights)
    if unexpected or wrong:
        raise CheckpointError(f"train.init_from: weights do not fit this run's model (not in it {unexpected[:3]}, "
                              f"other shape {wrong[:3]})", path=source.path,
                              hint="start from a checkpoint of the same model and sizes (e.g. its frozen run)")
    model.load_state_dict(weights, strict=False)
    prefixes = sorted({".".join(k.split(".")[:2]) for k in kept})
    return {"init_from": str(source.path), "loaded": len(weights), "kept_init": len(kept), "kept_prefixes": prefixes}


def weight_mismatch(expected: Mapping[str, torch.Tensor],
                    weights: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str], list[str]]:
    """The names by which `weights` fail a model's state dict `expected`: (missing from `weights`, not in
    the model, of another shape), each sorted."""
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(expected) & set(weights) if expected[k].shape != weights[k].shape)
    return missing, unexpected, wrong


def load_optimizer_state(path: str | Path, optimizer: torch.optim.Optimizer) -> None:
    """Load the optimizer's running state (Adam's moments, its step counts) saved at `path` into `optimizer`,
    keeping the settings it was built with: torch would restore every saved group setting, so a resume with
    --set train.weight_decay=... or train.backbone_lr_scale=... would be recorded and silently not applied."""
    file = Path(path) / OPTIMIZER
    if not file.is_file():
        raise CheckpointError("optimizer state missing; cannot resume exactly", path=file)
    configured = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    try:
        optimizer.load_state_dict(safe_torch_load(file))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"optimizer state does not fit this model ({exc})", path=file) from None
    for group, settings in zip(optimizer.param_groups, configured, strict=True):
        group.update(settings)


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    """trainer.pt of a checkpoint ({} when absent: checkpoints of older versions)."""
    file = Path(path) / TRAINER
    if not file.is_file():
        return {}
    data = safe_torch_load(file)
    if not isinstance(data, dict):
        raise CheckpointError("trainer state is not a mapping", path=file)
    return data
