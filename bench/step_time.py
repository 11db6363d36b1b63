"""Seconds per training step and for all-pairs scoring of a few presets on real precomp features
(a quick comparison, not a training: a handful of length-bucketed batches, random init).

    python bench/step_time.py --presets oan scan_t2i_avg --batches 4 --eval-images 100

Uses configs/flickr8k/cpu.yaml on top of each preset (D = 512, batch 128), one thread.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.utils.data import DataLoader

from itmatch.config import load_yaml
from itmatch.data.datasets import LengthBucketSampler, PairDataset, collate_pairs
from itmatch.data.precomp import read_precomp
from itmatch.data.vocab import build_vocab, tokenize
from itmatch.engine.evaluate import encode_captions, encode_images, score_matrix
from itmatch.engine.train import make_optimizer
from itmatch.models.registry import build_model, resolve_config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="runs/data/flickr8k_lite0", help="precomp directory")
    parser.add_argument("--schedule", default="configs/flickr8k/cpu.yaml", help="config applied on each preset")
    parser.add_argument("--presets", nargs="+", default=["oan", "scan_t2i_avg"], help="presets to time")
    parser.add_argument("--batches", type=int, default=4, help="training steps per preset (first 2: sum warm-up)")
    parser.add_argument("--eval-images", type=int, default=100, help="dev images (x5 captions) to score")
    args = parser.parse_args()
    torch.set_num_threads(1)
    train_split, dev = read_precomp(args.data, "train"), read_precomp(args.data, "dev").head(args.eval_images)
    vocab = build_vocab(train_split.captions)
    lengths = [len(tokenize(c)) for c in train_split.captions[: 128 * 40]]
    for preset in args.presets:
        cfg = resolve_config(preset, load_yaml(args.schedule), {"data": {"path": args.data}})
        cfg.model.vocab_size, cfg.model.img_dim = len(vocab), int(train_split.images.shape[2])
        torch.manual_seed(0)
        model = build_model(cfg.model)
        optimizer = make_optimizer(cfg, model, 0)
        sampler = LengthBucketSampler(lengths, cfg.train.batch_size, torch.Generator().manual_seed(0))
        loader = DataLoader(PairDataset(train_split, vocab), batch_sampler=sampler, collate_fn=collate_pairs)
        times = []
        for b, batch in enumerate(loader):
            if b >= args.batches:
                break
            start = time.perf_counter()
            img = model.encode_images(batch.images)
            txt = model.encode_texts(batch.text.tokens, batch.text.lengths)
            loss = model.training_loss(img, txt, cfg.loss.margin, hardest=b >= 2)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            optimizer.step()
            times.append(time.perf_counter() - start)
        model.eval()
        start = time.perf_counter()
        score_matrix(model, encode_images(model, dev.images), encode_captions(model, dev.captions, vocab))
        seconds = time.perf_counter() - start
        print(f"{preset:<20} s/step {' '.join(f'{t:.1f}' for t in times)}   "
              f"encode+score {dev.n_images}x{len(dev.captions)}: {seconds:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
