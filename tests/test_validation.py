"""Validation with the key path / file named, and fast in-process crash-safety and determinism checks
(the SIGKILL versions are in test_faults.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from itmatch.cli import main
from itmatch.config import parse_overrides
from itmatch.data.captions import read_captions
from itmatch.data.precomp import read_precomp, write_captions, write_features
from itmatch.data.vocab import Vocab
from itmatch.engine.train import train
from itmatch.errors import ConfigError, DataError
from itmatch.models.registry import resolve_config
from tests.engine.test_engine import QUICK as ENGINE_QUICK


@pytest.mark.parametrize("override, message", [
    ("train.lr=-0.1", "train.lr: -0.1 is out of range (must be > 0)"),
    ("train.epochs=0", "train.epochs: 0 is out of range (must be >= 1)"),
    ("loss.margin=-1", "loss.margin: -1.0 is out of range (must be >= 0)"),
    ("model.pool=mean", "model.pool: 'mean' is not one of avg, lse, max, sum"),
    ("train.optimizer=sgd", "train.optimizer: 'sgd' is not one of adam, adadelta"),
    ("train.lr=.inf", "train.lr: must be a finite number"),
    ("train.seed=-1", "train.seed: -1 is out of range"),
    ("model.embed_size=[1]", "model.embed_size: expected int"),
    ("model.embed_size=[", "not valid YAML"),
    ("a..b=1", "is not a key path"),
])
def test_config_values_are_checked_with_their_path(override, message):
    with pytest.raises(ConfigError) as err:
        resolve_config("scan_t2i_avg", parse_overrides([override]))
    assert message in str(err.value)


def test_config_accepts_exponent_floats_and_rejects_conflicting_overrides(tmp_path):
    assert resolve_config(None, parse_overrides(["train.lr=2e-4"])).train.lr == 2e-4  # YAML 1.1 reads a str
    with pytest.raises(ConfigError, match="cannot also have fields"):
        parse_overrides(["train=1", "train.lr.x=2"])
    (tmp_path / "c.yaml").write_bytes(b"\xff\xfe")
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "r")]) == 2


def test_reader_gaps(tmp_path):
    # Karpathy split / COCO id of the wrong JSON type: a message, not a TypeError
    (tmp_path / "k.json").write_text(json.dumps({"images": [{"filename": "a.jpg", "split": ["train"],
                                                             "sentences": []}]}))
    with pytest.raises(DataError, match=r"images\[0\] \(a.jpg\): unknown split"):
        read_captions(tmp_path / "k.json")
    (tmp_path / "c.json").write_text(json.dumps({"images": [{"id": [1], "file_name": "a.jpg"}], "annotations": []}))
    with pytest.raises(DataError, match=r"images\[0\]: needs 'id'"):
        read_captions(tmp_path / "c.json")
    # vocabulary: duplicate and non-string words, binary file
    words = {"0": "<pad>", "1": "<start>", "2": "<end>", "3": "<unk>", "4": "dog", "5": "dog"}
    with pytest.raises(DataError, match="'dog' has two indices"):
        Vocab.from_json({"idx2word": words})
    with pytest.raises(DataError, match="word 4 is 7"):
        Vocab.from_json({"idx2word": {**words, "4": 7, "5": "cat"}})
    (tmp_path / "v.json").write_bytes(b"\x80abc")
    with pytest.raises(DataError, match="not UTF-8"):
        Vocab.load(tmp_path / "v.json")
    # precomp: an .npz under the .npy name, an empty array
    np.savez(tmp_path / "npz.npz", a=np.zeros(3))
    (tmp_path / "npz.npz").rename(tmp_path / "train_ims.npy")
    write_captions(tmp_path, "train", ["a"], ["c"] * 5)
    with pytest.raises(DataError, match="train_ims.npy: .*npz"):
        read_precomp(tmp_path, "train")
    write_features(tmp_path, "train", np.zeros((1, 0, 3), np.float32))
    with pytest.raises(DataError, match=r"N, k, D > 0"):
        read_precomp(tmp_path, "train")


def test_precomp_manifest_catches_truncated_and_unfinished_splits(tmp_path):
    feats = np.ones((2, 3, 4), np.float32)
    write_features(tmp_path, "train", feats)
    write_captions(tmp_path, "train", ["a", "b"], [f"c {i}" for i in range(10)])
    size = (tmp_path / "train_ims.npy").stat().st_size
    meta = {"format": "itmatch-precomp", "splits": {"train": {"images": 2, "features_bytes": size}}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert read_precomp(tmp_path, "train").n_images == 2
    # a copy that lost its tail but whose header still parses
    data = (tmp_path / "train_ims.npy").read_bytes()
    (tmp_path / "train_ims.npy").write_bytes(data[:-16])
    with pytest.raises(DataError, match=f"{size - 16} bytes, meta.json recorded {size}"):
        read_precomp(tmp_path, "train")
    (tmp_path / "train_ims.npy").write_bytes(data)
    meta["splits"]["train"]["features_sha256"] = "0" * 64
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    read_precomp(tmp_path, "train")  # size checked always, the checksum on request
    with pytest.raises(DataError, match="SHA-256 differs"):
        read_precomp(tmp_path, "train", verify_checksum=True)
    # features of a split whose extraction never recorded it
    write_features(tmp_path, "dev", feats)
    write_captions(tmp_path, "dev", ["a", "b"], [f"c {i}" for i in range(10)])
    with pytest.raises(DataError, match="'dev' is not recorded as complete"):
        read_precomp(tmp_path, "dev")


# the engine tests' QUICK schedule, on one thread and a few batches an epoch
QUICK = {**ENGINE_QUICK, "train": {**ENGINE_QUICK["train"], "threads": 1, "max_batches": 12,
                                       "checkpoint_every": 5, "log_every": 1}}


class Crash(Exception):
    pass


def crash_in_epoch_two():
    """A caption transform for QUICK's schedule (12 batches of 32 an epoch, a save every 5) that raises while batch 8
    of epoch 2 is built, after its mid-epoch save at batch 5."""
    calls = 0

    def transform(caption, j):
        nonlocal calls
        calls += 1
        if calls > 32 * (12 + 7):
            raise Crash
        return caption

    return transform


def _untimed(obj):
    if isinstance(obj, dict):
        return {k: _untimed(v) for k, v in obj.items() if not k.endswith("_seconds")}
    return obj


def _log(run):
    return [_untimed(json.loads(x)) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_crash_mid_epoch_resumes_to_the_same_run_and_same_seed_is_deterministic(tiny_precomp, tmp_path):
    cfg = lambda: resolve_config("scan_t2i_avg", {**QUICK, "data": {"path": str(tiny_precomp)}})  # noqa: E731
    a = train(cfg(), tmp_path / "a", progress=False)
    b = train(cfg(), tmp_path / "b", progress=False)
    # same seed, same data, same config: the same metrics
    assert _untimed(a) == _untimed(b) and _log(tmp_path / "a") == _log(tmp_path / "b")

    with pytest.raises(Crash):
        train(cfg(), tmp_path / "c", progress=False, transform=crash_in_epoch_two())
    state = json.loads((tmp_path / "c" / "last" / "state.json").read_text())
    assert (state["epoch"], state["batch"]) == (1, 5) and state["epoch_cpu_seconds"] > 0
    resumed = train(cfg(), tmp_path / "c", resume=True, progress=False)
    assert _untimed(resumed) == _untimed(a) and _log(tmp_path / "c") == _log(tmp_path / "a")
    # the epoch's time includes the batches done before the crash
    epochs = [json.loads(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines() if "val_rsum" in x]
    assert epochs[1]["train_cpu_seconds"] >= state["epoch_cpu_seconds"]
    assert epochs[1]["train_seconds"] >= state["epoch_seconds"]


def test_a_run_killed_before_its_first_checkpoint_restarts_from_another_working_directory(tiny_precomp, tmp_path,
                                                                                        monkeypatch):
    """The run's config.json stores its data path from the run directory (as a checkpoint does), so --resume
    from another directory finds the data; one written by an older itmatch (from the working directory of the
    run) still restarts from that directory."""
    import shutil

    project = tmp_path / "project"
    shutil.copytree(tiny_precomp, project / "data" / "tiny")
    monkeypatch.chdir(project)
    cfg = resolve_config("vsepp", {**QUICK, "data": {"path": "data/tiny"}})
    cfg.train.epochs, cfg.train.max_batches = 1, 3
    ref = train(cfg, "runs/ref", progress=False)
    saved = json.loads((project / "runs" / "ref" / "config.json").read_text())
    assert saved["data"]["path"] == "../../data/tiny"  # from the run directory
    for name, data_path, cwd in [("moved", "../../data/tiny", tmp_path), ("old", "data/tiny", project)]:
        run = project / "runs" / name
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({**saved, "data": {**saved["data"], "path": data_path}}))
        monkeypatch.chdir(cwd)  # killed right after config.json; resumed from `cwd`
        assert _untimed(train(cfg, run.relative_to(cwd), resume=True, progress=False)) == _untimed(ref), name


def test_resume_before_first_checkpoint_restarts_and_force_drops_old_state(tiny_precomp, tmp_path):
    cfg = resolve_config("vsepp", {**QUICK, "data": {"path": str(tiny_precomp)}})
    cfg.train.epochs = 1
    ref = train(cfg, tmp_path / "ref", progress=False)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text((tmp_path / "ref" / "config.json").read_text())  # killed right after this
    assert _untimed(train(cfg, run, resume=True, progress=False)) == _untimed(ref)
    # --force over a finished run: its last/ must not survive to be resumed later
    cfg.train.max_batches = 2

    def crash(caption, j):
        raise Crash

    with pytest.raises(Crash):
        train(cfg, run, force=True, progress=False, transform=crash)
    assert not (run / "last").exists() and not (run / "best").exists()


def test_a_restart_from_another_directory_finds_the_vocabulary_and_the_weights_the_run_started_from(
        tiny_precomp, tmp_path, monkeypatch):
    """data.vocab and train.init_from were stored as given (from the working directory), so a run killed before its
    first checkpoint could not be restarted from elsewhere: "vocab.json: vocabulary file not found". They are
    stored from the run directory now, as the data path is."""
    import shutil

    project = tmp_path / "project"
    shutil.copytree(tiny_precomp, project / "data")
    monkeypatch.chdir(project)
    cfg = resolve_config("vsepp", {**QUICK, "data": {"path": "data"}})
    cfg.train.epochs, cfg.train.max_batches = 1, 3
    train(cfg, "runs/start", progress=False)
    shutil.copy(project / "runs" / "start" / "best" / "vocab.json", project / "words.json")
    for name, setting in (("vocab", "data.vocab=words.json"), ("init", "train.init_from=runs/start/best")):
        layered = resolve_config("vsepp", {**QUICK, "data": {"path": "data"}}, parse_overrides([setting]))
        layered.train.epochs, layered.train.max_batches = 1, 3
        ref = train(layered, f"runs/{name}", progress=False)
        for stale in ("best", "last", "metrics.jsonl"):  # killed right after config.json: only it is left
            path = project / "runs" / name / stale
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        monkeypatch.chdir(tmp_path)  # resumed from another directory
        restarted = train(layered, f"project/runs/{name}", resume=True, progress=False)
        assert _untimed(restarted) == _untimed(ref), name
        monkeypatch.chdir(project)


def test_validation_re_ranking_needs_a_first_stage_and_says_so_before_training(tiny_precomp, tmp_path):
    """train.val_rerank with a model without a global embedding (SCAN) failed at the first validation, an epoch in,
    leaving a run directory the corrected command then needed --force for."""
    cfg = resolve_config("scan_t2i_avg", {**QUICK, "data": {"path": str(tiny_precomp)}},
                         parse_overrides(["train.val_rerank=5"]))
    with pytest.raises(ConfigError, match="train.val_rerank needs a model with a global embedding"):
        train(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_region_count_the_model_cannot_read_is_refused_before_the_run_directory(tiny_precomp, tmp_path):
    """SMAN reads its grid in order, M = model.sman.regions cells: other data failed in the first batch, after
    config.json and metrics.jsonl were written (the corrected command then needed --force)."""
    cfg = resolve_config("sman", {**QUICK, "data": {"path": str(tiny_precomp)}})  # (49 regions; the data has 6)
    with pytest.raises(ConfigError, match="model.sman.regions=49 but the features have 6 regions") as err:
        train(cfg, tmp_path / "run", progress=False)
    assert "model.sman.regions=6" in err.value.hint and not (tmp_path / "run").exists()
