"""Training on a small dataset of one's own: settings that fit a benchmark but not a few photos are said
before any work, and a run that has nothing left to do says so."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from conftest import WORDS, make_precomp

from itmatch import distributed as dist
from itmatch.cli import main
from itmatch.config import Config, config_from_dict, parse_overrides
from itmatch.data.precomp import read_precomp, write_captions
from itmatch.data.vocab import build_vocab
from itmatch.engine import train as train_module
from itmatch.engine import vocabulary
from itmatch.engine.checkpoint import load_checkpoint
from itmatch.engine.train import check_full_batch, train, training_finished
from itmatch.errors import CheckpointError, ConfigError, DataError
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


@pytest.fixture(scope="module")
def finished(eight_photos, tmp_path_factory) -> Path:
    """A run that has trained its 2 epochs."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train(small_config(eight_photos, epochs=2, batch_size=8), run, progress=False)
    return run


def test_resuming_a_finished_run_says_so_without_loading_it(finished, tmp_path, monkeypatch, capsys):
    """It loaded the weights and the data (14 s) to train nothing, and printed only the best dev rsum."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    state = json.loads((run / "last" / "state.json").read_text())

    def no(*args, **kwargs):
        raise AssertionError("loaded")

    for name in ("load_checkpoint", "prepare_data", "build_model"):
        monkeypatch.setattr(train_module, name, no)
    result = train(Config(), run, resume=True, resume_overrides=parse_overrides(["train.epochs=2"]))
    assert (result["best_rsum"], result["best_epoch"]) == (state["best_rsum"], state["best_epoch"])
    assert result["best"] == state["best_result"]
    best = f"best dev rsum {state['best_rsum']:.1f} at epoch {state['best_epoch']}"
    assert result["note"] == f"{run} finished its 2 epochs ({best}); to train on: --resume --set train.epochs=N " \
                             "with N > 2"
    assert training_finished(run)
    # an edited state.json is refused as a load would refuse it
    (run / "last" / "state.json").write_text(json.dumps({**state, "epoch": 9}))
    with pytest.raises(CheckpointError, match="state.json does not match the manifest") as err:
        train(Config(), run, resume=True, progress=False)
    # what continues the run instead (the hint named RUN/best, which --resume cannot take)
    assert f"train on from {run / 'best'} in a new run: --set train.init_from={run / 'best'}" in err.value.hint


def test_resuming_with_fewer_epochs_than_trained_is_refused(finished, tmp_path, capsys):
    """`--resume --set train.epochs=1` on a 2-epoch run trained nothing, said nothing, and rewrote config.json to
    1 epoch for weights that have had 2."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    config = (run / "config.json").read_bytes()
    with pytest.raises(ConfigError) as err:
        train(Config(), run, resume=True, resume_overrides={"train": {"epochs": 1}}, progress=False)
    assert f"{run} has trained 2 epochs (best dev rsum" in err.value.message
    assert "more than train.epochs=1: a run cannot be cut back" in err.value.message
    assert "--set train.epochs=N with N > 2 to train on" in err.value.hint
    assert main(["train", "--out", str(run), "--resume", "--set", "train.epochs=1"]) == 2
    assert f"error: --set train.epochs=1: {run} has trained 2 epochs" in capsys.readouterr().err
    assert (run / "config.json").read_bytes() == config  # (was rewritten to 1 epoch)
    # more epochs train on from where the run stopped
    assert train(Config(), run, resume=True, resume_overrides={"train": {"epochs": 3}}, progress=False)
    assert json.loads((run / "last" / "state.json").read_text())["epoch"] == 3


def test_the_cli_closes_a_finished_runs_resume_with_its_note_alone(finished, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    assert main(["train", "--out", str(run), "--resume", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{run} finished its 2 epochs (best dev rsum") and out.count("best dev rsum") == 1


def test_resuming_a_run_whose_checkpoint_has_no_manifest_warns_once(finished, tmp_path, caplog, capsys):
    """A checkpoint of an older itmatch (no manifest.json): the finished-run check and the full load each warned."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "last" / "manifest.json").unlink()
    for more in ([], ["--set", "train.epochs=3"]):  # (finished: no load; epochs left: the full load)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="itmatch"):
            assert main(["train", "--out", str(run), "--resume", *more, "--quiet"]) == 0
        warned = [r for r in caplog.records if "no manifest.json" in r.getMessage()]
        assert len(warned) == 1, (more, [r.getMessage() for r in warned])
        assert "best dev rsum" in capsys.readouterr().out


def test_resuming_on_features_of_another_backbone_is_refused(eight_photos, tmp_path):
    """Lite0's and Lite2's cells are both 1280-d: `--resume --data` of a Lite2 extraction trained a Lite0 run on
    them without a word (evaluation compared the backbones; training did not)."""
    lite = {}
    for name in ("lite0", "lite2"):
        lite[name] = tmp_path / name
        shutil.copytree(eight_photos, lite[name])
        meta = {"format": "itmatch-precomp", "backbone": name, "splits": dict.fromkeys(("train", "dev", "test"), {})}
        (lite[name] / "meta.json").write_text(json.dumps(meta))  # (as `itmatch extract --backbone NAME` records it)
    run = tmp_path / "run"
    train(small_config(lite["lite0"], epochs=1, batch_size=8), run, progress=False)
    assert load_checkpoint(run / "best").config.data.backbone == "lite0"
    with pytest.raises(DataError, match="extracted with lite2, but the run's model reads lite0 features") as err:
        train(Config(), run, resume=True, progress=False,
              resume_overrides={"train": {"epochs": 2}, "data": {"path": str(lite["lite2"])}})
    assert "--backbone lite0" in err.value.hint and "train.init_from" in err.value.hint
    train(Config(), run, resume=True, progress=False,  # (its own features: trains on)
          resume_overrides={"train": {"epochs": 2}, "data": {"path": str(lite["lite0"])}})


@pytest.fixture(scope="module")
def rare_words(eight_photos, tmp_path_factory) -> Path:
    """The eight photos with captions of which a quarter of the words are seen once (`shape<i><j>`): SCAN's
    vocabulary threshold (4) leaves them out."""
    root = tmp_path_factory.mktemp("rare")
    for name in ("dev", "test"):
        for suffix in ("ims.npy", "caps.txt", "ids.txt"):
            shutil.copy(eight_photos / f"{name}_{suffix}", root)
    shutil.copy(eight_photos / "train_ims.npy", root)
    write_captions(root, "train", [f"train{i}" for i in range(8)],
                   [f"a {WORDS[i]} shape{i}{j} here" for i in range(8) for j in range(5)])
    return root


def test_training_says_its_vocabulary_and_the_training_words_it_reads_as_unknown(rare_words, tmp_path, capsys,
                                                                                 caplog):
    """Training said nothing of its vocabulary; evaluation said afterwards that 28 % of the words were unknown,
    and the threshold (4) could not be changed."""
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="itmatch.train"):
        train(small_config(rare_words, batch_size=8), run)
    out = capsys.readouterr().out
    assert ("vocabulary: 10 words (+ 4 special tokens), the training captions' words seen at least 4 times "
            "(data.min_word_count)\ntraining captions: unknown words: 40 of 160 caption words (25.00%) read as "
            "unknown") in out
    assert "25.0% of the training captions' words are read as unknown" in caplog.text
    assert "--set data.min_word_count=N, 2 <= N < 4 (at 1 the <unk> embedding never trains)" in caplog.text
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["vocabulary"]
    assert (record["size"], record["unknown"], record["words"], record["captions_read"]) == (14, 40, 160, 40)

    caplog.clear()
    every = tmp_path / "every"  # the threshold is a setting, saved with the run (its vocab.json holds the words)
    cfg = small_config(rare_words, batch_size=8)
    cfg.data.min_word_count = 1
    with caplog.at_level(logging.WARNING, logger="itmatch.train"):
        train(cfg, every, progress=False)
    assert "read as unknown" not in caplog.text
    ckpt = load_checkpoint(every / "best")
    assert (len(ckpt.vocab), ckpt.config.data.min_word_count) == (54, 1)
    assert json.loads((every / "metrics.jsonl").read_text().splitlines()[0])["vocabulary"]["unknown"] == 0
    # it made the vocabulary, so it cannot change on resume; where there is nothing to build, it is refused
    with pytest.raises(ConfigError, match="data.min_word_count=2: cannot change when resuming"):
        train(Config(), every, resume=True, resume_overrides={"data": {"min_word_count": 2}, "train": {"epochs": 2}})
    cfg = small_config(rare_words, init_from=str(every / "best"))
    cfg.data.min_word_count = 2
    with pytest.raises(ConfigError, match=r"data.min_word_count=2 has no effect: the vocabulary is train.init_from's"):
        train(cfg, tmp_path / "init", progress=False)
    assert not (tmp_path / "init").exists()


def test_the_vocabulary_of_a_large_split_is_measured_on_a_sample(rare_words, monkeypatch, capsys):
    monkeypatch.setattr(vocabulary, "COVERAGE_CAPTIONS", 10)
    vocab = build_vocab(read_precomp(rare_words, "train").training_captions)
    captions = read_precomp(rare_words, "train").training_captions
    record = vocabulary.report_vocabulary(small_config(rare_words), vocab, captions, progress=True)
    assert "1 in 4 of the 40 training captions: unknown words: 10 of 40 caption words" in capsys.readouterr().out
    assert (record["vocabulary"]["captions"], record["vocabulary"]["captions_read"]) == (40, 10)


def test_the_default_threshold_is_scans_and_older_configs_read_with_it():
    assert config_from_dict({"data": {"path": "d"}}).data.min_word_count == 4
