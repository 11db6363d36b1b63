"""Augmented views (`itmatch extract --view K`, `data.train_views`): the crop of a view is fixed by (K, photo id),
its extraction is recorded and kept apart from the photos' own features, and training draws each caption's image
from the photos and their views by (seed, epoch, caption) alone."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from itmatch.data.captions import CaptionTable
from itmatch.data.datasets import PairDataset
from itmatch.data.precomp import features_path, read_precomp, write_captions, write_features
from itmatch.data.views import FeatureViews, with_views
from itmatch.engine.checkpoint import load_checkpoint
from itmatch.engine.train import train
from itmatch.errors import ConfigError, DataError, OverwriteError
from itmatch.features import extract_precomp
from itmatch.features.views import random_crop_flip, view_meta, view_of
from tests.conftest import make_precomp
from tests.engine.test_engine import quick_config


def _photo(seed: int, size=(96, 64)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def test_a_view_is_fixed_by_its_number_and_the_photo_id():
    photo = _photo(0)
    assert view_of(photo, 0, "a.jpg") is photo  # view 0: the photo itself
    first = np.asarray(view_of(photo, 1, "a.jpg"))
    assert np.array_equal(first, np.asarray(view_of(photo, 1, "a.jpg")))  # the same crop every time
    others = [np.asarray(view_of(photo, 2, "a.jpg")), np.asarray(view_of(photo, 1, "b.jpg"))]
    assert all(o.shape != first.shape or not np.array_equal(o, first) for o in others)
    with pytest.raises(ValueError, match="view"):
        view_of(photo, -1, "a.jpg")


def test_the_crop_keeps_between_half_and_all_of_the_area():
    import random

    photo = _photo(1, (200, 160))
    for seed in range(50):
        crop = random_crop_flip(photo, random.Random(seed))
        share = crop.size[0] * crop.size[1] / (200 * 160)
        assert 0.49 <= share <= 1.0


def _photos(tmp_path: Path, n: int = 4) -> tuple[Path, CaptionTable]:
    images = tmp_path / "images"
    images.mkdir()
    table = CaptionTable(source=str(tmp_path / "captions.txt"))
    for i in range(n):
        _photo(i).save(images / f"p{i}.png")
        for c in range(5):
            table.add(f"p{i}.png", f"photo {i} caption {c}", "train")
    return images, table


def test_extract_a_view_records_it_and_differs_from_the_photos(tmp_path):
    images, table = _photos(tmp_path)
    extract_precomp(images, table, tmp_path / "photos", batch_size=2, progress=False)
    meta = extract_precomp(images, table, tmp_path / "view1", batch_size=2, progress=False, view=1)
    assert meta["view"] == 1 and meta["view_augmentation"] == view_meta(1)["view_augmentation"]
    assert "view" not in json.loads((tmp_path / "photos" / "meta.json").read_text())
    photos, view = read_precomp(tmp_path / "photos", "train"), read_precomp(tmp_path / "view1", "train")
    assert photos.ids == view.ids and photos.images.shape == view.images.shape
    assert not np.allclose(photos.images, view.images)
    # rerunning the command keeps the complete split (the same fingerprint); another view does not mix in
    before = features_path(tmp_path / "view1", "train").stat().st_mtime_ns
    extract_precomp(images, table, tmp_path / "view1", batch_size=2, progress=False, view=1)
    assert features_path(tmp_path / "view1", "train").stat().st_mtime_ns == before
    with pytest.raises(OverwriteError, match="another image list, backbone or view"):
        extract_precomp(images, table, tmp_path / "view1", batch_size=2, progress=False, view=2)
    with pytest.raises(ValueError, match="view must be >= 0"):
        extract_precomp(images, table, tmp_path / "bad", progress=False, view=-1)


def _fake_view(base: Path, root: Path, view: int, shift: float) -> Path:
    """A view directory of `base`'s training split whose features are the photos' plus `shift`."""
    split = read_precomp(base, "train")
    write_features(root, "train", np.asarray(split.images) + np.float32(shift))
    write_captions(root, "train", split.ids, split.captions)
    (root / "meta.json").write_text(json.dumps({"format": "itmatch-precomp", "view": view,
                                                "splits": {"train": {"images": len(split.ids)}}}))
    return root


def test_draws_cover_every_view_evenly_and_repeat_by_key(tiny_precomp, tmp_path):
    views = [_fake_view(tiny_precomp, tmp_path / f"v{k}", k, float(k)) for k in (1, 2)]
    split = with_views(read_precomp(tiny_precomp, "train"), ",".join(map(str, views)), seed=3)
    images = split.images
    assert isinstance(images, FeatureViews) and images.shape == (240, 6, 32)
    assert np.array_equal(images[5], read_precomp(tiny_precomp, "train").images[5])  # [i]: the photo's own
    counts = Counter(images.view_index((epoch, j)) for epoch in range(3) for j in range(1000))
    assert set(counts) == {0, 1, 2} and min(counts.values()) > 900  # 3000 draws, ~1000 each
    assert images.view_index((1, 7)) == images.view_index((1, 7))
    k = images.view_index((0, 11))
    assert np.array_equal(images.draw(2, (0, 11)), images.arrays[k][2])
    # the training dataset reads a view by (epoch, caption); evaluation (a plain index) the photo
    dataset = PairDataset(split, vocab=_Vocab())
    image, _, i, _ = dataset[(0, 11)]
    assert i == 2 and np.array_equal(image, images.arrays[k][2])
    assert np.array_equal(dataset[11][0], images.arrays[0][2])
    assert isinstance(split.head(10).images, FeatureViews) and len(split.head(10).images) == 10


class _Vocab:
    def encode(self, caption: str) -> list[int]:
        return [1, 2]


def test_views_are_checked_before_training(tiny_precomp, tmp_path):
    train_split = read_precomp(tiny_precomp, "train")
    with pytest.raises(DataError, match="no meta.json"):
        with_views(train_split, str(tiny_precomp), 0)
    photos_like = _fake_view(tiny_precomp, tmp_path / "own", 1, 0.0)
    (photos_like / "meta.json").write_text(json.dumps({"format": "itmatch-precomp", "splits": {"train": {}}}))
    with pytest.raises(DataError, match="not an augmented view"):
        with_views(train_split, str(photos_like), 0)
    v1 = _fake_view(tiny_precomp, tmp_path / "v1", 1, 0.5)
    with pytest.raises(ConfigError, match="view 1 twice"):
        with_views(train_split, f"{v1},{v1}", 0)
    other = make_precomp(tmp_path / "other", sizes=(("train", 240),), seed=1)
    (other / "meta.json").write_text(json.dumps({"format": "itmatch-precomp", "view": 2, "splits": {"train": {}}}))
    write_captions(other, "train", [f"x{i}" for i in range(240)], read_precomp(other, "train").captions)
    with pytest.raises(DataError, match="other images"):
        with_views(train_split, str(other), 0)
    assert with_views(train_split, " ", 0) is train_split  # none listed: the photos only


def _config(data: Path, views: str = ""):
    cfg = quick_config("vsepp", data, epochs=1)
    cfg.data.train_views = views
    return cfg


def test_training_on_views_reads_them_and_nothing_else_changes(tiny_precomp, tmp_path):
    plain = train(_config(tiny_precomp), tmp_path / "plain", progress=False)
    # views whose features equal the photos': the draws consume no RNG the training uses, so the run is the same
    same = _fake_view(tiny_precomp, tmp_path / "same", 1, 0.0)
    twin = train(_config(tiny_precomp, str(same)), tmp_path / "twin", progress=False)
    assert twin["best_rsum"] == plain["best_rsum"]
    a, b = (load_checkpoint(tmp_path / run / "best").model.state_dict() for run in ("plain", "twin"))
    assert all(torch.equal(a[key], b[key]) for key in a)
    # a view that differs is read: other weights
    moved = _fake_view(tiny_precomp, tmp_path / "moved", 1, 0.7)
    train(_config(tiny_precomp, str(moved)), tmp_path / "moved_run", progress=False)
    c = load_checkpoint(tmp_path / "moved_run" / "best").model.state_dict()
    assert any(not torch.equal(a[key], c[key]) for key in a)
    assert load_checkpoint(tmp_path / "moved_run" / "best").config.data.train_views == str(moved)
    shutil.rmtree(tmp_path / "moved_run")
