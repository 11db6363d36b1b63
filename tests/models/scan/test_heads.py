"""Every SCAN variant and Sum-Max against a slow per-pair implementation of the paper's equations."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from itmatch.models.base import ImageEmb, TextEmb, l2norm
from itmatch.models.scan.head import ScanHead
from itmatch.models.scan.summax import SumMaxHead

pytestmark = pytest.mark.usefixtures("float64")  # conftest.py


def random_block(n_img=3, n_txt=4, k=5, d=8, max_len=6, seed=0, normalise=True):
    g = torch.Generator().manual_seed(seed)
    regions = torch.randn(n_img, k, d, generator=g)
    words = torch.randn(n_txt, max_len, d, generator=g)
    lengths = torch.randint(2, max_len + 1, (n_txt,), generator=g)
    lengths[0] = max_len
    if normalise:
        regions, words = l2norm(regions), l2norm(words)
    words = words * (torch.arange(max_len)[None, :, None] < lengths[:, None, None])  # zero padding
    mask = torch.ones(n_img, k, dtype=torch.bool)
    return ImageEmb(regions=regions, mask=mask), TextEmb(words=words, lengths=lengths)


def cos(a, b):
    return float(a @ b) / max(float(a.norm() * b.norm()), 1e-8)


def normalise_ref(s, how, slope):
    """s: 2-D list-like [query, context] -> normalised over the query axis, element by element."""
    rows, cols = len(s), len(s[0])
    out = [[0.0] * cols for _ in range(rows)]
    for c in range(cols):
        column = [s[q][c] for q in range(rows)]
        if how == "softmax":
            z = sum(math.exp(x) for x in column)
            column = [math.exp(x) / z for x in column]
        else:
            if how in ("clipped_l2norm", "clipped"):
                column = [x if x > 0 else slope * x for x in column]
            if how in ("clipped_l2norm", "l2norm"):
                norm = math.sqrt(sum(x * x for x in column)) + 1e-8
                column = [x / norm for x in column]
        for q in range(rows):
            out[q][c] = column[q]
    return out


def pool_ref(values, how, lam):
    if how == "avg":
        return sum(values) / len(values)
    if how == "sum":
        return sum(values)
    if how == "max":
        return max(values)
    return math.log(sum(math.exp(lam * v) for v in values)) / lam


def scan_pair_ref(v, e, direction, pool, lam1, lam2, norm, slope):
    """One (image, caption) pair, straight from SCAN Eq. 1-8: the attended vector is built explicitly."""
    if direction == "t2i":
        query, context = e, v  # words attend to regions
    else:
        query, context = v, e  # regions attend to words
    s = [[float(q @ c) for c in context] for q in query]  # [query, context]
    sn = normalise_ref(s, norm, slope)  # normalised over the query axis
    relevances = []
    for qi, q in enumerate(query):
        weights = [math.exp(lam1 * sn[qi][ci]) for ci in range(len(context))]
        z = sum(weights)
        attended = sum((w / z) * c for w, c in zip(weights, context, strict=True))
        relevances.append(cos(q, attended))
    return pool_ref(relevances, pool, lam2)


@pytest.mark.parametrize("direction,pool,norm", list(itertools.product(
    ("t2i", "i2t"), ("avg", "lse", "max", "sum"),
    ("clipped_l2norm", "l2norm", "clipped", "softmax", "no_norm"))))
def test_scan_head_matches_per_pair_reference(direction, pool, norm):
    img, txt = random_block(seed=hash((direction, pool, norm)) % 1000)
    lam1, lam2, slope = (9.0, 6.0, 0.1) if direction == "t2i" else (4.0, 5.0, 0.1)
    head = ScanHead(direction, pool, lam1, lam2, norm, slope)
    fast = head(head.prepare_images(img), head.prepare_texts(txt))
    for n, m in itertools.product(range(len(img)), range(len(txt))):
        length = int(txt.lengths[m])
        ref = scan_pair_ref(img.regions[n], txt.words[m, :length], direction, pool, lam1, lam2, norm, slope)
        assert abs(float(fast[n, m]) - ref) <= 1e-5, (n, m, float(fast[n, m]), ref)


@pytest.mark.parametrize("direction", ["t2i", "i2t"])
def test_scan_unnormalised_features_and_paper_relu(direction):
    """Without l2-normalised inputs and with the paper's plain ReLU (slope 0) the identity still holds."""
    img, txt = random_block(normalise=False, seed=7)
    head = ScanHead(direction, "avg", 9.0, 6.0, "clipped_l2norm", 0.0)
    fast = head(head.prepare_images(img), head.prepare_texts(txt))
    for n, m in itertools.product(range(len(img)), range(len(txt))):
        length = int(txt.lengths[m])
        ref = scan_pair_ref(img.regions[n], txt.words[m, :length], direction, "avg", 9.0, 6.0,
                            "clipped_l2norm", 0.0)
        assert abs(float(fast[n, m]) - ref) <= 1e-5


@pytest.mark.parametrize("direction", ["t2i", "i2t"])
def test_summax_matches_reference(direction):
    img, txt = random_block(seed=3)
    fast = SumMaxHead(direction)(img, txt)
    for n, m in itertools.product(range(len(img)), range(len(txt))):
        length = int(txt.lengths[m])
        s = img.regions[n] @ txt.words[m, :length].T  # [k, n_words], s_ij = v_i . e_j (Eq. 9-10)
        ref = float(s.max(0).values.sum()) if direction == "t2i" else float(s.max(1).values.sum())
        assert abs(float(fast[n, m]) - ref) <= 1e-5


def test_block_scores_do_not_depend_on_block_composition():
    """Scoring a sub-block gives the same numbers as scoring everything (masking is exact)."""
    img, txt = random_block(n_img=4, n_txt=6, seed=11)
    for direction in ("t2i", "i2t"):
        head = ScanHead(direction, "lse")
        i, t = head.prepare_images(img), head.prepare_texts(txt)
        full = head(i, t)
        part = head(i.take(slice(1, 3)), t.take(torch.tensor([5, 2])).trimmed())
        assert torch.allclose(full[1:3][:, [5, 2]], part, atol=1e-10)


def test_float32_gram_identity_close_to_direct():
    torch.set_default_dtype(torch.float32)  # restored by the fixture
    img, txt = random_block(n_img=8, n_txt=10, k=36, d=64, max_len=12, seed=5)
    for direction in ("t2i", "i2t"):
        head = ScanHead(direction, "avg")
        fast = head(head.prepare_images(img), head.prepare_texts(txt))
        ref = torch.tensor([[scan_pair_ref(img.regions[n].double(), txt.words[m, :int(txt.lengths[m])].double(),
                                           direction, "avg", 9.0, 6.0, "clipped_l2norm", 0.1)
                             for m in range(len(txt))] for n in range(len(img))], dtype=torch.float64)
        assert (fast.double() - ref).abs().max() <= 1e-5


def test_vsepp_image_vector_is_l2_of_the_mean_of_l2_normalised_cell_embeddings():
    """docs/scan.md: VSE++'s image vector is l2(mean of the cell embeddings), each cell FC(cell) l2-normalised."""
    from itmatch.models.registry import build_model, resolve_config

    mc = resolve_config("vsepp").model
    mc.vocab_size, mc.img_dim, mc.embed_size = 20, 12, 16
    model = build_model(mc).eval()
    feats = torch.randn(3, 5, 12)
    cells = l2norm(model.image_encoder.fc(feats))
    with torch.no_grad():
        got = model.encode_images(feats).vector
        assert torch.allclose(got, l2norm(cells.mean(1)), atol=1e-6)


def test_a_head_left_with_the_other_directions_lambdas_is_warned_of():
    """A one-way head reads model.scan.lambda_* (the public code's one flag): a preset turned around by --set
    model.direction keeps its direction's lambdas, which SCAN's tables do not use for the other (t-i 9 / 6, i-t
    4 / 5, COCO i-t 4 / 20): said when the model is built, per head (lambda_2 only where it pools by LSE); the
    presets as they are and a head given its own direction's values are not."""
    import warnings

    from itmatch.config import parse_overrides
    from itmatch.models.registry import build_model, resolve_config

    def build(preset: str, *sets: str):
        mc = resolve_config(preset, parse_overrides(list(sets))).model
        mc.vocab_size, mc.img_dim, mc.embed_size, mc.word_dim = 20, 8, 16, 8
        return build_model(mc)

    for preset, sets, said in (
            ("scan_t2i_avg", ["model.direction=i2t"], "i2t head scores with model.scan.lambda_softmax = 9, the other"),
            ("scan_t2i_lse", ["model.direction=i2t", "model.scan.lambda_lse=5"], "lambda_lse = 9 / 5"),  # (λ1 still)
            ("scan_i2t_avg", ["model.direction=t2i"], "t2i head scores with model.scan.lambda_softmax = 4"),
            ("scan_i2t_lse_coco", ["model.direction=t2i"], "lambda_lse = 4 / 20"),
            ("scan_i2t_avg", ["model.direction=both"], "t2i head"),  # (its t-i half: what the i-t preset set)
            ("scan_t2i_avg", ["model.direction=both", "model.scan.i2t_lambda_softmax=9"], "model.scan.i2t_lambda")):
        with pytest.warns(UserWarning, match="the other direction's values in SCAN's tables") as caught:
            build(preset, *sets)
        assert said in str(caught[0].message), (preset, sets, str(caught[0].message))
    with pytest.warns(UserWarning):
        model = build("scan_t2i_avg", "model.direction=i2t")
    assert (model.head.direction, model.head.lambda_softmax) == ("i2t", 9.0)  # (warned, not changed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for preset, sets in [*((p, ()) for p in ("scan_t2i_avg", "scan_i2t_avg", "scan_i2t_lse_coco", "scan_t2i_sum")),
                             ("scan_t2i_avg", ("model.direction=both",)),  # (t-i 9 / 6, i-t 4 / 5: both halves' own)
                             ("scan_t2i_avg", ("model.direction=i2t", "model.scan.lambda_softmax=4")),  # (AVG: λ1 only)
                             ("scan_t2i_lse", ("model.direction=i2t", "model.scan.lambda_softmax=4",
                                               "model.scan.lambda_lse=20"))]:
            build(preset, *sets)
