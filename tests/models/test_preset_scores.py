"""Every preset scores as it did before the per-model packages (issue 25).

Each preset's model is built from its config and its trainable weights are set from their parameter names
(the same names give the same numbers, whatever order the modules are built in; pretrained parts keep their
packaged weights). The scores and training loss of fixed inputs, and the names and shapes of the state dict
(old checkpoints must load), must match `preset_scores.json`, written by this file at the commit it names,
before the move (`python tests/models/test_preset_scores.py --write`)."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

FIXTURE = Path(__file__).with_name("preset_scores.json")
#: parameters loaded from a package's pretrained weights (the CNN, the NL tail): left as loaded
PRETRAINED = ("image_encoder.backbone.", "image_encoder.fusion.tail.")
#: extra cases beside the presets: a setting that takes another code path
VARIANTS = {"scan_t2i_avg+both": ("scan_t2i_avg", {"direction": "both"}),
            "save_dsa+both": ("save_dsa", {"direction": "both"}),
            "vsepp+pixels": ("vsepp", {"pixels": True})}
N_IMAGES, REGIONS, LENGTHS = 3, 49, (5, 3, 7, 2)


def cases() -> list[str]:
    """Every preset the fixture was written for: the presets that existed before the move."""
    return sorted(json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"])


def current_cases() -> list[str]:
    from itmatch.models.registry import list_models

    return sorted([*list_models(), *VARIANTS])


def set_weights_by_name(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(PRETRAINED) or not param.is_floating_point():
                continue
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            std = 1 / math.sqrt(param.shape[-1]) if param.dim() > 1 else 0.1
            param.copy_(torch.randn(param.shape, generator=generator) * std)


def case_scores(case: str) -> dict[str, list]:
    """Scores [images, captions] and the hardest-negative training loss (eval mode) of fixed inputs."""
    from itmatch.models.registry import build_model, image_inputs, preset_config, resolve_config

    preset, changes = VARIANTS.get(case, (case, {}))
    cfg = resolve_config(preset, {"model": changes}) if changes else preset_config(preset)
    mc = cfg.model
    grid = mc.arch == "save" or mc.pixels
    mc.embed_size, mc.word_dim, mc.img_dim = 48, 24, 1280 if grid else 32
    if mc.arch == "mmca":
        from itmatch.features.text_backbone import load_pretrained_encoder

        mc.vocab_size = int(load_pretrained_encoder(mc.mmca.text_model).config.vocab_size)
    else:
        mc.vocab_size = 50
    mc.save.c3_dim, mc.save.c4_dim = 40, 112
    torch.manual_seed(0)
    model = build_model(mc)
    set_weights_by_name(model)
    model.eval()
    data = torch.Generator().manual_seed(1)
    inputs = image_inputs(mc)
    if inputs == ("pixels",):
        images = torch.randn(N_IMAGES, 3, 224, 224, generator=data)
    elif inputs:
        cells = {"c3": (784, 40), "c4": (196, 112), "c5": (49, 1280)}
        images = {s: torch.randn(N_IMAGES, *cells[s], generator=data) for s in inputs}
    else:
        images = torch.randn(N_IMAGES, REGIONS, mc.img_dim, generator=data)
    lengths = torch.tensor(LENGTHS)
    tokens = torch.randint(4, mc.vocab_size, (len(LENGTHS), max(LENGTHS)), generator=data)
    tokens[torch.arange(max(LENGTHS))[None] >= lengths[:, None]] = 0
    with torch.no_grad():
        img, txt = model.encode_images(images), model.encode_texts(tokens, lengths)
        scores = model.score(img, txt)
        loss = model.training_loss(img.take(slice(0, 3)), txt.take(slice(0, 3)).trimmed(), cfg.loss.margin, True)
    # the state-dict layout a saved checkpoint is loaded into: the same names and shapes as before
    layout = "\n".join(f"{k}:{tuple(v.shape)}" for k, v in sorted(model.state_dict().items()))
    return {"scores": scores.tolist(), "loss": float(loss), "state_dict": hashlib.sha256(layout.encode()).hexdigest()}


@pytest.fixture(scope="module")
def saved() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def test_no_preset_was_lost():
    assert not set(cases()) - set(current_cases()), "a preset of the fixture is gone"


@pytest.mark.parametrize("case", cases())
def test_preset_scores_as_before_the_move(saved, case):
    want, got = saved["cases"][case], case_scores(case)
    torch.testing.assert_close(torch.tensor(got["scores"]), torch.tensor(want["scores"]), rtol=1e-5, atol=1e-5)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-5)
    assert got["state_dict"] == want["state_dict"], "parameter names or shapes changed: old checkpoints would not load"


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    table = {"commit": commit, "cases": {case: case_scores(case) for case in current_cases()}}
    FIXTURE.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(table['cases'])} cases to {FIXTURE}")
