"""First-stage index over pair-independent float32 embeddings (FAISS, the `index` extra): exact flat
inner product, or IVF (inverted lists over k-means cells, approximate, sub-linear search).
Embeddings are l2-normalised by the models that have them, so inner product = cosine."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from itmatch.errors import ConfigError, DataError
from itmatch.io import write_with

KINDS = ("flat", "ivf")


def _faiss():
    try:
        import faiss
    except ImportError:
        raise ConfigError("the first-stage index needs faiss", hint="pip install 'itmatch[index]' (faiss-cpu)"
                          ) from None
    return faiss


def _as_float32(vectors: np.ndarray | torch.Tensor, what: str) -> np.ndarray:
    if isinstance(vectors, torch.Tensor):
        vectors = vectors.detach().cpu().numpy()
    array = np.ascontiguousarray(vectors, dtype=np.float32)
    if array.ndim != 2 or array.shape[0] == 0:
        raise DataError(f"{what} must be a non-empty [N, D] array, got shape {tuple(array.shape)}",
                        hint="encode at least one item with a model that has a global embedding")
    return array


class FirstStageIndex:
    """build(vectors) -> search(queries, k) -> (scores [Q, k], ids [Q, k]); save/load a FAISS file.

    IVF: nlist = clamp(4 sqrt(N), 1, N / 39) cells (FAISS wants >= 39 training points per cell) and
    nprobe = nlist / 4 cells visited per query by default, a conservative choice for recall (figures:
    docs/performance.md, 'Two-stage retrieval'); raise nprobe for more, lower it for speed."""

    def __init__(self, kind: str = "flat", nlist: int | None = None, nprobe: int | None = None) -> None:
        if kind not in KINDS:
            raise ConfigError(f"unknown first-stage index {kind!r}", hint=f"choose one of {', '.join(KINDS)}")
        self.kind, self.nlist, self.nprobe = kind, nlist, nprobe
        self.index = None

    def __len__(self) -> int:
        return 0 if self.index is None else int(self.index.ntotal)

    def build(self, vectors: np.ndarray | torch.Tensor) -> FirstStageIndex:
        faiss = _faiss()
        x = _as_float32(vectors, "index vectors")
        n, d = x.shape
        if self.kind == "flat":
            self.index = faiss.IndexFlatIP(d)
        else:
            nlist = self.nlist or max(1, min(int(4 * math.sqrt(n)), n // 39))
            quantizer = faiss.IndexFlatIP(d)
            index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
            index.train(x)
            self.nlist, self.nprobe = nlist, self.nprobe or max(1, nlist // 4)
            index.nprobe = self.nprobe
            self._quantizer = quantizer  # the index does not own it: keep it alive as long as the index
            self.index = index
        self.index.add(x)
        return self

    def search(self, queries: np.ndarray | torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k by inner product: (scores, ids), both [Q, min(k, N)]; ids of missing hits (IVF cells
        with fewer than k items) are -1."""
        if self.index is None:
            raise ConfigError("the first-stage index is empty", hint="call build(vectors) or load(path) first")
        q = _as_float32(queries, "query vectors")
        if q.shape[1] != self.index.d:
            raise DataError(f"query vectors have dimension {q.shape[1]}, the index {self.index.d}",
                            hint="use the same model for the index and the queries")
        if k < 1:
            raise ConfigError(f"k must be >= 1, got {k}")
        scores, ids = self.index.search(q, min(k, len(self)))
        return torch.from_numpy(scores), torch.from_numpy(ids)

    def save(self, path: str | Path) -> None:
        if self.index is None:
            raise ConfigError("nothing to save: the index is empty")
        faiss = _faiss()
        write_with(path, lambda tmp: faiss.write_index(self.index, str(tmp)))

    @classmethod
    def load(cls, path: str | Path) -> FirstStageIndex:
        faiss = _faiss()
        if not Path(path).is_file():
            raise DataError("no index file here", path=path, hint="build one and save() it first")
        try:
            index = faiss.read_index(str(path))
        except RuntimeError as exc:
            raise DataError(f"not a FAISS index ({str(exc).splitlines()[0][:120]})", path=path) from None
        ivf = faiss.try_extract_index_ivf(index)  # a view into `index`, valid while it lives
        self = cls("flat" if ivf is None else "ivf")
        self.index = index
        if ivf is not None:
            self.nlist, self.nprobe = int(ivf.nlist), int(ivf.nprobe)
        return self
