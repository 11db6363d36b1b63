"""Two-stage retrieval: the FAISS first stage, exact re-ranking in both directions, CLI and API."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from itmatch.api import ImageTextMatcher
from itmatch.cli import main
from itmatch.data.precomp import read_precomp
from itmatch.engine.checkpoint import load_checkpoint, save_checkpoint
from itmatch.engine.evaluate import encode_captions, encode_images, score_matrix
from itmatch.engine.train import prepare_data
from itmatch.errors import ConfigError, DataError
from itmatch.models.registry import build_model, resolve_config
from itmatch.retrieval.first_stage import FirstStageIndex
from itmatch.retrieval.two_stage import first_stage_vectors, two_stage_scores

pytest.importorskip("faiss", reason="faiss-cpu (the `index` extra) is not installed")


def unit_vectors(n: int, d: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=1)


def test_flat_index_is_exact_top_k_and_ivf_round_trips(tmp_path):
    base, queries = unit_vectors(500), unit_vectors(20, seed=1)
    scores, ids = FirstStageIndex("flat").build(base).search(queries, 7)
    ref = torch.topk(queries @ base.T, 7)
    assert torch.equal(ids, ref.indices) and torch.allclose(scores, ref.values, atol=1e-5)
    ivf = FirstStageIndex("ivf").build(base)
    assert ivf.nlist >= 2 and len(ivf) == 500
    _, ivf_ids = ivf.search(queries, 7)
    assert ivf_ids.shape == (20, 7) and ((ivf_ids >= -1) & (ivf_ids < 500)).all()
    ivf.save(tmp_path / "ivf.faiss")
    loaded = FirstStageIndex.load(tmp_path / "ivf.faiss")
    assert (loaded.kind, loaded.nlist, loaded.nprobe) == ("ivf", ivf.nlist, ivf.nprobe)
    assert torch.equal(loaded.search(queries, 7)[1], ivf_ids)
    (tmp_path / "junk.faiss").write_text("not an index")
    with pytest.raises(DataError, match="not a FAISS index"):
        FirstStageIndex.load(tmp_path / "junk.faiss")
    with pytest.raises(DataError, match="dimension 8"):
        loaded.search(unit_vectors(2, d=8), 3)
    with pytest.raises(ConfigError, match="unknown first-stage index"):
        FirstStageIndex("hnsw")


@pytest.fixture(scope="module")
def models(tiny_precomp):
    """Untrained SCAN i-t and VSE++ models on the tiny dataset (re-ranking is exact for any weights)."""
    out = {}
    for preset in ("scan_i2t_avg", "vsepp"):
        cfg = resolve_config(preset, {"data": {"path": str(tiny_precomp)},
                                      "model": {"embed_size": 32, "word_dim": 16}})
        _, _, vocab = prepare_data(cfg, None)
        torch.manual_seed(0)
        out[preset] = (build_model(cfg.model).eval(), vocab, cfg)
    return out


@pytest.mark.parametrize("index", ["flat", "ivf"])
def test_rerank_scores_candidates_exactly(models, tiny_precomp, index):
    split = read_precomp(tiny_precomp, "test")
    scan, vocab, _ = models["scan_i2t_avg"]
    vsepp, vvocab, _ = models["vsepp"]
    img, txt = encode_images(scan, split.images), encode_captions(scan, split.captions, vocab)
    exhaustive = score_matrix(scan, img, txt)
    img_vec, txt_vec = first_stage_vectors(encode_images(vsepp, split.images),
                                           encode_captions(vsepp, split.captions, vvocab))
    k = 6
    result = two_stage_scores(scan, img, txt, k, img_vec, txt_vec, index)
    finite = torch.isfinite(result.scores)
    assert (result.scores[finite] - exhaustive[finite]).abs().max() <= 1e-5
    assert result.pairs_scored == int(finite.sum()) <= k * (len(img) + len(txt))
    if index == "flat":  # every query keeps (at least) its first-stage top k
        assert (finite.sum(1) >= k).all() and (finite.sum(0) >= k).all()
        sims = img_vec @ txt_vec.T
        kth = torch.topk(sims, k, dim=1).values[:, -1:]
        assert finite[sims > kth + 1e-5].all()  # every caption above the k-th (ties may go either way)
    # K >= gallery: everything is re-scored, the exhaustive matrix comes back
    full = two_stage_scores(scan, img, txt, len(txt), img_vec, txt_vec, "flat")
    assert full.pairs_scored == full.pairs_total and (full.scores - exhaustive).abs().max() <= 1e-5
    with pytest.raises(ConfigError, match="no pair-independent embedding"):
        first_stage_vectors(img, txt)


def test_cli_and_api_rerank(models, tiny_precomp, tmp_path, capsys):
    for preset, (model, vocab, cfg) in models.items():
        save_checkpoint(tmp_path / preset, model, cfg, vocab)
    scan_ckpt, vsepp_ckpt = str(tmp_path / "scan_i2t_avg"), str(tmp_path / "vsepp")
    argv = ["evaluate", scan_ckpt, "--split", "test", "--quiet", "--rerank", "10"]
    assert main(argv) == 2
    assert "--first-stage CKPT" in capsys.readouterr().err
    assert main([*argv, "--first-stage", vsepp_ckpt, "--faiss", "ivf", "--json", str(tmp_path / "m.json")]) == 0
    assert "two-stage: top 10 (ivf)" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["two_stage"]["pairs_scored"] <= 10 * (40 + 200) and metrics["first_stage"] == vsepp_ckpt
    assert main(["evaluate", vsepp_ckpt, "--split", "test", "--quiet", "--rerank", "5"]) == 0  # its own vectors
    assert main(["evaluate", scan_ckpt, "--quiet", "--first-stage", vsepp_ckpt]) == 2  # without --rerank
    # Python API
    split = read_precomp(tiny_precomp, "test")
    scan, vsepp = ImageTextMatcher(load_checkpoint(scan_ckpt)), ImageTextMatcher(load_checkpoint(vsepp_ckpt))
    feats, caps = np.array(split.images[:12]), split.captions[:60]
    result = scan.rerank_scores(feats, caps, k=4, first_stage=vsepp)
    assert result.scores.shape == (12, 60) and result.pairs_scored <= 4 * 72
    exhaustive = scan.score(feats, caps)
    finite = torch.isfinite(result.scores)
    assert (result.scores[finite] - exhaustive[finite]).abs().max() <= 1e-5
