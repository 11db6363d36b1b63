"""The triplet losses (SCAN Eq. 11-12) against brute force."""

from __future__ import annotations

import pytest
import torch

from itmatch.models.losses import triplet_loss


def brute(scores, margin, hardest):
    n = scores.shape[0]
    total = 0.0
    for i in range(n):
        pos = float(scores[i, i])
        caps = [max(0.0, margin - pos + float(scores[i, j])) for j in range(n) if j != i]
        imgs = [max(0.0, margin - pos + float(scores[j, i])) for j in range(n) if j != i]
        total += (max(caps) + max(imgs)) if hardest else (sum(caps) + sum(imgs))
    return total


@pytest.mark.parametrize("hardest", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_triplet_loss_matches_brute_force(hardest, seed):
    scores = torch.randn(9, 9, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    assert float(triplet_loss(scores, 0.2, hardest)) == pytest.approx(brute(scores, 0.2, hardest))


def test_degenerate_value_and_zero_when_separated():
    n = 8
    assert float(triplet_loss(torch.zeros(n, n), 0.2, True)) == pytest.approx(2 * n * 0.2)
    separated = torch.eye(n)
    assert float(triplet_loss(separated, 0.2, True)) == 0.0


def test_extra_positives_are_not_negatives():
    scores = torch.zeros(3, 3)
    scores[0, 1] = 5.0  # caption 1 also describes image 0
    positives = torch.eye(3, dtype=torch.bool)
    positives[0, 1] = positives[1, 0] = True
    assert float(triplet_loss(scores, 0.2, True, positives)) == pytest.approx(2 * 3 * 0.2)
