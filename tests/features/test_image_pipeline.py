"""One image pipeline: extraction, the index, the Python API and pixel-input models (ImageFiles) turn the
same image files into the same numbers, bit for bit, and those numbers are what a slow reference written
here computes (PIL decode, EXIF orientation by hand, RGB, bilinear resize, the backbone's normalisation,
one batched forward). Images of every format a photo folder holds: JPEG/PNG with an EXIF orientation,
greyscale, RGBA, palette, CMYK, and real Flickr8K photos when ../shared/data has them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import itmatch
from itmatch.data.captions import CaptionTable
from itmatch.data.images import ImageFiles
from itmatch.errors import DataError
from itmatch.features import extract_precomp, load_backbone
from itmatch.features.pipeline import UnreadableImage, decode_image
from itmatch.retrieval.index import build_index, load_index

FLICKR8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "flickr8k" / "images"
ORIENTATION = 0x0112
# EXIF orientation -> the transpose that makes the stored pixels upright (the EXIF 2.3 table)
UPRIGHT = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_270, 8: Image.Transpose.ROTATE_90}


def _scene(seed: int, size=(80, 56)) -> Image.Image:
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * (seed + 2) * 3 % 256, yy * (seed + 3) * 5 % 256, (xx + 2 * yy) * 7 % 256], -1)
    return Image.fromarray(np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8))


def _with_orientation(image: Image.Image, orientation: int) -> Image.Exif:
    exif = image.getexif()
    exif[ORIENTATION] = orientation
    return exif


def _write_images(folder: Path) -> list[str]:
    """Image files of every kind, named so that sorted order is the order every caller batches them in."""
    folder.mkdir()
    _scene(0).save(folder / "a_rgb.jpg", quality=90)
    _scene(1).save(folder / "b_exif6.jpg", quality=90, exif=_with_orientation(_scene(1), 6))
    _scene(2).save(folder / "c_exif3.png", exif=_with_orientation(_scene(2), 3))
    _scene(3, (50, 70)).save(folder / "d_exif8.png", exif=_with_orientation(_scene(3), 8))
    _scene(4).convert("L").save(folder / "e_grey.png")
    rgba = _scene(5).convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(rgba.size))
    rgba.save(folder / "f_rgba.png")
    _scene(6).convert("P", palette=Image.Palette.ADAPTIVE, colors=32).save(folder / "g_palette.png")
    _scene(7).convert("CMYK").save(folder / "h_cmyk.jpg", quality=90)
    _scene(8, (300, 200)).save(folder / "i_large.webp", quality=80)
    if FLICKR8K.is_dir():
        for n, photo in enumerate(sorted(FLICKR8K.iterdir())[:2]):
            shutil.copy(photo, folder / f"j_flickr{n}{photo.suffix}")
    return sorted(p.name for p in folder.iterdir())


def _reference_pixels(path: Path, size: int) -> np.ndarray:
    """The rule written out slowly: decode, upright by the EXIF table, RGB, bilinear resize, (x - 127) / 128."""
    with Image.open(path) as im:
        im.load()
        orientation = im.getexif().get(ORIENTATION, 1)
        image = im.transpose(UPRIGHT[orientation]) if orientation in UPRIGHT else im.copy()
    image = image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
    arr = np.asarray(image, dtype=np.float32)
    return ((arr - np.float32(127.0)) / np.float32(128.0)).transpose(2, 0, 1)


@pytest.fixture(scope="module")
def lite0():
    return load_backbone("lite0")


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory) -> tuple[Path, list[str]]:
    folder = tmp_path_factory.mktemp("formats") / "images"
    return folder, _write_images(folder)


@pytest.fixture(scope="module")
def reference(lite0, photo_folder) -> dict[str, np.ndarray]:
    folder, names = photo_folder
    pixels = np.stack([_reference_pixels(folder / n, lite0.image_size) for n in names])
    with torch.inference_mode():
        grids = lite0(torch.from_numpy(pixels)).numpy()  # one batch: every caller below batches them alike
    return {"pixels": pixels, "grids": grids}


def test_exif_orientations_are_really_exercised(photo_folder):
    folder, _ = photo_folder
    with Image.open(folder / "b_exif6.jpg") as a, Image.open(folder / "d_exif8.png") as b:
        assert a.getexif()[ORIENTATION] == 6 and b.getexif()[ORIENTATION] == 8
        assert a.size == (80, 56) and b.size == (50, 70)


def test_pixel_models_read_the_reference_pixels(photo_folder, reference):
    folder, names = photo_folder
    pixels = ImageFiles(folder, names, "lite0").load_batch()
    assert pixels.dtype == torch.float32
    np.testing.assert_array_equal(pixels.numpy(), reference["pixels"])


def test_extraction_writes_the_reference_grids(photo_folder, reference, tmp_path):
    folder, names = photo_folder
    table = CaptionTable()
    for name in names:
        for c in range(5):
            table.add(name, f"a photo {name} {c}", "test")
    extract_precomp(folder, table, tmp_path / "precomp", batch_size=len(names), progress=False)
    np.testing.assert_array_equal(np.load(tmp_path / "precomp" / "test_ims.npy"), reference["grids"])


def test_api_and_index_compute_the_reference_grids(tiny_search_setup, photo_folder, reference, tmp_path):
    folder, names = photo_folder
    matcher = itmatch.load(tiny_search_setup["checkpoint"])
    from_paths = matcher.image_features([folder / n for n in names], batch_size=len(names))
    np.testing.assert_array_equal(from_paths.numpy(), reference["grids"])
    opened = []
    for n in names:
        with Image.open(folder / n) as im:
            im.load()
            opened.append(im.copy())
    from_pil = matcher.image_features(opened, batch_size=len(names))
    np.testing.assert_array_equal(from_pil.numpy(), reference["grids"])
    from_bytes = matcher.image_features([(folder / n).read_bytes() for n in names], batch_size=len(names))
    np.testing.assert_array_equal(from_bytes.numpy(), reference["grids"])
    from itmatch.retrieval.search import open_upload  # the service's uploads: decoded by the same pipeline

    uploaded = [open_upload((folder / n).read_bytes()) for n in names]
    np.testing.assert_array_equal(matcher.image_features(uploaded, batch_size=len(names)).numpy(), reference["grids"])

    build_index(folder, tiny_search_setup["checkpoint"], tmp_path / "index", batch_size=len(names),
                chunk=len(names), progress=False)
    index = load_index(tmp_path / "index")
    rows = {e["id"]: r for r, e in enumerate(index.manifest["images"])}
    features = np.load(tmp_path / "index" / index.manifest["arrays"]["features"]["file"])
    np.testing.assert_array_equal(features[[rows[n] for n in names]], reference["grids"])
    sizes = {e["id"]: (e["width"], e["height"]) for e in index.manifest["images"]}
    assert sizes["b_exif6.jpg"] == (56, 80) and sizes["a_rgb.jpg"] == (80, 56)  # as shown: upright


def test_an_unreadable_image_is_an_error_naming_it(tmp_path):
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not an image at all")
    with pytest.raises(UnreadableImage, match="cannot read image") as err:
        decode_image(broken)
    assert err.value.path == broken and not err.value.missing and isinstance(err.value, DataError)
    with pytest.raises(UnreadableImage, match="not found") as err:
        decode_image(tmp_path / "gone.png")
    assert err.value.missing
    with pytest.raises(UnreadableImage, match="<bytes>: cannot read image"):
        decode_image(b"\xff\xd8 truncated")


def test_extraction_of_stage_maps_writes_the_reference_maps(lite0, photo_folder, reference, tmp_path):
    folder, names = photo_folder
    table = CaptionTable()
    for name in names[:4]:
        for c in range(5):
            table.add(name, f"a photo {name} {c}", "test")
    extract_precomp(folder, table, tmp_path / "precomp", batch_size=4, progress=False, scales="c3,c4,c5")
    with torch.inference_mode():
        maps = lite0.stage_maps(torch.from_numpy(reference["pixels"][:4]))
    for scale, name in (("c3", "test_ims_c3.npy"), ("c4", "test_ims_c4.npy"), ("c5", "test_ims.npy")):
        expected = maps[scale].flatten(2).transpose(1, 2).numpy()
        np.testing.assert_array_equal(np.load(tmp_path / "precomp" / name), expected, err_msg=scale)


def test_bf16_runs_the_backbone_in_autocast_alike_in_extraction_and_the_api(tiny_search_setup, photo_folder,
                                                                            reference, tmp_path):
    """--precision bf16 on the CPU: extraction and the API run the same autocast forward (equal grids, float32
    on the host), and it is really bf16 (the grids differ from fp32's)."""
    folder, names = photo_folder
    names = names[:4]
    table = CaptionTable()
    for name in names:
        for c in range(5):
            table.add(name, f"a photo {name} {c}", "test")
    extract_precomp(folder, table, tmp_path / "precomp", batch_size=4, progress=False, precision="bf16")
    extracted = np.load(tmp_path / "precomp" / "test_ims.npy")
    matcher = itmatch.load(tiny_search_setup["checkpoint"], device="cpu", precision="bf16")
    from_api = matcher.image_features([folder / n for n in names], batch_size=4)
    assert from_api.dtype == torch.float32 and extracted.dtype == np.float32
    np.testing.assert_array_equal(from_api.numpy(), extracted)
    assert not np.array_equal(extracted, reference["grids"][:4])
    fp32 = reference["grids"][:4]
    assert np.abs(extracted - fp32).mean() < 0.05 * np.abs(fp32).mean()  # bf16's rounding, not other features


def test_photos_decode_on_one_thread_beside_a_cpu_network_and_on_several_beside_a_gpu(monkeypatch):
    """A network on the CPU needs its cores; a GPU network leaves them free: one decode thread a core, at most 8."""
    import os

    import torch

    from itmatch.features.pipeline import decode_threads

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert decode_threads("cpu") == 1 and decode_threads(torch.device("cpu")) == 1
    assert decode_threads("cuda:0") == 8 and decode_threads(torch.device("cuda")) == 8
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert decode_threads("cuda") == 2
