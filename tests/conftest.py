"""Shared fixtures: a tiny learnable precomp dataset (regions drawn from word prototypes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from itmatch.data.precomp import write_captions, write_features

WORDS = ["red", "blue", "green", "circle", "square", "triangle", "big", "small", "left", "right"]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def make_precomp(root: Path, sizes=(("train", 240), ("dev", 40), ("test", 40)), k: int = 6, dim: int = 32,
                 seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    protos = rng.standard_normal((len(WORDS), dim)).astype(np.float32)
    for split, n in sizes:
        feats = 0.3 * rng.standard_normal((n, k, dim)).astype(np.float32)
        caps = []
        for i in range(n):
            chosen = rng.choice(len(WORDS), 3, replace=False)
            feats[i, :3] += protos[chosen]
            caps += ["a " + " and ".join(WORDS[w] for w in rng.permutation(chosen)) for _ in range(5)]
        write_features(root, split, feats)
        write_captions(root, split, [f"{split}{i}" for i in range(n)], caps)
    return root


@pytest.fixture(scope="session")
def tiny_precomp(tmp_path_factory) -> Path:
    return make_precomp(tmp_path_factory.mktemp("precomp"))
