"""Training batches are the same wherever they are built: features resident on the device (train.resident,
gathered there by index) or collated on the host, in the main process or in DataLoader workers (train.workers),
in a run or in a run resumed mid-epoch; the trained weights are bit-identical."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from itmatch.config import Config, parse_overrides, update
from itmatch.data.datasets import PairDataset, collate_pairs, stack_images
from itmatch.data.images import read_image_split
from itmatch.data.precomp import MultiScaleArray, read_precomp
from itmatch.data.vocab import build_vocab
from itmatch.device import Placement
from itmatch.engine import resident as resident_mod
from itmatch.engine.checkpoint import load_checkpoint
from itmatch.engine.resident import ResidentImages, resident_images
from itmatch.engine.train import EpochBatches, epoch_batches, make_loader, train
from itmatch.errors import ConfigError
from itmatch.models.registry import resolve_config

CPU = torch.device("cpu")


def _config(preset: str, data, **train_settings):
    cfg = resolve_config(preset, {
        "model": {"embed_size": 32, "word_dim": 16}, "loss": {"warmup_epochs": 1}, "data": {"path": str(data)},
        "train": {"epochs": 2, "batch_size": 32, "lr": 2e-3, "val_images": 40, "lr_update": 10, "max_batches": 6,
                  "log_every": 1, "threads": 1}})
    update(cfg, {"train": train_settings})
    return cfg


def _weights(run) -> dict[str, torch.Tensor]:
    return load_checkpoint(run / "last").model.state_dict()


def _assert_same_weights(a, b) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def _losses(run) -> list[float]:
    import json

    return [x["loss"] for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in x]


def test_resident_features_and_workers_train_bit_identical_weights(tiny_precomp, tmp_path, caplog):
    """SCAN t-i trained 2 epochs x 6 steps with the features streamed from the host, resident (train.resident=on:
    on the CPU one in-memory tensor, batches gathered by index) and streamed by 2 DataLoader workers: the same
    losses at every step and the same weights, bit for bit. Which mode was chosen is logged once."""
    with caplog.at_level(logging.INFO, logger="itmatch.train"):
        train(_config("scan_t2i_avg", tiny_precomp, resident="off"), tmp_path / "off", progress=False)
        assert sum("training features: streamed: train.resident=off" in r.message for r in caplog.records) == 1
        caplog.clear()
        train(_config("scan_t2i_avg", tiny_precomp, resident="on"), tmp_path / "on", progress=False)
        assert sum("training features: resident on cpu: train.resident=on" in r.message
                   for r in caplog.records) == 1
    train(_config("scan_t2i_avg", tiny_precomp, resident="off", workers=2), tmp_path / "workers", progress=False)
    assert len(_losses(tmp_path / "off")) == 12
    assert _losses(tmp_path / "off") == _losses(tmp_path / "on") == _losses(tmp_path / "workers")
    _assert_same_weights(tmp_path / "off", tmp_path / "on")
    _assert_same_weights(tmp_path / "off", tmp_path / "workers")


class _Stop(Exception):
    pass


def _stop_after(items: int):
    """A caption transform that changes nothing and stops the run at its `items`-th item (a killed run)."""
    seen = [0]

    def transform(caption: str, j: int) -> str:
        seen[0] += 1
        if seen[0] > items:
            raise _Stop
        return caption

    return transform


def test_a_run_resumed_mid_epoch_with_resident_features_and_workers_ends_identical(tiny_precomp, tmp_path):
    """A model with dropout (meanpool: the global RNG draws masks at every step) stopped in its first epoch after
    5 batches (its last checkpoint at batch 4, train.checkpoint_every=2) and resumed with the features resident and
    2 workers ends with the uninterrupted streamed run's weights and per-step losses."""
    train(_config("meanpool", tiny_precomp, resident="off"), tmp_path / "full", progress=False)
    killed = _config("meanpool", tiny_precomp, resident="off", checkpoint_every=2)
    with pytest.raises(_Stop):
        train(killed, tmp_path / "run", progress=False, transform=_stop_after(32 * 5 + 3))
    assert load_checkpoint(tmp_path / "run" / "last").state["batch"] == 4
    train(killed, tmp_path / "run", resume=True, progress=False,
          resume_overrides=parse_overrides(["train.resident=on", "train.workers=2"]))
    assert _losses(tmp_path / "run") == _losses(tmp_path / "full")
    _assert_same_weights(tmp_path / "full", tmp_path / "run")


def test_a_run_stopped_mid_epoch_keeps_its_batch_order_until_the_epoch_ends(tiny_precomp, tmp_path):
    """The resumed epoch's batches are rebuilt at the new size and its first `batch` of them skipped as done:
    not the captions already seen (some would be trained on twice in the epoch, others never)."""
    killed = _config("meanpool", tiny_precomp, resident="off", checkpoint_every=2)
    with pytest.raises(_Stop):
        train(killed, tmp_path / "run", progress=False, transform=_stop_after(32 * 5 + 3))
    # (max_batches cuts the list: lowered below the batches done, the epoch's record counted them wrong)
    for setting in ("train.batch_size=16", "train.seed=7", "train.bucket_by_length=true", "train.max_batches=3"):
        with pytest.raises(ConfigError, match=f"stopped in the middle of epoch 1 .batch 4.: {setting.split('=')[0]}"
                                              " changes an epoch's list of batches"):
            train(killed, tmp_path / "run", resume=True, progress=False, resume_overrides=parse_overrides([setting]))
    train(killed, tmp_path / "run", resume=True, progress=False)  # (the same size resumes)


def test_resident_setting_reads_on_and_off_from_yaml_and_rejects_others():
    cfg = Config()
    assert cfg.train.resident == "auto" and cfg.train.workers == 0
    update(cfg, parse_overrides(["train.resident=on", "train.workers=3"]))  # YAML 1.1: on -> True
    assert (cfg.train.resident, cfg.train.workers) == ("on", 3)
    update(cfg, parse_overrides(["train.resident=off"]))
    assert cfg.train.resident == "off"
    with pytest.raises(ConfigError, match="train.resident: 'always' is not one of auto, on, off"):
        update(cfg, parse_overrides(["train.resident=always"]))
    with pytest.raises(ConfigError, match="train.workers: -1 is out of range"):
        update(cfg, parse_overrides(["train.workers=-1"]))


def test_what_auto_decides(tiny_precomp, monkeypatch):
    """auto: streamed on the CPU; on CUDA resident when the features take at most half of the free memory
    (the device is faked: free memory and the copy are stubbed)."""
    images = read_precomp(tiny_precomp, "train").images  # 240 x 6 x 32 float32 = 184320 bytes
    resident, why = resident_images("auto", images, CPU)
    assert resident is None and "resides only on a CUDA device" in why
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(resident_mod, "ResidentImages", lambda arrays, device: ("copied", device))
    monkeypatch.setattr(resident_mod, "free_memory", lambda device: 2 * 184320 - 1)
    resident, why = resident_images("auto", images, cuda)
    assert resident is None and "exceed 50% of the" in why
    monkeypatch.setattr(resident_mod, "free_memory", lambda device: 2 * 184320)
    resident, why = resident_images("auto", images, cuda)
    assert resident == ("copied", cuda) and why.startswith("resident on cuda:0: train.resident=auto")
    assert resident_images("off", images, cuda)[0] is None


def test_gathered_images_equal_the_host_collate_for_multi_scale_maps(tiny_precomp):
    """SAVE's cached {scale: [N, k_s, C_s]} maps (one of them memory-mapped) are gathered per scale, equal to
    what the host collate stacks."""
    c5 = read_precomp(tiny_precomp, "train").images
    c4 = np.random.default_rng(0).standard_normal((c5.shape[0], 12, 8)).astype(np.float32)
    images = MultiScaleArray({"c4": c4, "c5": c5})
    resident = ResidentImages({"c4": c4, "c5": c5}, CPU)
    index = [7, 3, 3, 239, 0]
    gathered = resident.take(torch.tensor(index))
    expected = stack_images([images[i] for i in index])
    assert gathered.keys() == expected.keys() == {"c4", "c5"}
    assert all(torch.equal(gathered[k], expected[k]) for k in expected)


def _pixel_batches(photos, workers: int, epochs=(0, 1)) -> list:
    """The training batches of a pixel-input model (random crop + flip of decoded files) for `epochs`."""
    cfg = resolve_config("vsepp", parse_overrides([f"train.workers={workers}", "train.batch_size=8"]))
    split = read_image_split(photos, "train", photos, "lite0", augment=True, seed=cfg.train.seed)
    dataset = PairDataset(split, build_vocab(split.captions))
    sampler = EpochBatches()
    loader = make_loader(dataset, sampler, cfg, Placement(CPU))
    out = []
    for epoch in epochs:
        sampler.set(epoch, epoch_batches(cfg, [], len(dataset), epoch)[:2])
        out += list(loader)
    return out


def test_pixel_batches_are_the_same_with_workers_and_across_resumes(photos):
    """Image files decoded and augmented by 2 persistent workers give the main process's batches, epoch after
    epoch: each item's crop comes from (seed, epoch, caption), not from the process's RNG. A resumed run (a fresh
    process starting at epoch 1) gets epoch 1's batches again; another epoch, other crops."""
    main, workers = _pixel_batches(photos, 0), _pixel_batches(photos, 2)
    assert len(main) == len(workers) == 4
    for a, b in zip(main, workers, strict=True):
        assert torch.equal(a.images, b.images) and torch.equal(a.text.tokens, b.text.tokens)
        assert torch.equal(a.image_index, b.image_index) and torch.equal(a.caption_index, b.caption_index)
    resumed = _pixel_batches(photos, 0, epochs=(1,))
    assert all(torch.equal(a.images, b.images) for a, b in zip(main[2:], resumed, strict=True))
    split = read_image_split(photos, "train", photos, "lite0", augment=True)
    assert not torch.equal(split.images.draw(0, (0, 0)), split.images.draw(0, (1, 0)))
    assert torch.equal(split.images.draw(0, (1, 0)), split.images.draw(0, (1, 0)))


def test_resident_is_ignored_for_image_files_with_a_warning(photos, caplog):
    split = read_image_split(photos, "train", photos, "lite0", augment=True)
    with caplog.at_level(logging.WARNING, logger="itmatch.train"):
        resident, why = resident_images("on", split.images, CPU)
    assert resident is None and why.startswith("streamed: the model reads image files")
    assert "train.resident=on is ignored" in caplog.text
    batch = collate_pairs([PairDataset(split, build_vocab(split.captions))[(0, j)] for j in range(3)])
    assert batch.images.shape == (3, 3, 224, 224)


@pytest.mark.slow
def test_a_pixel_model_trains_the_same_weights_with_workers(photos, tmp_path):
    """VSE++ fine-tuning its Lite0 CNN from the photos (random crop + flip), 2 epochs x 2 steps: the batches
    decoded by 2 persistent workers train the main process's weights, bit for bit."""
    sets = [f"data.path={photos}", f"data.images={photos}", "model.embed_size=16", "model.word_dim=8",
            "train.batch_size=4", "train.max_batches=2", "train.epochs=2", "train.val_images=4", "train.threads=1",
            "train.log_every=1", "train.finetune_backbone=true"]
    for workers in (0, 2):
        train(resolve_config("vsepp", parse_overrides([*sets, f"train.workers={workers}"])), tmp_path / f"w{workers}",
              progress=False)
    assert len(_losses(tmp_path / "w0")) == 4 and _losses(tmp_path / "w0") == _losses(tmp_path / "w2")
    _assert_same_weights(tmp_path / "w0", tmp_path / "w2")
