"""Fine-tuning the image CNN from pixels for every region-grid model (train.finetune_backbone): the model reads
image files through its own backbone, the backbone trains at lr * train.backbone_lr_scale with BatchNorm
frozen, and a model trained on cached features of the same CNN continues end to end with train.init_from."""

from __future__ import annotations

import pytest
import torch

from itmatch.config import parse_overrides
from itmatch.data.vocab import build_vocab
from itmatch.engine.checkpoint import init_weights_from, load_checkpoint, save_checkpoint
from itmatch.engine.train import make_optimizer, train
from itmatch.errors import ConfigError
from itmatch.models.registry import build_model, finetune_backbone, resolve_config

SMALL = ["model.embed_size=16", "model.word_dim=8", "train.batch_size=4", "train.max_batches=2", "train.epochs=1",
         "train.val_images=4", "train.log_every=1", "train.threads=1"]


def _config(preset: str, photos, *sets: str):
    return resolve_config(preset, parse_overrides([f"data.path={photos}", f"data.images={photos}", *SMALL, *sets]))


def _bn_state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k.startswith("image_encoder.backbone.")}


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["scan_t2i_avg", "oan"])
def test_two_training_steps_end_to_end_from_pixels(preset, photos, tmp_path):
    """SCAN and OAN train 2 steps from image files with the CNN fine-tuned: the CNN's weights move, its
    BatchNorm statistics and affine parameters do not, and the run's config records the pixel input."""
    cfg = _config(preset, photos, "train.finetune_backbone=true")
    before = _bn_state(build_model(_filled(cfg)))
    train(cfg, tmp_path / "run", progress=False)
    ckpt = load_checkpoint(tmp_path / "run" / "last")
    assert ckpt.config.model.pixels and ckpt.config.train.finetune_backbone
    after = {k: v for k, v in ckpt.model.state_dict().items() if k.startswith("image_encoder.backbone.")}
    bn = {k for k in after if "_bn" in k}  # EfficientNet-Lite names its BatchNorm layers _bn0, _bn1, ...
    assert bn and all(torch.equal(before[k], after[k]) for k in bn)  # frozen: running stats and affine
    convs = [k for k in after if k.endswith("weight") and k not in bn]
    assert sum(not torch.equal(before[k], after[k]) for k in convs) > len(convs) // 2  # the CNN trained


def _filled(cfg):
    """The model config as the trainer fills it from the data (Lite0 cells: 1280-d)."""
    mc = cfg.model
    mc.pixels, mc.img_dim, mc.vocab_size = True, 1280, 20
    return mc


def test_finetuning_puts_the_cnn_in_its_own_lr_group_with_batchnorm_frozen(photos):
    cfg = _config("vsepp", photos, "train.finetune_backbone=true", "train.backbone_lr_scale=0.05")
    model = build_model(_filled(cfg))
    finetune_backbone(cfg, model)
    backbone = model.image_encoder.backbone
    model.train()
    assert backbone.training and all(not bn.training for bn in backbone.batchnorm_layers())
    assert not any(p.requires_grad for bn in backbone.batchnorm_layers() for p in bn.parameters())
    trainable = sum(p.requires_grad for p in backbone.parameters())
    groups = {g["lr_scale"]: len(g["params"]) for g in make_optimizer(cfg, model, 0).param_groups}
    assert groups[0.05] == trainable > 0 and set(groups) == {1.0, 0.05}


def test_finetuning_a_model_without_pixel_input_is_a_config_error(photos):
    cfg = _config("scan_t2i_avg", photos, "train.finetune_backbone=true")
    assert cfg.model.pixels  # implied by the fine-tuning when the config is resolved
    mc = cfg.model
    mc.img_dim, mc.vocab_size, mc.pixels = 1280, 20, False  # a config that bypassed the resolution
    with pytest.raises(ConfigError, match="does not read pixels"):
        finetune_backbone(cfg, build_model(mc))


def test_a_cached_feature_model_continues_end_to_end_with_its_weights(tmp_path):
    """train.init_from: SCAN trained on cached Lite0 cells loads into the pixel model (only the CNN keeps its
    pretrained weights), and both encode a photo alike."""
    vocab = build_vocab(["a red picture"] * 4)

    def model(pixels: bool):
        cfg = resolve_config("scan_i2t_lse", parse_overrides([f"model.pixels={pixels}", "model.embed_size=16",
                                                                "model.word_dim=8"]))
        cfg.model.vocab_size, cfg.model.img_dim = len(vocab), 1280
        return cfg, build_model(cfg.model).eval()

    cfg, cached = model(pixels=False)
    save_checkpoint(tmp_path / "cached", cached, cfg, vocab)
    _, pixel = model(pixels=True)
    summary = init_weights_from(pixel, load_checkpoint(tmp_path / "cached"))
    assert summary["kept_prefixes"] == ["image_encoder.backbone"]
    x = torch.randn(2, 3, 224, 224)
    with torch.inference_mode():
        cells = pixel.image_encoder.backbone(x)
        assert (pixel.encode_images(x).regions - cached.encode_images(cells).regions).abs().max() <= 1e-5


def test_lite2_is_the_higher_resolution_option():
    """model.backbone=lite2: 260-px photos, a 9 x 9 grid of 1280-d cells."""
    cfg = resolve_config("scan_t2i_avg", parse_overrides(["model.pixels=true", "model.backbone=lite2",
                                                          "model.embed_size=16", "model.word_dim=8"]))
    cfg.model.vocab_size, cfg.model.img_dim = 20, 1280
    model = build_model(cfg.model).eval()
    with torch.inference_mode():
        img = model.encode_images(torch.randn(1, 3, 260, 260))
    assert img.regions.shape == (1, 81, 16)
    with pytest.raises(ConfigError, match="model.backbone"):
        resolve_config("scan_t2i_avg", parse_overrides(["model.backbone=lite9"]))


def test_a_loaded_pixel_model_preprocesses_photos_for_its_own_cnn(photos, tmp_path):
    """itmatch.load on a Lite2 pixel model whose precomp data came from Lite0: photos go in at 260 px."""
    import itmatch

    vocab = build_vocab(["a red photo"] * 4)
    cfg = resolve_config("scan_t2i_avg", parse_overrides(["model.pixels=true", "model.backbone=lite2",
                                                          "model.embed_size=16", "model.word_dim=8",
                                                          "data.backbone=lite0"]))
    cfg.model.vocab_size, cfg.model.img_dim = len(vocab), 1280
    save_checkpoint(tmp_path / "ckpt", build_model(cfg.model), cfg, vocab)
    matcher = itmatch.load(tmp_path / "ckpt")
    assert matcher.backbone_name == "lite2"
    assert matcher.score([photos / "p0.jpg", photos / "p1.jpg"], ["a red photo"]).shape == (2, 1)
