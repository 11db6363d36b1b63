"""Where a SAVE model's adaptive self-attention (ASA, Eq. 5-8) stands, per scale: the gate gamma, how sharp the
attention is, how large the residual branch gamma * W_z a (Eq. 8) is against the cells it is added to, and how alike
different images become through it. A collapse (every score alike, the loss at 2 * batch * margin) shows as a branch
larger than the cells and the same for every image (docs/save.md, "The GPU rows").

    # a trained SAVE run (any with ASA: save_asa, save_asa_ms3, ...) on 200 dev images of its own data
    python scripts/asa_state.py runs/flickr8k_gpu/save_asa/best
    # several runs, or checkpoints of one run side by side (best: its kept epoch, last: where it stopped)
    python scripts/asa_state.py runs/investigate/save_asa_cpu/best runs/investigate/save_asa_cpu/last --images 500
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from itmatch.analysis.sample import checkpoint_sample_parser
from itmatch.data.precomp import batch_tensor, read_precomp
from itmatch.engine.checkpoint import load_checkpoint
from itmatch.models.save.encoder import AdaptiveSelfAttention


def mean_cosine_between_images(x: torch.Tensor) -> float:
    """Mean cosine between two different images' vectors, x: [N, C] (1: every image the same; ~0: unrelated)."""
    unit = F.normalize(x, dim=-1)
    others = ~torch.eye(len(x), dtype=torch.bool)
    return float((unit @ unit.T)[others].mean())


@torch.no_grad()
def asa_state(asa: AdaptiveSelfAttention, u: torch.Tensor) -> dict[str, float]:
    """The state of one ASA block on its input cells u: [N, k, C] (after any standardisation the model applies)."""
    logits = asa.logits(u)
    alpha = torch.softmax(logits, dim=2)  # Eq. 5
    branch = asa.branch(u, alpha)
    entropy = -(alpha * alpha.clamp_min(1e-12).log()).sum(-1)
    return {"gamma": float(asa.gamma), "largest_weight": float(alpha.max(-1).values.mean()),
            "entropy": float(entropy.mean()), "uniform_entropy": math.log(u.shape[1]),
            "logits_std": float(logits.std()),
            "branch_over_cells": float((branch.norm(dim=-1) / u.norm(dim=-1).clamp_min(1e-12)).mean()),
            "images_alike_before": mean_cosine_between_images(u.mean(1)),
            "images_alike_after": mean_cosine_between_images((branch + u).mean(1))}


@torch.no_grad()
def model_state(checkpoint: Path, data: str | None, split: str, images: int) -> tuple[dict[str, dict], float]:
    """asa_state of every ASA block of a SAVE checkpoint, and how alike the images' final cell embeddings are."""
    ckpt = load_checkpoint(checkpoint)
    encoder = ckpt.model.eval().image_encoder
    fusion = getattr(encoder, "fusion", None)
    blocks = {s: m for s, m in fusion.attend.items() if isinstance(m, AdaptiveSelfAttention)} if fusion else {}
    if not blocks:
        raise SystemExit(f"{checkpoint}: no adaptive self-attention (ASA) block in this model")
    scales = tuple(fusion.inputs) if len(fusion.inputs) > 1 else ()  # (a single scale is the grid itself)
    feats = batch_tensor(read_precomp(data or ckpt.data_path(), split, scales=scales).head(images).images)
    maps = encoder.maps(feats)
    states = {scale: asa_state(block, fusion.cells(maps[scale])) for scale, block in blocks.items()}
    embedded = encoder(feats).regions  # [N, k, D], the cells the word attention reads
    return states, mean_cosine_between_images(embedded.mean(1))


def main() -> None:
    parser = checkpoint_sample_parser(__doc__, "SAVE checkpoint directories", images=200)
    args = parser.parse_args()
    for checkpoint in args.checkpoints:
        states, alike = model_state(checkpoint, args.data, args.split, args.images)
        print(f"{checkpoint}: final cell embeddings of two images, mean cosine {alike:.3f}")
        for scale, s in states.items():
            print(f"  {scale}: gamma {s['gamma']:+.4f}; attention: mean largest weight {s['largest_weight']:.3f}, "
                  f"entropy {s['entropy']:.2f} nats (uniform {s['uniform_entropy']:.2f}), logits std "
                  f"{s['logits_std']:.1f}; |gamma W_z a| / |u| {s['branch_over_cells']:.3f}; two images' mean "
                  f"cells, cosine {s['images_alike_before']:.3f} before ASA, {s['images_alike_after']:.3f} after")


if __name__ == "__main__":
    main()
