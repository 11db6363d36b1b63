"""OAN (Huang et al.): every equation against a slow per-pair reference written from the paper, the
intra-modal negative sampling (Eq. 11, 12) on a hand-built batch, presets, and a short training run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from itmatch.data.precomp import read_precomp
from itmatch.engine.checkpoint import load_checkpoint
from itmatch.engine.evaluate import encode_captions, encode_images, evaluate_models, score_matrix
from itmatch.engine.train import train
from itmatch.errors import ConfigError
from itmatch.models.base import ImageEmb, TextEmb
from itmatch.models.encoders import RegionEncoder
from itmatch.models.oan import OAN_VARIANTS
from itmatch.models.oan.head import OANHead
from itmatch.models.oan.loss import intra_modal_negatives, oan_triplet_loss
from itmatch.models.oan.text import TextCNNEncoder
from itmatch.models.registry import build_model, list_models, resolve_config

OAN_PRESETS = [f"oan{suffix}" for suffix in OAN_VARIANTS]
TOL = 1e-7  # float64; the implementation's x / (||x|| + 1e-8) normalisations differ from exact ones by ~1e-8


pytestmark = pytest.mark.usefixtures("float64")  # conftest.py


def vec(x):
    return [float(v) for v in x.detach()]


def dot(a, b):
    return sum(x * y for x, y in zip(a, b, strict=True))


def norm(a):
    return math.sqrt(dot(a, a))


def cos(a, b):
    return dot(a, b) / max(norm(a) * norm(b), 1e-8)


def softmax(xs):
    top = max(xs)
    ex = [math.exp(x - top) for x in xs]
    return [e / sum(ex) for e in ex]


def weighted_sum(weights, vectors):
    return [sum(w * v[d] for w, v in zip(weights, vectors, strict=True)) for d in range(len(vectors[0]))]


def tanh_affine(weight, bias, x):
    """tanh(W x + b) element by element; weight [out, in] as a nested list."""
    return [math.tanh(dot(row, x) + b) for row, b in zip(weight, bias, strict=True)]


# ---- references straight from the paper ---------------------------------------------------------------
@torch.no_grad()
def textcnn_ref(enc: TextCNNEncoder, token_ids: list[int]) -> list[list[float]]:
    """Eq. 1-2 for one caption: for every step i and kernel j, h_i^j = tanh(sum_o K_j[:, :, o] x_{i-(j-1)//2+o}
    + b_j) with zero word vectors outside the caption; e_i = tanh(W_T (h^1 || h^2 || ...) + b_T)."""
    x = [vec(enc.embed.weight[t]) for t in token_ids]
    n = len(x)
    out = []
    for i in range(n):
        h = []
        for j, conv in zip(enc.kernels, enc.convs, strict=True):
            for c in range(conv.out_channels):
                total = float(conv.bias[c])
                for o in range(j):
                    p = i - (j - 1) // 2 + o
                    if 0 <= p < n:
                        total += dot(vec(conv.weight[c, :, o]), x[p])
                h.append(math.tanh(total))
        out.append(tanh_affine(enc.fc.weight.tolist(), enc.fc.bias.tolist(), h))
    return out


def inter_ref(regions, words, lam_tv, lam_vt):
    """Eq. 4-5 and the set-wise cosine for one pair: (S(v_VT, e_VT), S(v_TV, e_TV)), attended vectors built."""
    s = [[max(dot(e, v), 0.0) / (norm(e) * norm(v)) for v in regions] for e in words]  # s[i][j]
    n, m = len(words), len(regions)
    row = [math.sqrt(sum(s[i][j] ** 2 for j in range(m))) + 1e-8 for i in range(n)]  # ||s_i,:||
    col = [math.sqrt(sum(s[i][j] ** 2 for i in range(n))) + 1e-8 for j in range(m)]  # ||s_:,j||
    e_v = [weighted_sum(softmax([lam_vt * s[i][j] / row[i] for i in range(n)]), words) for j in range(m)]
    v_t = [weighted_sum(softmax([lam_tv * s[i][j] / col[j] for j in range(m)]), regions) for i in range(n)]
    s_vt = sum(cos(regions[j], e_v[j]) for j in range(m)) / m
    s_tv = sum(cos(v_t[i], words[i]) for i in range(n)) / n
    return s_vt, s_tv


def intra_ref(attention, objects, lam):
    """Eq. 6-8 for one item: K attended vectors; head k's W^k is rows k*D..(k+1)*D of the stacked matrices."""
    d = len(objects[0])
    c = [sum(o[t] for o in objects) / len(objects) for t in range(d)]
    wc, wx = attention.context.weight.tolist(), attention.key.weight.tolist()
    sets, all_weights = [], []
    for k in range(attention.heads):
        q = [math.tanh(dot(r, c)) for r in wc[k * d:(k + 1) * d]]
        h = [dot(q, [math.tanh(dot(r, e)) for r in wx[k * d:(k + 1) * d]]) for e in objects]
        w = softmax([lam * hi for hi in h])
        sets.append(weighted_sum(w, objects))
        all_weights.append(w)
    return sets, all_weights


def setwise(a, b):
    """S(a, b) = 1/|a| sum_i cos(a_i, b_i)."""
    return sum(cos(x, y) for x, y in zip(a, b, strict=True)) / len(a)


def oan_ref(head: OANHead, regions, words, gamma):
    """Eq. 14 for one pair, from the references above (mean pooling for intra="mean")."""
    mean = lambda xs: [sum(x[t] for x in xs) / len(xs) for t in range(len(xs[0]))]  # noqa: E731
    total = 0.0
    if head.inter:
        s_vt, s_tv = inter_ref(regions, words, head.lambda_tv, head.lambda_vt)
        total += (1 - gamma if head.intra != "none" else 1.0) * (s_vt + s_tv)
    if head.intra == "attention":
        v_vv, _ = intra_ref(head.image_attention, regions, head.image_attention.lam)
        e_tt, _ = intra_ref(head.text_attention, words, head.text_attention.lam)
        total += (gamma if head.inter else 1.0) * setwise(v_vv, e_tt)
    elif head.intra == "mean":
        total += (gamma if head.inter else 1.0) * cos(mean(regions), mean(words))
    return total


def random_block(n_img=3, n_txt=4, k=5, d=6, max_len=6, seed=0):
    """tanh-range objects, variable caption lengths and one image with masked regions, padding zeroed as
    Matcher.encode_* guarantees."""
    g = torch.Generator().manual_seed(seed)
    regions = torch.tanh(torch.randn(n_img, k, d, generator=g))
    lengths = torch.tensor([max_len, 2, 4, 5][:n_txt])
    words = torch.tanh(torch.randn(n_txt, max_len, d, generator=g))
    words = words * (torch.arange(max_len)[None, :, None] < lengths[:, None, None])
    mask = torch.ones(n_img, k, dtype=torch.bool)
    mask[1, -2:] = False
    return ImageEmb(regions=regions * mask[..., None], mask=mask), TextEmb(words=words, lengths=lengths)


def real_objects(img, txt, i, j):
    regions = [vec(r) for r, keep in zip(img.regions[i], img.mask[i], strict=True) if keep]
    words = [vec(w) for w in txt.words[j, : int(txt.lengths[j])]]
    return regions, words


# ---- encoders --------------------------------------------------------------------------------------------
def test_textcnn_matches_eq1_eq2_and_ignores_batch_padding():
    torch.manual_seed(0)
    enc = TextCNNEncoder(20, 4, 3, kernels=(1, 2, 3, 5, 7), channels=2)
    tokens = torch.randint(4, 20, (3, 8))
    lengths = torch.tensor([8, 5, 2])
    out = enc(tokens, lengths)
    for b in range(3):
        ref = torch.tensor(textcnn_ref(enc, tokens[b, : lengths[b]].tolist()))
        assert (out.words[b, : lengths[b]] - ref).abs().max() <= TOL
        assert out.words[b, lengths[b]:].abs().max() == 0 if lengths[b] < 8 else True
    # the same captions padded less (another batch) give the same object embeddings
    short = enc(tokens[1:, :5], lengths[1:])
    assert (short.words - out.words[1:, :5]).abs().max() <= 1e-12


def test_region_encoder_tanh_is_eq3():
    torch.manual_seed(0)
    enc = RegionEncoder(7, 4, norm=False, activation="tanh")
    feats = torch.randn(2, 3, 7)
    out = enc(feats, torch.ones(2, 3, dtype=torch.bool)).regions
    ref = torch.tensor([[tanh_affine(enc.fc.weight.tolist(), enc.fc.bias.tolist(), vec(u)) for u in f] for f in feats])
    assert (out - ref).abs().max() <= 1e-12
    with pytest.raises(ValueError, match="activation"):
        RegionEncoder(7, 4, activation="relu6")


# ---- the head ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("inter", "intra"), [(True, "attention"), (True, "none"), (False, "attention"),
                                              (False, "mean"), (True, "mean")])
def test_score_matches_per_pair_reference(inter, intra):
    """Eq. 4-8 and 14 (and the ablations' scores) for every pair of a block vs the per-pair reference."""
    torch.manual_seed(1)
    head = OANHead(k_heads=3, embed_size=6, lambda_tt=1.0, lambda_vv=1.3, lambda_tv=0.9, lambda_vt=0.5,
                   gamma=0.3, inter=inter, intra=intra)
    img, txt = random_block()
    scores = head(head.prepare_images(img), head.prepare_texts(txt)).detach()
    for i in range(len(img)):
        for j in range(len(txt)):
            regions, words = real_objects(img, txt, i, j)
            assert abs(float(scores[i, j]) - oan_ref(head, regions, words, 0.3)) <= TOL, (i, j)


def test_components_match_reference_with_paper_temperatures():
    """Each set-wise similarity on its own, with the temperatures of section 5.2 and larger ones."""
    torch.manual_seed(2)
    for lam_tv, lam_vt in ((0.9, 0.5), (9.0, 4.0)):
        head = OANHead(k_heads=2, embed_size=6, lambda_tv=lam_tv, lambda_vt=lam_vt)
        img, txt = random_block(seed=3)
        with torch.no_grad():
            parts = head.components(head.prepare_images(img), head.prepare_texts(txt))
        for i in range(len(img)):
            for j in range(len(txt)):
                regions, words = real_objects(img, txt, i, j)
                s_vt, s_tv = inter_ref(regions, words, lam_tv, lam_vt)
                v_vv, _ = intra_ref(head.image_attention, regions, 1.0)
                e_tt, _ = intra_ref(head.text_attention, words, 1.0)
                assert abs(float(parts["vt"][i, j]) - s_vt) <= TOL
                assert abs(float(parts["tv"][i, j]) - s_tv) <= TOL
                assert abs(float(parts["intra"][i, j]) - setwise(v_vv, e_tt)) <= TOL


def test_attention_weights_sum_to_one_over_the_attended_set():
    torch.manual_seed(3)
    head = OANHead(k_heads=4, embed_size=6)
    img, txt = random_block()
    img, txt = head.prepare_images(img), head.prepare_texts(txt)
    alpha_tv, alpha_vt = head.attention(img, txt)
    rmask, wmask = img.mask[:, :, None, None], txt.mask[None, None]
    sums_tv = alpha_tv.sum(1)  # over regions, for every (image, caption, word)
    assert torch.allclose(sums_tv, torch.ones_like(sums_tv))
    assert alpha_tv.masked_select(~rmask.expand_as(alpha_tv)).abs().max() == 0  # no weight on masked regions
    sums_vt = alpha_vt.sum(3)  # over words, for every (image, region, caption)
    assert torch.allclose(sums_vt, torch.ones_like(sums_vt))
    assert alpha_vt.masked_select(~wmask.expand_as(alpha_vt)).abs().max() == 0  # no weight on padding words
    for attention, objects, mask in ((head.text_attention, txt.words, txt.mask),
                                     (head.image_attention, img.regions, img.mask)):
        _, weights = attention(objects, mask)  # [B, K, L]
        assert torch.allclose(weights.sum(2), torch.ones(weights.shape[:2]))
        assert weights.masked_select(~mask[:, None, :].expand_as(weights)).abs().max() == 0
        for b in range(len(objects)):  # and they are Eq. 7's weights
            _, ref = intra_ref(attention, [vec(o) for o in objects[b][mask[b]]], attention.lam)
            assert (weights[b][:, mask[b]] - torch.tensor(ref)).abs().max() <= TOL


@pytest.mark.parametrize("lambda_tv, lambda_vt", [(0.9, 0.5), (9.0, 4.0)])  # the paper's; SCAN's t-i / i-t
def test_inter_modal_attention_is_bounded_by_its_scale(lambda_tv, lambda_vt):
    """Eq. 4's logits lambda * s-hat lie in [0, lambda] (s-hat in [0, 1]), so however well one object matches, its
    weight is at most e^lambda / (e^lambda + M - 1): with the paper's lambda_TV = 0.9 over a 7 x 7 grid a word gives
    its own region 4.9 % (uniform: 2.0 %), and a region gives its word 13 % of 12 (uniform 8.3 %) at lambda_VT = 0.5
    (docs/oan.md, "How sharp the inter-modal attention can be"). Here each of 12 words is one of 49 regions exactly,
    the rest orthogonal: the bound is reached."""
    head = OANHead(k_heads=2, embed_size=64, lambda_tv=lambda_tv, lambda_vt=lambda_vt)
    basis = torch.eye(64)
    img = ImageEmb(regions=basis[:49][None], mask=torch.ones(1, 49, dtype=torch.bool))
    txt = TextEmb(words=basis[:12][None], lengths=torch.tensor([12]))
    alpha_tv, alpha_vt = head.attention(head.prepare_images(img), head.prepare_texts(txt))  # [1, 49, 1, 12] each
    peak_tv = alpha_tv[0, :12, 0, :].diagonal()  # word i on region i
    peak_vt = alpha_vt[0, :12, 0, :].diagonal()  # region j on word j
    bound = lambda lam, m: math.exp(lam) / (math.exp(lam) + m - 1)  # noqa: E731
    assert torch.allclose(peak_tv, torch.full((12,), bound(lambda_tv, 49)), atol=1e-4)
    assert torch.allclose(peak_vt, torch.full((12,), bound(lambda_vt, 12)), atol=1e-4)
    if lambda_tv < 1:
        assert peak_tv.max() < 0.05 and peak_vt.max() < 0.14  # near the uniform 1/49 and 1/12
    else:
        assert peak_tv.min() > 0.99 and peak_vt.min() > 0.82


def test_blocked_evaluation_equals_direct_scores():
    """The evaluator (length-sorted caption blocks, trimmed padding, tiny memory budget) gives head(img, txt)."""
    torch.set_default_dtype(torch.float32)  # the evaluator feeds float32 features
    torch.manual_seed(4)
    cfg = resolve_config("oan", {"model": {"img_dim": 10, "vocab_size": 30, "embed_size": 8, "word_dim": 6}})
    model = build_model(cfg.model).eval()
    feats = torch.randn(7, 5, 10).numpy()
    from itmatch.data.vocab import Vocab

    vocab = Vocab(["a", "b", "c", "d", "e"])
    captions = ["a b c d e a b", "a", "b c", "e d c b a a", "c c", "d e a", "b", "a b c d e a b c d"]
    img, txt = encode_images(model, feats, batch_size=3), encode_captions(model, captions, vocab, batch_size=3)
    blocked = score_matrix(model, img, txt, budget_bytes=2e4, captions_per_block=3)
    with torch.no_grad():
        direct = model.score(img, txt)
    assert (blocked - direct).abs().max() <= 1e-5


# ---- the objective -------------------------------------------------------------------------------------------
def hand_built_batch():
    """4 pairs (image i, caption i). Inter-modal hardest negatives of `scores`: caption t-hat of images
    0..3 = 1, 3, 1, 0; image v-hat of captions 0..3 = 3, 2, 0, 1. Intra-modal nearest neighbours:
    images 0..3 -> 1, 0, 3, 2; captions 0..3 -> 1, 0, 3, 2."""
    scores = torch.tensor([[0.9, 0.6, 0.5, 0.2],
                           [0.0, 0.8, 0.3, 0.6],
                           [0.4, 0.7, 0.9, 0.1],
                           [0.6, 0.2, 0.1, 0.9]])
    img_sim = torch.tensor([[1.0, 0.8, 0.2, 0.1],
                            [0.8, 1.0, 0.3, 0.4],
                            [0.2, 0.3, 1.0, 0.7],
                            [0.1, 0.4, 0.7, 1.0]])
    txt_sim = torch.tensor([[1.0, 0.9, 0.2, 0.3],
                            [0.9, 1.0, 0.4, 0.1],
                            [0.2, 0.4, 1.0, 0.8],
                            [0.3, 0.1, 0.8, 1.0]])
    return scores, img_sim, txt_sim


def test_negative_sampling_eq11_and_eq12_pick_the_documented_examples():
    scores, img_sim, txt_sim = hand_built_batch()
    img_neg, txt_neg, _, _ = intra_modal_negatives(scores, img_sim, txt_sim, "eq11")
    assert img_neg.tolist() == [1, 0, 3, 2]  # v-bar = argmax_{v-} S(v-, v)
    assert txt_neg.tolist() == [1, 0, 3, 2]  # t-bar = argmax_{t-} S(t-, t)
    img_neg, txt_neg, _, _ = intra_modal_negatives(scores, img_sim, txt_sim, "eq12")
    assert img_neg.tolist() == [1, 3, 1, 0]  # v-bar = the image of t-hat = argmax_{t-} S(v, t-)
    assert txt_neg.tolist() == [3, 2, 0, 1]  # t-bar = the caption of v-hat = argmax_{v-} S(v-, t)
    # pairs 0 and 1 show the same photo: never each other's negatives, in either modality
    same = torch.eye(4, dtype=torch.bool)
    same[0, 1] = same[1, 0] = True
    img_neg, txt_neg, valid_img, valid_txt = intra_modal_negatives(scores, img_sim, txt_sim, "eq11", same)
    assert img_neg.tolist() == [2, 3, 3, 2] and txt_neg.tolist() == [3, 2, 3, 2]
    assert valid_img.all() and valid_txt.all()
    img_neg, txt_neg, _, _ = intra_modal_negatives(scores, img_sim, txt_sim, "eq12", same)
    assert img_neg.tolist() == [2, 3, 1, 0] and txt_neg.tolist() == [3, 2, 0, 1]
    # a batch of one photo has no negative at all: nothing is valid, the intra-modal terms vanish
    _, _, valid_img, valid_txt = intra_modal_negatives(scores, img_sim, txt_sim, "eq11", torch.ones(4, 4) > 0)
    assert not valid_img.any() and not valid_txt.any()
    assert float(oan_triplet_loss(scores, img_sim, txt_sim, strategy="eq12", positives=torch.ones(4, 4) > 0)) == 0


def eq10_ref(scores, img_sim, txt_sim, margin, alpha_intra, beta, strategy, same):
    """Eq. 10 summed over the pairs, hardest negatives, written per pair with explicit loops."""
    n = len(scores)
    total = 0.0
    for i in range(n):
        negs = [j for j in range(n) if not same[i][j]]
        t_hat = max(negs, key=lambda j: scores[i][j])  # hardest caption of image i
        v_hat = max(negs, key=lambda j: scores[j][i])  # hardest image of caption i
        total += max(0.0, margin - scores[i][i] + scores[i][t_hat])
        total += max(0.0, margin - scores[i][i] + scores[v_hat][i])
        if strategy == "eq11":
            v_bar = max(negs, key=lambda j: img_sim[i][j])
            t_bar = max(negs, key=lambda j: txt_sim[i][j])
        else:
            v_bar, t_bar = t_hat, v_hat  # the image of pair t-hat, the caption of pair v-hat
        total += beta * max(0.0, alpha_intra - img_sim[i][i] + img_sim[i][v_bar])
        total += beta * max(0.0, alpha_intra - txt_sim[i][i] + txt_sim[i][t_bar])
    return total


@pytest.mark.parametrize("strategy", ["eq11", "eq12"])
@pytest.mark.parametrize("seed", range(3))
def test_eq10_matches_reference(strategy, seed):
    g = torch.Generator().manual_seed(seed)
    n = 7
    scores = torch.rand(n, n, generator=g)
    img_sim, txt_sim = (0.5 + 0.5 * torch.rand(n, n, generator=g) for _ in range(2))
    same = torch.eye(n, dtype=torch.bool)
    same[2, 5] = same[5, 2] = True
    loss = oan_triplet_loss(scores, img_sim, txt_sim, 0.2, 0.1, 0.5, strategy, True, same)
    ref = eq10_ref(scores.tolist(), img_sim.tolist(), txt_sim.tolist(), 0.2, 0.1, 0.5, strategy, same.tolist())
    assert abs(float(loss) - ref) <= TOL
    plain = oan_triplet_loss(scores, img_sim, txt_sim, 0.2, 0.1, 0.5, "none", True, same)
    assert abs(float(plain) - eq10_ref(scores.tolist(), img_sim.tolist(), txt_sim.tolist(), 0.2, 0.1, 0.0,
                                       strategy, same.tolist())) <= TOL


def test_eq13_training_loss_weights_the_three_terms():
    torch.manual_seed(5)
    head = OANHead(k_heads=2, embed_size=6, gamma=0.3, negatives="eq12", alpha_intra=0.1, beta=0.5)
    img, txt = random_block(n_img=4, n_txt=4)
    img, txt = head.prepare_images(img), head.prepare_texts(txt)

    loss = head.training_loss(img, txt, 0.2, hardest=True).detach()
    parts = {name: value.detach() for name, value in head.components(img, txt).items()}
    img_sim, txt_sim = (img.vector @ img.vector.T).detach(), (txt.vector @ txt.vector.T).detach()
    same = torch.eye(4, dtype=torch.bool).tolist()
    ref = sum(w * eq10_ref(parts[name].tolist(), img_sim.tolist(), txt_sim.tolist(), 0.2, 0.1, 0.5, "eq12", same)
              for name, w in (("vt", 0.7), ("tv", 0.7), ("intra", 0.3)))
    assert abs(float(loss) - ref) <= TOL
    # the intra-modal similarity is the set-wise cosine of the intra-modal sets (1 on the diagonal)
    assert torch.allclose(img_sim.diagonal(), torch.ones(4))


# ---- presets, config, training ---------------------------------------------------------------------------------
def test_presets_build_with_paper_hyper_parameters():
    assert set(OAN_PRESETS) <= set(list_models())
    cfg = resolve_config("oan")
    o, t = cfg.model.oan, cfg.train
    assert (cfg.model.embed_size, cfg.model.word_dim, cfg.loss.margin) == (512, 300, 0.2)
    assert (o.lambda_tt, o.lambda_vv, o.lambda_tv, o.lambda_vt) == (1.0, 1.0, 0.9, 0.5)
    assert (o.alpha_intra, o.beta, o.k_heads, o.gamma, o.negatives, o.kernels) == (0.1, 0.5, 6, 0.3, "eq12",
                                                                                   "1,2,3,5,7")
    assert (t.optimizer, t.lr, t.lr_update, t.weight_decay, t.grad_clip, t.batch_size, t.epochs) == (
        "adam", 5e-4, 15, 1e-6, 2.0, 128, 24)
    assert resolve_config("oan_eq11").model.oan.negatives == "eq11"
    for preset in OAN_PRESETS:
        cfg = resolve_config(preset, {"model": {"img_dim": 12, "vocab_size": 30}})
        model = build_model(cfg.model)
        img = model.encode_images(torch.randn(2, 4, 12))
        txt = model.encode_texts(torch.randint(4, 30, (3, 5)), torch.tensor([5, 3, 2]))
        assert model.score(img, txt).shape == (2, 3)


def test_bad_options_are_config_errors():
    base = {"model": {"img_dim": 12, "vocab_size": 30, "embed_size": 8}}
    cfg = resolve_config("oan", base, {"model": {"oan": {"intra": "none", "inter": False}}})
    with pytest.raises(ConfigError, match="no similarity"):
        build_model(cfg.model)
    for bad, match in (({"negatives": "eq13"}, "model.oan.negatives: 'eq13' is not one of eq12, eq11, none"),
                       ({"text_encoder": "gru"}, "model.oan.text_encoder: 'gru' is not one of cnn, bilstm"),
                       ({"kernels": "1,x"}, "model.oan.kernels: '1,x' is not a comma list of kernel widths")):
        with pytest.raises(ConfigError, match=match):  # the options' rules: refused before any model is built
            resolve_config("oan", base, {"model": {"oan": bad}})
    with pytest.raises(ConfigError, match="unknown config key 'model.oan.heads'"):
        resolve_config("oan", {"model": {"oan": {"heads": 3}}})


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["oan", "oan_eq11"])
def test_training_reduces_the_loss(tiny_precomp, tmp_path, preset):
    torch.set_default_dtype(torch.float32)
    layer = {"data": {"path": str(tiny_precomp)}, "loss": {"warmup_epochs": 1},
             "model": {"embed_size": 32, "word_dim": 16, "oan": {"k_heads": 2, "cnn_channels": 16}},
             "train": {"epochs": 3, "batch_size": 32, "lr": 2e-3, "val_images": 40, "log_every": 1}}
    result = train(resolve_config(preset, layer), tmp_path / "run", progress=False)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x["loss"] for x in lines if "step" in x and x["epoch"] == 1]  # hardest-negative epochs
    assert sum(steps[-5:]) < sum(steps[:5])
    assert result["best_rsum"] > 150  # chance on 40 images is 80
    ckpt = load_checkpoint(tmp_path / "run" / "best")
    metrics = evaluate_models([(ckpt.model, ckpt.vocab)], read_precomp(tiny_precomp, "test"), "full")
    assert metrics["rsum"] > 120


def test_docs_quote_the_bytes_per_cell_of_the_head_the_preset_builds():
    """docs/oan.md states the evaluator's sizing figure; it must be the one the code uses."""
    import re
    from pathlib import Path

    mc = resolve_config("oan").model
    mc.vocab_size, mc.img_dim = 20, 8
    doc = (Path(__file__).resolve().parents[3] / "docs" / "oan.md").read_text(encoding="utf-8")
    quoted = {float(x) for x in re.findall(r"bytes_per_cell = (\d+(?:\.\d+)?)", doc)}
    assert quoted == {build_model(mc).head.bytes_per_cell}
