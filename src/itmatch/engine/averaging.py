"""The weights a run validates and keeps as best/: the trained weights themselves, or (train.ema_decay > 0) their
exponential moving average over the optimizer's steps, W_avg <- d W_avg + (1 - d) W after every step, starting from
the weights of the first (torch's AveragedModel with its EMA rule). Not in any of the five papers: an option for
Flickr8K's small training set, where two seeds of one model differ by several rsum and their ensemble is far better
than either (docs/training.md, "Weight averaging")."""

from __future__ import annotations

from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from itmatch.config import Config
from itmatch.models.base import Matcher

#: trainer.pt's key for the average (a run resumed from last/ goes on averaging where it stopped)
STATE_KEY = "weight_average"


def weight_average(cfg: Config, model: Matcher) -> AveragedModel | None:
    """The moving average of `model`'s weights (a copy on its device: build it after model.to), None when
    train.ema_decay is 0. `.module` is the averaged Matcher (what validation scores and best/ keeps),
    `.update_parameters(model)` folds in the step just taken. Buffers (batch-norm statistics, an encoder's
    fingerprint) are the trained model's own, copied at each update, not averaged (use_buffers=False)."""
    if cfg.train.ema_decay <= 0:
        return None
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(cfg.train.ema_decay), use_buffers=False)
