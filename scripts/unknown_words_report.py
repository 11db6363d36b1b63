"""How many caption words a vocabulary cannot read (each becomes <unk> / [UNK]): the figures of
docs/reliability.md, "Unknown words". The same report `itmatch evaluate` prints for a checkpoint, here
for a vocabulary alone, without a model.

    # Flickr8K: a word vocabulary built from the training captions (count >= 4, as `itmatch train` does)
    python scripts/unknown_words_report.py ../shared/data/flickr8k/Flickr8k.token.txt --split test
    # SCAN's own vocabulary on its Flickr30K test captions (one caption a line)
    python scripts/unknown_words_report.py ../shared/data/precomp-captions/f30k_precomp/test_caps.txt \
        --vocab ../shared/data/precomp-captions/vocab/f30k_precomp_vocab.json
    # the WordPiece tokenizer of MMCA's text encoder
    python scripts/unknown_words_report.py ../shared/data/flickr8k/Flickr8k.token.txt --split test --wordpiece
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

from itmatch.data.vocab import AnyVocab, WordPieceVocab, build_vocab, load_vocab, unknown_word_report
from itmatch.engine.evaluate import format_unknown_words


def captions_of(source: Path, split: str | None) -> tuple[list[str], list[str]]:
    """(captions to report on, training captions) of a caption source: a file the caption readers know
    (Flickr8K token file, Karpathy/COCO JSON, CSV) with `split`, or a plain text file, one caption a line."""
    if split is None:
        return [line.strip() for line in source.read_text(encoding="utf-8").splitlines() if line.strip()], []
    from itmatch.data.captions import read_captions

    with warnings.catch_warnings():  # (Flickr8K's one known bogus id is reported by the reader)
        warnings.simplefilter("ignore")
        table = read_captions(source)
    pick = [c for c, s in zip(table.captions, table.splits, strict=True) if s == split]
    train = [c for c, s in zip(table.captions, table.splits, strict=True) if s == "train"]
    return pick, train


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("captions", type=Path, help="caption source (with --split) or a text file, one caption a line")
    p.add_argument("--split", help="split of a caption source to report on (e.g. test)")
    p.add_argument("--vocab", type=Path, help="vocab.json (default: built from the source's training captions)")
    p.add_argument("--wordpiece", action="store_true", help="MMCA's WordPiece tokenizer (all-MiniLM-L6-v2)")
    p.add_argument("--top", type=int, default=10, help="most frequent unknown words to list")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args()
    captions, train = captions_of(args.captions, args.split)
    vocab: AnyVocab
    if args.wordpiece:
        vocab = WordPieceVocab.from_pretrained("all-MiniLM-L6-v2")
    elif args.vocab:
        vocab = load_vocab(args.vocab)
    elif train:
        vocab = build_vocab(train)
    else:
        raise SystemExit("no vocabulary: pass --vocab FILE, or a caption source with a train split and --split")
    report = unknown_word_report(vocab, captions, top=args.top)
    print(json.dumps(report, indent=2) if args.json else f"{len(captions):,} captions: {format_unknown_words(report)}")


if __name__ == "__main__":
    main()
