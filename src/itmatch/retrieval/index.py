"""An on-disk index of a photo collection for text-to-image search with a trained matcher.

It stores the image encoder's output for every photo, is incremental by content (a photo's sha256), resumable
and crash-safe (the manifest is written last), and is only ever used with the model that built it.
Layout on disk and these rules: docs/search.md, 'Index'.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock, Timeout
from numpy.lib.format import open_memmap
from tqdm import tqdm

from itmatch.errors import CheckpointError, ConfigError, DataError, OverwriteError, whole_number
from itmatch.features.pipeline import (
    IMAGE_SUFFIXES,
    UnreadableImage,
    decode_image,
    decode_threads,
    grid_features,
    strict_decoding,
)
from itmatch.fingerprint import file_record
from itmatch.io import atomic_path, file_sha256, write_json_atomic, write_with
from itmatch.models.base import ImageEmb
from itmatch.retrieval.names import public_id

log = logging.getLogger("itmatch.retrieval")

MANIFEST = "manifest.json"
PARTS = "parts"
FORMAT = "itmatch-index"
# 2: the regions may be stored once, as the features (manifest "regions_from"; a model whose image encoder passes
# the backbone's cells through, SMAN). 3: a pair-independent model's photos are stored as the item vectors its score
# reads, prepared, and nothing else (manifest "image_encodings": "vectors"; VSE++, MMCA alpha = 0, SMAN-IM). 4: no
# backbone features (`itmatch index --no-features`: no "features" array; an older itmatch would fail to update it).
# Each index is written as the lowest version that holds it, so that older itmatch reads every index it can
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
VECTORS_ONLY = "vectors"  # manifest "image_encodings" of a version-3 index; absent: the encoder's every field
ARRAYS = ("features", "regions", "vectors")
EXTRA_PREFIX = "extra_"  # array name of an ImageEmb.extras entry: extra_<key>


def extra_array(key: str) -> str:
    return f"{EXTRA_PREFIX}{key}"


def is_index_array(name: str) -> bool:
    """Whether an array name is one an index stores (the features, the encodings, an encoder's extras)."""
    return name in ARRAYS or name.startswith(EXTRA_PREFIX)


def is_encoding_array(name: str) -> bool:
    """Whether an array name holds the model's encodings (not the backbone features)."""
    return name in ("regions", "vectors") or name.startswith(EXTRA_PREFIX)


def rebuild_hint(index_dir: Path | str, manifest: dict | None = None) -> str:
    return f"rebuild it: {index_command(index_dir, manifest)} --force"


def missing_manifest_hint(folder: Path) -> str:
    """What to do with a folder given as an index that has no manifest: the first run into it was stopped, it is
    the photos themselves, or it is something else."""
    if (folder / PARTS).is_dir():
        return "the first `itmatch index` into it stopped before it finished: run the same command again (it resumes)"
    with contextlib.suppress(OSError):
        if any(f.suffix.lower() in IMAGE_SUFFIXES for f in folder.iterdir()):
            return (f"this is a photo folder: index it first (itmatch index {folder} --model "
                    f"mmca_alpha0_lite2-flickr8k --out INDEX), then search INDEX")
    return ("give the --out folder of `itmatch index PHOTOS --model MODEL --out INDEX` (from Python: the out_dir "
            "given to build_index)")


def index_command(index_dir: Path | str, manifest: dict | None = None) -> str:
    """The `itmatch index` command that updates the index (its photo folder and model, from its manifest)."""
    images = (manifest or {}).get("images_root", "IMAGES_DIR")
    model = (manifest or {}).get("model") or {}
    ckpt = pretrained_name(model) or model.get("checkpoint", "CKPT")  # (a name holds wherever itmatch is installed)
    return f"itmatch index {images} --model {ckpt} --out {index_dir}"


def moved_folder_hint(index_dir: Path | str, manifest: dict[str, Any]) -> str:
    """What to do when an index's photo folder is not where it was indexed: index it where it is now (the photos
    it has encoded are reused, by content), or serve it from there."""
    index_again = index_command(index_dir, {**manifest, "images_root": "NEW_FOLDER"})
    return (f"if it moved, index it where it is ({index_again} --force: photos already encoded are not encoded again), "
            f"or search or serve it from there (itmatch search {index_dir} QUERY --images NEW_FOLDER, or itmatch "
            f"serve ... --images NEW_FOLDER)")


def own_model_advice(built: dict[str, Any]) -> str:
    """What to load instead of a refused model: the index's own checkpoint, unless the index now loads a shipped model
    by its name (its recorded path gone): then that name's weights are what changed (itmatch updated), and only a
    rebuild works."""
    name = pretrained_name(built)
    if name and not Path(built.get("checkpoint") or "").exists():
        return (f"the shipped {name} it was built with has other weights in this itmatch (installed since), so the "
                "index must be rebuilt for it")
    return f"use the index's own model {name or built.get('checkpoint')}"


def pretrained_name(model: dict[str, Any]) -> str | None:
    """The shipped model an index's model identity is of, by name: as recorded, or for an index written before it
    was, from a checkpoint path that ends in itmatch/pretrained/<name>; None for a checkpoint of the user's."""
    if model.get("pretrained"):
        return str(model["pretrained"])
    path = Path(model.get("checkpoint") or "")
    return path.name if path.parent.name == "pretrained" and path.parent.parent.name == "itmatch" else None


def model_identity(checkpoint: Path | str, backbone: str) -> dict[str, Any]:
    """What an index's encodings depend on (the model config, the backbone and the weights) and what its
    queries are encoded with (the vocabulary); a shipped model's name too (`ImageIndex.checkpoint`)."""
    from itmatch.pretrained import PRETRAINED_DIR

    checkpoint = Path(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    canonical = json.dumps({"model": config["model"], "backbone": backbone}, sort_keys=True)
    where = checkpoint.resolve()
    shipped = where.parent == PRETRAINED_DIR.resolve()
    return {"checkpoint": str(where), **({"pretrained": where.name} if shipped else {}),
            "arch": config["model"]["arch"],
            "preset": config.get("preset", ""), "backbone": backbone,
            "config_hash": hashlib.sha256(canonical.encode()).hexdigest(),
            "weights_hash": file_sha256(checkpoint / "model.safetensors"),
            "vocab_hash": file_sha256(checkpoint / "vocab.json")}


def same_image_encoder(a: dict, b: dict) -> bool:
    """Whether two identities encode images alike (the stored encodings of one serve the other)."""
    return a.get("config_hash") == b.get("config_hash") and a.get("weights_hash") == b.get("weights_hash")


def same_model(a: dict, b: dict) -> bool:
    """Same image encodings and same vocabulary (not compared when either identity predates it)."""
    vocab_known = "vocab_hash" in a and "vocab_hash" in b
    return same_image_encoder(a, b) and (not vocab_known or a["vocab_hash"] == b["vocab_hash"])


def scan_images(root: Path, exclude: Path | None = None) -> list[str]:
    """Relative POSIX paths of the image files under `root` (recursive, sorted; hidden files and
    folders and the folder `exclude`, e.g. an index kept inside the photo folder, are left out; a folder
    that cannot be listed, e.g. no permission or a path over the system's limit, is left out with a warning)."""
    found, outside, unread = [], [], Counter()
    exclude = exclude.resolve() if exclude is not None else None
    real_root = root.resolve()

    def unlisted(exc: OSError) -> None:  # os.walk would leave out a folder it cannot list without a word
        where = os.path.relpath(exc.filename, root) if exc.filename else str(root)
        log.warning("cannot list the folder %s (%s): the photos in it are not indexed", public_id(where),
                    exc.strerror or exc)

    for dirpath, dirnames, filenames in os.walk(root, onerror=unlisted):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")
                             and (exclude is None or (here / d).resolve() != exclude))
        for name in filenames:
            if name.startswith("."):
                continue
            suffix = Path(name).suffix.lower()
            if suffix not in IMAGE_SUFFIXES:
                unread[suffix or "(no extension)"] += 1
                continue
            rel = (here / name).relative_to(root).as_posix()
            # a link to a file outside the folder: the service never serves such files
            # (Searcher.image_path), so indexing it would give results that cannot be shown
            target = (here / name).resolve()
            if target.is_relative_to(real_root):
                found.append(rel)
            else:
                outside.append((rel, target))
    if outside:
        # (a folder of links into a photo library is common: name the folder to index instead, unless the links
        # point into trees that share only the filesystem's root)
        where = os.path.commonpath([str(target.parent) for _, target in outside])
        instead = f"index the folder they point to, {public_id(where)}, or " if os.path.dirname(where) != where else ""
        log.warning("%d image(s) in %s are links to files outside it and are not indexed (the server only "
                    "serves files inside the photo folder, so that a link cannot expose other files), e.g. %s; "
                    "%scopy them in", len(outside), public_id(str(root)), public_id(outside[0][0]), instead)
    if unread:  # (a phone's .heic photos among its .jpg ones would otherwise be missing from every search unsaid)
        common = sorted(unread.items(), key=lambda kind: (-kind[1], kind[0]))[:8]  # (most first, then by name)
        kinds = ", ".join(f"{suffix} {n}" for suffix, n in common)
        log.warning("%d file(s) in %s are not indexed: not in a format itmatch reads (%s%s; it reads %s); convert "
                    "the photos among them to JPEG or PNG to find them", sum(unread.values()), public_id(str(root)),
                    kinds, ", ..." if len(unread) > 8 else "", " ".join(sorted(IMAGE_SUFFIXES)))
    return sorted(found)


# -- reading -------------------------------------------------------------------------------------------

def read_manifest(index_dir: Path) -> dict[str, Any]:
    path = index_dir / MANIFEST
    if not path.is_file():
        raise DataError("not an index: manifest.json is missing", path=index_dir, hint=missing_manifest_hint(index_dir))
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"corrupt index manifest ({exc})", path=path, hint=rebuild_hint(index_dir)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError("not an itmatch index manifest", path=path, hint=rebuild_hint(index_dir))
    if manifest.get("version") not in READABLE_VERSIONS:
        raise DataError(f"index format version {manifest.get('version')} is not one this itmatch reads "
                        f"({', '.join(map(str, READABLE_VERSIONS))})", path=path,
                        hint=rebuild_hint(index_dir, manifest))
    return manifest


def _open_array(index_dir: Path, manifest: dict, name: str, verify: bool) -> np.ndarray:
    spec = manifest["arrays"][name]
    path = index_dir / spec["file"]
    hint = rebuild_hint(index_dir, manifest)
    if not path.is_file():
        raise DataError(f"index file {spec['file']} is missing", path=path, hint=hint)
    if verify and file_sha256(path) != spec["sha256"]:
        raise DataError(f"index file {spec['file']} is corrupt (its sha256 differs from the manifest's)",
                        path=path, hint=hint)
    try:
        arr = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise DataError(f"unreadable index file ({exc})", path=path, hint=hint) from None
    if list(arr.shape) != spec["shape"] or arr.dtype != np.float32:
        raise DataError(f"index file has shape {list(arr.shape)} {arr.dtype}, the manifest says "
                        f"{spec['shape']} float32", path=path, hint=hint)
    return arr


def encodings_layout(manifest: dict[str, Any]) -> str:
    """How an index stores its photos' encodings: "fields" (the image encoder's every output, which the head
    prepares when the index is loaded) or "vectors" (a pair-independent model's prepared item vectors alone)."""
    return manifest.get("image_encodings", "fields")


@dataclass
class ImageIndex:
    """A loaded index: the manifest, the image records in row order and the model's encodings."""

    root: Path
    manifest: dict[str, Any]
    regions: np.ndarray | None  # [N, k, d]; None where the index holds the prepared vectors alone
    vectors: np.ndarray | None  # [N, d]
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # ImageEmb.extras key -> [N, ...]

    @property
    def images(self) -> list[dict[str, Any]]:
        return self.manifest["images"]

    @property
    def ids(self) -> list[str]:
        return [e["id"] for e in self.images]

    @property
    def images_root(self) -> Path:
        return Path(self.manifest["images_root"])

    @property
    def grid(self) -> int:
        return int(self.manifest["backbone"]["grid"])

    @property
    def vectors_only(self) -> bool:
        """Whether the index holds its model's prepared item vectors alone (a pair-independent head's index)."""
        return encodings_layout(self.manifest) == VECTORS_ONLY

    def image_emb(self) -> ImageEmb:
        """The stored encodings as an ImageEmb (grid backbones: every region is real); the head's
        per-item parts (e.g. SCAN's region Gram matrices) are added by the caller's `prepare_images`, except in
        an index of prepared vectors alone, whose ImageEmb is `vectors_only()`'s, ready to score."""
        def tensor(arr: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.array(arr, dtype=np.float32))

        if self.regions is None:
            vector = tensor(self.vectors)
            return ImageEmb(regions=vector.new_empty((len(vector), 0, vector.shape[1])),
                            mask=torch.ones((len(vector), 0), dtype=torch.bool), vector=vector)
        regions = tensor(self.regions)
        vector = tensor(self.vectors) if self.vectors is not None else None
        return ImageEmb(regions=regions, mask=torch.ones(regions.shape[:2], dtype=torch.bool), vector=vector,
                        extras={key: tensor(arr) for key, arr in self.extras.items()})

    @property
    def has_features(self) -> bool:
        """Whether the index keeps its photos' backbone features (not with `itmatch index --no-features`)."""
        return "features" in self.manifest["arrays"]

    def features(self, verify: bool = True) -> np.ndarray:
        if not self.has_features:
            raise DataError("the index keeps no backbone features (it was built with --no-features)",
                            path=self.root / MANIFEST,
                            hint=f"index the photos again keeping them: {index_command(self.root, self.manifest)} "
                                 "--features")
        return _open_array(self.root, self.manifest, "features", verify)

    def checkpoint(self) -> Path:
        """The checkpoint the index was built with: the path it recorded; where that is gone and it was a shipped
        model (itmatch reinstalled, another virtual environment, an editable checkout moved), the shipped model of
        that name as installed now (its weights are checked against the index's once loaded: `check_model`)."""
        from itmatch.pretrained import shipped

        built = self.manifest["model"]
        recorded, name = Path(built["checkpoint"]), pretrained_name(built)
        if recorded.exists():
            return recorded
        if name and name in (models := shipped()):
            return models[name].path
        raise CheckpointError(f"the index's model is gone from {recorded}" + (
            f" (and this itmatch ships no model named {name!r})" if name else ""), path=self.root / MANIFEST,
            hint="pass the checkpoint it was built with where it is now (--model CKPT; from Python, checkpoint=), "
                 "or index the photos again with a model at hand: "
                 f"{index_command(self.root, {**self.manifest, 'model': {}})} --force")

    def check_model(self, identity: dict[str, Any]) -> None:
        """Refuse a model other than the one the index was built with."""
        built = self.manifest["model"]
        if "vocab_hash" not in built:
            log.warning("%s: built before indexes recorded the model's vocabulary; the checkpoint's vocabulary "
                        "is not checked (%s)", self.root, rebuild_hint(self.root, self.manifest))
        if not same_model(built, identity):
            differ = [name for name, key in (("weights", "weights_hash"), ("model config", "config_hash"),
                                             ("vocabulary", "vocab_hash"))
                      if key in built and built.get(key) != identity.get(key)]
            raise CheckpointError(
                f"the index was built with another model (its {', '.join(differ)} differ: "
                f"{built.get('preset') or built.get('arch')} from {built.get('checkpoint')}, weights "
                f"{built.get('weights_hash', '')[:12]}); this checkpoint is "
                f"{identity.get('preset') or identity.get('arch')} from {identity.get('checkpoint')}, "
                f"weights {identity.get('weights_hash', '')[:12]}",
                path=self.root / MANIFEST,
                hint=f"{own_model_advice(built)}, or rebuild the index for this "
                     f"model: {index_command(self.root, {**self.manifest, 'model': identity})} --force")


def load_index(index_dir: Path | str, verify: bool = True) -> ImageIndex:
    """Open an index; `verify` checks the sha256 of every array it loads against the manifest."""
    index_dir = Path(index_dir)
    manifest = read_manifest(index_dir)
    try:
        vectors_only = encodings_layout(manifest) == VECTORS_ONLY
        regions = None if vectors_only else _open_array(index_dir, manifest, manifest.get("regions_from", "regions"),
                                                         verify)
        vectors = (_open_array(index_dir, manifest, "vectors", verify)
                   if vectors_only or "vectors" in manifest["arrays"] else None)
        # (indexes built before the extras were stored have no `image_extras`: their models had none)
        extras = {key: _open_array(index_dir, manifest, extra_array(key), verify)
                  for key in manifest.get("image_extras", [])}
        n = len(manifest["images"])
    except (KeyError, TypeError) as exc:
        raise DataError(f"index manifest lacks {exc}", path=index_dir / MANIFEST,
                        hint=rebuild_hint(index_dir, manifest)) from None
    for arr in (regions, vectors, *extras.values()):
        if arr is not None and arr.shape[0] != n:
            raise DataError(f"index arrays hold {arr.shape[0]} rows for {n} images", path=index_dir,
                            hint=rebuild_hint(index_dir, manifest))
    return ImageIndex(index_dir, manifest, regions, vectors, extras)


# -- building ------------------------------------------------------------------------------------------

def _read_parts(parts_dir: Path, identity: dict, layout: str, arrays: Iterable[str]) -> dict[str, dict[str, Any]]:
    """sha256 -> row of a finished chunk of an interrupted run (same model and encodings layout only: a chunk of an
    older itmatch holds a pair-independent model's fields, not its prepared vectors), of the chunks that hold every
    one of `arrays` (a run with --no-features left chunks without the features a run that keeps them needs)."""
    needed = set(arrays)
    rows: dict[str, dict[str, Any]] = {}
    if not parts_dir.is_dir():
        return rows
    for part in sorted(parts_dir.glob("part-*.npz")):
        try:
            with np.load(part) as z:
                if str(z["weights_hash"]) != identity["weights_hash"] or str(z["config_hash"]) != identity[
                        "config_hash"] or _chunk_layout(z) != layout or not needed <= set(z.files):
                    continue
                data = {k: z[k] for k in z.files}
        except (OSError, ValueError, KeyError):
            log.warning("ignoring unreadable chunk %s", part)
            continue
        rows.update(_part_rows(data))
    return rows


def _chunk_layout(chunk: Any) -> str:
    return str(chunk["image_encodings"]) if "image_encodings" in chunk.files else "fields"


def _part_rows(data: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    # (chunks of older versions hold an empty `vectors` for a model without one)
    stored = [name for name in data if (name == "features" or is_encoding_array(name)) and data[name].size]
    return {str(sha): {**{name: data[name][i] for name in stored},
                       "width": int(data["sizes"][i][0]), "height": int(data["sizes"][i][1])}
            for i, sha in enumerate(data["sha256"])}


def _index_encodings(model: torch.nn.Module, feats: torch.Tensor, vectors_only: bool) -> dict[str, np.ndarray]:
    """What the index stores of a batch of photos' backbone features: the image encoder's every field, or, with
    `vectors_only` (a pair-independent head, whose score is one product of item vectors), those vectors as the head
    prepares them (OAN's intra-modal sets, SMAN-SIM's appended v(2)), which is all its search reads."""
    emb = model.encode_image_fields(feats)
    if vectors_only:
        return {"vectors": model.head.prepare_images(emb).vector.float().cpu().numpy()}
    return _stored_fields(emb)


def _stored_fields(emb: ImageEmb) -> dict[str, np.ndarray]:
    """Array name -> float32 host array of every per-image tensor the image encoder returned."""
    arrays = {"regions": emb.regions, **({"vectors": emb.vector} if emb.vector is not None else {}),
              **{extra_array(key): value for key, value in emb.extras.items()}}
    return {name: value.float().cpu().numpy() for name, value in arrays.items()}


def _save_npz(path: Path, data: dict[str, np.ndarray]) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:  # a file object: np.savez would append ".npz" to a path
            np.savez(fh, **data)

    write_with(path, write)


def _compare_ids(old: dict[str, str], now: dict[str, str]) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """Ids (id -> content hash) added and removed since the last run, and the (old, new) pairs among them that
    are one photo renamed or moved: a new id whose content is a removed id's (each removed id pairs once)."""
    gone: dict[str, list[str]] = {}
    for i in sorted(set(old) - set(now)):
        gone.setdefault(old[i], []).append(i)
    added, renamed = [], []
    for i in sorted(set(now) - set(old)):
        same = gone.get(now[i])
        if same:
            renamed.append((same.pop(0), i))
        else:
            added.append(i)
    was = {o for o, _ in renamed}
    return added, sorted(set(old) - set(now) - was), renamed


def build_index(images_dir: Path | str, checkpoint: Path | str, out_dir: Path | str, *, force: bool = False,
                rehash: bool = False,
                batch_size: int = 8, chunk: int = 64, progress: bool = True,
                on_chunk: Callable[[int, int], None] | None = None, device: str | torch.device = "cpu",
                precision: str = "fp32", trust_modified: bool = False, features: bool | None = None
                ) -> dict[str, Any]:
    """Index (or update the index of) every image under `images_dir` with the model of `checkpoint` (a checkpoint
    directory, or a shipped model's name: `itmatch models --pretrained`), the backbone and the model on `device`
    (in `precision`; photos are decoded on the host; what is stored is float32 on the host, whatever the device).
    The arguments, the checkpoint's name and the photo folder are checked before anything is locked or read
    (ConfigError, CheckpointError, DataError).

    Returns a summary: counts of images total / encoded / reused, the ids added / changed / removed and the
    (old, new) ids renamed or moved since the last run, skipped unreadable files, seconds. A skipped file is
    also logged as a warning on the "itmatch.retrieval" logger (`progress` is the progress bars only: configure
    or silence that logger to change where the warning goes). An index built with
    another model is replaced only with `force` (its backbone features are reused when the backbone is the
    same). `on_chunk(done, total)` is called after each saved chunk (it may raise to stop the run, which then
    resumes from the saved chunks).
    `trust_modified` loads a checkpoint whose files differ from its manifest (engine/checkpoint.py).

    `features`: whether the index keeps the photos' backbone features beside the encodings its search reads, so that
    a new model of the same backbone re-indexes them without the CNN (most of an index's bytes: VSE++'s vectors are
    1/60 of them); None keeps them as the existing index has them (a new index keeps them).

    Under torchrun (docs/distributed.md) every rank calls this with the same arguments: rank r encodes its
    contiguous share of the images to encode into chunk files of its own, then rank 0 reads every rank's
    chunks and writes the index; every rank returns rank 0's summary.

    A photo whose size and mtime equal its record in the existing manifest is not read again, unless
    `rehash` (then every photo is hashed).
    """
    from itmatch import distributed as dist
    from itmatch.device import resolve
    from itmatch.pretrained import resolve_checkpoint

    # the arguments first, before the lock, the model or any photo: a bad one leaves nothing behind
    # (no lock file, no folder) and is said before minutes of hashing
    _check_build_arguments(batch_size=batch_size, chunk=chunk, on_chunk=on_chunk)
    resolve(device, precision, device_setting="device=", precision_setting="precision=")
    checkpoint = resolve_checkpoint(checkpoint)  # (a path, or a shipped model's name: its folder)
    images_dir = Path(images_dir).resolve()
    if not images_dir.is_dir():
        raise DataError("images folder not found", path=images_dir, hint="pass the folder that holds your photos")
    out_dir = Path(out_dir)
    if out_dir.resolve() == images_dir:  # (--force wrote the index among the photos, whose scan then named its files)
        raise ConfigError(f"--out {out_dir} is the photo folder itself", path=out_dir,
                          hint=f"write the index to a folder of its own, e.g. --out {images_dir.name}-index (a "
                               "subfolder of the photos works too: it is left out of the scan)")
    dist.init_from_env("gloo")
    with index_lock(out_dir) if dist.is_main() else contextlib.nullcontext():
        return _build_index(images_dir, checkpoint, out_dir, force=force, rehash=rehash, batch_size=batch_size,
                            chunk=chunk, progress=progress, on_chunk=on_chunk, device=device, precision=precision,
                            trust_modified=trust_modified, features=features)


def _check_build_arguments(*, batch_size: int, chunk: int, on_chunk: Callable[[int, int], None] | None) -> None:
    """ConfigError naming the build_index argument whose value cannot work (and the CLI option it comes from)."""
    whole_number("batch_size", batch_size, hint="pass batch_size=N (--batch-size N, N >= 1; the default is 8)")
    whole_number("chunk", chunk, hint="pass chunk=N (N >= 1; the default is 64)")
    if on_chunk is not None and not callable(on_chunk):
        raise ConfigError(f"on_chunk must be a function on_chunk(done, total) or None, got {type(on_chunk).__name__}",
                          hint="pass a callable, or leave on_chunk out")


@contextlib.contextmanager
def index_lock(out_dir: Path):
    """Held while an index is written (`.NAME.lock` beside it): a second `itmatch index` on the same --out, which
    would otherwise write beside the first and leave only its own photos in the manifest, stops at once. Under
    torchrun rank 0 holds it for the group."""
    # resolved: `--out .` has no name (the lock would be `./..lock`, inside the index folder, which is then no
    # longer empty), and two spellings of one folder (`idx`, `./idx/`, a link to it) share one lock
    where = out_dir.resolve()
    where.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(where.parent / f".{where.name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise OverwriteError("another `itmatch index` is writing this index now", path=out_dir,
                             hint="wait for it to finish (it leaves the index complete), or write to another "
                                  "--out (out_dir)") from None
    try:
        yield
    finally:
        lock.release()


def _build_index(images_dir: Path, checkpoint: Path | str, out_dir: Path, *, force: bool, rehash: bool,
                 batch_size: int, chunk: int, progress: bool, on_chunk: Callable[[int, int], None] | None,
                 device: str | torch.device, precision: str, trust_modified: bool, features: bool | None
                 ) -> dict[str, Any]:
    from itmatch import distributed as dist
    from itmatch.features.extract import _backbone_meta, _version
    from itmatch.retrieval.matcher import load

    progress = progress and dist.is_main()
    started = time.perf_counter()
    images_dir, out_dir = Path(images_dir).resolve(), Path(out_dir)
    matcher = load(checkpoint, device=device, precision=precision, trust_modified=trust_modified)
    model, backbone_name, on = matcher.model, matcher.backbone_name, matcher.device
    identity = model_identity(checkpoint, backbone_name)
    k, dim = matcher.backbone.grid ** 2, matcher.backbone.out_dim
    # random cells, which no encoder but one that passes its cells through returns unchanged (below)
    cells = torch.randn(2, k, dim, generator=torch.Generator().manual_seed(0)).to(on)
    with torch.inference_mode():
        # every field the image encoder returns is stored (SMAN: its v0, v1, att1 too), and only those: the
        # head's per-item parts are recomputed from them when the index is loaded (Searcher); except for a
        # pair-independent head, whose search reads the prepared item vectors alone: only those are stored (the
        # regions would be ~k times their bytes, and as many again in memory while the index loads)
        probe = model.encode_image_fields(cells)
        vectors_only = model.head.pair_independent  # (its score is one product of the item vectors)
        layout = VECTORS_ONLY if vectors_only else "fields"
        stored = _index_encodings(model, cells, vectors_only)
    not_float = sorted(key for key, value in probe.extras.items() if not value.is_floating_point())
    if not_float and not vectors_only:
        raise ConfigError(f"the {identity['preset'] or identity['arch']} model cannot be indexed: its image "
                          f"encodings carry non-float parts ({', '.join(not_float)}) that the index cannot store",
                          path=checkpoint, hint="store them as float tensors in the image encoder's extras")
    row_shapes = {"features": (k, dim), **{name: arr.shape[1:] for name, arr in stored.items()}}

    old: dict[str, Any] | None = None
    if (out_dir / MANIFEST).exists():
        try:
            old = read_manifest(out_dir)
        except DataError:
            if not force:
                raise
        if old is not None and not same_model(old["model"], identity) and not force:
            raise OverwriteError(
                f"{out_dir} is an index built with another model ({old['model'].get('checkpoint')})",
                path=out_dir, hint="write to another --out, or pass --force (force=True from Python) to "
                                   "re-encode it with this model")
        if old is not None and old.get("images_root") not in (None, str(images_dir)) and not force:
            # (an update removes the photos it does not find: from another folder, every photo of this index)
            raise OverwriteError(
                f"{out_dir} indexes {old['images_root']} ({old['count']} photos), not {images_dir}", path=out_dir,
                hint="write to another --out; or, to make it the index of this folder (a moved photo folder, say), "
                     "pass --force (force=True from Python): photos whose content it has already encoded are not "
                     "encoded again")
    elif out_dir.exists() and any(p.name != PARTS for p in out_dir.iterdir()) and not force:
        raise OverwriteError("exists and is not an index", path=out_dir,
                             hint="choose an empty or new --out, or pass --force (force=True from Python)")
    keep_features = features if features is not None else old is None or "features" in old["arrays"]
    if not keep_features:
        del row_shapes["features"]
    # regions that are the backbone's cells themselves (SMAN's I_m, exactly, in evaluation mode) are stored once,
    # as the features, where the index keeps them: half the bytes of such an index
    regions_are_features = (keep_features and not vectors_only and probe.regions.shape == cells.shape
                            and torch.equal(probe.regions.float(), cells))
    if regions_are_features:
        del row_shapes["regions"]
    out_dir.mkdir(parents=True, exist_ok=True)
    if dist.is_main():  # (the rank that holds index_lock and writes the arrays)
        _remove_killed_writes(out_dir)
    parts_dir = out_dir / PARTS

    # Where each sha256's encodings (or at least features) can come from without running the CNN.
    old_rows: dict[str, int] = {}
    old_arrays: dict[str, np.ndarray] = {}
    old_sizes: dict[str, tuple[int, int]] = {}
    if old is not None:
        same_backbone = old["model"].get("backbone") == backbone_name
        # (a model that differs only in its vocabulary encodes images alike: its encodings are kept, where they are
        # stored alike: an index of an older itmatch holds a pair-independent model's fields, re-encoded from its
        # features into the prepared vectors)
        same_encodings = same_image_encoder(old["model"], identity) and encodings_layout(old) == layout
        keep = list(old["arrays"]) if same_encodings else (["features"] if same_backbone else [])
        try:
            for name in keep:
                if name in old["arrays"]:
                    # verified: rows copied into the new generation must not carry corruption forward
                    old_arrays[name] = _open_array(out_dir, old, name, verify=True)
            if same_encodings and old.get("regions_from") == "features" and "features" in old_arrays:  # (SMAN)
                old_arrays["regions"] = old_arrays["features"]
            for row, e in enumerate(old["images"]):
                old_rows.setdefault(e["sha256"], row)
                old_sizes[e["sha256"]] = (e["width"], e["height"])
        except DataError:
            if not force:
                raise
            old_rows, old_arrays = {}, {}
    parts = _read_parts(parts_dir, identity, layout, row_shapes)

    paths = scan_images(images_dir, exclude=out_dir)
    if not paths and old is not None and old["count"] and not force:
        raise DataError(f"no image under {images_dir} (recursively): updating {out_dir} would remove all its "
                        f"{old['count']} photos", path=images_dir,
                        hint="check the folder (a disk not mounted?); pass --force (force=True from Python) to "
                             "empty the index")
    records, unreadable = _hash_files(images_dir, paths, progress, None if rehash else old)

    # the old rows serve only when they hold every array this index stores (the features too: an index built with
    # --no-features that keeps them now reads its photos through the CNN again)
    has_regions = all(name in old_arrays for name in row_shapes)
    todo = []  # unique contents with no encodings yet
    seen = set()
    for r in records:
        sha = r["sha256"]
        if sha in seen or sha in parts or (has_regions and sha in old_rows):
            continue
        seen.add(sha)
        todo.append(r)

    skipped: list[dict[str, str]] = []
    # every rank has read the parts directory and made its `todo` before any rank writes a part there: a rank
    # that read late would see another's new parts, make a shorter `todo` and shard it differently, so that
    # some images would be encoded by no rank (seen once under load: rank 0 then found no row for them)
    dist.barrier()
    start, stop = dist.shard_bounds(len(todo))  # this rank's share (everything in one process)
    mine = todo[start:stop]
    bar = tqdm(total=len(mine), desc="encode images", unit="img", disable=not progress)

    def decoded(record: dict[str, Any]) -> tuple[torch.Tensor, tuple[int, int]]:
        image = decode_image(images_dir / record["id"])
        return matcher.backbone.preprocess(image), image.size  # (the size as shown: EXIF orientation applied)

    decoders = ThreadPoolExecutor(decode_threads(matcher.placement.device), thread_name_prefix="itmatch-decode")
    with strict_decoding(), torch.inference_mode(), decoders:
        for c0 in range(0, len(mine), chunk):
            batch_records = mine[c0:c0 + chunk]
            # per record: None where its backbone features are reused, else its photo decoding on the threads
            decoding = [None if "features" in old_arrays and r["sha256"] in old_rows else decoders.submit(decoded, r)
                        for r in batch_records]
            feats, sizes, good = [], [], []
            for r, pending in zip(batch_records, decoding, strict=True):
                sha = r["sha256"]
                if pending is None:
                    feats.append(torch.from_numpy(np.array(old_arrays["features"][old_rows[sha]])))
                    sizes.append(old_sizes[sha])
                    good.append(r)
                    continue
                try:
                    pixels, size = pending.result()
                except UnreadableImage as exc:
                    log.warning("skipping %s: %s", public_id(r["id"]), exc.reason)
                    skipped.append({"id": r["id"], "reason": exc.reason})
                    continue
                feats.append(pixels)
                sizes.append(size)
                good.append(r)
            # backbone on the images that need it, in batches
            need = [i for i, f in enumerate(feats) if f.dim() == 3]  # pixels [3, S, S], not features [k, D]
            for b0 in range(0, len(need), batch_size):
                idx = need[b0:b0 + batch_size]
                out = grid_features(matcher.backbone, torch.stack([feats[i] for i in idx]), matcher.placement)["c5"]
                for j, i in enumerate(idx):
                    feats[i] = out[j]
            if good:
                f = torch.stack(feats).float()
                with matcher.placement.arithmetic():
                    fields = _index_encodings(model, f.to(on), vectors_only)
                if regions_are_features:
                    if not np.array_equal(fields["regions"], f.numpy()):  # (the probe said they would be)
                        raise RuntimeError("the image encoder's regions differ from its input features")
                    del fields["regions"]
                chunk_data = {"sha256": np.array([r["sha256"] for r in good]),
                              **({"features": f.numpy()} if keep_features else {}), **fields,
                              "sizes": np.array(sizes, dtype=np.int64),
                              "weights_hash": np.array(identity["weights_hash"]),
                              "config_hash": np.array(identity["config_hash"]),
                              "image_encodings": np.array(layout)}
                name = parts_dir / f"part-{identity['weights_hash'][:12]}-{secrets.token_hex(6)}.npz"
                parts_dir.mkdir(exist_ok=True)
                _save_npz(name, chunk_data)
                parts.update(_part_rows(chunk_data))
            bar.update(len(batch_records))
            if on_chunk is not None:
                on_chunk(min(c0 + chunk, len(mine)), len(mine))
    bar.close()
    if dist.is_distributed():  # rank 0 goes on with every rank's chunks (all saved once this returns)
        gathered = dist.gather_objects(skipped)
        if gathered is None:
            return dist.broadcast_object(None)
        skipped = [s for part in gathered for s in part]
        parts = _read_parts(parts_dir, identity, layout, row_shapes)

    encoded = {t["sha256"] for t in todo}
    encoded_count = len(encoded) - len(skipped)  # the files that failed to decode were not encoded
    records, undecodable = _drop_undecodable(records, skipped)
    skipped = unreadable + undecodable
    old_ids = {e["id"]: e["sha256"] for e in old["images"]} if old is not None else {}
    now_ids = {r["id"]: r["sha256"] for r in records}
    added, removed, renamed = _compare_ids(old_ids, now_ids)
    summary = {"index": str(out_dir), "images": len(records), "encoded": encoded_count,
               "reused": sum(1 for r in records if r["sha256"] not in encoded),
               "added": added, "removed": removed, "renamed": renamed,
               "changed": sorted(i for i in set(now_ids) & set(old_ids) if now_ids[i] != old_ids[i]),
               "skipped": skipped}
    # (files that still cannot be read need no rewrite: they are listed in the old manifest already)
    unchanged = (old is not None and has_regions and not encoded and skipped == old.get("skipped") and not parts
                 and old["model"] == identity  # (else records this checkpoint: its vocabulary, its path)
                 and set(old["arrays"]) == set(row_shapes)  # (else rewritten: an older index's second copy goes)
                 and old.get("images_root") == str(images_dir)
                 and [(e["id"], e["sha256"]) for e in old["images"]] == [(r["id"], r["sha256"]) for r in records])
    if unchanged:  # no array to rewrite (an up-to-date index of a large collection costs one stat per photo)
        if [e.get("mtime_ns") for e in old["images"]] != [r["mtime_ns"] for r in records]:
            # touched files (same content, new mtime): recorded, so that the next run skips their hashing
            images = [{**e, "bytes": r["bytes"], "mtime_ns": r["mtime_ns"]}
                      for e, r in zip(old["images"], records, strict=True)]
            write_json_atomic(out_dir / MANIFEST, {**old, "images": images})
        return dist.broadcast_object({**summary, "seconds": round(time.perf_counter() - started, 2)})
    manifest = _consolidate(out_dir, old, old_arrays if has_regions else {}, old_rows, parts, records,
                            identity, row_shapes, images_dir)
    manifest["image_extras"] = sorted(name.removeprefix(EXTRA_PREFIX) for name in row_shapes
                                      if name.startswith(EXTRA_PREFIX))
    if regions_are_features:
        manifest["regions_from"] = "features"
    if vectors_only:
        manifest["image_encodings"] = VECTORS_ONLY
    # each version only where its addition is used: older itmatch reads every other index
    manifest["version"] = (FORMAT_VERSION if not keep_features else 3 if vectors_only else 2 if regions_are_features
                           else 1)
    manifest["skipped"] = skipped
    manifest["itmatch_version"] = _version()
    manifest["backbone"] = _backbone_meta(matcher.backbone)
    write_json_atomic(out_dir / MANIFEST, manifest)  # the commit point
    _cleanup(out_dir, manifest)
    return dist.broadcast_object({**summary, "seconds": round(time.perf_counter() - started, 2)})


def _drop_undecodable(records: list[dict], failed: list[dict[str, str]]) -> tuple[list[dict], list[dict[str, str]]]:
    """`records` less every file whose content failed to decode, and those files as skipped entries (id, reason).
    Only the first file of each content is decoded (`todo` holds each sha256 once), so its copies (two empty
    .jpg files, say) fail with it: dropped by id alone, a copy would stay in the index with no encoding to store."""
    sha_of = {r["id"]: r["sha256"] for r in records}
    failures = {sha_of[f["id"]]: (f["id"], f["reason"]) for f in failed}  # content -> (the file decoded, why)
    kept, skipped = [], []
    for r in records:
        if r["sha256"] not in failures:
            kept.append(r)
            continue
        decoded, reason = failures[r["sha256"]]
        if r["id"] != decoded:  # (the decoded one was named as it failed)
            log.warning("skipping %s: %s (the same content as %s)", public_id(r["id"]), reason, public_id(decoded))
        skipped.append({"id": r["id"], "reason": reason})
    return kept, skipped


def _hash_files(images_dir: Path, paths: list[str], progress: bool, old: dict[str, Any] | None
                ) -> tuple[list[dict], list[dict[str, str]]]:
    """A record (id, bytes, mtime_ns, sha256) per file, and the files that could not be read, which are
    skipped with a warning. A file whose size and mtime equal its record in the `old` manifest is not
    read (`itmatch.fingerprint.file_record`)."""
    known = {e["id"]: e for e in old["images"]} if old is not None else {}
    records, unreadable = [], []
    for rel in tqdm(paths, desc="hash images", unit="img", disable=not progress, leave=False):
        try:
            rec = file_record(images_dir / rel, known.get(rel))
        except OSError as exc:
            log.warning("skipping %s: cannot read the file (%s)", public_id(rel), exc.strerror or exc)
            unreadable.append({"id": rel, "reason": f"cannot read the file: {exc.strerror or exc}"})
            continue
        records.append({"id": rel, "bytes": rec["bytes"], "mtime_ns": rec["mtime_ns"], "sha256": rec["sha256"]})
    return records, unreadable


def _consolidate(out_dir: Path, old: dict | None, old_arrays: dict[str, np.ndarray], old_rows: dict[str, int],
                 parts: dict[str, dict], records: list[dict], identity: dict,
                 row_shapes: dict[str, tuple[int, ...]], images_dir: Path) -> dict[str, Any]:
    """Write the arrays of the new generation (rows in `records` order) and return its manifest."""
    gen = f"{time.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"
    n = len(records)

    def row(name: str, sha: str) -> np.ndarray:
        if sha in parts:
            return parts[sha][name]
        return old_arrays[name][old_rows[sha]]

    arrays: dict[str, dict[str, Any]] = {}
    for name, per_row in row_shapes.items():
        shape = (n, *per_row)
        file = out_dir / f"{name}-{gen}.npy"
        with atomic_path(file) as tmp:
            arr = open_memmap(tmp, mode="w+", dtype=np.float32, shape=shape)
            for i, r in enumerate(records):
                arr[i] = row(name, r["sha256"])
            arr.flush()
            del arr
        arrays[name] = {"file": file.name, "shape": list(shape), "sha256": file_sha256(file)}
    images = []
    for r in records:
        sha = r["sha256"]
        if sha in parts:
            w, h = parts[sha]["width"], parts[sha]["height"]
        else:
            e = old["images"][old_rows[sha]] if old else {}
            w, h = e.get("width"), e.get("height")
        images.append({**r, "width": w, "height": h})
    return {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "images_root": str(images_dir), "model": identity, "count": n, "arrays": arrays, "images": images}


def _remove_killed_writes(out_dir: Path) -> None:
    """The arrays of a generation whose run was killed while writing them (io.atomic_path's temporary files, as
    large as the index): never read, and no one else writes here while index_lock is held."""
    for f in out_dir.glob(".*-*.npy.*.partial"):
        if is_index_array(f.name[1:].split("-", 1)[0]):
            f.unlink(missing_ok=True)


def _cleanup(out_dir: Path, manifest: dict) -> None:
    """Delete the arrays of older generations and the chunks the new manifest has absorbed."""
    current = {spec["file"] for spec in manifest["arrays"].values()}
    for f in out_dir.glob("*-*.npy"):
        if is_index_array(f.name.split("-", 1)[0]) and f.name not in current:
            f.unlink(missing_ok=True)
    parts_dir = out_dir / PARTS
    if parts_dir.is_dir():
        for f in parts_dir.glob("part-*.npz"):
            f.unlink(missing_ok=True)
        for f in parts_dir.glob(".*.partial"):
            f.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # something not ours left in it
            parts_dir.rmdir()
