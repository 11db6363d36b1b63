"""The photo index: incremental by content hash, resumable, refuses corrupt files and other models;
search ranks exactly as the model scores; SCAN's attention weights against a per-pair reference."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import itmatch
from itmatch.cli import main
from itmatch.engine.checkpoint import load_checkpoint, save_checkpoint
from itmatch.errors import CheckpointError, ConfigError, DataError, OverwriteError
from itmatch.models.registry import build_model
from itmatch.retrieval.index import MANIFEST, PARTS, build_index, load_index, scan_images
from itmatch.retrieval.search import QueryError, Searcher, read_captions_file


@pytest.fixture()
def photos(tiny_search_setup, tmp_path):
    folder = tmp_path / "photos"
    shutil.copytree(tiny_search_setup["photos"], folder)
    return folder


def _build(setup, photos, out, **kw):
    return build_index(photos, setup["checkpoint"], out, progress=False, **kw)


def test_incremental_add_change_delete_move(tiny_search_setup, photos, tmp_path):
    out = tmp_path / "index"
    first = _build(tiny_search_setup, photos, out)
    assert first["images"] == 12 and first["encoded"] == 12 and first["reused"] == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["model"]["weights_hash"] and manifest["model"]["config_hash"]
    e = manifest["images"][0]
    assert e["id"] == "test_00000.png" and e["width"] == 224 and e["bytes"] == (photos / e["id"]).stat().st_size
    assert len(e["sha256"]) == 64 and not (out / PARTS).exists()

    again = _build(tiny_search_setup, photos, out)
    assert again["encoded"] == 0 and again["reused"] == 12 and not again["added"] and not again["removed"]

    # add one photo in a sub-folder, replace the content of another, delete a third, rename a fourth
    (photos / "new").mkdir()
    shutil.copy(tiny_search_setup["root"] / "synth" / "images" / "train_00000.png", photos / "new" / "a.png")
    Image.new("RGB", (224, 224), (200, 30, 30)).save(photos / "test_00001.png")
    (photos / "test_00002.png").unlink()
    (photos / "test_00003.png").rename(photos / "moved.png")
    (photos / "notes.txt").write_text("not an image")
    upd = _build(tiny_search_setup, photos, out)
    assert upd["added"] == ["new/a.png"] and upd["renamed"] == [("test_00003.png", "moved.png")]
    assert upd["removed"] == ["test_00002.png"] and upd["changed"] == ["test_00001.png"]
    assert upd["encoded"] == 2 and upd["images"] == 12 and upd["reused"] == 10  # the move costs no encoding
    index = load_index(out)
    assert "test_00002.png" not in index.ids and "new/a.png" in index.ids
    assert len(list(out.glob("regions-*.npy"))) == 1  # the old generation was removed

    # the stored encodings equal a fresh encoding of each file (reused rows are the right rows)
    matcher = itmatch.load(tiny_search_setup["checkpoint"])
    for image_id in ("moved.png", "test_00001.png", "new/a.png"):
        fresh = matcher.encode_images([photos / image_id]).regions[0]
        stored = torch.from_numpy(np.array(index.regions[index.ids.index(image_id)]))
        assert torch.allclose(fresh, stored, atol=1e-5), image_id


def test_another_or_an_empty_folder_never_empties_an_index_without_force(tiny_search_setup, photos, tmp_path):
    """An update removes the photos it no longer finds: a mistyped folder (another one, or one with no image: a disk
    not mounted) would silently empty the index. Both are refused without --force, the index untouched; with it,
    a moved folder's photos are not encoded again."""
    out = tmp_path / "index"
    _build(tiny_search_setup, photos, out)
    before = (out / MANIFEST).read_bytes()
    moved = tmp_path / "moved_photos"
    shutil.copytree(photos, moved)
    with pytest.raises(OverwriteError, match=r"indexes .*photos \(12 photos\), not .*moved_photos"):
        _build(tiny_search_setup, moved, out)
    for photo in photos.iterdir():
        photo.unlink()
    with pytest.raises(DataError, match="would remove all its 12 photos"):
        _build(tiny_search_setup, photos, out)
    assert (out / MANIFEST).read_bytes() == before
    replaced = _build(tiny_search_setup, moved, out, force=True)
    assert replaced["images"] == 12 and replaced["encoded"] == 0 and replaced["reused"] == 12
    assert _build(tiny_search_setup, photos, out, force=True)["images"] == 0


def test_a_second_index_run_on_the_same_out_stops_at_once(tiny_search_setup, photos, tmp_path):
    """Two runs writing one index would each write the manifest of their own photos; the second waits for nothing
    and says why. The lock goes with the run: the next run proceeds."""
    from itmatch.retrieval.index import index_lock

    out = tmp_path / "index"
    with index_lock(out), pytest.raises(OverwriteError, match="another `itmatch index` is writing this index now"):
        _build(tiny_search_setup, photos, out)
    assert _build(tiny_search_setup, photos, out)["images"] == 12


def test_an_array_write_killed_before_its_rename_is_removed_by_the_next_run(tiny_search_setup, photos, tmp_path):
    out = tmp_path / "index"
    _build(tiny_search_setup, photos, out)
    leftover = out / ".regions-20261126213412-74db00.npy.host-16941.6t6en6kw.partial"  # (io.atomic_path's name)
    leftover.write_bytes(b"half an array")
    mine = out / ".notes.txt.host-1.x.partial"  # not the index's
    mine.write_text("kept")
    assert _build(tiny_search_setup, photos, out)["encoded"] == 0  # (nothing changed: no array is written)
    assert not leftover.exists() and mine.exists()


def test_rerun_reads_only_files_whose_size_or_mtime_changed(tiny_search_setup, photos, tmp_path, monkeypatch):
    import os

    import itmatch.fingerprint as fingerprint

    out = tmp_path / "index"
    _build(tiny_search_setup, photos, out)
    hashed = []
    real = fingerprint.file_sha256
    monkeypatch.setattr(fingerprint, "file_sha256", lambda path, *a: hashed.append(path.name) or real(path, *a))
    again = _build(tiny_search_setup, photos, out)
    assert hashed == [] and again["encoded"] == 0  # one stat per photo, no reading
    touched = photos / "test_00005.png"
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, new mtime
    Image.new("RGB", (224, 224), (10, 200, 30)).save(photos / "test_00006.png")  # new content
    upd = _build(tiny_search_setup, photos, out)
    assert sorted(hashed) == ["test_00005.png", "test_00006.png"]
    assert upd["changed"] == ["test_00006.png"] and upd["encoded"] == 1
    entry = next(e for e in json.loads((out / MANIFEST).read_text())["images"] if e["id"] == "test_00005.png")
    assert entry["mtime_ns"] == st.st_mtime_ns + 10**9
    hashed.clear()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))  # touched alone: manifest refreshed
    assert _build(tiny_search_setup, photos, out)["encoded"] == 0 and hashed == ["test_00005.png"]
    hashed.clear()
    assert _build(tiny_search_setup, photos, out)["encoded"] == 0 and hashed == []
    assert _build(tiny_search_setup, photos, out, rehash=True)["encoded"] == 0 and len(hashed) == 12
    (photos / "dangling.png").symlink_to(photos / "gone.png")  # a file that cannot be read: skipped, not a crash
    skipped = _build(tiny_search_setup, photos, out)["skipped"]
    assert [s["id"] for s in skipped] == ["dangling.png"] and "cannot read the file" in skipped[0]["reason"]


def test_resumes_after_interruption_and_skips_unreadable(tiny_search_setup, photos, tmp_path):
    out = tmp_path / "index"
    (photos / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")

    def stop(done, total):
        if done >= 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _build(tiny_search_setup, photos, out, chunk=4, on_chunk=stop)
    assert not (out / MANIFEST).exists() and len(list((out / PARTS).glob("part-*.npz"))) == 1
    resumed = _build(tiny_search_setup, photos, out, chunk=4)
    # the saved chunk held broken.jpg (sorted first, skipped) and 3 photos: only the other 9 are encoded
    assert resumed["encoded"] == 9 and resumed["images"] == 12
    assert [s["id"] for s in resumed["skipped"]] == ["broken.jpg"]
    assert not (out / PARTS).exists() and len(load_index(out).ids) == 12


def test_search_ranks_by_the_models_scores(tiny_search_setup, tmp_path):
    out = tmp_path / "index"
    _build(tiny_search_setup, tiny_search_setup["photos"], out)
    searcher = Searcher(out)
    hits = searcher.search("a large red circle in the center", k=5)
    assert [h.rank for h in hits] == [1, 2, 3, 4, 5]
    paths = [tiny_search_setup["photos"] / i for i in searcher.ids]
    scores = searcher.matcher.score(paths, ["a large red circle in the center"])[:, 0]
    order = torch.argsort(scores, descending=True)[:5]
    assert [h.id for h in hits] == [searcher.ids[i] for i in order]
    assert np.allclose([h.score for h in hits], scores[order].numpy(), atol=1e-5)
    assert searcher.candidates(searcher.encode_query("red")) == list(range(12))  # the first-stage seam
    for bad in ("", "   ", "x" * 400, "qwzx vbnm", " ".join(["red"] * 50)):
        with pytest.raises(QueryError):
            searcher.search(bad)
    with pytest.raises(QueryError):
        searcher.search("red", k=0)


def _vsepp(setup, folder):
    """An untrained VSE++ checkpoint with the test model's vocabulary (a model with a global embedding)."""
    scan = load_checkpoint(setup["checkpoint"])
    cfg = copy.deepcopy(scan.config)
    cfg.model.arch, cfg.preset = "vsepp", "vsepp"
    torch.manual_seed(0)
    save_checkpoint(folder / "vsepp", build_model(cfg.model).eval(), cfg, scan.vocab)
    return folder / "vsepp"


def test_first_stage_shortlist_reranks_the_top_n(tiny_search_setup, tmp_path, capsys):
    """shortlist=N: only the FAISS top N by the global embedding are scored. For VSE++ the head's score is
    that embedding's cosine, so the shortlist's ranking is the exhaustive one cut at N."""
    pytest.importorskip("faiss", reason="faiss-cpu (the `index` extra) is not installed")
    out = tmp_path / "index"
    build_index(tiny_search_setup["photos"], _vsepp(tiny_search_setup, tmp_path), out, progress=False)
    exhaustive, short = Searcher(out), Searcher(out, shortlist=5)
    query = "a large red circle in the center"
    full = exhaustive.search(query, k=12)
    rows = short.candidates(short.encode_query(query))
    assert len(rows) == 5 and [short.ids[r] for r in rows] == [h.id for h in full[:5]]
    hits = short.search(query, k=10)  # k > shortlist: the shortlist is all there is
    assert [(h.id, h.rank) for h in hits] == [(h.id, h.rank) for h in full[:5]]
    assert np.allclose([h.score for h in hits], [h.score for h in full[:5]], atol=1e-5)
    assert len(Searcher(out, shortlist=5, shortlist_index="ivf").search(query, k=3)) == 3
    assert Searcher(out, shortlist=50).candidates(short.encode_query(query)) == list(range(12))  # N >= images
    scan_index = tmp_path / "scan_index"
    _build(tiny_search_setup, tiny_search_setup["photos"], scan_index)
    with pytest.raises(ConfigError, match="no global embedding"):
        Searcher(scan_index, shortlist=5)  # SCAN has none: exhaustive only
    # the CLI flag; fewer results than -k asks for are said (they were not)
    assert main(["search", str(out), query, "-k", "10", "--shortlist", "3", "--json"]) == 0
    printed = capsys.readouterr()
    assert [r["id"] for r in json.loads(printed.out)["results"]] == [h.id for h in full[:3]]
    assert "note: --shortlist 3 ranks only the first stage's top 3 photos: -k 10 returns 3" in printed.err
    assert main(["search", str(out), query, "-k", "3", "--shortlist", "3"]) == 0
    assert "--shortlist" not in capsys.readouterr().err
    assert main(["search", str(scan_index), query, "--shortlist", "3"]) == 2
    assert "no global embedding" in capsys.readouterr().err


def test_refuses_corrupt_index_and_other_model(tiny_search_setup, tmp_path):
    out = tmp_path / "index"
    _build(tiny_search_setup, tiny_search_setup["photos"], out)
    manifest = json.loads((out / MANIFEST).read_text())
    regions = out / manifest["arrays"]["regions"]["file"]

    # another model: same architecture, different weights
    other = tmp_path / "other"
    ckpt = load_checkpoint(tiny_search_setup["checkpoint"])
    with torch.no_grad():
        for param in ckpt.model.parameters():
            param += 0.01
    save_checkpoint(other, ckpt.model, ckpt.config, ckpt.vocab)  # a valid checkpoint (its own manifest)
    with pytest.raises(CheckpointError, match="another model") as err:
        Searcher(out, other)
    assert "--force" in str(err.value) and "itmatch index" in str(err.value)
    with pytest.raises(OverwriteError):
        _build(tiny_search_setup | {"checkpoint": other}, tiny_search_setup["photos"], out)
    # with --force it re-encodes from the stored backbone features (no CNN pass needed)
    redo = _build(tiny_search_setup | {"checkpoint": other}, tiny_search_setup["photos"], out, force=True)
    assert redo["encoded"] == 12 and Searcher(out, other).search("red", 1)
    manifest = json.loads((out / MANIFEST).read_text())
    regions = out / manifest["arrays"]["regions"]["file"]

    data = bytearray(regions.read_bytes())
    data[-1] ^= 0xFF
    regions.write_bytes(bytes(data))
    with pytest.raises(DataError, match="corrupt") as err:
        Searcher(out, other)
    assert "rebuild it: itmatch index" in str(err.value)
    (out / MANIFEST).write_text("{ not json")
    with pytest.raises(DataError, match="corrupt index manifest"):
        load_index(out)
    assert main(["serve", str(out)]) == 2  # refused at start-up, before listening


def test_search_refuses_a_checkpoint_with_another_vocabulary(tiny_search_setup, tmp_path, capsys, caplog):
    """An index records the vocabulary of the model that built it. The same weights and config with two
    words swapped in vocab.json read other embedding rows for a query: "red" then ranks as "blue" did."""
    out = tmp_path / "index"
    _build(tiny_search_setup, tiny_search_setup["photos"], out)
    blue = [h.id for h in Searcher(out).search("blue", 12)]
    ckpt = load_checkpoint(tiny_search_setup["checkpoint"])
    swapped = copy.deepcopy(ckpt.vocab)
    a, b = swapped.word2idx["red"], swapped.word2idx["blue"]
    swapped.idx2word[a], swapped.idx2word[b] = "blue", "red"
    swapped.word2idx.update(red=b, blue=a)
    other = tmp_path / "swapped"
    save_checkpoint(other, ckpt.model, ckpt.config, swapped)  # a valid checkpoint (its own manifest)
    with pytest.raises(CheckpointError, match="its vocabulary differ"):
        Searcher(out, other)
    assert main(["search", str(out), "red", "--model", str(other)]) == 2
    assert "its vocabulary differ" in capsys.readouterr().err
    # the same edit made in place is refused by the checkpoint's manifest, and trusting it does not get past
    # the index's check
    edited = tmp_path / "edited"
    shutil.copytree(tiny_search_setup["checkpoint"], edited)
    shutil.copy(other / "vocab.json", edited / "vocab.json")
    with pytest.raises(CheckpointError, match="vocab.json does not match the manifest"):
        Searcher(out, edited)
    with pytest.raises(CheckpointError, match="its vocabulary differ"):
        Searcher(out, edited, trust_modified=True)
    # an index of an older version (no vocabulary recorded) is used with a warning, and re-indexing records it
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["model"]["vocab_hash"]
    (out / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level("WARNING", "itmatch.retrieval"):
        Searcher(out)
    assert "vocabulary is not checked" in caplog.text
    assert _build(tiny_search_setup, tiny_search_setup["photos"], out)["encoded"] == 0
    assert json.loads((out / MANIFEST).read_text())["model"]["vocab_hash"]
    # re-indexing for the swapped vocabulary: --force, and the image encodings are kept (same weights)
    with pytest.raises(OverwriteError):
        _build(tiny_search_setup | {"checkpoint": other}, tiny_search_setup["photos"], out)
    assert _build(tiny_search_setup | {"checkpoint": other}, tiny_search_setup["photos"], out, force=True)[
        "encoded"] == 0
    assert [h.id for h in Searcher(out, other).search("red", 12)] == blue


def test_cli_index_and_search(tiny_search_setup, tmp_path, capsys):
    out = tmp_path / "index"
    assert main(["index", str(tiny_search_setup["photos"]), "--model", str(tiny_search_setup["checkpoint"]),
                 "--out", str(out), "--quiet"]) == 0
    assert "12 images" in capsys.readouterr().out
    assert main(["search", str(out), "a red circle", "-k", "3", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert {k: document[k] for k in ("query", "k", "unknown_words")} == {"query": "a red circle", "k": 3,
                                                                         "unknown_words": []}
    results = document["results"]
    assert [r["rank"] for r in results] == [1, 2, 3] and results[0]["score"] >= results[2]["score"]
    # the query's words unquoted are that query (it was "unrecognized arguments: red circle")
    assert main(["search", str(out), "a", "red", "circle", "-k", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == document
    # the photo folder as --out: refused before anything is written (--force wrote the index among the photos)
    assert main(["index", str(tiny_search_setup["photos"]), "--model", str(tiny_search_setup["checkpoint"]),
                 "--out", str(tiny_search_setup["photos"]), "--force"]) == 2
    assert "is the photo folder itself" in capsys.readouterr().err
    assert not (tiny_search_setup["photos"] / "manifest.json").exists()
    # a word the model does not know is in the document itself (and noted on stderr), not only on stderr
    assert main(["search", str(out), "a red qwzx circle", "-k", "3", "--json"]) == 0
    printed = capsys.readouterr()
    assert json.loads(printed.out)["unknown_words"] == ["qwzx"] and "qwzx" in printed.err
    photo = tiny_search_setup["photos"] / "test_00004.png"
    assert main(["search", str(out), "--image", str(photo), "--captions", str(tiny_search_setup["captions"]),
                 "-k", "2", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["image"] == str(photo) and document["captions_without_known_word"] == 0
    captions = document["results"]
    assert len(captions) == 2 and all(isinstance(c["caption"], str) for c in captions)
    assert main(["search", str(out), "qwzx"]) == 2
    assert "vocabulary" in capsys.readouterr().err
    # bytes that are not UTF-8 reach argv as lone surrogates (the tokenizer raised a TypeError on them)
    assert main(["search", str(out), "a red \udcff\udcfe circle"]) == 2
    assert "not UTF-8 text" in capsys.readouterr().err


def test_search_notes_results_whose_photo_is_gone_since_indexing(tiny_search_setup, photos, tmp_path, capsys):
    """A photo deleted after indexing is still ranked (its encoding is in the index) until the next `itmatch index`:
    the CLI says so, with the command that updates the index."""
    out = tmp_path / "index"
    _build(tiny_search_setup, photos, out)
    assert main(["search", str(out), "a red circle", "-k", "12"]) == 0
    assert "no longer where" not in capsys.readouterr().err
    (photos / "test_00002.png").unlink()
    assert main(["search", str(out), "a red circle", "-k", "12"]) == 0
    printed = capsys.readouterr()
    assert "test_00002.png" in printed.out
    assert (f"note: 1 of these 12 photos are no longer where they were indexed (moved or deleted); update the index: "
            f"itmatch index {photos} --model {tiny_search_setup['checkpoint']} --out {out}") in printed.err


def test_the_api_says_what_to_do_about_a_photo_deleted_since_indexing(tiny_search_setup, photos, tmp_path):
    """GET /api/images/ID of a photo deleted after indexing said "not available" with no hint; the page showed a
    broken image (tests/retrieval/test_search_browser.py: a placeholder now)."""
    pytest.importorskip("fastapi", reason="the `serve` extra (fastapi) is not installed")
    pytest.importorskip("httpx", reason="fastapi's TestClient needs httpx (dev extra)")
    from fastapi.testclient import TestClient

    from itmatch.retrieval.service import create_app

    out = tmp_path / "index"
    _build(tiny_search_setup, photos, out)
    (photos / "test_00002.png").unlink()
    client = TestClient(create_app(Searcher(out)), base_url="http://localhost")
    error = client.get("/api/images/test_00002.png").json()["error"]
    assert error["status"] == 404 and error["message"] == "image 'test_00002.png' is not available"
    assert "deleted or moved on the server since the index was made" in error["hint"]
    assert "`itmatch index PHOTOS --model MODEL --out INDEX` again, then restart `itmatch serve`" in error["hint"]
    assert str(photos) not in error["hint"]  # (the server's paths are not a client's business)


def test_a_moved_photo_folder_is_said_with_what_to_do_in_search_serve_and_the_api(tiny_search_setup, photos,
                                                                                  tmp_path, capsys, caplog,
                                                                                  monkeypatch):
    """After `mv photos elsewhere`, search advised `itmatch index OLD_FOLDER ...`, which fails (the folder is gone);
    serve started without a word and answered every photo with a bare 404. Each now says the folder is not there and
    the way on, and the command it gives works (photos already encoded are reused)."""
    pytest.importorskip("fastapi", reason="the `serve` extra (fastapi) is not installed")
    pytest.importorskip("httpx", reason="fastapi's TestClient needs httpx (dev extra)")
    import uvicorn
    from fastapi.testclient import TestClient

    from itmatch.retrieval.service import create_app, serve

    out = tmp_path / "index"
    _build(tiny_search_setup, photos, out)
    moved = photos.rename(tmp_path / "moved")
    assert main(["search", str(out), "a red circle", "-k", "3"]) == 0
    err = capsys.readouterr().err
    assert f"note: the photo folder {photos} is not there; if it moved, index it where it is (itmatch index " \
           f"NEW_FOLDER --model {tiny_search_setup['checkpoint']} --out {out} --force" in err
    assert f"itmatch search {out} QUERY --images NEW_FOLDER" in err
    # search from the folder where the photos are now: their paths, and no note (it printed the old paths)
    assert main(["search", str(out), "a red circle", "-k", "3", "--images", str(moved)]) == 0
    shown = capsys.readouterr()
    assert str(moved) in shown.out and str(photos) + "/" not in shown.out and "note:" not in shown.err
    client = TestClient(create_app(Searcher(out)), raise_server_exceptions=False, base_url="http://localhost")
    url = client.get("/api/search", params={"q": "a red circle", "k": 1}).json()["results"][0]["url"]
    answer = client.get(url)
    assert answer.status_code == 404 and "--images NEW_FOLDER" in answer.json()["error"]["hint"]
    assert str(photos) not in answer.text  # (the server's paths are not a client's business)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)  # (its start-up, not its serving)
    with caplog.at_level("WARNING", logger="itmatch.retrieval"):
        serve(out, port=0)
    assert f"the photo folder {photos} is not there: results will come without their photos" in caplog.text
    summary = build_index(moved, tiny_search_setup["checkpoint"], out, force=True, progress=False)  # (the way on)
    assert summary["images"] == summary["reused"] == 12 and summary["encoded"] == 0


def test_searching_an_empty_index_or_a_photo_without_captions_says_so(tiny_search_setup, tmp_path, capsys,
                                                                     monkeypatch):
    """A search of an index of no photo printed nothing and exited 0 (the note came once, when it was indexed); --image
    without --captions loaded the index and the model before saying the captions were needed."""
    import itmatch.retrieval.search as search_module

    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "index"
    build_index(empty, tiny_search_setup["checkpoint"], out, progress=False)
    assert main(["search", str(out), "a red circle"]) == 0
    printed = capsys.readouterr()
    assert printed.out == "" and f"note: the index {out} holds no photo (none was found in {empty}" in printed.err
    monkeypatch.setattr(search_module, "Searcher", lambda *a, **k: pytest.fail("loaded before the arguments"))
    photo = next(tiny_search_setup["photos"].iterdir())
    assert main(["search", str(out), "--image", str(photo)]) == 2
    assert "give the captions to rank with --captions FILE" in capsys.readouterr().err


def test_an_empty_index_searched_with_a_shortlist_says_it_holds_no_photo(tiny_search_setup, tmp_path, capsys):
    """`--shortlist` over an index of no photo failed to build the first stage ("index vectors must be a non-empty
    [N, D] array") instead of saying that the index is empty."""
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "index"
    build_index(empty, _vsepp(tiny_search_setup, tmp_path), out, progress=False)
    assert Searcher(out, shortlist=5).search("a red circle") == []
    assert main(["search", str(out), "a red circle", "--shortlist", "3"]) == 0
    assert f"note: the index {out} holds no photo" in capsys.readouterr().err


def test_a_captions_file_with_a_byte_order_mark_reads_its_first_caption_plainly(tmp_path):
    """Windows Notepad starts a UTF-8 file with U+FEFF: it became part of the first caption's first word."""
    captions = tmp_path / "captions.txt"
    captions.write_bytes("a red circle\r\na blue square\n".encode("utf-8-sig"))
    assert read_captions_file(captions) == ["a red circle", "a blue square"]


def test_a_folder_without_manifest_is_told_what_to_do(tiny_search_setup, photos, tmp_path, capsys):
    """Searching the photo folder itself, a first index that was stopped, or any other folder: each gets its own
    fix (the photo folder's is not "rebuild it with --out PHOTOS --force", which would write the index into it)."""
    stopped = tmp_path / "stopped"
    (stopped / PARTS).mkdir(parents=True)
    for folder, fix in ((photos, f"this is a photo folder: index it first (itmatch index {photos} --model"),
                        (stopped, "stopped before it finished: run the same command again (it resumes)"),
                        (tmp_path / "stopped" / PARTS, "give the --out folder of `itmatch index")):
        assert main(["search", str(folder), "a red circle"]) == 2
        err = capsys.readouterr().err
        assert "not an index: manifest.json is missing" in err and fix in err and "--force" not in err


def test_indexing_a_folder_without_images_says_so(tiny_search_setup, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a photo")
    assert main(["index", str(empty), "--model", str(tiny_search_setup["checkpoint"]), "--out", str(tmp_path / "i"),
                 "--quiet"]) == 0
    assert f"note: no image indexed under {empty} (recursively; files ending in .bmp" in capsys.readouterr().err


def test_a_folder_of_links_to_photos_elsewhere_says_why_nothing_was_indexed(tiny_search_setup, tmp_path, capsys,
                                                                           caplog):
    """Links to photos outside the folder are left out (the server would not serve them): the warning names the
    folder to index instead, and the closing note does not say that no image was there."""
    photos = tiny_search_setup["photos"]
    links = tmp_path / "links"
    links.mkdir()
    first = sorted(photos.glob("*.png"))[0]
    (links / first.name).symlink_to(first)
    assert main(["index", str(links), "--model", str(tiny_search_setup["checkpoint"]), "--out", str(tmp_path / "i"),
                 "--quiet"]) == 0
    err = capsys.readouterr().err + caplog.text
    assert "1 image(s) in" in err and "are links to files outside it" in err
    assert f"index the folder they point to, {photos}" in err
    assert "no image indexed under" in err and "links to files outside the folder left out" in err
    assert "no image found" not in err


def test_scan_attention_matches_per_pair_reference():
    """ScanHead.attention (t2i) against Sec. 3.2 written out for one image and one caption at a time:
    s_kl = v_k . e_l, clipped l2 norm over words, alpha'_kl = softmax_k(lambda_1 * s_bar_kl)."""
    from itmatch.models.base import ImageEmb, TextEmb, l2norm, length_mask
    from itmatch.models.scan.head import ScanHead

    g = torch.Generator().manual_seed(0)
    img = ImageEmb(regions=l2norm(torch.randn(3, 5, 8, generator=g)), mask=torch.ones(3, 5, dtype=torch.bool))
    lengths = torch.tensor([4, 2])
    words = l2norm(torch.randn(2, 4, 8, generator=g)) * length_mask(lengths)[..., None]  # zero padding, as encoded
    txt = TextEmb(words=words, lengths=lengths)
    head = ScanHead("t2i", lambda_softmax=9.0)
    alpha = head.attention(head.prepare_images(img), head.prepare_texts(txt))
    for n in range(3):
        for m in range(2):
            length = int(txt.lengths[m])
            s = img.regions[n] @ txt.words[m, :length].T  # [k, l]
            clipped = torch.nn.functional.leaky_relu(s, 0.1)
            s_bar = clipped / (clipped.norm(dim=1, keepdim=True) + 1e-8)
            ref = torch.softmax(9.0 * s_bar, dim=0)
            assert (alpha[n, :, m, :length] - ref).abs().max() <= 1e-5
            assert torch.allclose(alpha[n, :, m, :length].sum(0), torch.ones(length), atol=1e-6)


@pytest.fixture(scope="module")
def tiny_vsepp(tiny_search_setup, tmp_path_factory):
    """A VSE++ checkpoint trained two steps on the search scenes: a pair-independent head."""
    from itmatch.engine.train import train
    from itmatch.models.registry import resolve_config

    run = tmp_path_factory.mktemp("tiny_vsepp") / "run"
    cfg = resolve_config("vsepp", {"model": {"embed_size": 16, "word_dim": 16},
                                   "data": {"path": str(tiny_search_setup["root"] / "precomp")},
                                   "train": {"epochs": 1, "batch_size": 16, "max_batches": 2, "val_images": 8}})
    train(cfg, run, progress=False)
    return run / "best"


def test_global_vector_model_stores_vectors(tiny_search_setup, tiny_vsepp, tmp_path):
    """VSE++ has a pair-independent vector, its score's only input: the index stores it and no regions (format
    version 3), search works, and explain says the model has no attention to show."""
    out = tmp_path / "index"
    build_index(tiny_search_setup["photos"], tiny_vsepp, out, progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    assert (manifest["version"], manifest["image_encodings"]) == (3, "vectors")
    assert sorted(manifest["arrays"]) == ["features", "vectors"] and manifest["image_extras"] == []
    index = load_index(out)
    assert index.vectors is not None and index.vectors.shape == (12, 16) and index.regions is None
    searcher = Searcher(out)
    expected = searcher.matcher.encode_images([tiny_search_setup["photos"] / searcher.ids[0]]).vector[0]
    assert torch.allclose(torch.from_numpy(np.array(index.vectors[0])), expected, atol=1e-5)
    assert len(searcher.search("a red circle", k=3)) == 3
    with pytest.raises(QueryError, match="no per-word attention over regions") as err:
        searcher.explain("a red circle", searcher.ids[0])
    assert err.value.status == 409


def test_model_of_other_features_is_refused_before_reading_photos(tiny_search_setup, tmp_path):
    """A model trained on region features of another size (e.g. bottom-up 2048) used to fail in a matrix
    product (RuntimeError, a traceback) when indexing photos."""
    from itmatch.engine.checkpoint import load_checkpoint, save_checkpoint
    from itmatch.errors import ConfigError
    from itmatch.models.registry import build_model, resolve_config

    vocab = load_checkpoint(tiny_search_setup["checkpoint"]).vocab
    cfg = resolve_config("vsepp", {"model": {"embed_size": 8, "word_dim": 8, "img_dim": 16, "vocab_size": len(vocab)}})
    save_checkpoint(tmp_path / "ckpt", build_model(cfg.model), cfg, vocab)
    with pytest.raises(ConfigError, match="reads 16-dimensional region features, but the lite0 backbone .* gives 1280"):
        build_index(tiny_search_setup["photos"], tmp_path / "ckpt", tmp_path / "index", progress=False)
    assert not (tmp_path / "index").exists()


def _untrained_sman(setup, folder, **sman):
    from itmatch.models.registry import resolve_config

    vocab = load_checkpoint(setup["checkpoint"]).vocab
    cfg = resolve_config("sman", {"model": {"embed_size": 8, "word_dim": 8, "img_dim": 1280, "vocab_size": len(vocab),
                                            "sman": {"att_hidden": 4, **sman}}})
    torch.manual_seed(0)
    save_checkpoint(folder, build_model(cfg.model), cfg, vocab)
    return folder


@pytest.mark.parametrize("alpha", [0.9, 1.0], ids=["sman", "sman_sim"])
def test_sman_index_ranks_exactly_as_the_model_scores(tiny_search_setup, tmp_path, alpha):
    """SMAN's image encodings carry v0, v1, att1 beside the regions and the vector: the index stores every
    field the encoder returns (it used to refuse SMAN), and the head's parts are added when it is loaded, so
    search equals `itmatch.load(...).score` (alpha = 1: the head appends v(2) to the vector when preparing;
    storing the prepared vector would append it twice)."""
    ckpt = _untrained_sman(tiny_search_setup, tmp_path / "ckpt", alpha=alpha)
    out = tmp_path / "index"
    build_index(tiny_search_setup["photos"], ckpt, out, progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    index = load_index(out)
    if alpha == 1.0:  # pair-independent: the vectors, v(2) appended once, at indexing, and nothing else
        assert sorted(manifest["arrays"]) == ["features", "vectors"] and manifest["version"] == 3
        # [v0/|v0|, v1/|v1|, v(2)/|v(2)|], D = 8 each: v(2) appended once
        assert manifest["arrays"]["vectors"]["shape"] == [12, 24] and index.regions is None
    else:
        assert manifest["image_extras"] == ["att1", "v0", "v1"]
        assert manifest["arrays"]["extra_v0"]["shape"] == [12, 8]
        # SMAN's regions are the backbone's cells themselves: stored once, as the features
        assert "regions" not in manifest["arrays"]
        assert (manifest["regions_from"], manifest["version"]) == ("features", 2)
        assert np.array_equal(index.regions, index.features())
    searcher = Searcher(out)
    query = "a red circle above two stars"
    hits = searcher.search(query, k=12)
    matcher = itmatch.load(ckpt)
    # the same backbone features through the model's own encode + score: bit-identical
    reference = matcher.score(torch.from_numpy(np.array(index.features())), [query])[:, 0]
    got = torch.tensor([h.score for h in sorted(hits, key=lambda h: searcher.ids.index(h.id))])
    assert torch.allclose(got, reference, atol=1e-6, rtol=0)  # (Hit rounds to 6 decimals only in as_dict)
    assert torch.equal(score_of(searcher, query), reference)
    # and the photos themselves, decoded and encoded afresh
    fresh = matcher.score([tiny_search_setup["photos"] / i for i in searcher.ids], [query])[:, 0]
    assert torch.allclose(reference, fresh, atol=1e-5)
    with pytest.raises(QueryError, match="no per-word attention over regions") as err:
        searcher.explain(query, searcher.ids[0])  # one query-guided map per pair, not one per word
    assert err.value.status == 409


def test_an_older_sman_index_with_a_second_copy_of_the_regions_is_read_and_compacted_by_the_next_run(
        tiny_search_setup, tmp_path):
    """An index written before the regions were stored as the features (version 1, a `regions` array equal to
    the features) still searches the same; `itmatch index` over it again, with nothing changed, rewrites it
    without the copy (the file goes) and the search is unchanged."""
    ckpt = _untrained_sman(tiny_search_setup, tmp_path / "ckpt")
    out = tmp_path / "index"
    build_index(tiny_search_setup["photos"], ckpt, out, progress=False)
    query = "a red circle above two stars"
    reference = score_of(Searcher(out), query)
    manifest = json.loads((out / MANIFEST).read_text())
    features = manifest["arrays"]["features"]
    old_copy = out / features["file"].replace("features-", "regions-", 1)
    shutil.copy(out / features["file"], old_copy)  # as the older itmatch wrote it: a second file, same bytes
    manifest["arrays"]["regions"] = {**features, "file": old_copy.name}
    del manifest["regions_from"]
    manifest["version"] = 1
    (out / MANIFEST).write_text(json.dumps(manifest))
    assert torch.equal(score_of(Searcher(out), query), reference)
    summary = build_index(tiny_search_setup["photos"], ckpt, out, progress=False)
    assert (summary["encoded"], summary["reused"]) == (0, 12)  # nothing re-encoded: only the copy dropped
    manifest = json.loads((out / MANIFEST).read_text())
    assert "regions" not in manifest["arrays"] and manifest["regions_from"] == "features"
    assert not old_copy.exists()
    assert torch.equal(score_of(Searcher(out), query), reference)


def test_an_index_of_a_model_whose_regions_are_its_own_stays_version_1(tiny_search_setup, tmp_path):
    """SCAN's regions are its FC layer's output, not the cells: stored as before, readable by older itmatch;
    an index of a format version this itmatch does not know is refused, naming the versions it reads."""
    out = tmp_path / "index"
    build_index(tiny_search_setup["photos"], tiny_search_setup["checkpoint"], out, progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["version"] == 1 and "regions" in manifest["arrays"] and "regions_from" not in manifest
    (out / MANIFEST).write_text(json.dumps({**manifest, "version": 5}))
    with pytest.raises(DataError, match=r"index format version 5 is not one this itmatch reads \(1, 2, 3, 4\)"):
        load_index(out)


def _as_indexed_before_vectors_only(monkeypatch):
    """Index as itmatch did before 2026-12-05: a pair-independent model's every encoder field, regions included."""
    from itmatch.models.base import SimilarityHead

    monkeypatch.setattr(SimilarityHead, "pair_independent", property(lambda head: False))  # (as the index saw it)


def test_an_older_index_of_a_pair_independent_model_searches_the_same_and_is_rewritten_without_regions(
        tiny_search_setup, tiny_vsepp, tmp_path, monkeypatch, caplog):
    """An index written before (version 1: VSE++'s regions and vectors) searches as a new one does, and says how
    to drop the regions; `itmatch index` again rewrites it as vectors alone from its stored features, without
    reading a photo through the CNN, and the search is unchanged."""
    import itmatch.retrieval.index as index_module

    out, new = tmp_path / "old", tmp_path / "new"
    build_index(tiny_search_setup["photos"], tiny_vsepp, new, progress=False)
    with monkeypatch.context() as patched:
        _as_indexed_before_vectors_only(patched)
        build_index(tiny_search_setup["photos"], tiny_vsepp, out, progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["version"] == 1 and "regions" in manifest["arrays"] and "image_encodings" not in manifest
    query = "a red circle above two stars"
    with caplog.at_level("INFO", logger="itmatch.retrieval"):
        reference = score_of(Searcher(out), query)
    assert "holds regions its model never reads" in caplog.text
    assert f"itmatch index {tiny_search_setup['photos']}" in caplog.text
    assert torch.allclose(score_of(Searcher(new), query), reference, atol=1e-6, rtol=0)

    def no_cnn(*args, **kwargs):
        raise AssertionError("the CNN ran: the stored features were not reused")

    monkeypatch.setattr(index_module, "grid_features", no_cnn)
    summary = build_index(tiny_search_setup["photos"], tiny_vsepp, out, progress=False)
    assert summary["images"] == 12 and not summary["skipped"]
    manifest = json.loads((out / MANIFEST).read_text())
    assert sorted(manifest["arrays"]) == ["features", "vectors"] and manifest["version"] == 3
    assert not list(out.glob("regions-*.npy"))
    assert torch.allclose(score_of(Searcher(out), query), reference, atol=1e-6, rtol=0)


def test_a_chunk_of_the_other_layout_is_encoded_again_on_resume(tiny_search_setup, tiny_vsepp, tmp_path, monkeypatch):
    """A run stopped under an older itmatch left chunks of a pair-independent model's fields: the resumed run
    encodes their photos again (its vectors are the head's prepared ones), and keeps chunks of its own."""
    out = tmp_path / "index"

    def stop(done, total):
        if done >= 4:
            raise KeyboardInterrupt

    with monkeypatch.context() as patched, pytest.raises(KeyboardInterrupt):
        _as_indexed_before_vectors_only(patched)
        build_index(tiny_search_setup["photos"], tiny_vsepp, out, progress=False, chunk=4, on_chunk=stop)
    assert (build_index(tiny_search_setup["photos"], tiny_vsepp, out, progress=False)["encoded"]) == 12
    with pytest.raises(KeyboardInterrupt):
        build_index(tiny_search_setup["photos"], tiny_vsepp, tmp_path / "again", progress=False, chunk=4,
                    on_chunk=stop)
    assert build_index(tiny_search_setup["photos"], tiny_vsepp, tmp_path / "again", progress=False)["encoded"] == 8


def score_of(searcher: Searcher, query: str) -> torch.Tensor:
    """Every image's score for `query` as the searcher ranks them, in index order."""
    from itmatch.inference import score_matrix

    with torch.inference_mode():
        return score_matrix(searcher.model, searcher.images, searcher.encode_query(query))[:, 0]


def test_sman_index_search_and_serve_from_the_cli(tiny_search_setup, tmp_path, capsys):
    ckpt = _untrained_sman(tiny_search_setup, tmp_path / "ckpt")
    out = tmp_path / "index"
    assert main(["index", str(tiny_search_setup["photos"]), "--model", str(ckpt), "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["search", str(out), "a red circle", "-k", "3", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert len(results) == 3 and results[0]["score"] >= results[2]["score"]
    pytest.importorskip("httpx", reason="fastapi's TestClient needs httpx (dev extra)")
    from fastapi.testclient import TestClient

    from itmatch.retrieval.service import create_app

    client = TestClient(create_app(Searcher(out)), base_url="http://localhost")
    served = client.get("/api/search", params={"q": "a red circle", "k": 3}).json()["results"]
    assert [r["id"] for r in served] == [r["id"] for r in results]
    assert client.get("/api/explain", params={"q": "a red circle", "id": served[0]["id"]}).status_code == 409


def test_an_encoder_part_the_index_cannot_store_as_float_is_refused_before_reading_photos(tiny_search_setup, tmp_path,
                                                                                          monkeypatch):
    """Stored float32, an integer or bool part (e.g. a mask) would come back as another dtype at search."""
    from itmatch.models.sman.encoders import SMANImageEncoder

    forward = SMANImageEncoder.forward

    def with_a_mask(self, feats, mask):
        emb = forward(self, feats, mask)
        emb.extras["cells"] = mask
        return emb

    monkeypatch.setattr(SMANImageEncoder, "forward", with_a_mask)
    ckpt = _untrained_sman(tiny_search_setup, tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=r"non-float parts \(cells\)"):
        build_index(tiny_search_setup["photos"], ckpt, tmp_path / "index", progress=False)
    assert not (tmp_path / "index").exists()


def test_index_without_image_extras_in_its_manifest_still_loads(tiny_search_setup, photos, tmp_path):
    """Indexes written before the encoder's extras were stored have no `image_extras`: they load as before."""
    out = tmp_path / "index"
    _build(tiny_search_setup, photos, out)
    manifest = json.loads((out / MANIFEST).read_text())
    before = Searcher(out).search("a red circle", k=5)
    del manifest["image_extras"]
    (out / MANIFEST).write_text(json.dumps(manifest))
    assert load_index(out).extras == {}
    assert Searcher(out).search("a red circle", k=5) == before


def test_links_to_files_outside_the_folder_are_not_indexed(tmp_path, caplog):
    """The service serves only files inside the photo folder; the index must not list others."""
    photos, elsewhere = tmp_path / "photos", tmp_path / "elsewhere"
    (photos / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    Image.new("RGB", (8, 8)).save(photos / "inside.jpg")
    Image.new("RGB", (8, 8)).save(elsewhere / "outside.jpg")
    (photos / "sub" / "link_in.jpg").symlink_to(photos / "inside.jpg")  # stays inside: kept
    (photos / "link_out.jpg").symlink_to(elsewhere / "outside.jpg")
    with caplog.at_level("WARNING", logger="itmatch.retrieval"):
        assert scan_images(photos) == ["inside.jpg", "sub/link_in.jpg"]
    assert "link_out.jpg" in caplog.text and "outside" in caplog.text
    assert f"index the folder they point to, {elsewhere}, or copy them in" in caplog.text  # (the library)


def test_files_in_formats_it_cannot_read_are_counted_not_left_out_unsaid(tmp_path, caplog):
    """A phone's folder mixes .jpg and .heic: the .heic photos were left out of the index without a word (the summary
    counted only what it indexed), so they were missing from every search."""
    photos = tmp_path / "photos"
    (photos / "2024").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(photos / "a.jpg")
    for name in ("IMG_0001.HEIC", "2024/IMG_0002.heic", "2024/clip.mov", "README"):
        (photos / name).write_bytes(b"...")
    (photos / ".DS_Store").write_bytes(b"...")  # (hidden: not counted)
    with caplog.at_level("WARNING", logger="itmatch.retrieval"):
        assert scan_images(photos) == ["a.jpg"]
    assert "4 file(s) in" in caplog.text and "(.heic 2, (no extension) 1, .mov 1; it reads .bmp" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="itmatch.retrieval"):
        assert scan_images(photos / "2024") == []
    assert "2 file(s) in" in caplog.text


def test_unknown_words_are_reported_and_captions_without_a_known_word_never_ranked(tiny_search_setup, tmp_path,
                                                                                     capsys):
    out = tmp_path / "index"
    _build(tiny_search_setup, tiny_search_setup["photos"], out)
    garbage = ["zzz qqq xxx", "qwzx vbnm ."]  # the full stop is known: still no word the model can read
    real = read_captions_file(tiny_search_setup["captions"])[:10]
    captions = [*garbage[:1], *real, "a red qwzx circle", garbage[1]]
    searcher = Searcher(out, captions=captions)
    assert searcher.unknown_words("a red qwzx circle, qwzx") == ["qwzx"]  # each once
    assert searcher.unknown_words("a red circle!") == ["!"]  # punctuation it does not know is read as <unk> too
    assert searcher.unknown_words("a red circle") == []
    with pytest.raises(QueryError, match="qwzx, vbnm"):
        searcher.search("qwzx vbnm .")
    assert searcher.captions_without_known_word == garbage
    for photo in ("test_00000.png", "test_00005.png", "test_00009.png"):
        results = searcher.search_image(tiny_search_setup["photos"] / photo, k=100)
        # every caption the model can read, and only those, ranked by the model's unchanged scores
        assert sorted(r["caption"] for r in results) == sorted(captions[1:-1])
        scores = searcher.matcher.score([tiny_search_setup["photos"] / photo], [r["caption"] for r in results])[0]
        assert np.allclose([r["score"] for r in results], scores.numpy(), atol=1e-5)
    marked = next(r for r in results if r["caption"] == "a red qwzx circle")
    assert marked["unknown_words"] == ["qwzx"] and all(r["unknown_words"] == [] for r in results if r is not marked)

    # the CLI says so too
    assert main(["search", str(out), "a red qwzx circle", "-k", "2"]) == 0
    assert "not in the model's vocabulary, read as <unk>: qwzx" in capsys.readouterr().err
    collection = tmp_path / "captions.txt"
    collection.write_text("\n".join(captions) + "\n")
    assert main(["search", str(out), "--image", str(tiny_search_setup["photos"] / "test_00000.png"),
                 "--captions", str(collection), "-k", "100"]) == 0
    printed = capsys.readouterr()
    assert "2 caption(s)" in printed.err and "never ranked" in printed.err
    assert "zzz" not in printed.out and "[unknown: qwzx]" in printed.out


def test_python_api_reports_unknown_words(tiny_search_setup):
    from itmatch.errors import UnknownWordsWarning

    matcher = itmatch.load(tiny_search_setup["checkpoint"])
    photos = sorted(tiny_search_setup["photos"].glob("*.png"))[:3]
    assert matcher.unknown_words("a red qwzx circle") == ["qwzx"]
    with pytest.warns(UnknownWordsWarning, match="qwzx"):
        assert len(matcher.rank("a red qwzx circle", photos, top_k=2)) == 2
    with pytest.raises(DataError, match="vocabulary"):
        matcher.rank("qwzx vbnm", photos)
    # image -> texts: a text without a known word is never ranked
    ranked = matcher.rank(str(photos[0]), ["zzz qqq xxx", "a red circle", "a blue square"], top_k=3)
    assert sorted(i for i, _ in ranked) == [1, 2]


def test_a_renamed_photo_pairs_with_one_new_id_of_its_content():
    from itmatch.retrieval.index import _compare_ids

    old = {"a.png": "h1", "b.png": "h2", "c.png": "h3"}
    now = {"a.png": "h1", "b2.png": "h2", "b3.png": "h2", "d.png": "h4"}  # b copied twice under new names
    assert _compare_ids(old, now) == (["b3.png", "d.png"], ["c.png"], [("b.png", "b2.png")])


@pytest.fixture(params=["scan", "vsepp", "sman"])
def any_layout_checkpoint(request, tiny_search_setup, tiny_vsepp, tmp_path):
    """One model per way an index stores its photos: SCAN's regions (version 1), VSE++'s prepared vectors (3), SMAN's
    regions that are the backbone's cells, stored once as the features (2)."""
    if request.param == "scan":
        return tiny_search_setup["checkpoint"]
    if request.param == "vsepp":
        return tiny_vsepp
    return _untrained_sman(tiny_search_setup, tmp_path / "sman", alpha=0.9)


def test_an_index_without_features_searches_the_same_and_stays_so_until_told(any_layout_checkpoint, photos, tmp_path):
    """--no-features: the index keeps what search reads alone (format version 4), ranks bit for bit as the index with
    features, says what to do when its features are asked for, stays without them on an update, and takes them back
    with --features (reading the photos through the CNN again); dropping them later re-encodes nothing."""
    ckpt, query = any_layout_checkpoint, "a red circle above two stars"
    build_index(photos, ckpt, tmp_path / "full", progress=False)
    reference = score_of(Searcher(tmp_path / "full"), query)
    out = tmp_path / "lean"
    build_index(photos, ckpt, out, progress=False, features=False)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["version"] == 4 and "features" not in manifest["arrays"] and "regions_from" not in manifest
    assert not list(out.glob("features-*.npy"))
    assert torch.equal(score_of(Searcher(out), query), reference)
    with pytest.raises(DataError, match="keeps no backbone features") as err:
        load_index(out).features()
    assert "--features" in err.value.hint
    assert build_index(photos, ckpt, out, progress=False)["encoded"] == 0  # (as the index has them: none)
    assert "features" not in json.loads((out / MANIFEST).read_text())["arrays"]
    assert build_index(photos, ckpt, out, progress=False, features=True)["encoded"] == 12
    full = json.loads((tmp_path / "full" / MANIFEST).read_text())
    again = json.loads((out / MANIFEST).read_text())
    assert (again["version"], sorted(again["arrays"])) == (full["version"], sorted(full["arrays"]))
    assert build_index(photos, ckpt, out, progress=False, features=False)["encoded"] == 0
    assert not list(out.glob("features-*.npy")) and torch.equal(score_of(Searcher(out), query), reference)


def test_chunks_without_features_are_encoded_again_by_a_run_that_keeps_them(tiny_search_setup, photos, tmp_path,
                                                                            capsys):
    out = tmp_path / "index"

    def stop(done, total):
        if done >= 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _build(tiny_search_setup, photos, out, chunk=4, on_chunk=stop, features=False)
    assert _build(tiny_search_setup, photos, out)["encoded"] == 12  # (its 4 photos' chunk lacks their features)
    with pytest.raises(KeyboardInterrupt):
        _build(tiny_search_setup, photos, tmp_path / "again", chunk=4, on_chunk=stop)
    assert _build(tiny_search_setup, photos, tmp_path / "again", features=False)["encoded"] == 8  # (a superset)
    assert main(["index", str(photos), "--model", str(tiny_search_setup["checkpoint"]), "--out", str(tmp_path / "cli"),
                 "--no-features", "--quiet"]) == 0
    assert "features" not in json.loads((tmp_path / "cli" / MANIFEST).read_text())["arrays"]
