"""Per-word attention maps (`Searcher.explain`, GET /api/explain) for every preset family: a map where the
model has one, a clean 409 where it has none, never a 500 (docs/search.md, "Explain")."""

from __future__ import annotations

import pytest
import torch
from conftest import serve_process

from itmatch.config import parse_overrides
from itmatch.models.mmca.head import MMCAHead
from itmatch.models.registry import build_model, resolve_config

K, IMG_DIM, VOCAB = 9, 12, 20

# preset (+ --set overrides) -> the axis its map is normalised over, or None: no per-word map over regions
FAMILIES = [
    ("scan_t2i_avg", (), "regions"),
    ("scan_i2t_lse", (), "words"),
    ("scan_t2i_avg", ("model.direction=both",), "regions"),  # a two-way head: its t-i half
    ("vsepp", (), None),
    ("summax_t2i", (), None),
    ("oan", (), "regions"),
    ("oan_no_inter_attn", (), None),  # intra-modal attention only: nothing word-to-region
    ("save_dsa", (), "words"),
    ("save_asa", ("model.direction=both",), "regions"),
    ("sman", (), None),
]


def _tiny_model(preset: str, sets: tuple[str, ...]):
    mc = resolve_config(preset, parse_overrides(list(sets))).model
    mc.vocab_size, mc.img_dim, mc.embed_size, mc.word_dim = VOCAB, IMG_DIM, 16, 8
    mc.sman.att_hidden, mc.sman.regions = 8, K
    torch.manual_seed(0)
    return build_model(mc).eval()


@pytest.mark.parametrize(("preset", "sets", "axis"), FAMILIES, ids=lambda v: "-".join(v) if isinstance(v, tuple)
                         else str(v))
def test_each_family_has_a_word_map_or_says_it_has_none(preset, sets, axis):
    model = _tiny_model(preset, sets)
    assert model.head.has_word_attention is (axis is not None)
    if axis is None:
        return
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(2, K, IMG_DIM, generator=g)
    length = 5
    tokens = torch.randint(4, VOCAB, (2, 7), generator=g)
    with torch.inference_mode():
        img = model.encode_images(feats)
        txt = model.encode_texts(tokens, torch.tensor([length, 7]))
        alpha, normalised_over = model.head.word_attention(img, txt)
    assert normalised_over == axis and alpha.shape == (K, 7)
    sums = alpha[:, :length].sum(0 if axis == "regions" else 1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5)


def test_mmca_has_no_word_map():
    """MMCA's cross Transformer mixes words and regions in one sequence: no map of a word over regions."""
    assert not MMCAHead(16, heads=4, filters=8).has_word_attention
    with pytest.raises(ValueError, match="no per-word attention"):
        MMCAHead(16, heads=4, filters=8).word_attention(None, None)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def oan_searcher(tiny_search_setup, tmp_path_factory):
    """An untrained OAN checkpoint and its index of the 12 test photos."""
    from itmatch.engine.checkpoint import load_checkpoint, save_checkpoint
    from itmatch.retrieval.index import build_index
    from itmatch.retrieval.search import Searcher

    vocab = load_checkpoint(tiny_search_setup["checkpoint"]).vocab
    cfg = resolve_config("oan")
    cfg.model.vocab_size, cfg.model.img_dim, cfg.model.embed_size, cfg.model.word_dim = len(vocab), 1280, 16, 8
    root = tmp_path_factory.mktemp("oan")
    torch.manual_seed(0)
    save_checkpoint(root / "ckpt", build_model(cfg.model), cfg, vocab)
    build_index(tiny_search_setup["photos"], root / "ckpt", root / "index", progress=False)
    return Searcher(root / "index")


def test_oan_explain_over_http_is_a_map_not_a_500(oan_searcher):
    """OAN's `attention` returns (T-V, V-T); explain used to index the tuple like a tensor (a 500)."""
    pytest.importorskip("fastapi", reason="the `serve` extra (fastapi) is not installed")
    pytest.importorskip("httpx", reason="fastapi's TestClient needs httpx (dev extra)")
    from fastapi.testclient import TestClient

    from itmatch.retrieval.service import create_app

    client = TestClient(create_app(oan_searcher), raise_server_exceptions=False, base_url="http://localhost")
    resp = client.get("/api/explain", params={"q": "a red circle", "id": oan_searcher.ids[0]})
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["normalised_over"] == "regions" and [w["word"] for w in data["words"]] == [
        "<start>", "a", "red", "circle", "<end>"]
    for w in data["words"]:
        assert abs(sum(x for row in w["weights"] for x in row) - 1.0) <= 1e-5


def test_a_shipped_model_without_word_attention_says_so_in_health_and_explain_is_a_409(shipped_vsepp_index):
    """The page reads /health's `explain` to leave results unclickable and say why (test_search_browser.py)."""
    pytest.importorskip("fastapi", reason="the `serve` extra (fastapi) is not installed")
    pytest.importorskip("httpx", reason="fastapi's TestClient needs httpx (dev extra)")
    from fastapi.testclient import TestClient

    from itmatch.retrieval.matcher import WORD_ATTENTION_MODELS
    from itmatch.retrieval.search import Searcher
    from itmatch.retrieval.service import create_app

    searcher = Searcher(shipped_vsepp_index)
    client = TestClient(create_app(searcher), raise_server_exceptions=False, base_url="http://localhost")
    health = client.get("/health").json()
    assert health["explain"] is False and health["model"]["preset"] == "vsepp"
    assert health["explain_note"] == searcher.explain_note and "(vsepp)" in health["explain_note"]
    assert WORD_ATTENTION_MODELS in health["explain_note"]  # the same models the 409's hint names
    resp = client.get("/api/explain", params={"q": "a dog", "id": searcher.ids[0]})
    assert resp.status_code == 409 and "no per-word attention" in resp.json()["error"]["message"]
    assert WORD_ATTENTION_MODELS in resp.json()["error"]["hint"]
    assert client.get("/api/search", params={"q": "a dog", "k": 3}).status_code == 200  # search itself works


def test_serve_says_at_start_that_its_model_draws_no_maps(shipped_vsepp_index):
    """`itmatch serve` (a real process on a free port) says it once in its log, before the address."""
    pytest.importorskip("uvicorn", reason="the `serve` extra (uvicorn) is not installed")
    with serve_process(str(shipped_vsepp_index), ready="serving 12 images") as (_, lines):
        pass
    said = "".join(lines)
    note = "This index's model (vsepp) scores a photo without attending from words to its regions"
    assert note in said  # (the page's note, Searcher.explain_note)
    assert said.index(note) < said.index("serving 12 images")
