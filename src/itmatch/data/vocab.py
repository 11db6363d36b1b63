"""Word vocabulary and tokenizer, compatible with SCAN's `vocab/*_precomp_vocab.json`.

Tokenization is lower-case Penn-Treebank word tokenization (SCAN used `nltk.word_tokenize`). We use
NLTK's Treebank word tokenizer directly: it is the word step of `word_tokenize` without the Punkt
sentence splitter, whose model cannot be downloaded here; captions are single sentences, so the two agree.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from nltk.tokenize import NLTKWordTokenizer

from itmatch.errors import DataError
from itmatch.io import write_json_atomic

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS = (PAD, START, END, UNK)  # ids 0, 1, 2, 3 as in SCAN
MIN_COUNT = 4

_tokenizer = NLTKWordTokenizer()


def tokenize(caption: str) -> list[str]:
    """Lower-case Treebank tokens of one caption."""
    return _tokenizer.tokenize(caption.lower())


class Vocab:
    """word <-> index. Index 0 is padding, 1/2 wrap every caption, 3 stands for unknown words."""

    def __init__(self, words: Iterable[str] = ()) -> None:
        self.idx2word: list[str] = list(SPECIALS)
        self.word2idx: dict[str, int] = {w: i for i, w in enumerate(SPECIALS)}
        for w in words:
            self.add(w)

    def add(self, word: str) -> int:
        if word not in self.word2idx:
            self.word2idx[word] = len(self.idx2word)
            self.idx2word.append(word)
        return self.word2idx[word]

    def __len__(self) -> int:
        return len(self.idx2word)

    def __call__(self, word: str) -> int:
        return self.word2idx.get(word, self.word2idx[UNK])

    def encode(self, caption: str) -> list[int]:
        """Token ids with <start> and <end>, which SCAN treats as real time steps."""
        return [self.word2idx[START], *(self(w) for w in tokenize(caption)), self.word2idx[END]]

    def to_json(self) -> dict:
        """SCAN's on-disk format."""
        return {"word2idx": self.word2idx, "idx2word": {str(i): w for i, w in enumerate(self.idx2word)},
                "idx": len(self.idx2word)}

    def save(self, path: str | Path) -> None:
        write_json_atomic(path, self.to_json())

    @classmethod
    def from_json(cls, data: dict, path: str | Path | None = None) -> Vocab:
        try:
            idx2word = data["idx2word"]
            pairs = sorted((int(i), w) for i, w in idx2word.items())
        except (KeyError, AttributeError, ValueError, TypeError):
            raise DataError("not a vocabulary JSON (needs 'idx2word': {index: word})", path=path,
                            hint="use a file written by `itmatch` or SCAN's vocab/*_precomp_vocab.json") from None
        if [i for i, _ in pairs] != list(range(len(pairs))):
            raise DataError("vocabulary indices are not 0..N-1", path=path)
        if [w for _, w in pairs[:4]] != list(SPECIALS):
            raise DataError(f"the first four words must be {SPECIALS}, found {[w for _, w in pairs[:4]]}",
                            path=path)
        bad = next(((i, w) for i, w in pairs if not isinstance(w, str) or not w), None)
        if bad is not None:
            raise DataError(f"word {bad[0]} is {bad[1]!r}, not a non-empty string", path=path)
        words = [w for _, w in pairs]
        if len(set(words)) != len(words):
            dup = next(w for w in words if words.count(w) > 1)
            raise DataError(f"the word {dup!r} has two indices", path=path, hint="each word must appear once")
        vocab = cls()
        for _, w in pairs[4:]:
            vocab.add(w)
        return vocab

    @classmethod
    def load(cls, path: str | Path) -> Vocab:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DataError("vocabulary file not found", path=path) from None
        except IsADirectoryError:
            raise DataError("expected a vocabulary JSON file, found a directory", path=path) from None
        except json.JSONDecodeError as exc:
            raise DataError(f"invalid JSON: {exc.msg}", path=path, line=exc.lineno) from None
        except UnicodeDecodeError as exc:
            raise DataError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", path=path) from None
        except RecursionError:
            raise DataError("JSON nested too deeply", path=path) from None
        return cls.from_json(data, path)


def build_vocab(train_captions: Iterable[str], min_count: int = MIN_COUNT) -> Vocab:
    """Words seen at least `min_count` times in the *training* captions, in first-seen order."""
    counts: Counter[str] = Counter()
    for caption in train_captions:
        counts.update(tokenize(caption))
    return Vocab(w for w, c in counts.items() if c >= min_count)
