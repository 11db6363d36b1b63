"""What `itmatch train --resume` may change and what it keeps: the rules found missing in a review of the engine
(2026-11-27), each test failing on the code before its fix."""

from __future__ import annotations

import json
import math

import pytest
import torch

from itmatch.config import parse_overrides
from itmatch.engine import train as engine
from itmatch.engine.checkpoint import OPTIMIZER, load_checkpoint, load_optimizer_state
from itmatch.engine.train import adopt_newer_best, apply_resume_overrides, train
from itmatch.errors import ConfigError, OverwriteError, TrainingError
from itmatch.models.registry import resolve_config
from tests.engine.test_engine import QUICK as ENGINE_QUICK

# the engine tests' QUICK schedule, on one thread and a few batches an epoch
QUICK = {**ENGINE_QUICK, "train": {**ENGINE_QUICK["train"], "threads": 1, "max_batches": 6, "log_every": 1}}


def _cfg(tiny_precomp, **train_settings):
    cfg = resolve_config("vsepp", {**QUICK, "data": {"path": str(tiny_precomp)}})
    for key, value in train_settings.items():
        setattr(cfg.train, key, value)
    return cfg


def _untimed(result: dict) -> dict:
    return {k: _untimed(v) if isinstance(v, dict) else v for k, v in result.items() if not k.endswith("_seconds")}


def test_a_run_with_best_but_no_last_is_refused_not_restarted(tiny_precomp, tmp_path):
    """With last/ deleted by hand (it holds the optimizer state), --resume took the run for one killed before its
    first checkpoint: it deleted best/ and emptied metrics.jsonl, without --force."""
    run = tmp_path / "run"
    train(_cfg(tiny_precomp, epochs=1), run, progress=False)
    log = (run / "metrics.jsonl").read_text()
    weights = sorted(p.name for p in (run / "best").iterdir())
    import shutil

    shutil.rmtree(run / "last")
    with pytest.raises(OverwriteError, match="has a best/ checkpoint but no last/") as err:
        train(_cfg(tiny_precomp), run, resume=True, progress=False)
    assert f"train.init_from={run / 'best'}" in err.value.hint
    assert sorted(p.name for p in (run / "best").iterdir()) == weights and (run / "metrics.jsonl").read_text() == log


def test_a_run_killed_before_its_first_checkpoint_restarts_in_its_own_precision(tiny_precomp, tmp_path):
    """The restart read the run's config.json but kept the placement of the default config the CLI passes with
    --resume: a bf16 run restarted in fp32 (and validated in bf16)."""
    cfg = _cfg(tiny_precomp, epochs=1, device="cpu", precision="bf16")
    ref = train(cfg, tmp_path / "ref", progress=False)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text((tmp_path / "ref" / "config.json").read_text())  # killed right after this
    from itmatch.config import Config

    resumed = train(Config(), run, resume=True, progress=False)  # (what `itmatch train --resume` passes)
    assert _untimed(resumed) == _untimed(ref)
    assert json.loads((run / "config.json").read_text())["train"]["precision"] == "bf16"


def test_resume_refuses_settings_that_made_the_optimizer_or_chose_best(tiny_precomp):
    cfg = _cfg(tiny_precomp)
    for setting, why in [("train.optimizer=adadelta", "optimizer state were made with it"),
                         ("train.finetune_backbone=true", "optimizer state were made with it"),
                         ("train.val_images=30", "best/ epoch was chosen by the dev rsum"),
                         ("train.val_rerank=5", "best/ epoch was chosen by the dev rsum")]:
        with pytest.raises(ConfigError, match="cannot change when resuming") as err:
            apply_resume_overrides(cfg, parse_overrides([setting]))
        assert why in err.value.message, setting
    # the schedule may change; a key under its old name, set to the run's own value, is accepted (it raised an
    # AttributeError: the old path was looked up in the config)
    scan = resolve_config("scan_t2i_avg", {})
    assert apply_resume_overrides(scan, parse_overrides(
        ["train.epochs=40", f"model.lambda_softmax={scan.model.scan.lambda_softmax}"])) == ["train.epochs"]


def test_resumed_optimizer_keeps_the_configured_settings_and_the_saved_moments(tmp_path):
    """torch restores every saved group setting: --resume --set train.weight_decay=... was recorded in config.json
    and the log, and not applied."""
    weight = torch.nn.Parameter(torch.ones(3))
    saved = torch.optim.Adam([{"params": [weight], "lr": 1e-3, "lr_scale": 1.0}], weight_decay=0.0)
    weight.grad = torch.ones(3)
    saved.step()
    torch.save(saved.state_dict(), tmp_path / OPTIMIZER)
    resumed = torch.optim.Adam([{"params": [weight], "lr": 1e-4, "lr_scale": 0.5}], weight_decay=0.1)
    load_optimizer_state(tmp_path, resumed)
    group = resumed.param_groups[0]
    assert (group["weight_decay"], group["lr_scale"], group["lr"]) == (0.1, 0.5, 1e-4)
    assert torch.equal(resumed.state[weight]["exp_avg"], saved.state[weight]["exp_avg"])


def test_optimizer_groups_are_per_role_so_another_scale_keeps_the_saved_state_fitting(tmp_path):
    """Grouped by the scale's value, backbone_lr_scale=1 merged the backbone's group into the rest: the saved state
    of two groups no longer fitted ("optimizer state does not fit this model")."""
    from itmatch.engine.train import make_optimizer

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone, self.head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
            self.lr_scales = {"backbone.": 0.1}

    model, cfg = Two(), resolve_config("vsepp", {})
    saved = make_optimizer(cfg, model, 0)
    torch.save(saved.state_dict(), tmp_path / OPTIMIZER)
    model.lr_scales["backbone."] = 1.0
    resumed = make_optimizer(cfg, model, 0)
    load_optimizer_state(tmp_path, resumed)
    assert [g["lr_scale"] for g in resumed.param_groups] == [1.0, 1.0] and len(resumed.param_groups) == 2


def test_a_diverged_loss_stops_training_before_anything_is_saved(tiny_precomp, tmp_path, monkeypatch):
    """A NaN loss trained on: every later step wrote NaN weights into last/, which then could not be resumed."""
    calls = 0
    real = engine.batch_loss

    def diverging(*args, **kwargs):  # the loss of the 9th batch (epoch 2, batch 3) is NaN
        nonlocal calls
        calls += 1
        loss = real(*args, **kwargs)
        return loss * math.nan if calls == 9 else loss

    monkeypatch.setattr(engine, "batch_loss", diverging)
    run = tmp_path / "run"
    with pytest.raises(TrainingError, match=r"the loss is nan at epoch 2, batch 3 \(step 9\)") as err:
        train(_cfg(tiny_precomp), run, progress=False)
    assert "--resume --set train.lr=0.0002" in err.value.hint
    last = load_checkpoint(run / "last")
    assert last.state["epoch"] == 1 and all(torch.isfinite(p).all() for p in last.model.parameters())


def test_a_best_saved_after_the_last_checkpoint_is_adopted_on_resume():
    """Killed between saving best/ and last/: the redone epoch replaces best/ only when it beats it."""
    state = {"best_rsum": 100.0, "best_epoch": 3, "best_result": {"rsum": 100.0}}
    adopt_newer_best(state, {"best_rsum": 120.0, "best_epoch": 4, "best_result": {"rsum": 120.0}})
    assert (state["best_rsum"], state["best_epoch"], state["best_result"]) == (120.0, 4, {"rsum": 120.0})
    adopt_newer_best(state, {"best_rsum": 90.0, "best_epoch": 2})  # an older best/ (the usual case): kept as is
    assert state["best_epoch"] == 4
    adopt_newer_best(state, {})  # no best/ yet
    assert state["best_epoch"] == 4


def test_a_run_from_another_runs_weights_takes_its_vocabulary_kind_and_refuses_another_vocabulary(tmp_path):
    """train.init_from with `--set model.arch=mmca` (data.tokenizer word by default) trained from the checkpoint's
    WordPiece and saved checkpoints that no load accepted; a data.vocab beside init_from was ignored unsaid."""
    from itmatch.data.vocab import Vocab
    from itmatch.engine.vocabulary import take_init_vocabulary

    cfg = resolve_config("vsepp", {"train": {"init_from": str(tmp_path / "run" / "best")},
                                   "data": {"tokenizer": "wordpiece"}})
    take_init_vocabulary(cfg, Vocab(["a", "dog"]))
    assert cfg.data.tokenizer == "word"
    cfg.data.vocab = str(tmp_path / "vocab.json")
    with pytest.raises(ConfigError, match="data.vocab=.* has no effect: the run keeps the vocabulary of "
                                          "train.init_from"):
        take_init_vocabulary(cfg, Vocab(["a", "dog"]))


def test_the_starting_command_with_resume_continues_even_where_its_flags_override_its_file(tiny_precomp, tmp_path,
                                                                                           capsys):
    """A new run layers --name and --device over its --config file; --resume layered them under it, so the starting
    command re-run with --resume was refused (the file's name: against the run's --name) and the resumed run's log
    recorded the file's train.device as applied while --device had won."""
    from itmatch.cli import main

    config = tmp_path / "run.yaml"
    config.write_text("name: from-the-file\ntrain:\n  device: cuda\n  epochs: 1\n  batch_size: 32\n  val_images: 40\n"
                      "  threads: 1\n  max_batches: 2\nmodel:\n  embed_size: 32\n  word_dim: 16\n")
    run = tmp_path / "run"
    start = ["train", "--preset", "vsepp", "--config", str(config), "--name", "from-the-flag", "--device", "cpu",
             "--data", str(tiny_precomp), "--out", str(run), "--quiet"]
    assert main(start) == 0
    assert json.loads((run / "config.json").read_text())["name"] == "from-the-flag"
    assert main([*start, "--resume", "--set", "train.epochs=2"]) == 0
    resumed = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
               if "resumed_at_step" in line]
    assert resumed[-1]["overrides"] == {"train.epochs": 2}
    # a file naming another preset than --preset is refused on resume as in a new run (it was dropped unsaid)
    config.write_text("preset: scan_t2i_avg\n" + config.read_text())
    assert main([*start, "--resume", "--set", "train.epochs=3"]) == 2
    assert "preset 'scan_t2i_avg' conflicts" in capsys.readouterr().err
