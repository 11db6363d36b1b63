"""train.ema_decay: best/ holds the exponential moving average of the trained weights over the steps, checked against
the average written out by hand from the trained weights after each step; training itself is unchanged; a resumed
run goes on averaging where it stopped."""

from __future__ import annotations

import pytest
import torch

from itmatch.config import parse_overrides
from itmatch.engine.averaging import weight_average
from itmatch.engine.checkpoint import load_checkpoint
from itmatch.engine.train import train
from itmatch.errors import ConfigError
from itmatch.models.registry import list_models, preset_config, resolve_config
from tests.conftest import tiny_preset_model
from tests.engine.test_engine import quick_config

DECAY = 0.6  # far from 0 and 1: each step's weights count, none dominates


def _parameters(run, which: str) -> dict[str, torch.Tensor]:
    model = load_checkpoint(run / which).model
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_best_weights_are_the_moving_average_of_the_weights_after_each_step(tiny_precomp, tmp_path):
    steps = 4
    # the trained weights after step j: a run of one epoch cut at j batches (the epoch's batches do not depend on
    # the cut), whose last/ is saved after its validation
    after = []
    for j in range(1, steps + 1):
        train(quick_config("vsepp", tiny_precomp, epochs=1, max_batches=j), tmp_path / f"cut{j}", progress=False)
        after.append(_parameters(tmp_path / f"cut{j}", "last"))
    run = tmp_path / "averaged"
    train(quick_config("vsepp", tiny_precomp, epochs=1, max_batches=steps, ema_decay=DECAY), run, progress=False)

    expected = dict(after[0])  # the first step's weights, then W_avg <- d W_avg + (1 - d) W_j
    for weights in after[1:]:
        expected = {name: DECAY * expected[name] + (1 - DECAY) * weights[name] for name in expected}
    best, last = _parameters(run, "best"), _parameters(run, "last")
    for name in expected:
        assert torch.equal(last[name], after[-1][name]), f"{name}: averaging changed the training"
        torch.testing.assert_close(best[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(best[n], last[n]) for n in best), "best/ holds the trained weights, not the average"


def test_a_resumed_run_goes_on_averaging_where_it_stopped(tiny_precomp, tmp_path):
    whole = quick_config("vsepp", tiny_precomp, epochs=2, max_batches=3, ema_decay=DECAY)
    train(whole, tmp_path / "whole", progress=False)
    half = quick_config("vsepp", tiny_precomp, epochs=1, max_batches=3, ema_decay=DECAY)
    train(half, tmp_path / "resumed", progress=False)
    with pytest.raises(ConfigError, match="train.ema_decay=0.9: cannot change when resuming"):
        train(half, tmp_path / "resumed", resume=True, resume_overrides={"train": {"epochs": 2, "ema_decay": 0.9}},
              progress=False)
    train(half, tmp_path / "resumed", resume=True, resume_overrides={"train": {"epochs": 2}}, progress=False)
    for which in ("best", "last"):
        a, b = _parameters(tmp_path / "whole", which), _parameters(tmp_path / "resumed", which)
        assert all(torch.equal(a[n], b[n]) for n in a), which


def test_a_decay_of_one_is_refused():
    with pytest.raises(ConfigError, match="train.ema_decay"):
        resolve_config("vsepp", parse_overrides(["train.ema_decay=1"]))


def _one_preset_per_arch() -> list[str]:
    return list({preset_config(name).model.arch: name for name in reversed(list_models())}.values())


@pytest.mark.parametrize("preset", _one_preset_per_arch())
def test_every_model_can_be_averaged(preset):
    """(AveragedModel copies the model: MMCA's unregistered frozen encoder, SMAN's graphs, ... must copy.)"""
    cfg, model = tiny_preset_model(preset, regions=4, img_dim=12)
    cfg.train.ema_decay = DECAY
    average = weight_average(cfg, model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    average.update_parameters(model)  # the first update copies the weights
    for (name, p), q in zip(model.named_parameters(), average.module.parameters(), strict=True):
        assert torch.equal(p, q), name
