"""Region dropout (train.region_dropout, VSE∞'s size augmentation): the masks it draws, that a masked region is
exactly a region that is not there for every model that accepts it, that the others refuse it before any work,
and that a run with it trains, differs from one without, and resumes to the same weights."""

from __future__ import annotations

import pytest
import torch
from conftest import make_precomp, tiny_preset_model

from itmatch.engine.augment import check_region_dropout, region_keep_mask, training_region_mask
from itmatch.engine.checkpoint import load_checkpoint
from itmatch.engine.train import train
from itmatch.errors import ConfigError
from itmatch.models.registry import PRESETS, resolve_config

K, IMG_DIM = 6, 12
# every preset but SAVE's 44, which share one encoder (two of them stand for it)
PRESETS_TO_CHECK = sorted(p for p in PRESETS if not p.startswith("save_")) + ["save_dsa", "save_asa"]


def test_each_region_is_dropped_at_the_rate_and_every_image_keeps_one():
    torch.manual_seed(0)
    keep = region_keep_mask(torch.zeros(4000, 49, 8), 0.2)
    assert keep.shape == (4000, 49) and keep.dtype == torch.bool
    assert keep.float().mean().item() == pytest.approx(0.8, abs=0.005)
    # not the same cells for every image: the per-cell keep rate is the same everywhere
    assert keep.float().mean(0).min().item() > 0.75 and keep.float().mean(0).max().item() < 0.85
    sparse = region_keep_mask(torch.zeros(4000, 3, 8), 0.9)
    assert bool(sparse.any(1).all())  # (0.9 ** 3 = 73 % of these images would otherwise lose every region)
    # the region kept for an image that drew none is a random one, not always the first
    alone = sparse[sparse.sum(1) == 1].float().mean(0)
    assert alone.min().item() > 0.25


def tiny_model(preset: str):
    return tiny_preset_model(preset, K, IMG_DIM)


@pytest.mark.parametrize("preset", PRESETS_TO_CHECK)
def test_a_masked_region_is_a_region_that_is_not_there(preset):
    """Every model that accepts train.region_dropout scores an image whose regions are masked exactly as the same
    image with those regions removed (the slow, obviously-correct reference); every other one refuses it."""
    cfg, model = tiny_model(preset)
    cfg.train.region_dropout = 0.5
    if not getattr(model.image_encoder, "reads_region_mask", False):
        with pytest.raises(ConfigError, match="masked or not, so a dropped region would still be seen") as err:
            check_region_dropout(cfg, model)
        assert err.value.hint == "set train.region_dropout=0 for this model"
        return
    check_region_dropout(cfg, model)
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(4, K, IMG_DIM, generator=gen)
    keep = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 0, 1, 0, 0, 1], [0, 0, 0, 0, 1, 0], [0, 1, 1, 1, 1, 1]],
                        dtype=torch.bool)
    tokens = torch.randint(4, 40, (5, 7), generator=gen)
    lengths = torch.tensor([7, 3, 5, 1, 6])
    with torch.no_grad():
        txt = model.encode_texts(tokens, lengths)
        masked = model.score(model.encode_images(feats, keep), txt)
        removed = torch.cat([model.score(model.encode_images(feats[i:i + 1, keep[i]]), txt) for i in range(4)])
        every_region = model.score(model.encode_images(feats), txt)
    torch.testing.assert_close(masked, removed, atol=1e-5, rtol=1e-5)
    assert masked[1:].sub(every_region[1:]).abs().max() > 1e-3  # the dropped regions mattered


def test_the_mask_is_drawn_only_in_training_on_region_features():
    cfg, model = tiny_model("vsepp")
    feats = torch.zeros(3, K, IMG_DIM)
    assert training_region_mask(model, feats, cfg) is None  # train.region_dropout = 0
    cfg.train.region_dropout = 0.3
    assert training_region_mask(model.eval(), feats, cfg) is None  # evaluation sees every region
    assert training_region_mask(model.train(), feats, cfg).shape == (3, K)
    assert training_region_mask(model, torch.zeros(3, 3, 32, 32), cfg) is None  # pixels (refused at the start)


def quick(preset: str, data, **train_keys):
    return resolve_config(preset, {"model": {"embed_size": 16, "word_dim": 8},
                                   "data": {"path": str(data)},
                                   "train": {"epochs": 2, "val_images": 20, "batch_size": 40, **train_keys}})


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_precomp(tmp_path_factory.mktemp("regions"), sizes=(("train", 48), ("dev", 20), ("test", 8)))


def weights(run) -> dict[str, torch.Tensor]:
    return load_checkpoint(run / "last").model.state_dict()


def test_a_run_with_region_dropout_trains_differs_and_resumes_to_the_same_weights(data, tmp_path):
    train(quick("vsepp", data), tmp_path / "plain", progress=False)
    dropped = train(quick("vsepp", data, region_dropout=0.3), tmp_path / "dropped", progress=False)
    assert dropped["best_rsum"] > 80  # it learns (chance on 20 dev images is ~30)
    a, b = weights(tmp_path / "plain"), weights(tmp_path / "dropped")
    assert any(not torch.equal(a[k], b[k]) for k in a)  # the masks changed the training
    # stopped after epoch 1 and resumed: the masks drawn in epoch 2 are the ones the uninterrupted run drew
    train(quick("vsepp", data, region_dropout=0.3, epochs=1), tmp_path / "halves", progress=False)
    train(quick("vsepp", data, region_dropout=0.3, epochs=1), tmp_path / "halves", resume=True,
          resume_overrides={"train": {"epochs": 2}}, progress=False)
    c = weights(tmp_path / "halves")
    assert all(torch.equal(b[k], c[k]) for k in b)


def test_region_dropout_is_refused_before_any_work(data, tmp_path):
    """A grid reader (SMAN's spatial GRU), on a new run and on --resume, and a run that reads pixels."""
    def sman(**train_keys):
        cfg = quick("sman", data, epochs=1, **train_keys)
        cfg.model.sman.regions = 6
        return cfg

    with pytest.raises(ConfigError, match="SMANImageEncoder.*masked or not, so a dropped region would still be seen"):
        train(sman(region_dropout=0.2), tmp_path / "new", progress=False)
    assert not (tmp_path / "new").exists()
    train(sman(), tmp_path / "sman", progress=False)
    before = weights(tmp_path / "sman")
    with pytest.raises(ConfigError, match="masked or not, so a dropped region would still be seen"):
        train(sman(), tmp_path / "sman", resume=True, progress=False,
              resume_overrides={"train": {"epochs": 2, "region_dropout": 0.2}})
    after = weights(tmp_path / "sman")
    assert all(torch.equal(before[k], after[k]) for k in before)
    cfg, model = tiny_model("vsepp")
    cfg.train.region_dropout, cfg.train.finetune_backbone = 0.2, True
    with pytest.raises(ConfigError, match="this run reads pixels") as err:
        check_region_dropout(cfg, model)
    assert "itmatch extract" in err.value.hint
