"""Shared fixtures: a tiny learnable precomp dataset (regions drawn from word prototypes)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from itmatch.data.precomp import write_captions, write_features

REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """A script of the repository (bench/*.py, scripts/*.py) imported as a fresh module, its main not run; it
    stays in sys.modules under its own name (its dataclasses look their module up)."""
    name = "script_" + relative.removesuffix(".py").replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


WORDS = ["red", "blue", "green", "circle", "square", "triangle", "big", "small", "left", "right"]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def tiny_preset_model(preset: str, regions: int, img_dim: int):
    """(config, model in eval mode) of `preset` at D = 16 on `regions` cells of `img_dim` features, its weights
    drawn larger (uniform in [-0.5, 0.5], seed 0) so that scores spread out and a wrong one shows; skipped for a
    preset that reads stage maps or photos, or that needs a package or weights this machine lacks."""
    from itmatch.errors import ItmatchError
    from itmatch.models.registry import build_model, image_inputs, preset_config

    cfg = preset_config(preset)
    if image_inputs(cfg.model):
        pytest.skip(f"{preset} reads {image_inputs(cfg.model)} (stage maps or photos), not one region grid; "
                    "its head (SCAN) is covered by the single-scale presets")
    vocab_size = 30522 if cfg.model.arch == "mmca" else 40  # MMCA's frozen encoder's WordPiece ids
    cfg.model.embed_size, cfg.model.word_dim, cfg.model.img_dim, cfg.model.vocab_size = 16, 8, img_dim, vocab_size
    cfg.model.sman.regions = regions
    try:
        model = build_model(cfg.model).eval()
    except (ImportError, ItmatchError) as exc:
        pytest.skip(f"{preset}: cannot build a tiny model here ({exc})")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5)
    return cfg, model


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
def photos(tmp_path_factory) -> Path:
    """A precomp directory (captions and ids only) and a folder of 8 small photos it names, for models that read
    pixels (train: all 8, 5 captions each; dev: the first 4)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    ids = []
    for i in range(8):
        name = f"p{i}.jpg"
        Image.fromarray(rng.integers(0, 255, (48 + 4 * i, 64, 3), dtype=np.uint8)).save(root / name)
        ids.append(name)
    words = ["red", "blue", "green", "grey", "dark", "light", "big", "small"]
    caps = [f"a {w} photo number {c}" for w in words for c in range(5)]
    write_captions(root, "train", ids, caps)
    write_captions(root, "dev", ids[:4], caps[:20])
    return root


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


@pytest.fixture(scope="session")
def shipped_vsepp_index(tiny_search_setup, tmp_path_factory) -> Path:
    """The 12 test photos indexed with the shipped VSE++ model (`vsepp_seed1-flickr8k`, by name, through the real
    CNN): a model whose score has no per-word attention, as a user of the shipped models meets it."""
    from itmatch.retrieval.index import build_index

    out = tmp_path_factory.mktemp("shipped_vsepp") / "index"
    build_index(tiny_search_setup["photos"], "vsepp_seed1-flickr8k", out, progress=False)
    return out


@pytest.fixture
def float64():
    """Run a test in float64 (the slow per-pair references; the heads follow the input dtype)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


# File names a photo folder can hold on Linux (bytes; not all UTF-8), mapped to the id the index gives them
# (itmatch.retrieval.names.public_id): search, serve and the web page must handle every one.
HOSTILE_NAMES: dict[bytes, str] = {
    b"caf\xe9.png": "caf\\xe9.png",  # Latin-1, not UTF-8
    b"\xff\xfe half \xc3.png": "\\xff\\xfe half \\xc3.png",
    "café ünïcode 😀.png".encode(): "café ünïcode 😀.png",
    b"<img src=x onerror=window.pwned=1>.png": "<img src=x onerror=window.pwned=1>.png",
    b"<script>window.pwned=2<\\script>.png": "<script>window.pwned=2<\\\\script>.png",
    b"it's \"quoted\" & more.png": "it's \"quoted\" & more.png",
    b"hash#frag.png": "hash#frag.png",
    b"what?q=1&id=x.png": "what?q=1&id=x.png",
    b"100% real %2e%2e%2Fetc.png": "100% real %2e%2e%2Fetc.png",
    b"  two  spaces .png": "  two  spaces .png",
    b"new\nline\ttab.png": "new\\nline\\ttab.png",
    b"-rf --help.png": "-rf --help.png",
    b"C:drive.png": "C:drive.png",
    "\u202egnp.exe.png".encode(): "\\u202egnp.exe.png",
    b"L" * 251 + b".png": "L" * 251 + ".png",  # 255 bytes: the longest name ext4 allows
    b"caf\xe9 dir/in a folder.png": "caf\\xe9 dir/in a folder.png",
    b"sub #1?/new\nline dir/deep.png": "sub #1?/new\\nline dir/deep.png",
    b"-dash dir/a..b.png": "-dash dir/a..b.png",
}


@pytest.fixture(scope="session")
def hostile_photos(tiny_search_setup, tmp_path_factory) -> Path:
    """A photo folder whose files have the HOSTILE_NAMES (2:1 photos, distinct contents; nothing else in it)."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("hostile")
    sources = sorted(tiny_search_setup["photos"].iterdir())
    for n, name in enumerate(HOSTILE_NAMES):
        path = Path(os.fsdecode(bytes(folder) + b"/" + name))
        path.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(sources[n % len(sources)]) as im:
            im.convert("RGB").resize((336, 168)).rotate(20 * n).save(path, format="PNG")
    return folder


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """Run an ASGI app under uvicorn on a free 127.0.0.1 port in a thread; yields its base URL. A real server,
    not fastapi's TestClient: that one decodes the request path twice (a name holding `%2e` arrives as `.`)."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("the server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def serve_process(*args: str, ready: str) -> Iterator[tuple[int, list[str]]]:
    """A real `itmatch serve ARGS` process on a free port until its log says `ready`; yields the port and the lines
    it has logged (still growing), and ends it (SIGTERM, then SIGKILL after 30 s) on leaving."""
    import socket
    import subprocess
    import threading
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "itmatch", "serve", *args, "--port", str(port)],
                              stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(server.stderr), daemon=True)  # (a read never blocks us)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.poll() is None and ready not in "".join(lines):
            time.sleep(0.2)
        assert ready in "".join(lines), "".join(lines)
        yield port, lines
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        reader.join(timeout=10)
