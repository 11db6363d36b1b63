"""Training on a small dataset of one's own: settings that fit a benchmark but not a few photos are said
before any work, and a run that has nothing left to do says so."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_precomp

from itmatch import distributed as dist
from itmatch.cli import main
from itmatch.engine.train import check_full_batch, train
from itmatch.errors import ConfigError
from itmatch.models.registry import resolve_config

QUICK = {"model": {"embed_size": 16, "word_dim": 8}, "train": {"epochs": 1, "val_images": 4}}


@pytest.fixture(scope="module")
def eight_photos(tmp_path_factory) -> Path:
    """8 training photos, 40 captions (the user trial's dataset)."""
    return make_precomp(tmp_path_factory.mktemp("eight"), sizes=(("train", 8), ("dev", 4), ("test", 4)))


def small_config(data: Path, **train: object):
    return resolve_config("vsepp", {**QUICK, "data": {"path": str(data)}, "train": {**QUICK["train"], **train}})


@pytest.mark.parametrize("bucket", [False, True])
def test_a_batch_larger_than_the_training_split_is_refused_before_any_work(eight_photos, tmp_path, bucket):
    """It trained 0 steps an epoch, validated the untrained model and saved it as `best`, exit 0."""
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        train(small_config(eight_photos, batch_size=128, bucket_by_length=bucket), run, progress=False)
    assert "train.batch_size 128 > the 40 training captions" in str(err.value)
    assert "no full batch (0 steps an epoch)" in str(err.value)
    assert err.value.hint.startswith("--set train.batch_size=N with N <= 40")
    assert not run.exists()  # nothing written
    # the bound is exact: a batch of all 40 captions is one step an epoch
    result = train(small_config(eight_photos, batch_size=40, bucket_by_length=bucket), run, progress=False)
    assert result["best_epoch"] == 1
    # --resume with a larger batch is refused too (the check is on the data, whichever way the config came)
    with pytest.raises(ConfigError, match="train.batch_size 41 > the 40 training captions"):
        train(small_config(eight_photos), run, resume=True, progress=False,
              resume_overrides={"train": {"batch_size": 41, "epochs": 2}})


def test_the_cli_refuses_a_preset_batch_on_a_small_dataset(eight_photos, tmp_path, capsys):
    code = main(["train", "--preset", "vsepp", "--data", str(eight_photos), "--out", str(tmp_path / "run"),
                 "--set", "train.epochs=2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "train.batch_size 128 > the 40 training captions" in err
    assert "fix: --set train.batch_size=N with N <= 40" in err


def test_the_bound_under_torchrun_is_a_multiple_of_the_processes(monkeypatch, eight_photos):
    """The global batch splits evenly across the ranks: the largest batch offered is a multiple of them."""
    monkeypatch.setattr(dist, "world_size", lambda: 3)
    cfg = small_config(eight_photos, batch_size=42)
    with pytest.raises(ConfigError) as err:
        check_full_batch(cfg, 40)
    assert "N <= 39, a multiple of the 3 processes" in err.value.hint
    with pytest.raises(ConfigError, match="needs at least 3 captions"):
        check_full_batch(cfg, 2)
