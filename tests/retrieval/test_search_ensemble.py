"""Searching with an ensemble (`Searcher(..., ensemble=[...])`, `--ensemble`): each index of the same photos scored by
its own model, a pair's score the mean of theirs (the rule of `itmatch evaluate`, checked here against single-model
searches); indexes of other photos, or one model twice, refused with what differs (docs/search.md, 'Ensembles')."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import serve_process
from PIL import Image

from itmatch.cli import main
from itmatch.errors import ConfigError, DataError
from itmatch.retrieval.index import build_index
from itmatch.retrieval.indexed_model import aligned
from itmatch.retrieval.search import QueryError, Searcher

QUERY = "a red circle in the center"


@pytest.fixture(scope="module")
def scan_index(tiny_search_setup, tmp_path_factory):
    """The 12 photos of `shipped_vsepp_index`, indexed with the tiny SCAN t-i model (attention maps; synthetic-scene
    words only)."""
    out = tmp_path_factory.mktemp("ensemble") / "scan"
    build_index(tiny_search_setup["photos"], tiny_search_setup["checkpoint"], out, progress=False)
    return out


def _scores_by_id(searcher: Searcher, query: str) -> dict[str, float]:
    return {hit.id: hit.score for hit in searcher.search(query, k=len(searcher.ids))}


def test_an_ensemble_ranks_every_photo_by_the_mean_of_its_models_scores(scan_index, shipped_vsepp_index):
    vsepp, scan = Searcher(shipped_vsepp_index), Searcher(scan_index)
    ensemble = Searcher(shipped_vsepp_index, ensemble=[scan_index])
    alone = [_scores_by_id(vsepp, QUERY), _scores_by_id(scan, QUERY)]
    expected = sorted(((alone[0][i] + alone[1][i]) / 2, i) for i in vsepp.ids)[::-1]
    hits = ensemble.search(QUERY, k=12)
    assert [h.rank for h in hits] == list(range(1, 13)) and [h.id for h in hits] == [i for _, i in expected]
    assert np.allclose([h.score for h in hits], [s for s, _ in expected], atol=1e-5)
    assert [m.name for m in ensemble.members] == ["vsepp_seed1-flickr8k", "scan_t2i_avg"]
    # the two models' scores differ enough for the mean to rank otherwise than either model alone: not vacuous
    assert [h.id for h in hits] != [h.id for h in vsepp.search(QUERY, k=12)]


def test_an_ensemble_ranks_captions_by_the_mean_and_only_those_every_model_reads(scan_index, shipped_vsepp_index,
                                                                                   tiny_search_setup):
    captions = [*tiny_search_setup["captions"].read_text().splitlines()[:20], "dogs run through grass"]
    photo = tiny_search_setup["photos"] / "test_00004.png"
    singles = [Searcher(index, captions=captions) for index in (shipped_vsepp_index, scan_index)]
    ensemble = Searcher(shipped_vsepp_index, ensemble=[scan_index], captions=captions)
    # "a dog runs on the grass": VSE++ (Flickr8K words) reads it, the synthetic-scene SCAN knows none of its words
    assert ensemble.captions_without_known_word == ["dogs run through grass"]
    assert singles[0].captions_without_known_word == []
    results = ensemble.search_image(photo, k=100)
    assert len(results) == 20
    mean = _mean_of_singles(captions, photo, shipped_vsepp_index, scan_index)
    assert all(r["score"] == pytest.approx(mean[r["caption"]], abs=1e-5) for r in results)
    assert [r["score"] for r in results] == sorted((r["score"] for r in results), reverse=True)


def test_a_photo_query_decodes_the_photo_once_and_runs_each_shared_cnn_once(scan_index, shipped_vsepp_index,
                                                                             tiny_search_setup, monkeypatch):
    import itmatch.retrieval.matcher as matcher_module
    import itmatch.retrieval.search as search_module

    captions = tiny_search_setup["captions"].read_text().splitlines()[:20]
    photo = tiny_search_setup["photos"] / "test_00004.png"
    ensemble = Searcher(shipped_vsepp_index, ensemble=[scan_index], captions=captions)
    ensemble.search_image(photo)  # (the captions are encoded at the first photo query)
    # both models read Lite0's cells on the CPU: one reading, so one decode and one CNN pass serve the two
    assert len({m.matcher.photo_reading() for m in ensemble.members}) == 1
    calls = {"decode": 0, "cnn": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(search_module, "decode_image", counted("decode", search_module.decode_image))
    monkeypatch.setattr(matcher_module, "decode_image", counted("decode", matcher_module.decode_image))
    monkeypatch.setattr(matcher_module, "grid_features", counted("cnn", matcher_module.grid_features))
    results = ensemble.search_image(photo, k=100)
    assert calls == {"decode": 1, "cnn": 1}
    # the shared features give each model its own scores: the mean of the single-model searches
    mean = _mean_of_singles(captions, photo, shipped_vsepp_index, scan_index)
    assert all(r["score"] == pytest.approx(mean[r["caption"]], abs=1e-5) for r in results)


def _mean_of_singles(captions, photo, *indexes) -> dict[str, float]:
    """Each caption's mean score over single-model searches of `photo`, one index each (of the captions every one
    of them ranks)."""
    alone = [{r["caption"]: r["score"] for r in Searcher(index, captions=captions).search_image(photo, k=100)}
             for index in indexes]
    return {caption: sum(a[caption] for a in alone) / len(alone) for caption in alone[0]
            if all(caption in a for a in alone)}


def test_a_query_no_model_of_the_ensemble_can_read_is_refused_naming_that_model(scan_index, shipped_vsepp_index):
    ensemble = Searcher(shipped_vsepp_index, ensemble=[scan_index])
    with pytest.raises(QueryError, match="none of the query's words is in the vocabulary of the ensemble's model "
                                         r"scan_t2i_avg \(unknown: dog, runs\)"):
        ensemble.search("dog runs")
    assert Searcher(shipped_vsepp_index).search("dog runs")  # (the one model alone reads it)
    # a word one model lacks is read as <unk> by it and said, as for one model
    assert ensemble.unknown_words("a red dog") == ["dog"]


def test_explain_draws_the_first_model_with_word_attention_and_says_which(scan_index, shipped_vsepp_index):
    ensemble = Searcher(shipped_vsepp_index, ensemble=[scan_index])
    assert ensemble.explains and ensemble.explain_note is None
    drawn = ensemble.explain(QUERY, ensemble.ids[2])
    alone = Searcher(scan_index).explain(QUERY, ensemble.ids[2])
    assert drawn["model"] == "scan_t2i_avg" and drawn["score"] == alone["score"] and drawn["words"] == alone["words"]


def test_the_indexes_rows_are_matched_by_photo_not_by_position(scan_index, shipped_vsepp_index):
    first = Searcher(scan_index).members[0]
    vsepp = Searcher(shipped_vsepp_index).members[0]
    order = torch.arange(len(vsepp.index.ids)).flip(0)
    manifest = {**vsepp.index.manifest, "images": vsepp.index.manifest["images"][::-1]}
    shuffled = dataclasses.replace(vsepp, index=dataclasses.replace(vsepp.index, manifest=manifest),
                                   images=vsepp.images.take(order))
    assert torch.equal(aligned(first, shuffled).images.regions, vsepp.images.regions)
    assert aligned(first, vsepp) is vsepp  # (the same order: nothing copied)


def test_indexes_of_other_photos_are_refused_saying_what_differs(scan_index, shipped_vsepp_index, tiny_search_setup,
                                                                 tmp_path):
    photos = tmp_path / "photos"
    shutil.copytree(tiny_search_setup["photos"], photos)
    (photos / "test_00011.png").unlink()
    Image.new("RGB", (224, 224), (200, 30, 30)).save(photos / "test_00001.png")
    shutil.copy(photos / "test_00002.png", photos / "extra.png")
    other = tmp_path / "index"
    build_index(photos, tiny_search_setup["checkpoint"], other, progress=False)
    with pytest.raises(DataError) as caught:
        Searcher(shipped_vsepp_index, ensemble=[other])
    message = caught.value.message
    assert "the ensemble's indexes hold different photos" in message
    assert "lacks 1 of its photos (test_00011.png)" in message and "holds 1 it lacks (extra.png)" in message
    assert "holds 1 with other contents (test_00001.png)" in message
    assert caught.value.path == other and f"--out {other}" in caught.value.hint
    with pytest.raises(ConfigError, match="the ensemble names one model twice"):
        Searcher(scan_index, ensemble=[other])  # (the same tiny SCAN: the photos are not compared first)
    with pytest.raises(ConfigError, match="the ensemble names one model twice"):
        Searcher(shipped_vsepp_index, ensemble=[scan_index, other])  # (two of the later ones alike)


def test_search_and_serve_take_the_ensemble_from_the_command_line(scan_index, shipped_vsepp_index, capsys):
    expected = Searcher(shipped_vsepp_index, ensemble=[scan_index]).search(QUERY, k=5)
    assert main(["search", str(shipped_vsepp_index), QUERY, "-k", "5", "--ensemble", str(scan_index), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [(r["id"], r["score"]) for r in results] == [(h.id, round(h.score, 6)) for h in expected]
    assert main(["search", str(shipped_vsepp_index), "a red dog", "--ensemble", str(scan_index)]) == 0
    assert "note: not in every model's vocabulary, read as <unk>: dog" in capsys.readouterr().err

    pytest.importorskip("fastapi", reason="the `serve` extra (fastapi) is not installed")
    pytest.importorskip("httpx", reason="fastapi's TestClient needs httpx (dev extra)")
    from fastapi.testclient import TestClient

    from itmatch.retrieval.service import create_app

    client = TestClient(create_app(Searcher(shipped_vsepp_index, ensemble=[scan_index])), base_url="http://localhost")
    health = client.get("/health").json()
    assert [m["preset"] for m in health["models"]] == ["vsepp", "scan_t2i_avg"] and health["model"]["preset"] == "vsepp"
    got = client.get("/api/search", params={"q": QUERY, "k": 5}).json()["results"]
    assert [r["id"] for r in got] == [h.id for h in expected]


def test_the_shipped_dev_pick_searches_across_backbones(shipped_vsepp_index, tiny_search_setup, tmp_path):
    """The pair `ensemble_dev_pick_shipped` chose on dev (docs/results/flickr8k_gpu.csv): MMCA alpha = 0 on Lite2
    cells, VSE++ on Lite0 cells, each index read through its own CNN; neither draws attention maps, and says so."""
    mmca = tmp_path / "mmca"
    build_index(tiny_search_setup["photos"], "mmca_alpha0_lite2_decay4-flickr8k", mmca, progress=False)
    captions = ["a dog runs on the grass", "a man rides a bike down the street", "two children play in the water"]
    ensemble = Searcher(mmca, ensemble=[shipped_vsepp_index], captions=captions)
    assert [m.index.manifest["model"]["backbone"] for m in ensemble.members] == ["lite2", "lite0"]
    assert len(ensemble.search("a dog runs on the grass", k=12)) == 12
    # photo -> captions: two CNNs, so the photo is read twice, each model through its own
    assert len({m.matcher.photo_reading() for m in ensemble.members}) == 2
    photo = tiny_search_setup["photos"] / "test_00004.png"
    mean = _mean_of_singles(captions, photo, mmca, shipped_vsepp_index)
    results = ensemble.search_image(photo, k=3)
    assert [r["score"] for r in results] == pytest.approx(sorted(mean.values(), reverse=True), abs=1e-5)
    assert not ensemble.explains
    assert ensemble.explain_note.startswith("This ensemble's models (mmca_alpha0_lite2_decay4-flickr8k, "
                                            "vsepp_seed1-flickr8k) all score a photo without attending")


def test_a_shortlist_is_the_first_models_and_every_model_scores_it(scan_index, shipped_vsepp_index):
    full = Searcher(shipped_vsepp_index, ensemble=[scan_index])
    short = Searcher(shipped_vsepp_index, ensemble=[scan_index], shortlist=4)
    first_stage = Searcher(shipped_vsepp_index, shortlist=4).candidates(short.encode_query(QUERY))
    hits = short.search(QUERY, k=10)
    assert len(hits) == 4 and {h.id for h in hits} == {short.ids[r] for r in first_stage}
    everyone = _scores_by_id(full, QUERY)
    assert all(h.score == pytest.approx(everyone[h.id], abs=1e-5) for h in hits)  # (the ensemble's mean, re-ranked)
    with pytest.raises(ConfigError, match="no global embedding for a first-stage shortlist"):
        Searcher(scan_index, ensemble=[shipped_vsepp_index], shortlist=4)  # (SCAN first: it has none)


def test_itmatch_serve_with_an_ensemble_answers_its_ranking_over_http(scan_index, shipped_vsepp_index):
    """A real `itmatch serve INDEX --ensemble INDEX2` process on a free port: it says at start which models it
    averages, and its /api/search ranks as the ensemble Searcher does."""
    pytest.importorskip("uvicorn", reason="the `serve` extra (uvicorn) is not installed")
    import urllib.parse
    import urllib.request

    with serve_process(str(shipped_vsepp_index), "--ensemble", str(scan_index), ready="serving 12 images") as (
            port, lines):
        url = f"http://127.0.0.1:{port}/api/search?q={urllib.parse.quote(QUERY)}&k=5"
        with urllib.request.urlopen(url, timeout=30) as resp:
            got = [(r["id"], r["score"]) for r in json.load(resp)["results"]]
    assert "each photo is ranked by the mean score of 2 models: vsepp_seed1-flickr8k, scan_t2i_avg" in "".join(lines)
    expected = Searcher(shipped_vsepp_index, ensemble=[scan_index]).search(QUERY, k=5)
    # (another process may sum in another order: the scores agree to float32's last digits, not bit for bit)
    assert [i for i, _ in got] == [h.id for h in expected]
    assert [s for _, s in got] == pytest.approx([h.score for h in expected], abs=1e-5)
