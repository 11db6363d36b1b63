"""The training pairs' captions: each encoded by the vocabulary once per run, not once per step (the tokenizer's
regexes took ~13 ms a batch of 128, about as long as a launch-bound GPU step's launches), and a transform's
captions every time."""

from __future__ import annotations

from itmatch.data.datasets import PairDataset
from itmatch.data.precomp import read_precomp
from itmatch.data.vocab import build_vocab


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
