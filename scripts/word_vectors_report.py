"""What pretrained word vectors gave a run and what training did to them (the figures of docs/sman.md,
"What the rows say"): how many vocabulary words have a vector, how many *distinct* vectors those are, their
per-coordinate std against the random init's, and how far training moved them.

    python scripts/word_vectors_report.py runs/flickr8k/sman_w2v_spacy/best runs/flickr8k/sman_w2v_spacy_init/best
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from itmatch.data.word_vectors import load_word_vectors
from itmatch.engine.checkpoint import load_checkpoint


def report(path: str) -> dict[str, float | int | str]:
    ckpt = load_checkpoint(path)
    source = ckpt.config.model.word_vectors
    if not source:
        raise SystemExit(f"{path}: this run did not load pretrained word vectors (model.word_vectors is empty)")
    words = ckpt.vocab.idx2word
    table, found = load_word_vectors(source, words)
    # the factor the run applied (model.word_vectors_scale) is the first line of its log; runs from before
    # the option loaded the vectors as they are
    log = Path(path).parent / "metrics.jsonl"
    header = json.loads(log.read_text(encoding="utf-8").splitlines()[0]) if log.is_file() else {}
    factor = float(header.get("scale", 1.0))
    init = torch.empty(len(words), table.shape[1])
    torch.nn.init.xavier_uniform_(init)  # the random init's scale (the embedding's shape, Xavier-uniform)
    loaded = table[found] * factor
    trained = ckpt.model.text_encoder.embed.weight.detach().numpy()[found]
    moved = np.linalg.norm(trained - loaded, axis=1) / np.linalg.norm(loaded, axis=1)
    return {"run": path, "words with a vector": int(found.sum()),
            "distinct vectors": len(np.unique(table[found], axis=0)),
            "vector std / init std": round(float(table[found].std() / init.std()), 2),
            "scale applied": round(factor, 4),
            "median |trained - loaded| / |loaded|": round(float(np.median(moved)), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", help="run checkpoints (RUN/best) trained with model.word_vectors")
    for path in parser.parse_args().checkpoints:
        print(json.dumps(report(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
