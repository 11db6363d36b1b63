"""Gradients stay finite with padded captions of different lengths and all-zero regions (ReLU6 grid
features have them): a 0 * inf in a norm's backward once turned SCAN i-t training into NaN."""

from __future__ import annotations

import pytest
import torch

from itmatch.models.losses import triplet_loss
from itmatch.models.registry import build_model, image_inputs, list_models, resolve_config


def _needs_backbone(preset: str) -> bool:  # SAVE from pixels / NL-ms2: covered in tests/models/save/test_save.py
    save = resolve_config(preset).model.save
    return save.pixels or save.fusion == "nl"


@pytest.mark.parametrize("preset", [p for p in list_models() if not p.endswith("_coco") and not _needs_backbone(p)])
def test_gradients_finite_with_padding_and_zero_regions(preset):
    torch.manual_seed(0)
    vocab = 30522 if preset.startswith("mmca") else 50  # MMCA: the frozen MiniLM's WordPiece ids
    cfg = resolve_config(preset, {"model": {"img_dim": 16, "vocab_size": vocab, "embed_size": 16, "word_dim": 8,
                                            "sman": {"regions": 4}, "save": {"c3_dim": 16, "c4_dim": 16}}})
    model = build_model(cfg.model)
    scales = image_inputs(cfg.model)
    if scales:  # multi-scale grid models (SAVE): c3 4x4, c4 2x2, c5 1x1 maps, one all-zero cell each
        feats = {s: torch.rand(6, k, 16) for s, k in (("c3", 16), ("c4", 4), ("c5", 1)) if s in scales}
        for f in feats.values():
            f[0, 0] = 0
    else:
        feats = torch.rand(6, 4, 16)  # 4 regions: also a 2x2 grid for the single-scale grid models
        feats[0, 2] = 0  # an all-zero grid cell
    tokens = torch.randint(4, vocab, (6, 7))
    lengths = torch.tensor([7, 3, 5, 2, 7, 4])  # padded captions
    for hardest in (False, True):
        model.zero_grad()
        loss = triplet_loss(model.score(model.encode_images(feats), model.encode_texts(tokens, lengths)),
                            hardest=hardest)
        loss.backward()
        assert torch.isfinite(loss)
        for name, p in model.named_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all(), name
