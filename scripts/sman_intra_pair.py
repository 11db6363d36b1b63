"""Whether SMAN's intra-pair term (Eq. 22) still acts on a trained model: the scores d (Eq. 20, a sum of three
cosines) of the matched pairs of a split, how many of them lie below the margin m2 (where the term `[m2 - d]+` of
the default similarity form pulls them together; docs/sman.md, "The sign of the intra-pair constraint"), and the
scores of all pairs beside them. A model whose matched pairs all score above m2 trains on Eq. 21 alone, as
`sman_inter` does.

    python scripts/sman_intra_pair.py runs/investigate/sman_warmup_cpu/best
    python scripts/sman_intra_pair.py RUN/best RUN/last --images 1000
"""

from __future__ import annotations

from pathlib import Path

import torch

from itmatch.analysis.sample import checkpoint_sample_parser
from itmatch.data.precomp import read_precomp
from itmatch.engine.checkpoint import load_checkpoint
from itmatch.engine.evaluate import split_scores
from itmatch.engine.metrics import matched_scores


def intra_pair_state(scores: torch.Tensor, per_image: int, margin: float) -> dict[str, float]:
    """What Eq. 22 sees in a split's score matrix: the matched pairs' scores, the share below `margin` (m2), and all
    pairs' mean score."""
    matched = matched_scores(scores, per_image)
    return {"matched_mean": float(matched.mean()), "matched_min": float(matched.min()),
            "active_share": float((matched < margin).float().mean()), "all_mean": float(scores.mean())}


@torch.no_grad()
def model_state(checkpoint: Path, data: str | None, split: str, images: int) -> tuple[dict[str, float], float]:
    """intra_pair_state of a SMAN checkpoint on the first `images` images of `split`, and its margin m2."""
    ckpt = load_checkpoint(checkpoint)
    if ckpt.config.model.arch != "sman":
        raise SystemExit(f"{checkpoint}: a {ckpt.config.model.arch!r} model, not SMAN (no intra-pair term)")
    margin = ckpt.config.model.sman.intra_pair_margin
    part = read_precomp(data or ckpt.data_path(), split).head(images)
    return intra_pair_state(split_scores(ckpt.model.eval(), ckpt.vocab, part), part.per_image, margin), margin


def main() -> None:
    parser = checkpoint_sample_parser(__doc__, "SMAN checkpoint directories", images=1000)
    args = parser.parse_args()
    for checkpoint in args.checkpoints:
        s, margin = model_state(checkpoint, args.data, args.split, args.images)
        print(f"{checkpoint}: matched pairs' d mean {s['matched_mean']:.3f} (lowest {s['matched_min']:.3f}); "
              f"{s['active_share'] * 100:.1f} % below m2 = {margin} (Eq. 22 active); all pairs' d mean "
              f"{s['all_mean']:.3f}")


if __name__ == "__main__":
    main()
