"""Word vocabulary and tokenizer, compatible with SCAN's `vocab/*_precomp_vocab.json`, and the WordPiece
tokenizer of a pretrained transformer (MMCA). Both offer `encode(caption) -> ids`, `len()`, `save`, `load`,
and `coverage(text)`, which says which words were read as unknown so that they are reported, never dropped
silently. Tokenization and unknown words: docs/data.md, 'Tokenization'; docs/search.md, 'Unknown words'.
"""

from __future__ import annotations

import functools
import json
import unicodedata
import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from itmatch.config import MIN_WORD_COUNT
from itmatch.errors import ConfigError, DataError
from itmatch.io import write_json_atomic

if TYPE_CHECKING:
    from nltk.tokenize import NLTKWordTokenizer

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS = (PAD, START, END, UNK)  # ids 0, 1, 2, 3 as in SCAN

@functools.cache
def _word_tokenizer() -> NLTKWordTokenizer:
    # (imported at the first caption: the nltk package takes seconds to import, most of `import itmatch`'s time)
    from nltk.tokenize import NLTKWordTokenizer

    return NLTKWordTokenizer()


# The typographic quotes and dashes a phone or a word processor types where the benchmarks' captions have ASCII ones
# ("doesn’t", "a man’s hat", "t–shirt"): read as those, they tokenize as the training captions did ("does", "n't").
TYPOGRAPHIC = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'",
                             "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u2013": "-", "\u2014": "-"})


def normalize_text(caption: str) -> str:
    """A caption read in Unicode's compatibility form (NFKC: full-width letters, ligatures) with typographic quotes
    and dashes as ASCII ones (TYPOGRAPHIC), case kept: what the tokenizer splits."""
    return unicodedata.normalize("NFKC", caption).translate(TYPOGRAPHIC)


def tokenize(caption: str) -> list[str]:
    """Lower-case Treebank tokens of one caption (normalize_text first). Flickr8K's captions are ASCII, so they
    tokenize as before the normalisation. A new list each call (the cached tokens are a tuple)."""
    return list(_tokens(caption))


# A training run tokenizes each training caption twice, to count its words (build_vocab) and to encode it
# (PairDataset): ~3-4 s a pass over Flickr8K's 30,000 captions on one core. The second pass reads this cache. Bounded,
# so that a server tokenizing its users' queries keeps at most 2^16 of them.
@functools.lru_cache(maxsize=1 << 16)
def _tokens(caption: str) -> tuple[str, ...]:
    return tuple(_word_tokenizer().tokenize(normalize_text(caption).lower()))


def is_word(token: str) -> bool:
    """A token that carries meaning: it has a letter or a digit (not only punctuation or symbols)."""
    return any(ch.isalnum() for ch in token)


@dataclass(frozen=True)
class WordCoverage:
    """How a vocabulary reads one text: its words as the tokenizer splits them, and for each whether the
    vocabulary knows it (False: read as `<unk>` / `[UNK]`, its meaning lost)."""

    words: tuple[str, ...]
    known: tuple[bool, ...]

    @property
    def unknown(self) -> list[str]:
        """The words read as unknown, in order (repeats kept)."""
        return [w for w, k in zip(self.words, self.known, strict=True) if not k]

    @property
    def has_known_word(self) -> bool:
        """Whether any word with a letter or digit is known: a text without one carries nothing the
        model can match (a known full stop alone does not count)."""
        return any(k and is_word(w) for w, k in zip(self.words, self.known, strict=True))


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

    def words(self, text: str) -> list[str]:
        """`tokenize(text)`, with a full stop the Treebank tokenizer leaves on a word inside a text taken off when the
        vocabulary knows the word without it and not with it: "a black dog. a white cat" reads "dog", "." (it splits
        sentences only with a sentence splitter, and "dog." is <unk>), while "st." or "u.s." stay as they are."""
        words: list[str] = []
        for word in tokenize(text):
            if len(word) > 1 and word.endswith(".") and word not in self.word2idx and word[:-1] in self.word2idx:
                words += [word[:-1], "."]
            else:
                words.append(word)
        return words

    def encode(self, caption: str) -> list[int]:
        """Token ids with <start> and <end>, which SCAN treats as real time steps."""
        return [self.word2idx[START], *(self(w) for w in self.words(caption)), self.word2idx[END]]

    def coverage(self, text: str) -> WordCoverage:
        """The text's tokens and which of them the vocabulary knows (the others are encoded as <unk>)."""
        words = self.words(text)
        return WordCoverage(tuple(words), tuple(w in self.word2idx for w in words))

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
        return cls.from_json(_read_json(path), path)


def build_vocab(train_captions: Iterable[str], min_count: int = MIN_WORD_COUNT) -> Vocab:
    """Words seen at least `min_count` times in the *training* captions, in first-seen order."""
    counts: Counter[str] = Counter()
    for caption in train_captions:
        counts.update(tokenize(caption))
    return Vocab(w for w, c in counts.items() if c >= min_count)


TOKENIZERS = ("word", "wordpiece")


class WordPieceVocab:
    """The WordPiece tokenizer of a pretrained BERT-like model: `[CLS] pieces [SEP]` ids, the ids the
    model was trained with. The whole tokenizer (the `tokenizers` library's JSON) is stored in vocab.json,
    so a checkpoint tokenizes exactly as at training time without the model directory.

    Captions longer than `max_length` tokens are cut to `max_length - 1` tokens plus `[SEP]` (not an
    error); `truncated` counts them (the trainer logs the count per epoch) and the first one warns."""

    kind = "wordpiece"

    def __init__(self, tokenizer_json: str, max_length: int, source: str = "") -> None:
        from tokenizers import Tokenizer

        self._json, self.max_length, self.source = tokenizer_json, int(max_length), source
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        # tokenizer.json files often carry fixed padding/truncation (e.g. 128): padding is the collate's
        # job and truncation is ours (counted), so both are switched off.
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        if self.max_length < 3:
            raise ConfigError(f"WordPiece max_length must be >= 3 ([CLS] word [SEP]), got {self.max_length}")
        self.sep_id = self.tokenizer.token_to_id("[SEP]")
        self.pad_id = self.tokenizer.token_to_id("[PAD]")
        self.unk_id = self.tokenizer.token_to_id("[UNK]")
        if self.sep_id is None or self.pad_id is None:
            raise ConfigError("the tokenizer has no [SEP] or [PAD] token: not a BERT-style WordPiece tokenizer",
                              path=source or None)
        self.truncated = 0

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, max_length: int = 0) -> WordPieceVocab:
        """The tokenizer of a Hugging Face model directory; max_length 0: the model's position limit."""
        from itmatch.features.text_backbone import load_pretrained_tokenizer

        tokenizer_json, model_max = load_pretrained_tokenizer(model_dir)
        if max_length > model_max:  # (the encoder has no position beyond: a longer caption crashed it)
            raise ConfigError(f"model.mmca.max_tokens={max_length} exceeds the {model_max} positions of the text "
                              f"encoder {model_dir}", hint=f"set model.mmca.max_tokens to at most {model_max} (0: all)")
        return cls(tokenizer_json, max_length or model_max, source=str(model_dir))

    def __len__(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, caption: str) -> list[int]:
        ids = self.tokenizer.encode(caption).ids
        if len(ids) > self.max_length:
            if self.truncated == 0:
                warnings.warn(f"a caption has {len(ids)} WordPiece tokens, more than the text encoder's "
                              f"{self.max_length}; it is truncated (further ones are counted, not shown)",
                              stacklevel=2)
            self.truncated += 1
            ids = [*ids[: self.max_length - 1], self.sep_id]
        return ids

    def coverage(self, text: str) -> WordCoverage:
        """The text's words as the tokenizer's pre-tokenizer splits them (original spelling) and which of
        them have pieces: a word is unknown when it is read as [UNK], not when it is spelled in pieces."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        spans: dict[int, list[int]] = {}  # word index -> [start, end, unknown?] in the original text
        for word, (start, end), piece in zip(encoding.word_ids, encoding.offsets, encoding.ids, strict=True):
            if word is None:
                continue
            span = spans.setdefault(word, [start, end, 0])
            span[0], span[1] = min(span[0], start), max(span[1], end)
            span[2] |= piece == self.unk_id
        ordered = [spans[w] for w in sorted(spans)]
        return WordCoverage(tuple(text[a:b] for a, b, _ in ordered), tuple(not unk for _, _, unk in ordered))

    def to_json(self) -> dict:
        return {"type": self.kind, "max_length": self.max_length, "source": self.source,
                "tokenizer": json.loads(self._json)}

    def save(self, path: str | Path) -> None:
        write_json_atomic(path, self.to_json())

    @classmethod
    def from_json(cls, data: dict, path: str | Path | None = None) -> WordPieceVocab:
        if data.get("type") != cls.kind or "tokenizer" not in data:
            raise DataError("not a WordPiece vocabulary JSON (needs 'type': 'wordpiece' and 'tokenizer')",
                            path=path, hint="use a vocab.json written by `itmatch train` with data.tokenizer=wordpiece")
        try:
            return cls(json.dumps(data["tokenizer"]), int(data.get("max_length", 512)), data.get("source", ""))
        except Exception as exc:  # the tokenizers library rejects a malformed tokenizer
            if isinstance(exc, ConfigError | DataError):
                raise
            raise DataError(f"invalid WordPiece tokenizer ({exc})", path=path) from None

    @classmethod
    def load(cls, path: str | Path) -> WordPieceVocab:
        return cls.from_json(_read_json(path), path)


class RememberedVocab:
    """A vocabulary that reads each text once: `encode` and `coverage` of a text it has read before are what they were
    then, looked up, not tokenized again; everything else is the vocabulary's own. The trainer validates on the same
    dev captions every epoch, and tokenizing their 5000 twice (the ids, then the unknown-word report) made a VSE++
    validation 1.17 s against 0.18 s remembered (`python bench/trainer_host.py`, one CPU core). Only for a fixed set
    of texts: it keeps all it has read."""

    def __init__(self, vocab: Vocab | WordPieceVocab) -> None:
        self.vocab = vocab
        self._ids: dict[str, list[int]] = {}
        self._coverage: dict[str, WordCoverage] = {}

    def encode(self, caption: str) -> list[int]:
        """The vocabulary's ids of `caption` (the same list each time: not to be changed by the caller)."""
        ids = self._ids.get(caption)
        if ids is None:
            ids = self._ids[caption] = self.vocab.encode(caption)
        return ids

    def coverage(self, text: str) -> WordCoverage:
        cov = self._coverage.get(text)
        if cov is None:
            cov = self._coverage[text] = self.vocab.coverage(text)
        return cov

    def __len__(self) -> int:
        return len(self.vocab)

    def __getattr__(self, name: str):  # (only for what is not defined here: the vocabulary's own attributes)
        if name == "vocab":  # (not set yet: an instance copy() or pickle is making; not the vocabulary's to answer)
            raise AttributeError(name)
        return getattr(self.vocab, name)


AnyVocab = Vocab | WordPieceVocab | RememberedVocab

TOP_UNKNOWN = 10  # most frequent unknown words an evaluation lists


def unknown_word_report(vocab: AnyVocab, captions: Iterable[str], top: int = TOP_UNKNOWN) -> dict:
    """What a vocabulary does not know in a set of captions: word counts, the unknown ones (read as
    <unk>/[UNK]), captions left without a known word, and the `top` most frequent unknown words."""
    unknown: Counter[str] = Counter()
    words = without_known = 0
    for caption in captions:
        cov = vocab.coverage(caption)
        words += len(cov.words)
        unknown.update(cov.unknown)
        without_known += not cov.has_known_word
    count = sum(unknown.values())
    return {"words": words, "unknown": count, "unknown_percent": round(100 * count / max(1, words), 3),
            "distinct_unknown": len(unknown), "captions_without_known_word": without_known,
            "top_unknown": [[w, c] for w, c in unknown.most_common(top)]}


def _read_json(path: str | Path) -> dict:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
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


def load_vocab(path: str | Path, tokenizer: str = "word") -> AnyVocab:
    """Read a vocab.json of the kind `tokenizer` names (data.tokenizer: word | wordpiece)."""
    if tokenizer not in TOKENIZERS:
        raise ConfigError(f"unknown data.tokenizer {tokenizer!r}", hint=f"choose one of {', '.join(TOKENIZERS)}")
    data = _read_json(path)
    kind = data.get("type", "word") if isinstance(data, dict) else "word"
    if kind != tokenizer:
        raise DataError(f"the vocabulary is a {kind!r} tokenizer but data.tokenizer is {tokenizer!r}", path=path,
                        hint="pass the vocab.json written with the same data.tokenizer")
    return WordPieceVocab.from_json(data, path) if tokenizer == "wordpiece" else Vocab.from_json(data, path)
