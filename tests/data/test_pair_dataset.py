"""The captions a run reads: each training pair's encoded by the vocabulary once per run, not once per step (the
tokenizer's regexes took ~13 ms a batch of 128, about as long as a launch-bound GPU step's launches), a transform's
captions every time, and the dev captions once for all the run's validations."""

from __future__ import annotations

from collections import Counter

from itmatch.data.datasets import PairDataset
from itmatch.data.precomp import read_precomp
from itmatch.data.vocab import Vocab, build_vocab
from itmatch.engine.train import train
from itmatch.models.registry import resolve_config


class CountingVocab:
    """A vocabulary that counts the captions it encodes."""

    def __init__(self, vocab) -> None:
        self.vocab, self.encoded = vocab, []

    def encode(self, caption: str) -> list[int]:
        self.encoded.append(caption)
        return self.vocab.encode(caption)


def test_each_caption_is_encoded_once_and_reads_as_the_vocabulary_encodes_it(tiny_precomp):
    split = read_precomp(tiny_precomp, "train")
    vocab = build_vocab(split.training_captions)
    counting = CountingVocab(vocab)
    dataset = PairDataset(split, counting, read_images=False)
    for epoch in range(2):
        for j in range(len(dataset)):
            _, ids, i, jj = dataset[(epoch, j)]
            assert ids == vocab.encode(split.training_captions[j]) and (i, jj) == (split.image_of(j), j)
    assert sorted(counting.encoded) == sorted(split.training_captions)  # (once each over two epochs)
    assert [len(dataset.caption_ids(j)) for j in range(3)] == [len(vocab.encode(c)) for c in dataset.captions[:3]]
    assert len(counting.encoded) == len(dataset)  # (the bucketing's lengths read the same ids)


def test_a_transforms_captions_are_encoded_each_time(tiny_precomp):
    split = read_precomp(tiny_precomp, "train")
    vocab = build_vocab(split.training_captions)
    counting = CountingVocab(vocab)
    calls = []

    def reverse(caption: str, j: int) -> str:  # (a perturbation may change with the epoch: never kept)
        calls.append(j)
        return " ".join(reversed(caption.split()))

    dataset = PairDataset(split, counting, reverse, read_images=False)
    for epoch in range(2):
        assert dataset[(epoch, 0)][1] == vocab.encode(reverse(split.training_captions[0], 0))
    assert calls == [0, 0, 0, 0] and len(counting.encoded) == 2


def test_the_validations_of_a_run_tokenize_each_dev_caption_once(tiny_precomp, tmp_path, monkeypatch):
    cfg = resolve_config("vsepp", {"model": {"embed_size": 16, "word_dim": 8}, "data": {"path": str(tiny_precomp)},
                                   "train": {"epochs": 3, "val_images": 4, "batch_size": 16, "max_batches": 2,
                                             "threads": 1}})
    training = set(read_precomp(tiny_precomp, "train").training_captions)
    dev = [c for c in read_precomp(tiny_precomp, "dev").head(4).captions if c not in training]
    tokenized: Counter[str] = Counter()
    words = Vocab.words
    monkeypatch.setattr(Vocab, "words", lambda self, text: tokenized.update([text]) or words(self, text))
    train(cfg, tmp_path / "run", progress=False)
    log = [line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if "val_rsum" in line]
    assert len(log) == 3 and dev
    assert {c: tokenized[c] for c in dev} == {c: 2 for c in dev}  # its ids and its unknown words, in the first epoch
