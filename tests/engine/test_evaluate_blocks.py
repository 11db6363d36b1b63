"""The blocked evaluator equals one-shot scoring for every preset's head and any block shape; bad budgets
and empty inputs are clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_preset_model

from itmatch import inference
from itmatch.data.vocab import Vocab
from itmatch.engine.evaluate import (
    bucket_texts,
    encode_caption_buckets,
    encode_captions,
    encode_images,
    images_per_block,
    item_bytes,
    score_blocks,
    score_matrix,
    score_pairs,
    unbucket_texts,
)
from itmatch.errors import ConfigError, DataError
from itmatch.inference import GPU_BLOCK_CELLS, MAX_BLOCK_CELLS, default_block_cells
from itmatch.models.base import ImageEmb
from itmatch.models.registry import PRESETS

WORDS = ["a", "the", "dog", "cat", "runs", "sits", "on", "grass", "red", "ball", "man",
         "woman", "with", "near", "water"]
N_IMG, K, IMG_DIM = 11, 4, 12  # 4 regions: also a 2x2 grid (SAVE, SMAN)


def tiny_model(preset: str):
    return tiny_preset_model(preset, K, IMG_DIM)[1]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((N_IMG, K, IMG_DIM)).astype(np.float32)
    lengths = rng.integers(1, 9, size=23)  # caption lengths 1..8 words (+ <start>/<end>)
    captions = [" ".join(rng.choice(WORDS, int(n))) for n in lengths]
    return feats, captions, Vocab(WORDS)


@pytest.mark.parametrize("preset", sorted(p for p in PRESETS if not p.endswith("_coco")))
def test_blocked_equals_one_shot_for_every_head(preset, data):
    feats, captions, vocab = data
    model = tiny_model(preset)
    img = encode_images(model, feats)
    txt = encode_captions(model, captions, vocab)
    with torch.inference_mode():
        one_shot = model.score(img, txt).float()
    assert one_shot.shape == (N_IMG, len(captions))
    assert one_shot.std() > 1e-3  # a meaningful comparison, not all scores alike
    max_len = int(txt.lengths.max())
    # blocks of 1 image, 3 images (does not divide 11), everything; caption buckets of 1, 4, 7, all
    for captions_per_block in (1, 4, 7, len(captions)):
        for rows in (1, 3, N_IMG):
            blocked = score_matrix(model, img, txt, budget_bytes=2**30, captions_per_block=captions_per_block,
                                   max_cells=rows * K * captions_per_block * max_len)
            assert (blocked - one_shot).abs().max() <= 1e-5, (captions_per_block, rows)
    # the evaluator's own path: captions encoded straight into length buckets
    buckets = encode_caption_buckets(model, captions, vocab, bucket_size=5)
    assert (score_matrix(model, img, buckets) - one_shot).abs().max() <= 1e-5
    if model.head.pair_independent:  # its score reads the vectors alone (all a search keeps of photos and captions)
        with torch.inference_mode():
            assert torch.equal(model.score(img.vectors_only(), txt.vectors_only()), model.score(img, txt))


@pytest.mark.parametrize("preset", sorted(p for p in PRESETS if not p.endswith("_coco")))
def test_listed_pairs_equal_the_exhaustive_scores_for_every_head(preset, data):
    """score_pairs (the re-ranking engine) gives the all-pairs scores on any list of pairs: repeated
    images and captions, captions of different lengths, blocks of a size that does not divide the list."""
    feats, captions, vocab = data
    model = tiny_model(preset)
    img, txt = encode_images(model, feats), encode_captions(model, captions, vocab)
    with torch.inference_mode():
        one_shot = model.score(img, txt).float()
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, N_IMG, (97,), generator=g)
    captions_idx = torch.randint(0, len(captions), (97,), generator=g)
    assert len(set(txt.lengths[captions_idx].tolist())) >= 5  # several caption lengths in the list
    expected = one_shot[images, captions_idx]
    max_len = int(txt.lengths.max())
    for per_block in (1, 3, 1000):  # captions per block at the longest length: 1, 3 (divides nothing), all
        got = score_pairs(model, img, txt, images, captions_idx, max_cells=per_block * K * max_len)
        assert got.shape == (97,) and (got - expected).abs().max() <= 1e-5, per_block
    # every pair of the gallery, in a shuffled order, is the whole matrix
    grid = torch.randperm(N_IMG * len(captions), generator=g)
    every = score_pairs(model, img, txt, grid // len(captions), grid % len(captions))
    assert (every - one_shot.flatten()[grid]).abs().max() <= 1e-5


@pytest.mark.parametrize("preset", ["vsepp", "mmca_alpha0", "scan_t2i_avg"])
def test_captions_kept_in_their_scoring_form_are_scored_as_they_are(preset, data):
    """A caption collection searched by photo is kept as `scoring_form` makes it: a pair-independent head's one
    product takes the captions' vectors alone (before, each call bucketed the TextEmb and merged the buckets back: ~1
    s a photo over 5000 captions; and it kept their word embeddings), a pair head's blocks take length buckets made
    once; either gives the one-shot scores."""
    feats, captions, vocab = data
    model = tiny_model(preset)
    img, txt = encode_images(model, feats), encode_captions(model, captions, vocab)
    with torch.inference_mode():
        one_shot = model.score(img, txt).float()
    kept = inference.scoring_form(model, txt)
    if model.head.pair_independent:  # the vectors alone: no word embeddings kept
        assert kept.words.numel() == 0 and torch.equal(kept.vector, txt.vector) and torch.equal(kept.lengths,
                                                                                               txt.lengths)
        assert inference.scoring_form(model, kept) is kept
        (_, _, block_txt), = score_blocks(model, img, txt)
        assert block_txt is txt
    else:
        assert sorted(int(j) for columns, _ in kept for j in columns) == list(range(len(captions)))
        assert inference.scoring_form(model, kept) is kept  # (buckets stay as they are)
    assert (score_matrix(model, img, kept) - one_shot).abs().max() <= 1e-5


def test_listed_pairs_bad_input_and_budget(data):
    feats, captions, vocab = data
    model = tiny_model("scan_t2i_avg")
    img, txt = encode_images(model, feats), encode_captions(model, captions, vocab)
    assert score_pairs(model, img, txt, torch.zeros(0), torch.zeros(0)).shape == (0,)
    with pytest.raises(ConfigError, match="one of each"):
        score_pairs(model, img, txt, torch.tensor([0, 1]), torch.tensor([0]))
    with pytest.raises(ConfigError, match="out of range"):
        score_pairs(model, img, txt, torch.tensor([N_IMG]), torch.tensor([0]))
    longest = int(txt.lengths.max())
    minimum = 4 * 3 + model.head.bytes_per_cell * K * longest + item_bytes(txt.narrowed(longest))
    pairs = torch.tensor([0, 1, 2]), torch.argsort(txt.lengths)[-3:]
    score_pairs(model, img, txt, *pairs, budget_bytes=minimum)  # exactly the minimum works: 1 caption per block
    with pytest.raises(ConfigError, match="too small") as err:
        score_pairs(model, img, txt, *pairs, budget_bytes=minimum - 1)
    assert "--budget-gb" in str(err.value)


def test_take_gathers_and_trims_like_indexing(data):
    feats, captions, vocab = data
    model = tiny_model("scan_i2t_avg")  # word Gram matrices in extras: two word axes to trim
    txt = encode_captions(model, captions, vocab)
    index = torch.argsort(txt.lengths)[:6]  # the shortest captions: trimming cuts columns
    taken, reference = txt.take_trimmed(index), txt.take(index).trimmed()
    assert taken.words.shape[1] == int(txt.lengths[index].max()) < txt.words.shape[1]
    assert torch.equal(taken.words, txt.words[index][:, :taken.words.shape[1]])
    assert torch.equal(taken.words, reference.words) and torch.equal(taken.lengths, reference.lengths)
    assert torch.equal(taken.extras["gram"], reference.extras["gram"])
    mask = torch.zeros(len(txt), dtype=torch.bool)
    mask[index] = True  # a bool mask still selects (advanced indexing)
    assert torch.equal(txt.take(mask).lengths, txt.lengths[mask])


def test_rows_follow_the_budget_and_blocks_do_not_divide(data):
    feats, captions, vocab = data
    model = tiny_model("scan_t2i_avg")
    img = encode_images(model, feats)
    buckets = bucket_texts(encode_captions(model, captions, vocab), 6)
    per_image = [model.head.bytes_per_cell * K * len(t) * t.words.shape[1] for _, t in buckets]
    out_bytes = 4 * N_IMG * len(captions)
    budget = out_bytes + 3.5 * max(per_image)
    rows = images_per_block(model, img, buckets, budget, max_cells=10**9)
    assert rows[int(np.argmax(per_image))] == 3  # 3 images fit the largest bucket, 11 = 3 + 3 + 3 + 2
    assert all(r * b <= budget - out_bytes for r, b in zip(rows, per_image, strict=True))
    one_shot = model.score(img, unbucket_texts(buckets))
    blocked = score_matrix(model, img, buckets, budget_bytes=budget, max_cells=10**9)
    assert (blocked - one_shot).abs().max() <= 1e-5


@pytest.mark.parametrize("preset", ["scan_t2i_avg", "sman", "mmca"])
def test_a_bucket_too_large_for_the_budget_is_cut_into_runs_of_captions(preset, data):
    """One image x a whole bucket over the budget (MMCA's per-pair transformer on a bucket of 1024 captions
    at the default 4 GB): the bucket is scored in runs of captions, same numbers."""
    feats, captions, vocab = data
    model = tiny_model(preset)
    img = encode_images(model, feats)
    buckets = bucket_texts(encode_captions(model, captions, vocab), len(captions))  # one bucket
    one_shot = score_matrix(model, img, buckets, budget_bytes=2**30)
    (_, txt), = buckets
    per_caption = model.head.bytes_per_cell * K * txt.words.shape[1] + model.head.bytes_per_pair
    budget = 4 * N_IMG * len(captions) + 3.5 * per_caption  # 3 captions of the longest length per block
    with pytest.raises(ConfigError):
        images_per_block(model, img, buckets, budget)  # the whole bucket does not fit one image
    blocked = score_matrix(model, img, buckets, budget_bytes=budget, max_cells=10**9)
    assert (blocked - one_shot).abs().max() <= 1e-5


def test_budget_too_small_states_the_minimum(data):
    feats, captions, vocab = data
    model = tiny_model("scan_i2t_lse")
    img = encode_images(model, feats)
    buckets = bucket_texts(encode_captions(model, captions, vocab), 8)
    # one image x one caption of the longest bucket (a bucket that does not fit is cut into runs of captions)
    minimum = 4 * N_IMG * len(captions) + max(model.head.bytes_per_cell * K * t.words.shape[1] for _, t in buckets)
    score_matrix(model, img, buckets, budget_bytes=minimum)  # exactly the minimum works
    assert 2**10 < minimum < 2**20  # (so the message gives it in KB, not as "0.0 MB")
    with pytest.raises(ConfigError, match=rf"too small: the minimum .* is {minimum / 2**10:.1f} KB") as err:
        score_matrix(model, img, buckets, budget_bytes=minimum - 1)
    assert f"at least {minimum / 2**30:.3g} GB (--budget-gb)" in str(err.value)
    # a pair-independent head still needs room for the score matrix
    vsepp = tiny_model("vsepp")
    with pytest.raises(ConfigError, match="score matrix"):
        score_matrix(vsepp, encode_images(vsepp, feats), encode_captions(vsepp, captions, vocab), budget_bytes=100)


def test_empty_gallery_or_query_set_is_a_data_error(data):
    feats, captions, vocab = data
    model = tiny_model("scan_t2i_avg")
    with pytest.raises(DataError, match="gallery is empty"):
        encode_images(model, feats[:0])
    with pytest.raises(DataError, match="query set is empty"):
        encode_captions(model, [], vocab)
    empty = ImageEmb(regions=torch.zeros(0, K, 16), mask=torch.zeros(0, K, dtype=torch.bool))
    with pytest.raises(DataError, match="gallery is empty"):
        score_matrix(model, empty, encode_captions(model, captions, vocab))


def test_encoders_zero_the_padding(data):
    """Heads rely on zero padded words / masked regions (s = 0 there without a mask pass)."""
    feats, captions, vocab = data
    model = tiny_model("scan_i2t_avg")
    txt = encode_captions(model, captions, vocab)
    assert (txt.mask.sum() < txt.mask.numel()) and txt.words[~txt.mask].abs().max() == 0
    mask = torch.ones(2, K, dtype=torch.bool)
    mask[0, 3:] = False
    img = model.encode_images(torch.from_numpy(feats[:2]), mask)
    assert img.regions[~mask].abs().max() == 0


def test_a_heads_block_cap_bounds_every_block_and_changes_no_score(data):
    """MMCA caps its blocks (max_block_cells) so a block's activations stay in the cache; the evaluator
    cuts caption buckets into runs and image rows to honour it, and the scores are the head's own."""
    feats, captions, vocab = data
    model = tiny_model("mmca")
    img = encode_images(model, feats)
    buckets = encode_caption_buckets(model, captions, vocab, bucket_size=8)
    model.head.max_block_cells = 0  # the evaluator's default cap only
    uncapped, uncapped_blocks = score_matrix(model, img, buckets), score_blocks(model, img, buckets)
    cap = K * 2 * 10  # 1 image x 2 captions of 10 tokens: cuts buckets into runs, one image per block
    model.head.max_block_cells = cap
    blocks = score_blocks(model, img, buckets)
    assert len(blocks) > len(uncapped_blocks)
    for rows, _, txt in blocks:
        cells = (rows.stop - rows.start) * K * len(txt) * txt.words.shape[1]
        assert cells <= cap or (rows.stop - rows.start == 1 and len(txt) == 1), (rows, len(txt))
    assert (score_matrix(model, img, buckets) - uncapped).abs().max() <= 1e-5


def test_the_cell_cap_follows_the_device_and_never_changes_the_scores(data):
    """score_matrix's cap on a block's region-word cells is its model's device's (default_block_cells): the
    cache-sized MAX_BLOCK_CELLS on a CPU, the larger GPU_BLOCK_CELLS on a GPU (docs/gpu.md, "Block size on a GPU").
    Any cap gives the same scores, so the change of plan between devices is only one of speed."""
    feats, captions, vocab = data
    model = tiny_model("scan_t2i_avg")
    img = encode_images(model, feats)
    buckets = bucket_texts(encode_captions(model, captions, vocab), 6)
    assert default_block_cells(torch.device("cpu")) == MAX_BLOCK_CELLS
    assert default_block_cells(torch.device("cuda", 0)) == GPU_BLOCK_CELLS > MAX_BLOCK_CELLS

    def scored(max_cells: int | None) -> tuple[torch.Tensor, int]:
        blocks: list[int] = []
        return inference.score_matrix(model, img, buckets, max_cells=max_cells, on_block=blocks.append), len(blocks)

    default, n_default = scored(None)
    cpu_cap, n_cpu_cap = scored(MAX_BLOCK_CELLS)
    one_pair, n_one_pair = scored(1)  # a block of one image x one caption: the smallest a cap allows
    assert n_default == n_cpu_cap == len(buckets) and n_one_pair == N_IMG * len(captions)
    assert torch.equal(default, cpu_cap)
    assert (one_pair - default).abs().max() <= 1e-5
