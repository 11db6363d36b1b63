"""Finished blocks of an exhaustive score matrix kept on disk (`itmatch evaluate --resume-dir`), so that a killed
evaluation continues: a later run over exactly the same inputs (a key hashing the model, the encoded items and
the block plan) loads the finished blocks and scores only the others.
Why and how, and what "the same inputs" means: docs/reliability.md, "Crash safety in detail" (Evaluation).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from itmatch.io import write_with
from itmatch.models.base import Block, ImageEmb, Matcher

KEY_CHARS = 20  # of the SHA-256 hex digest: a directory name, collisions out of reach
FLUSH_SECONDS = 60.0  # of scoring between two writes of finished blocks (what a kill can lose at most)


def _update(h: hashlib._Hash, t: torch.Tensor) -> None:
    h.update(str((t.dtype, tuple(t.shape))).encode())
    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def matrix_key(model: Matcher, img: ImageEmb, blocks: list[Block]) -> str:
    """Hex key of one score matrix: model parameters and buffers, encoded items, block plan."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        _update(h, t)
    for t in img.tensors():
        _update(h, t)
    seen: set[int] = set()
    for rows, columns, txt in blocks:
        h.update(repr((rows.start, rows.stop)).encode())
        if isinstance(columns, slice):
            h.update(repr((columns.start, columns.stop)).encode())
        else:
            _update(h, columns)
        if id(txt) not in seen:  # a caption bucket serves many blocks: hash it once
            seen.add(id(txt))
            for t in txt.tensors():
                _update(h, t)
    return h.hexdigest()[:KEY_CHARS]


class MatrixBlocks:
    """The finished blocks of one score matrix, in `DIR/<key>/part-<first>-<last>.safetensors` files: one
    tensor per block (`b<k>`); the metadata holds each block's scoring seconds and how many ranks were
    scoring side by side when it was made. Blocks are written in parts every FLUSH_SECONDS of scoring, not
    one file each (a pair head's test matrix has very many short blocks: docs/reliability.md), and a kill
    loses at most one part's work.

    `ranks` is this run's number of processes (torchrun's world size). A block's share of an earlier run's
    wall time is its seconds / that run's ranks, so resumed seconds add up to the earlier runs' wall time
    whether those ran alone or sharded, and whatever this run's ranks."""

    def __init__(self, cache: ScoreCache, key: str, ranks: int = 1) -> None:
        self.cache, self.dir, self.ranks = cache, cache.root / key, ranks
        self.flush_seconds = FLUSH_SECONDS
        self._finished: dict[int, tuple[torch.Tensor, float]] = {}  # from earlier runs, until used
        for part in sorted(self.dir.glob("part-*.safetensors")):
            with safe_open(str(part), framework="pt") as f:
                meta = f.metadata()
                seconds, ranks_then = json.loads(meta["seconds"]), int(meta.get("ranks", 1))
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    self._finished[int(name[1:])] = (f.get_tensor(name), seconds[name] / ranks_then)
        self._pending: dict[int, tuple[torch.Tensor, float]] = {}
        self._pending_seconds = 0.0

    def load(self, k: int) -> torch.Tensor | None:
        """Block k's scores if an earlier run finished it (its share of that run's wall time is added to the
        cache's tally)."""
        if k not in self._finished:
            return None
        scores, seconds = self._finished.pop(k)
        self.cache.resumed_blocks += 1
        self.cache.resumed_seconds += seconds
        return scores

    def save(self, k: int, scores: torch.Tensor, seconds: float) -> None:
        """Keep block k; written with the others of its part once FLUSH_SECONDS of scoring have passed."""
        self._pending[k] = (scores, seconds)
        self._pending_seconds += seconds
        if self._pending_seconds >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Write the blocks kept since the last part (nothing if none)."""
        if not self._pending:
            return
        ks = sorted(self._pending)
        tensors = {f"b{k}": self._pending[k][0].contiguous() for k in ks}
        seconds = json.dumps({f"b{k}": round(self._pending[k][1], 6) for k in ks})
        self.dir.mkdir(parents=True, exist_ok=True)
        write_with(self.dir / f"part-{ks[0]:07d}-{ks[-1]:07d}.safetensors",
                   lambda tmp: save_file(tensors, str(tmp),
                                                 metadata={"seconds": seconds, "ranks": str(self.ranks)}))
        self._pending, self._pending_seconds = {}, 0.0

    def finish(self) -> None:
        """The matrix is complete: its blocks are no longer needed (nor the cache directory, if empty)."""
        self._pending, self._finished = {}, {}
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.cache.root.is_dir() and not any(self.cache.root.iterdir()):
            self.cache.root.rmdir()


class ScoreCache:
    """A directory of finished score blocks (`itmatch evaluate --resume-dir`), one subdirectory per matrix;
    counts what it resumed (blocks, and the wall seconds earlier runs spent scoring them)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.resumed_blocks = 0
        self.resumed_seconds = 0.0

    def matrix(self, model: Matcher, img: ImageEmb,
               blocks: list[Block], ranks: int = 1) -> MatrixBlocks:
        key = matrix_key(model, img, blocks)
        others = sorted(p.name for p in self.root.glob("*") if p.is_dir() and p.name != key)
        if others and not (self.root / key).exists():  # said at the start, not after hours of scoring
            warnings.warn(f"{self.root}: holds unfinished scores of {len(others)} other evaluation(s) "
                          f"({', '.join(others)}), not of this one, which starts from its first block; they "
                          f"were made with another model, other data or another --threads (remove them when "
                          f"they are no longer needed)", stacklevel=2)
        return MatrixBlocks(self, key, ranks)
