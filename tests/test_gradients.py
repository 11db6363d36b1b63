"""Gradients stay finite with padded captions of different lengths and all-zero regions (ReLU6 grid
features have them): a 0 * inf in a norm's backward once turned SCAN i-t training into NaN."""

from __future__ import annotations

import pytest
import torch

from itmatch.models.losses import triplet_loss
from itmatch.models.registry import build_model, list_models, resolve_config


@pytest.mark.parametrize("preset", [p for p in list_models() if not p.endswith("_coco")])
def test_gradients_finite_with_padding_and_zero_regions(preset):
    torch.manual_seed(0)
    vocab = 30522 if preset.startswith("mmca") else 50  # MMCA: the frozen MiniLM's WordPiece ids
    cfg = resolve_config(preset, {"model": {"img_dim": 16, "vocab_size": vocab, "embed_size": 16, "word_dim": 8,
                                            "sman": {"regions": 5}}})  # SMAN checks the grid size
    model = build_model(cfg.model)
    feats = torch.rand(6, 5, 16)
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
