"""The photo index and search from Python (build_index, Searcher), as a new user meets them: a shipped model's
name, arguments checked before any work (nothing left behind), k up to the index's size when asked for, messages
that name the Python argument as well as the CLI option, a Searcher as a snapshot, skipped photos logged."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch

import itmatch.pretrained as pretrained
from itmatch.errors import CheckpointError, ConfigError, DataError
from itmatch.retrieval.index import MANIFEST, build_index
from itmatch.retrieval.search import QueryError, Searcher


@pytest.fixture()
def few_photos(tiny_search_setup, tmp_path):
    """Three of the fixture's photos (an index of them is built in a second)."""
    folder = tmp_path / "photos"
    folder.mkdir()
    for p in sorted(tiny_search_setup["photos"].iterdir())[:3]:
        shutil.copy(p, folder / p.name)
    return folder


@pytest.fixture()
def few_index(tiny_search_setup, few_photos, tmp_path):
    out = tmp_path / "index"
    build_index(few_photos, tiny_search_setup["checkpoint"], out, progress=False)
    return out


def _no_trace_of(out):
    """Nothing of a refused run: no lock file beside the output, no output folder."""
    return not out.exists() and not (out.parent / f".{out.name}.lock").exists()


def test_build_index_takes_a_shipped_models_name(tiny_search_setup, few_photos, tmp_path, monkeypatch):
    """load(), Searcher and `itmatch index --model NAME` take a shipped model's name; so does build_index (it read
    NAME/config.json in the working folder after the model had loaded)."""
    shelf = tmp_path / "shelf"
    shutil.copytree(tiny_search_setup["checkpoint"], shelf / "tiny-scan")
    (shelf / "tiny-scan" / pretrained.CARD).write_text(json.dumps({"name": "tiny-scan"}))
    monkeypatch.setattr(pretrained, "PRETRAINED_DIR", shelf)
    monkeypatch.chdir(tmp_path)  # (no folder named tiny-scan here)
    summary = build_index(few_photos, "tiny-scan", tmp_path / "index", progress=False)
    assert summary["images"] == summary["encoded"] == 3
    manifest = json.loads((tmp_path / "index" / MANIFEST).read_text())
    assert manifest["model"]["checkpoint"] == str((shelf / "tiny-scan").resolve())
    assert len(Searcher(tmp_path / "index", "tiny-scan").search("a red circle", k=3)) == 3


def test_an_index_of_a_shipped_model_outlives_a_reinstall_and_a_lost_checkpoint_says_what_to_do(
        tiny_search_setup, few_photos, tmp_path, monkeypatch):
    """An index records its checkpoint's absolute path: for a shipped model, inside site-packages, gone after itmatch
    is reinstalled or the virtual environment is made again; searching it then failed with "no pretrained model
    named '/old/venv/.../vsepp-flickr8k'". It records the shipped name and loads the model by it (an index written
    before it did: from a path ending in itmatch/pretrained/<name>); a checkpoint of the user's that is gone says so
    and what to pass."""
    from itmatch.retrieval.index import index_command, load_index

    def install(venv):  # itmatch's shipped models as installed in `venv`
        shelf = tmp_path / venv / "itmatch" / "pretrained"
        shutil.copytree(tiny_search_setup["checkpoint"], shelf / "tiny-scan")
        (shelf / "tiny-scan" / pretrained.CARD).write_text(json.dumps({"name": "tiny-scan"}))
        monkeypatch.setattr(pretrained, "PRETRAINED_DIR", shelf)
        return shelf

    old = install("old-venv")
    build_index(few_photos, "tiny-scan", tmp_path / "index", progress=False)
    manifest = json.loads((tmp_path / "index" / MANIFEST).read_text())
    assert manifest["model"]["pretrained"] == "tiny-scan"
    expected = Searcher(tmp_path / "index").search("a red circle", k=3)
    shutil.rmtree(tmp_path / "old-venv")
    install("new-venv")
    assert Searcher(tmp_path / "index").search("a red circle", k=3) == expected
    assert "--model tiny-scan " in index_command(tmp_path / "index", manifest)
    del manifest["model"]["pretrained"]  # (an index written before the name was recorded)
    (tmp_path / "index" / MANIFEST).write_text(json.dumps(manifest))
    assert str(old) in manifest["model"]["checkpoint"]
    assert Searcher(tmp_path / "index").search("a red circle", k=3) == expected
    # an itmatch that ships other weights under that name: only a rebuild works, and the hint says so
    from safetensors.torch import load_file, save_file

    from itmatch.engine.checkpoint import _write_manifest

    shutil.rmtree(tmp_path / "new-venv")
    newer = install("newer-venv") / "tiny-scan"
    weights = load_file(newer / "model.safetensors")
    first = next(iter(weights))
    save_file({**weights, first: weights[first] + 0.01}, newer / "model.safetensors")
    _write_manifest(newer)
    with pytest.raises(CheckpointError, match="the index was built with another model") as refused:
        Searcher(tmp_path / "index")
    assert "the shipped tiny-scan it was built with has other weights in this itmatch" in refused.value.hint

    mine = tmp_path / "my-run" / "best"  # a checkpoint of the user's, moved away after indexing
    shutil.copytree(tiny_search_setup["checkpoint"], mine)
    build_index(few_photos, mine, tmp_path / "index2", progress=False)
    shutil.rmtree(tmp_path / "my-run")
    with pytest.raises(CheckpointError, match=r"the index's model is gone from .*my-run/best") as err:
        Searcher(tmp_path / "index2")
    assert "--model CKPT" in err.value.hint and "--force" in err.value.hint
    assert err.value.hint.endswith(f"itmatch index {few_photos} --model CKPT --out {tmp_path / 'index2'} --force")
    assert load_index(tmp_path / "index2").manifest["model"].get("pretrained") is None


@pytest.mark.parametrize(("arguments", "named"), [
    ({"batch_size": 0}, "batch_size must be a whole number >= 1, got 0"),
    ({"batch_size": -3}, "batch_size must be a whole number >= 1, got -3"),
    ({"batch_size": 2.5}, "batch_size must be a whole number >= 1, got 2.5"),
    ({"chunk": 0}, "chunk must be a whole number >= 1, got 0"),
    ({"on_chunk": 3}, "on_chunk must be a function"),
    ({"precision": "fp8"}, "precision= 'fp8' is not a precision"),
    ({"device": "tpu"}, "device= 'tpu' is not a device"),
])
def test_a_bad_argument_is_refused_before_any_work(tiny_search_setup, few_photos, tmp_path, monkeypatch, caplog,
                                                   arguments, named):
    """batch_size=0 was a ValueError from range() after every photo had been hashed and the skip warnings
    printed; now a ConfigError naming the argument, before the lock, the model or a photo is touched."""
    import itmatch.retrieval.index as index_module

    def no_hashing(*args, **kw):
        raise AssertionError("photos were hashed before the arguments were checked")

    monkeypatch.setattr(index_module, "_hash_files", no_hashing)
    (few_photos / "broken.jpg").write_bytes(b"not a jpeg")
    out = tmp_path / "new" / "idx2"
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError, match=named.replace("(", r"\(")) as err:
        build_index(few_photos, tiny_search_setup["checkpoint"], out, progress=False, **arguments)
    assert err.value.hint
    if "batch_size" in arguments:
        assert "batch_size=N (--batch-size N" in err.value.hint
    assert _no_trace_of(out) and not (tmp_path / "new").exists() and not caplog.records


def test_a_missing_photo_folder_or_model_leaves_no_lock_file(tiny_search_setup, tmp_path, monkeypatch):
    """The error was right, but `.idx2.lock` (and the folders above it) stayed beside the intended output: the
    inputs are checked before the lock is taken (a lock file is never removed: flock's file may be held by a
    concurrent run)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "new" / "idx2"
    with pytest.raises(DataError, match="images folder not found"):
        build_index(tmp_path / "no-photos", tiny_search_setup["checkpoint"], out, progress=False)
    assert _no_trace_of(out) and not (tmp_path / "new").exists()
    with pytest.raises(CheckpointError, match="no checkpoint directory and no pretrained model named 'no-model'"):
        build_index(tiny_search_setup["photos"], "no-model", out, progress=False)
    assert _no_trace_of(out) and not (tmp_path / "new").exists()


def test_python_may_ask_for_more_results_than_the_http_limit(few_index):
    """k above 100 (limits.MAX_K, the CLI's and the HTTP API's limit, which POST /api/search leaves to the
    Searcher) is refused by default with a hint that says how to lift it; Searcher(max_k=None) answers any k with
    up to the index's images."""
    default = Searcher(few_index)
    with pytest.raises(QueryError, match="k must be between 1 and 100, got 1000") as err:
        default.search("a red circle", k=1000)
    assert "max_k=None" in err.value.hint
    unlimited = Searcher(few_index, max_k=None)
    assert [h.rank for h in unlimited.search("a red circle", k=1000)] == [1, 2, 3]
    assert len(Searcher(few_index, max_k=2).search("a red circle", k=2)) == 2
    assert len(unlimited.search("a red circle", k=np.int64(2))) == 2
    for bad in (0, -1, 2.0, True, "3"):
        with pytest.raises(QueryError, match="k must be a whole number >= 1"):
            unlimited.search("a red circle", k=bad)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ConfigError, match="max_k must be a whole number >= 1"):
            Searcher(few_index, max_k=bad)


def test_messages_name_the_python_argument_and_the_cli_option(few_index, tmp_path):
    from itmatch.retrieval.two_stage import two_stage_scores

    vectors = torch.zeros(2, 4)
    with pytest.raises(ConfigError, match=r"k \(--rerank K\) must be a whole number >= 1, got 0"):
        two_stage_scores(None, [0, 1], [0, 1], 0, vectors, vectors)
    with pytest.raises(QueryError, match="no caption collection loaded") as err:
        Searcher(few_index).search_image(tmp_path / "photos" / "test_00000.png")
    assert "captions=" in err.value.hint and "--captions FILE" in err.value.hint
    with pytest.raises(DataError, match="not an index: manifest.json is missing") as err:
        Searcher(tmp_path / "nope")
    assert "give the --out folder of `itmatch index" in err.value.hint and "build_index" in err.value.hint


def test_a_searcher_is_a_snapshot_and_a_new_one_sees_the_update(tiny_search_setup, few_photos, few_index):
    """An open Searcher keeps serving the index it read (the server serves one for its lifetime, from concurrent
    requests: no reload in place); a new Searcher sees what build_index added."""
    before = Searcher(few_index)
    for p in sorted(tiny_search_setup["photos"].iterdir())[3:5]:
        shutil.copy(p, few_photos / p.name)
    assert build_index(few_photos, tiny_search_setup["checkpoint"], few_index, progress=False)["added"]
    assert len(before.ids) == len(before.search("a red circle", k=10)) == 3
    assert len(Searcher(few_index).search("a red circle", k=10)) == 5
    assert "snapshot" in Searcher.__doc__


def test_a_skipped_photo_is_a_log_record_not_a_print(tiny_search_setup, few_photos, tmp_path, capsys, caplog):
    """With progress=False nothing is printed: the skipped file is in the summary and a warning of the
    "itmatch.retrieval" logger (an application configures or silences it)."""
    (few_photos / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    with caplog.at_level(logging.WARNING, logger="itmatch.retrieval"):
        summary = build_index(few_photos, tiny_search_setup["checkpoint"], tmp_path / "index", progress=False)
    assert [s["id"] for s in summary["skipped"]] == ["broken.jpg"]
    assert [r.name for r in caplog.records if "skipping broken.jpg" in r.getMessage()] == ["itmatch.retrieval"]
    printed = capsys.readouterr()
    assert printed.out == "" and "broken.jpg" not in printed.err


def test_an_index_opened_with_a_model_of_another_backbone_says_another_model(few_index):
    """A Lite0 index opened with a model trained on Lite2 features: the loader's "backbone='lite0', but the model was
    trained on lite2 features ... leave backbone unset" answered first, about an argument the user never gave."""
    with pytest.raises(CheckpointError, match="the index was built with another model"):
        Searcher(few_index, "mmca_alpha0_lite2-flickr8k")


def test_copies_of_an_unreadable_photo_are_all_skipped_in_a_first_index_and_an_update(tiny_search_setup, few_photos,
                                                                                      tmp_path, caplog):
    """Two empty .jpg files (one content) crashed `itmatch index` with KeyError: 'features' (a first index) or the
    content's sha256 (an update): each content is decoded once, from its first file, and only that file was left
    out. Every file of a content that cannot be decoded is skipped now, for the same reason, and listed."""
    out = tmp_path / "index"
    for name in ("IMG_1.jpg", "IMG_2.jpg"):
        (few_photos / name).write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="itmatch.retrieval"):
        first = build_index(few_photos, tiny_search_setup["checkpoint"], out, progress=False)
    assert first["images"] == len(Searcher(out).ids) == 3 and first["encoded"] == 3
    assert [s["id"] for s in first["skipped"]] == ["IMG_1.jpg", "IMG_2.jpg"]
    assert first["skipped"][0]["reason"] == first["skipped"][1]["reason"]
    assert json.loads((out / MANIFEST).read_text())["skipped"] == first["skipped"]
    assert "skipping IMG_2.jpg: " in caplog.text and "(the same content as IMG_1.jpg)" in caplog.text
    # an update: two copies of another unreadable content, one in a sub-folder
    (few_photos / "sub").mkdir()
    for path in (few_photos / "x1.jpg", few_photos / "sub" / "x2.png"):
        path.write_bytes(b"\xff\xd8 not really a jpeg")
    update = build_index(few_photos, tiny_search_setup["checkpoint"], out, progress=False)
    assert update["images"] == len(Searcher(out).ids) == 3 and update["encoded"] == 0
    assert [s["id"] for s in update["skipped"]] == ["IMG_1.jpg", "IMG_2.jpg", "sub/x2.png", "x1.jpg"]


def test_index_out_dot_writes_into_the_folder_it_is_run_in(tiny_search_setup, few_photos, tmp_path, monkeypatch):
    """`itmatch index PHOTOS --out .` in a new, empty folder was refused ("exists and is not an index") and left
    `..lock` in it: the lock is named after the folder, and Path('.').name is ''."""
    from itmatch.cli import main

    here = tmp_path / "idx"
    here.mkdir()
    monkeypatch.chdir(here)
    argv = ["index", str(few_photos), "--model", str(tiny_search_setup["checkpoint"]), "--out", ".", "--quiet"]
    assert main(argv) == 0
    assert len(Searcher(here).ids) == 3 and not [p.name for p in here.iterdir() if p.name.endswith(".lock")]
    assert main(argv) == 0  # (an update in place)
    monkeypatch.chdir(tmp_path)  # (another spelling of the same folder takes the same lock)
    assert build_index(few_photos, tiny_search_setup["checkpoint"], "idx/", progress=False)["reused"] == 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".lock")) == [".idx.lock"]
