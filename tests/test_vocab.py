"""Vocabulary rules (DESIGN.md section 3) and SCAN vocab compatibility."""

from __future__ import annotations

from pathlib import Path

import pytest

from itmatch.data.vocab import Vocab, build_vocab, tokenize
from itmatch.errors import DataError

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def test_treebank_lowercase_tokenization():
    assert tokenize("A dog's toy, isn't it?") == ["a", "dog", "'s", "toy", ",", "is", "n't", "it", "?"]


def test_min_count_on_training_captions_and_special_ids():
    caps = ["a red ball"] * 4 + ["a blue ball"] * 3
    vocab = build_vocab(caps)
    assert vocab.idx2word[:4] == ["<pad>", "<start>", "<end>", "<unk>"]
    assert "red" in vocab.word2idx and "ball" in vocab.word2idx and "blue" not in vocab.word2idx
    assert vocab.encode("A blue ball") == [1, vocab("a"), 3, vocab("ball"), 2]


def test_save_load_round_trip(tmp_path):
    vocab = build_vocab(["x y z"] * 5)
    vocab.save(tmp_path / "v.json")
    again = Vocab.load(tmp_path / "v.json")
    assert again.idx2word == vocab.idx2word


def test_bad_vocab_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"idx2word": {"0": "<pad>",\n "1": }')
    with pytest.raises(DataError, match=r"bad.json:2"):
        Vocab.load(bad)
    bad.write_text('{"idx2word": {"0": "a", "1": "b", "2": "c", "3": "d"}}')
    with pytest.raises(DataError, match="first four"):
        Vocab.load(bad)


@pytest.mark.skipif(not (SHARED / "precomp-captions").exists(), reason="../shared/data is absent")
def test_loads_scan_vocab_json():
    vocab = Vocab.load(SHARED / "precomp-captions/vocab/f30k_precomp_vocab.json")
    assert len(vocab) == 8480 and vocab("two") == 4 and vocab("zzzzqq") == 3
