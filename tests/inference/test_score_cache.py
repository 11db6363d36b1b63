"""Resumable exhaustive scoring (inference.score_cache): an evaluation interrupted after some blocks continues
from them and ends with exactly the matrix of an uninterrupted run; other inputs never reuse them.
(The same through `itmatch evaluate --resume-dir` killed with SIGKILL: tests/test_faults.py.)"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from conftest import WORDS
from safetensors import safe_open

from itmatch.data.precomp import read_precomp
from itmatch.data.vocab import Vocab
from itmatch.engine.evaluate import encode_caption_buckets, encode_images, evaluate_models, score_matrix
from itmatch.inference.score_cache import ScoreCache
from itmatch.models.registry import build_model, preset_config

BUDGET = 2e5  # bytes: a few images per block, so the 40 x 200 test matrix has 80 blocks


class Interrupted(Exception):
    pass


def _scan(seed: int = 0):
    cfg = preset_config("scan_t2i_avg")
    cfg.model.embed_size, cfg.model.word_dim, cfg.model.img_dim, cfg.model.vocab_size = 16, 8, 32, len(WORDS) + 4
    torch.manual_seed(seed)
    return build_model(cfg.model).eval()


def _count_and_stop_after(model, calls: list[int], stop_after: int | None, delay: float = 0.0) -> None:
    """Count the head's block calls; raise (a stand-in for a kill) after `stop_after` of them; each call
    takes at least `delay` seconds."""
    score = type(model).score.__get__(model)  # the head's own method, even if wrapped before

    def counted(img, txt):
        if stop_after is not None and len(calls) == stop_after:
            raise Interrupted
        calls.append(len(img) * len(txt))
        time.sleep(delay)
        return score(img, txt)

    model.score = counted


def _blocks_on_disk(root) -> int:
    count = 0
    for part in root.glob("*/part-*.safetensors"):
        with safe_open(str(part), framework="pt") as f:
            count += len(list(f.keys()))
    return count


@pytest.fixture()
def split(tiny_precomp):
    return read_precomp(tiny_precomp, "test")


def _encoded(model, split):
    return encode_images(model, split.images), encode_caption_buckets(model, split.captions, Vocab(WORDS))


@pytest.fixture()
def inputs(split):
    model = _scan()
    return (model, *_encoded(model, split))


def test_interrupted_scoring_resumes_to_the_uninterrupted_matrix(inputs, tmp_path):
    model, img, buckets = inputs
    reference = score_matrix(model, img, buckets, budget_bytes=BUDGET)
    first, second = [], []
    _count_and_stop_after(model, first, stop_after=5)
    with pytest.raises(Interrupted):
        score_matrix(model, img, buckets, budget_bytes=BUDGET, cache=ScoreCache(tmp_path / "blocks"))
    assert _blocks_on_disk(tmp_path / "blocks") == 5  # (kept in memory, written when interrupted)
    cache = ScoreCache(tmp_path / "blocks")
    _count_and_stop_after(model, second, stop_after=None)
    resumed = score_matrix(model, img, buckets, budget_bytes=BUDGET, cache=cache)
    assert torch.equal(resumed, reference)  # bit for bit
    assert cache.resumed_blocks == 5 and cache.resumed_seconds > 0
    assert len(second) > 5 and sum(first) + sum(second) == reference.numel()  # no pair scored twice
    assert not (tmp_path / "blocks").exists()  # a complete matrix leaves nothing behind


def test_blocks_of_other_inputs_are_not_reused(inputs, split, tmp_path):
    model, img, buckets = inputs
    _count_and_stop_after(model, [], stop_after=3)
    with pytest.raises(Interrupted):
        score_matrix(model, img, buckets, budget_bytes=BUDGET, cache=ScoreCache(tmp_path))
    other = _scan(seed=1)  # another model: same shapes, other weights
    other_img, other_buckets = _encoded(other, split)
    cache = ScoreCache(tmp_path)
    with pytest.warns(UserWarning, match="unfinished scores of 1 other evaluation"):
        scores = score_matrix(other, other_img, other_buckets, BUDGET, cache=cache)
    assert cache.resumed_blocks == 0
    assert torch.equal(scores, score_matrix(other, other_img, other_buckets, BUDGET))
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 1  # the first model's blocks are left alone


def test_evaluate_reports_resumed_blocks_and_their_time(split, tmp_path):
    model, vocab = _scan(), Vocab(WORDS)
    plain = evaluate_models([(model, vocab)], split, budget_bytes=BUDGET)
    _count_and_stop_after(model, [], stop_after=4, delay=0.05)  # 4 blocks of >= 0.05 s before the "kill"
    with pytest.raises(Interrupted):
        evaluate_models([(model, vocab)], split, budget_bytes=BUDGET, resume_dir=tmp_path / "blocks")
    del model.score  # the head's own method again
    resumed = evaluate_models([(model, vocab)], split, budget_bytes=BUDGET, resume_dir=tmp_path / "blocks")
    assert resumed["resumed"]["blocks"] == 4 and resumed["resumed"]["seconds"] >= 0.2  # the first run's time
    assert resumed["eval_seconds"] >= resumed["resumed"]["seconds"]
    for key in ("image_to_text", "text_to_image", "rsum"):
        assert resumed[key] == plain[key]
    assert "resumed" not in plain


def test_blocks_are_written_in_parts_every_flush_seconds(inputs, tmp_path, monkeypatch):
    """One file per part, not per block (an MMCA test matrix has ~100k blocks); a kill loses one part."""
    import itmatch.inference.score_cache as score_cache

    model, img, buckets = inputs
    reference = score_matrix(model, img, buckets, budget_bytes=BUDGET)
    monkeypatch.setattr(score_cache, "FLUSH_SECONDS", 0.0)  # every block its own part
    _count_and_stop_after(model, [], stop_after=6)
    with pytest.raises(Interrupted):
        score_matrix(model, img, buckets, budget_bytes=BUDGET, cache=ScoreCache(tmp_path))
    assert len(list(tmp_path.glob("*/part-*.safetensors"))) == 6
    monkeypatch.setattr(score_cache, "FLUSH_SECONDS", 1e9)  # nothing written until interrupted
    _count_and_stop_after(model, [], stop_after=20)
    with pytest.raises(Interrupted):
        score_matrix(model, img, buckets, budget_bytes=BUDGET, cache=ScoreCache(tmp_path))
    assert len(list(tmp_path.glob("*/part-*.safetensors"))) == 7 and _blocks_on_disk(tmp_path) == 26
    _count_and_stop_after(model, [], stop_after=None)
    assert torch.equal(score_matrix(model, img, buckets, budget_bytes=BUDGET, cache=ScoreCache(tmp_path)), reference)


def test_a_long_scoring_without_cache_suggests_resume_dir(inputs, monkeypatch):
    import itmatch.engine.evaluate as evaluate

    model, img, buckets = inputs
    monkeypatch.setattr(evaluate, "ADVICE_AFTER_SECONDS", 0.0)
    monkeypatch.setattr(evaluate, "LONG_SCORING_SECONDS", 0.0)  # every scoring is "long"
    with pytest.warns(UserWarning, match="--resume-dir DIR") as record:
        score_matrix(model, img, buckets, budget_bytes=BUDGET)
    assert len(record) == 1  # once, not per block
    monkeypatch.setattr(evaluate, "LONG_SCORING_SECONDS", 1e9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # short: nothing said
        score_matrix(model, img, buckets, budget_bytes=BUDGET)


def test_resumed_seconds_are_the_earlier_runs_wall_time_whatever_their_ranks(tmp_path):
    """A block scored while two ranks scored side by side took half its seconds of the run's wall time; so
    blocks of a two-rank run and of a single-process run add up to the wall time of both runs."""
    from itmatch.inference.score_cache import MatrixBlocks

    cache = ScoreCache(tmp_path)
    for ranks, first in ((2, 0), (1, 4)):
        earlier = MatrixBlocks(cache, "key", ranks)
        for k in range(first, first + 4):
            earlier.save(k, torch.zeros(2, 3), seconds=1.0)
        earlier.flush()
    resumed = MatrixBlocks(cache, "key", ranks=2)
    assert all(resumed.load(k) is not None for k in range(8))
    assert cache.resumed_blocks == 8 and cache.resumed_seconds == pytest.approx(4 / 2 + 4 / 1)
