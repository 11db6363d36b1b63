"""Pretrained models by name: a trained checkpoint converted to the shipped fp16 form (scripts/ship_pretrained.py,
size limit), loaded by name (itmatch.load, `itmatch index --model NAME`), listed by `itmatch models --pretrained`.
The tests of the mechanism ship into a temporary folder; the models the package ships are checked against
their results rows and on real photos."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_script
from safetensors.torch import load_file

import itmatch
import itmatch.pretrained as pretrained
from itmatch.cli import main as itmatch_main
from itmatch.config import parse_overrides
from itmatch.data.vocab import build_vocab
from itmatch.engine.checkpoint import load_checkpoint, save_checkpoint
from itmatch.engine.train import train
from itmatch.errors import CheckpointError
from itmatch.models.registry import build_model, resolve_config

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"


def ship_main(argv: list[str]) -> int:
    return load_script("scripts/ship_pretrained.py").main(argv)


@pytest.fixture(scope="module")
def trained(tiny_precomp, tmp_path_factory) -> Path:
    """A tiny SCAN model trained for 2 batches on the tiny fixture."""
    run = tmp_path_factory.mktemp("run")
    cfg = resolve_config("scan_t2i_avg", parse_overrides(
        [f"data.path={tiny_precomp}", "model.embed_size=16", "model.word_dim=8", "train.epochs=1",
         "train.max_batches=2", "train.batch_size=16", "train.val_images=20", "train.threads=1"]))
    train(cfg, run, progress=False)
    return run / "best"


@pytest.fixture
def shelf(tmp_path, monkeypatch) -> Path:
    """An empty folder of shipped models in place of the package's."""
    root = tmp_path / "pretrained"
    root.mkdir()
    monkeypatch.setattr(pretrained, "PRETRAINED_DIR", root)
    return root


def test_a_trained_checkpoint_ships_in_fp16_and_loads_by_name(trained, shelf, tiny_precomp, tmp_path, capsys):
    results = tmp_path / "results.csv"
    from itmatch.engine.results import result_row, upsert_row

    result = {"protocol": "1k", "rsum": 300.0, "eval_seconds": 1.0, "image_to_text": {"r1": 1, "r5": 2, "r10": 3},
              "text_to_image": {"r1": 4, "r5": 5, "r10": 6}}
    upsert_row(results, result_row("tiny", "scan_t2i_avg", "tiny", result, "python bench/x.py --row tiny"))
    assert ship_main([str(trained), "tiny-scan", "--out-root", str(shelf), "--results", str(results),
                      "--row", "tiny"]) == 0
    folder = shelf / "tiny-scan"
    weights = load_file(str(folder / "model.safetensors"))
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.float16}
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 20_000_000
    card = pretrained.shipped()["tiny-scan"].card
    assert card["results"]["rsum"] == "300.0" and card["command"] == "python bench/x.py --row tiny"

    feats = np.load(tiny_precomp / "test_ims.npy")[:5]
    captions = (tiny_precomp / "test_caps.txt").read_text().splitlines()[:10]
    by_name, original = itmatch.load("tiny-scan"), itmatch.load(trained)
    shipped_scores = by_name.score(torch.from_numpy(feats), captions)
    assert (shipped_scores - original.score(torch.from_numpy(feats), captions)).abs().max() < 1e-2  # fp16 rounding
    assert itmatch_main(["models", "--pretrained"]) == 0
    assert "tiny-scan" in (listed := capsys.readouterr().out) and "rsum 300.0 (1k tiny, row tiny)" in listed


def test_evaluate_takes_a_shipped_models_name_and_says_it_brings_no_features(trained, shelf, tiny_precomp,
                                                                             tmp_path, monkeypatch, capsys):
    assert ship_main([str(trained), "tiny-scan", "--out-root", str(shelf)]) == 0
    assert itmatch_main(["evaluate", "tiny-scan", "--data", str(tiny_precomp), "--quiet"]) == 0
    assert "rsum" in capsys.readouterr().out
    monkeypatch.setattr(pretrained, "PRETRAINED_DIR", ROOT / "src" / "itmatch" / "pretrained")
    monkeypatch.chdir(tmp_path)  # (no runs/data here: the shipped model's data.path is nowhere)
    assert itmatch_main(["evaluate", "vsepp-flickr8k", "--quiet"]) == 2  # (a data error)
    err = capsys.readouterr().err
    assert "a shipped model comes without features" in err and "--backbone lite0" in err


def test_the_shipped_form_halves_the_weights_and_keeps_exact_buffers():
    """float32 weights go to fp16; float64 buffers (MMCA's encoder fingerprint, checked to 1e-9 on load) and
    integer ones stay as they are: an fp16 fingerprint made the first shipped MMCA model unloadable."""
    state = {"w": torch.randn(3, 2), "fingerprint": torch.tensor([12345.678901234, 22e6], dtype=torch.float64),
             "steps": torch.tensor(7)}
    shipped = pretrained.fp16_weights(state)
    assert shipped["w"].dtype == torch.float16 and torch.allclose(shipped["w"].float(), state["w"], atol=1e-3)
    assert torch.equal(shipped["fingerprint"], state["fingerprint"]) and torch.equal(shipped["steps"], state["steps"])


def test_nothing_is_shipped_over_the_size_limit_or_over_an_existing_name(trained, shelf, capsys):
    assert ship_main([str(trained), "too-big", "--out-root", str(shelf), "--max-mb", "0.01"]) == 1
    assert "over the 0.01 MB limit" in capsys.readouterr().err
    assert not list(shelf.iterdir())  # no folder, no partial one
    assert ship_main([str(trained), "twice", "--out-root", str(shelf)]) == 0
    assert ship_main([str(trained), "twice", "--out-root", str(shelf)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert ship_main([str(trained), "Bad Name", "--out-root", str(shelf)]) == 1
    with pytest.raises(SystemExit) as usage:  # (was a FileNotFoundError traceback from the temporary folder)
        ship_main([str(trained), "elsewhere", "--out-root", str(shelf / "no-such-folder")])
    assert usage.value.code == 2 and "no-such-folder: no such folder" in capsys.readouterr().err


def test_an_unknown_name_says_where_to_look(shelf, capsys):
    assert itmatch_main(["models", "--pretrained"]) == 0
    assert "no pretrained model is shipped yet" in capsys.readouterr().out  # (an empty shelf)
    with pytest.raises(CheckpointError, match="no pretrained model named 'scan_i2t_lse-flickr8k'") as err:
        itmatch.load("scan_i2t_lse-flickr8k")
    assert "itmatch models --pretrained" in err.value.hint


SHIPPED = sorted(pretrained.shipped())


def test_the_package_ships_the_converged_models_listed_by_name(capsys):
    assert SHIPPED, "the package ships no pretrained model"
    assert itmatch_main(["models", "--pretrained"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in SHIPPED)
    # one column each, however long the longest name (the preset column starts where every name has ended)
    lines = listed.splitlines()
    starts = {len(line) - len(line[len(name):].lstrip()) for line, name in zip(lines, SHIPPED, strict=True)}
    assert len(starts) == 1 and min(starts) == max(map(len, SHIPPED)) + 1, listed


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_model_is_its_results_row_within_the_size_limit(name):
    """Each shipped model weighs at most 20 MB, and its card holds its row of the converged table as the bench
    wrote it and the command that trained it."""
    from itmatch.engine.results import read_rows

    model = pretrained.shipped()[name]
    assert sum(p.stat().st_size for p in model.path.iterdir()) <= pretrained.MAX_BYTES
    rows = {r["name"]: r for r in read_rows(ROOT / "docs" / "results" / "flickr8k_gpu.csv")}
    row = model.card["results"]
    assert row == rows[row["name"]] and model.card["command"] == row["command"]
    assert row["command"].startswith("python bench/flickr8k.py --config gpu")
    assert itmatch.load(name).model.training is False  # (loads by name: weights, vocabulary, frozen parts)


def test_no_file_of_a_shipped_model_is_ignored_by_git():
    """A shipped model's weights must reach a clone: `*.safetensors` is ignored everywhere else (run outputs)."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = [str(f.relative_to(ROOT)) for m in SHIPPED for f in pretrained.shipped()[m].path.iterdir()]
    # (--no-index: the patterns alone decide, so a file added by hand does not hide the trap)
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *files], cwd=ROOT, capture_output=True,
                             text=True).stdout
    assert files and not ignored, f"ignored by git, so missing from a clone: {ignored}"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::itmatch.data.captions.SkippedRowsWarning")  # (5 rows of a photo not in the set)
@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_model_finds_real_photos_by_their_captions(name):
    """The shipped weights (fp16), loaded by name, read real Flickr8K test photos through the real CNN and rank
    them by captions they have never been trained on: text-to-image R@5 over 100 test photos (chance: 5 %)."""
    flickr = SHARED / "flickr8k"
    if not (flickr / "images").is_dir():
        pytest.skip(f"the Flickr8K photos are not at {flickr} (../shared beside the checkout)")
    from itmatch.data.captions import read_flickr8k

    table = read_flickr8k(flickr / "Flickr8k.token.txt")
    ids, captions = table.precomp_rows("test")
    ids, first = ids[:100], captions[:500:5]
    matcher = itmatch.load(name)
    scores = matcher.score([flickr / "images" / i for i in ids], first)  # [images, captions]
    ranks = (scores > scores.diagonal().unsqueeze(0)).sum(0)  # per caption: images scored above its own
    r5 = float((ranks < 5).float().mean())
    assert r5 >= 0.5, f"{name}: text-to-image R@5 over 100 test photos is {r5:.2f}"


@pytest.fixture(scope="module")
def test_photos_features(tmp_path_factory):
    """Flickr8K's 1000 test photos through a backbone (`itmatch extract --splits test`), once per backbone."""
    flickr = SHARED / "flickr8k"
    if not (flickr / "images").is_dir():
        pytest.skip(f"the Flickr8K photos are not at {flickr} (../shared beside the checkout)")
    extracted: dict[str, Path] = {}

    def features(backbone: str) -> Path:
        if backbone not in extracted:
            out = tmp_path_factory.mktemp(f"flickr8k_{backbone}") / "precomp"
            assert itmatch_main(["extract", str(flickr / "images"), str(flickr / "Flickr8k.token.txt"), "--out",
                                 str(out), "--backbone", backbone, "--splits", "test", "--quiet"]) == 0
            extracted[backbone] = out
        return extracted[backbone]

    return features


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::itmatch.data.captions.SkippedRowsWarning")  # (5 rows of a photo not in the set)
@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_model_reproduces_its_results_row_from_the_photos(name, test_photos_features, tmp_path):
    """What a reader of the results table can check with two commands: the shipped model, by name, evaluated on
    features extracted here from the real test photos gives its row's recalls. The weights ship in fp16, so a
    recall may move by a tenth (measured: MMCA alpha = 0 269.9 -> 269.8, VSE++ 237.5 exactly)."""
    model = pretrained.shipped()[name]
    row = model.card["results"]
    backbone = json.loads((model.path / "config.json").read_text(encoding="utf-8"))["data"]["backbone"]
    data = test_photos_features(backbone)
    metrics = tmp_path / "metrics.json"
    assert itmatch_main(["evaluate", name, "--data", str(data), "--protocol", row["protocol"], "--quiet",
                         "--json", str(metrics)]) == 0
    got = json.loads(metrics.read_text(encoding="utf-8"))
    for direction in ("image_to_text", "text_to_image"):
        for k in ("r1", "r5", "r10"):
            assert abs(got[direction][k] - float(row[f"{direction}_{k}"])) <= 0.3, (name, direction, k, got)
    assert abs(got["rsum"] - float(row["rsum"])) <= 0.5, (name, got["rsum"], row["rsum"])


def test_index_photos_with_a_pretrained_model_by_name(shelf, tmp_path):
    """`itmatch index PHOTOS --model NAME` (a Lite0-grid model, untrained: only the plumbing is tested)."""
    from PIL import Image

    vocab = build_vocab(["a red photo"] * 4)
    cfg = resolve_config("vsepp", parse_overrides(["model.embed_size=16", "model.word_dim=8"]))
    cfg.model.vocab_size, cfg.model.img_dim = len(vocab), 1280
    save_checkpoint(tmp_path / "ckpt", build_model(cfg.model), cfg, vocab)
    assert ship_main([str(tmp_path / "ckpt"), "tiny-vsepp", "--out-root", str(shelf)]) == 0
    photos = tmp_path / "photos"
    photos.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(photos / f"p{i}.jpg")
    assert itmatch_main(["index", str(photos), "--model", "tiny-vsepp", "--out", str(tmp_path / "index"),
                         "--quiet"]) == 0
    assert (tmp_path / "index").is_dir()
    assert load_checkpoint(shelf / "tiny-vsepp").config.name == "tiny-vsepp"


def test_a_folder_with_a_shipped_models_name_that_is_not_a_checkpoint_names_the_clash(shelf, tmp_path, monkeypatch):
    """A path that exists is taken as a path first (a checkpoint folder of that name is loaded); one that is not a
    checkpoint hid the shipped model behind "not a checkpoint: model.safetensors is missing": the error says that a
    shipped model has the name and how to reach either."""
    (shelf / "tiny-vsepp").mkdir()
    (shelf / "tiny-vsepp" / pretrained.CARD).write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert pretrained.resolve_checkpoint("tiny-vsepp") == shelf / "tiny-vsepp"  # (no folder of that name here)
    (tmp_path / "tiny-vsepp").mkdir()  # e.g. the photos, or notes about the model
    for given in ("tiny-vsepp", Path("tiny-vsepp")):
        with pytest.raises(CheckpointError, match="a shipped model is named 'tiny-vsepp' too") as err:
            itmatch.load(given)
        assert "a folder without model.safetensors, config.json, vocab.json" in err.value.message
        assert "rename or move tiny-vsepp" in err.value.hint and str(shelf / "tiny-vsepp") in err.value.hint
    (tmp_path / "other").mkdir()  # no shipped model of that name: the loader's own error, as before
    with pytest.raises(CheckpointError, match="not a checkpoint: model.safetensors is missing"):
        itmatch.load("other")
    for name in ("model.safetensors", "config.json", "vocab.json"):  # a checkpoint folder of that name wins
        (tmp_path / "tiny-vsepp" / name).write_text("{}")
    assert pretrained.resolve_checkpoint("tiny-vsepp") == Path("tiny-vsepp")
