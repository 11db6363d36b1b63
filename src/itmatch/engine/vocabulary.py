"""A new run's vocabulary: which one it reads its captions with (built from the training captions, a file, or the
model's WordPiece tokenizer), what it says about it when the run starts, and pretrained word vectors copied into
the text encoder's embedding of it (SMAN, model.word_vectors)."""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from itmatch.config import Config, DataConfig
from itmatch.data.vocab import SPECIALS, TOKENIZERS, AnyVocab, Vocab, build_vocab, load_vocab, unknown_word_report
from itmatch.engine.evaluate import format_unknown_words
from itmatch.errors import ConfigError
from itmatch.models.registry import arch

log = logging.getLogger("itmatch.train")


def make_vocab(cfg: Config, train_captions: list[str]) -> AnyVocab:
    """The tokenizer data.tokenizer names: a word vocabulary (data.vocab, or built from the training
    captions) or the WordPiece tokenizer the model brings (`Arch.tokenizer`: MMCA's frozen text encoder's)."""
    if cfg.data.tokenizer not in TOKENIZERS:
        raise ConfigError(f"unknown data.tokenizer {cfg.data.tokenizer!r}",
                          hint=f"choose one of {', '.join(TOKENIZERS)}")
    if cfg.data.vocab:
        return load_vocab(cfg.data.vocab, cfg.data.tokenizer)
    if cfg.data.tokenizer == "wordpiece":
        own = arch(cfg.model).tokenizer(cfg.model)
        if own is None:
            raise ConfigError(f"data.tokenizer=wordpiece: the {cfg.model.arch} model brings no WordPiece tokenizer",
                              hint="set data.tokenizer=word (a vocabulary built from the training captions)")
        return own
    return build_vocab(train_captions, cfg.data.min_word_count)


def builds_vocab(cfg: Config) -> bool:
    """Whether a new run builds its vocabulary from the training captions (data.min_word_count applies)."""
    return not (cfg.train.init_from or cfg.data.vocab or cfg.data.tokenizer == "wordpiece")


def vocabulary_source(cfg: Config) -> str:
    """Where a new run's vocabulary comes from, for its log and errors."""
    if cfg.train.init_from:  # (a run started from another's weights keeps that run's vocabulary)
        return f"train.init_from's ({cfg.train.init_from})"
    if cfg.data.vocab:
        return f"data.vocab ({cfg.data.vocab})"
    if cfg.data.tokenizer == "wordpiece":
        return "the model's WordPiece tokenizer (data.tokenizer=wordpiece)"
    times = "once" if cfg.data.min_word_count == 1 else f"{cfg.data.min_word_count} times"
    return f"the training captions' words seen at least {times} (data.min_word_count)"


def take_init_vocabulary(cfg: Config, init_vocab: AnyVocab) -> None:
    """A run started from another's weights (train.init_from) keeps that run's vocabulary, its word embedding rows:
    data.vocab beside it would be ignored unsaid, so it is refused, and data.tokenizer becomes that vocabulary's
    kind (a run of `--set model.arch=mmca`, whose default is `word`, from an MMCA checkpoint's WordPiece trained, and
    then every checkpoint it saved was refused: "the vocabulary is a 'wordpiece' tokenizer but data.tokenizer is
    'word'")."""
    if cfg.data.vocab:
        raise ConfigError(f"data.vocab={cfg.data.vocab} has no effect: the run keeps the vocabulary of "
                          f"train.init_from ({cfg.train.init_from}), whose word embedding rows it starts from",
                          hint="drop data.vocab (or train.init_from, to train from scratch with that vocabulary)")
    kind = "word" if isinstance(init_vocab, Vocab) else "wordpiece"
    if cfg.data.tokenizer != kind:
        log.info("data.tokenizer=%s: the vocabulary of train.init_from (%s) is %s", kind, cfg.train.init_from, kind)
        cfg.data.tokenizer = kind


def check_min_word_count(cfg: Config) -> None:
    """data.min_word_count set where no vocabulary is built from the training captions would do nothing: said."""
    if not builds_vocab(cfg) and cfg.data.min_word_count != DataConfig.min_word_count:
        raise ConfigError(f"data.min_word_count={cfg.data.min_word_count} has no effect: the vocabulary is "
                          f"{vocabulary_source(cfg)}", hint="drop data.min_word_count: it applies to a vocabulary "
                          "built from the training captions (no data.vocab, train.init_from or WordPiece tokenizer)")


#: training captions read for the vocabulary's coverage when a run starts: beyond it an even sample (the share of
#: unknown words to a few tenths of a percent in ~2 s, where tokenising all of Flickr8K's 30,000 takes ~15 s)
COVERAGE_CAPTIONS = 5000
#: a share of unknown training words (%) above which a run suggests a lower data.min_word_count (Flickr8K's at
#: SCAN's 4: 1.9 %)
UNKNOWN_WARNING = 5.0


def report_vocabulary(cfg: Config, vocab: AnyVocab, captions: list[str], progress: bool) -> dict[str, Any]:
    """Say a new run's vocabulary: its size, where it comes from, and the training caption words it reads as
    unknown (`unknown_word_report`, on an even sample of COVERAGE_CAPTIONS captions beyond that many), with a
    warning suggesting a lower data.min_word_count when a built vocabulary leaves out over UNKNOWN_WARNING % of
    them. Returns the record for the run's log. (Before, evaluation said it, after the training.)"""
    step = max(1, math.ceil(len(captions) / COVERAGE_CAPTIONS))
    report = unknown_word_report(vocab, captions[::step])
    source = vocabulary_source(cfg)
    size = (f"{len(vocab) - len(SPECIALS):,} words (+ {len(SPECIALS)} special tokens)" if isinstance(vocab, Vocab)
            else f"{len(vocab):,} tokens")
    read = f"1 in {step} of the {len(captions):,} training captions" if step > 1 else "training captions"
    text = f"vocabulary: {size}, {source}\n{format_unknown_words(report, f'{read}: ')}"
    log.info(text)
    if progress:  # (where the epoch lines go; the CLI configures no logging handler)
        tqdm.write(text)
    # (N = 1 is not offered: no training word is then read as <unk>, so its embedding never trains, and every word
    # a query has that the captions lack reads as that untrained vector)
    if builds_vocab(cfg) and report["unknown_percent"] > UNKNOWN_WARNING and cfg.data.min_word_count > 2:
        log.warning("%.1f%% of the training captions' words are read as unknown by a vocabulary of the words seen at "
                     "least %d times (SCAN's threshold, for 30,000+ captions): a small dataset keeps more of its words "
                     "with --set data.min_word_count=N, 2 <= N < %d (at 1 the <unk> embedding never trains)",
                     report["unknown_percent"], cfg.data.min_word_count, cfg.data.min_word_count)
    return {"vocabulary": {"size": len(vocab), "source": source, "captions": len(captions),
                           "captions_read": len(captions[::step]), **report}}


def apply_word_vectors(model: torch.nn.Module, vocab: Vocab, source: str,
                       scale: str = "raw") -> dict[str, int | float]:
    """Copy pretrained vectors (`model.word_vectors`) into the text encoder's word embedding. Words
    without a vector keep the random initialisation; their count is logged (the four special tokens
    are not counted). `scale="init"` multiplies the vectors by the one factor that gives them the
    per-coordinate std of the random init (`model.word_vectors_scale`; directions are kept). Returns
    {"found": ..., "missing": ..., "scale": the factor applied}."""
    from itmatch.data.word_vectors import load_word_vectors

    embed = getattr(model.text_encoder, "embed", None)
    if not isinstance(embed, torch.nn.Embedding):
        raise ConfigError("model.word_vectors is set but this model's text encoder has no word embedding",
                          hint="unset model.word_vectors")
    table, found = load_word_vectors(source, vocab.idx2word)
    if table.shape[1] != embed.embedding_dim:
        raise ConfigError(f"model.word_vectors {source!r} are {table.shape[1]}-d but model.word_dim is "
                          f"{embed.embedding_dim}", hint=f"set model.word_dim={table.shape[1]}")
    vectors = torch.from_numpy(table[found]).to(embed.weight.dtype)
    factor = 1.0
    if scale == "init" and len(vectors) > 1:
        factor = float(embed.weight.detach().std() / vectors.std())
    with torch.no_grad():
        embed.weight[torch.from_numpy(np.flatnonzero(found))] = vectors * factor
    real = np.array([w not in SPECIALS for w in vocab.idx2word])
    counts = {"found": int((found & real).sum()), "missing": int((~found & real).sum()), "scale": factor}
    log.log(logging.WARNING if counts["missing"] else logging.INFO,
            "word vectors %s: %d of %d vocabulary words found, %d missing (kept their random init); scaled by %.4g",
            source, counts["found"], int(real.sum()), counts["missing"], factor)
    return counts
