"""Shared fixtures: a tiny learnable precomp dataset (regions drawn from word prototypes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

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


@pytest.fixture(scope="session")
def tiny_search_setup(tmp_path_factory) -> dict[str, Path]:
    """A tiny SCAN t-i checkpoint trained for a few steps on rendered scenes, and a folder of 12
    held-out photos to index (search tests; about 15 s on 2 cores, once per session)."""
    import shutil

    from itmatch.data.captions import read_captions
    from itmatch.data.synth import render_synthetic
    from itmatch.engine.train import train
    from itmatch.features.extract import extract_precomp
    from itmatch.models.registry import resolve_config

    root = tmp_path_factory.mktemp("search")
    scenes = render_synthetic(root / "synth", n_train=48, n_dev=8, n_test=12, seed=0, progress=False).parent
    extract_precomp(scenes / "images", read_captions(scenes / "dataset_synth.json"), root / "precomp",
                    splits=["train", "dev"], progress=False)
    cfg = resolve_config("scan_t2i_avg", {
        "model": {"embed_size": 32, "word_dim": 32}, "data": {"path": str(root / "precomp")},
        "train": {"epochs": 1, "batch_size": 16, "val_images": 8, "log_every": 100}})
    train(cfg, root / "run", progress=False)
    photos = root / "photos"
    photos.mkdir()
    for p in sorted((scenes / "images").glob("test_*.png")):
        shutil.copy(p, photos / p.name)
    captions = root / "captions.txt"
    import json

    data = json.loads((scenes / "dataset_synth.json").read_text())
    captions.write_text("\n".join(s["raw"] for im in data["images"] if im["split"] == "test"
                                  for s in im["sentences"]) + "\n")
    return {"checkpoint": root / "run" / "best", "photos": photos, "captions": captions, "root": root}


@pytest.fixture
def float64():
    """Run a test in float64 (the slow per-pair references; the heads follow the input dtype)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
