"""How far captions the model cannot read would reach in photo -> captions ranking if they were scored (the
figure behind docs/reliability.md row 13): captions made only of unknown words are added to a split's captions,
every pair is scored with the model's own head, and for each image we count its true captions that score
below the best unreadable caption, and whether an unreadable caption is the image's top-1.
`Searcher.search_image` never ranks such captions, so with it both counts are 0.

    python bench/unreadable_captions.py RUN/best --split test [--data PRECOMP] [--images 1000]
"""

from __future__ import annotations

import argparse
import json

import torch

from itmatch.engine.checkpoint import load_checkpoint
from itmatch.engine.evaluate import encode_captions, encode_images, score_matrix
from itmatch.engine.inputs import open_split

UNREADABLE = ["zzz qqq xxx", "qwzx vbnm plokm .", "xq zv"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="checkpoint directory (RUN/best)")
    p.add_argument("--split", default="test")
    p.add_argument("--data", help="precomp directory (default: the checkpoint's)")
    p.add_argument("--images", type=int, default=1000, help="first N images of the split (default 1000)")
    args = p.parse_args()
    ckpt = load_checkpoint(args.checkpoint)
    split = open_split(ckpt.config, args.split, data_path=args.data).head(args.images)
    for caption in UNREADABLE:
        assert not ckpt.vocab.coverage(caption).has_known_word, f"{caption!r} has a word this model knows"
    model = ckpt.model.eval()
    img = encode_images(model, split.images)
    scores = score_matrix(model, img, encode_captions(model, [*split.captions, *UNREADABLE], ckpt.vocab))
    n, per = split.n_images, split.per_image
    true = scores[:, :n * per].reshape(n, n, per)[torch.arange(n), torch.arange(n)]  # [n, per] own captions
    best_unreadable = scores[:, n * per:].max(dim=1).values
    below = int((true < best_unreadable[:, None]).sum())
    top1 = int((scores.argmax(dim=1) >= n * per).sum())
    print(json.dumps({"checkpoint": args.checkpoint, "split": args.split, "images": n,
                      "unreadable_captions": UNREADABLE,
                      "true_captions_below_an_unreadable_one": below, "true_captions": n * per,
                      "images_whose_top1_is_unreadable": top1}, indent=2))


if __name__ == "__main__":
    main()
